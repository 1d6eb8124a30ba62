"""The CPU AdamW's time in a step: the seconds of each block's update on the host, spill traffic included (the
cost model queues them on the AdamW workers of its replay). Pure stdlib.
"""
from __future__ import annotations

from megatrain.planner.costs import spill_placement
from megatrain.plan.buffer_kinds import has_shadow
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload

# AdamW also writes the compute-dtype shadow the next H2D sends: ~6 more bytes per param on ~28.
# Used where the profile has no measured shadow rate; fp32 compute has no shadow pass (the master
# is what travels) unless the master spills.
ADAM_SHADOW_FACTOR = 1.15
# AdamW with bf16 state (one pass: m and v widened, updated, rounded back at random) in fp32 AdamW times, where the
# profile has no measured rate: no slower (it ran at 1.06-1.11x fp32 AdamW's params/s on one thread of this
# project's CPU, and moves 20 bytes a parameter to fp32's 28 where memory bounds it).
BF16_STATE_FACTOR = 1.0


class AdamTime:
    """Seconds of CPU AdamW per block, spill traffic included."""

    def __init__(self, model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile) -> None:
        cal = hw.fitted(work.compute_dtype)
        self.spilled = spill_placement.Spilled.of(model, plan, work.state_bytes)
        self.resident = frozenset(plan.resident_blocks)  # updated on the device: resident_blocks.add_device_updates
        # Seconds per parameter: AdamW, then the shadow pass where there is one (measured, or the factor). Rates
        # where it runs: every core on the compute thread, else as the worker runs (HardwareProfile.adam_params_per_s:
        # one thread on a CPU device, as the bf16-state pass is measured; ``cores`` scales it to the compute thread).
        rate = hw.cpu_adam_params_per_s if plan.adam_thread == "compute" else hw.adam_params_per_s
        per_param, cores = 1.0 / rate, rate / hw.adam_params_per_s
        # bf16 m and v: their one pass in place of fp32 state's AdamW (measured, or the factor); ``state``: its
        # time over fp32 AdamW's
        state = 1.0
        if work.optimizer_state == "bf16":
            state = (rate / (hw.cpu_bf16_state_params_per_s * cores) if hw.cpu_bf16_state_params_per_s > 0
                     else BF16_STATE_FACTOR)
        if cal is not None and plan.adam_thread == "worker":
            # measured in the step (on the worker): the shadow pass, where there is one, is inside it
            per_param = state / cal.adam_params_per_s
        elif has_shadow(work.compute_bytes, plan.weights_cast):  # no pass in fp32 or with the cast on the device
            per_param = state * per_param + (1.0 / hw.cpu_shadow_params_per_s if hw.cpu_shadow_params_per_s > 0
                                             else per_param * (ADAM_SHADOW_FACTOR - 1.0))
        else:
            per_param = state * per_param
        self.per_param = per_param
        if self.spilled.kinds and (hw.disk_read_gbps <= 0 or hw.disk_write_gbps <= 0):
            raise ValueError("a spill plan needs the disk's read and write GB/s in the hardware profile "
                             "(megatrain-plan profile --spill-dir DIR, or --nvme GBPS)")
        self.read_gbps, self.write_gbps = hw.disk_read_gbps, hw.disk_write_gbps
        self.blocks = self._blocks()

    def block(self, b: int) -> float:
        """Block b's update (``blocks[b]``)."""
        return self.blocks[b]

    def _blocks(self) -> list[float]:
        """Each block's update, priced once (the replay asks each block's several times):
        t_b = numel_b x (1 / AdamW params/s + 1 / shadow params/s) (0 for a resident block); with k_b of its kinds
        spilled the disk runs beside it (reads ahead, writes behind; a spilled kind is read once and written
        once: master, m and v by AdamW, grads in backward): t_b = max(that, numel_b x sum of s_k over its spilled
        kinds x (1 / read GB/s + 1 / write GB/s) / 1e9) (s_k 4, or 2 for bf16 m and v)."""
        numels, resident, per_param = self.spilled.numels, self.resident, self.per_param
        compute = [(0 if b in resident else n) * per_param for b, n in enumerate(numels)]
        if not self.spilled.kinds:
            return compute
        disk_s = 1 / self.read_gbps + 1 / self.write_gbps  # a byte read once and written once
        disk_bytes = self.spilled.disk_bytes_by_block
        return [max(t, disk_bytes[b] * disk_s / 1e9) if self.spilled.kinds_by_block[b] else t
                for b, t in enumerate(compute)]

    def total(self) -> float:
        """Every block's update, one after another: the sum of ``block``."""
        return sum(self.blocks)

    def arithmetic(self) -> float:
        """Every block's update without its disk time: (N - Nr) x seconds per parameter."""
        return sum(n for b, n in enumerate(self.spilled.numels) if b not in self.resident) * self.per_param
