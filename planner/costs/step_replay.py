"""The replay of one training step: its block visits on three streams (H2D, compute, D2H) and the CPU AdamW
workers, bounded by the plan's slots, prefetch depth, gradient buffers and host slabs. ``cost_model`` builds
the visits and times them here. Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.plan.plan import Plan


@dataclass(slots=True)
class BlockVisit:
    """One block visit: H2D load, compute, D2H drain (seconds), and its constraints."""

    load_s: float
    compute_s: float
    d2h_s: float
    d2h_at_start: bool = False        # a checkpoint leaves when compute starts; grads when it ends
    wait_d2h_of: int | None = None    # index of the step whose drain must finish before compute
    earliest_load: float = 0.0        # deferred mode: AdamW of this block must be done first
    adam_s: float = 0.0               # eager mode: AdamW after this step's drain
    wait_adam_of: int | None = None   # eager mode: the drain needs a host slab, freed by that AdamW
    backward: bool = False


def step_time(steps: list[BlockVisit], n_fwd: int, plan: Plan, hw: HardwareProfile,
              total_adam: float) -> tuple[float, float, float]:
    """(end of forward, step seconds, exposed AdamW seconds) from the replay of the block visits."""
    K, depth = plan.num_slots, plan.prefetch_depth
    if hw.device_is_host:
        # No GPU: the copies run in program order on the calling thread and AdamW shares the cores with
        # compute; nothing overlaps: step = sum(load + compute + drain) + AdamW.
        fwd_end = sum([st.load_s + st.compute_s + st.d2h_s for st in steps[:n_fwd]])
        end = fwd_end + sum([st.load_s + st.compute_s + st.d2h_s for st in steps[n_fwd:]])
        return fwd_end, end + total_adam, total_adam
    replay = simulate(steps, K, depth)
    end, fwd_end = replay.end, replay.compute_end[n_fwd - 1]
    if plan.optimizer_mode == "eager":
        # Eager: AdamW overlaps backward; the next forward starts with the embedding, updated last,
        # so exposed = adam_end - backward_end.
        exposed = max(0.0, replay.adam_end - end)
        return fwd_end, end + exposed, exposed
    # Deferred: the delay AdamW puts on the next forward is inside the simulated time;
    # exposed = end(with AdamW gating) - end(without).
    return fwd_end, end, max(0.0, end - simulate(steps, K, depth, gated=False).end)


def busy(steps: list[BlockVisit]) -> tuple[float, float, float]:
    """(compute, H2D, D2H) seconds the visits keep each stream busy: the sums of their terms, in visit order."""
    return (sum([s.compute_s for s in steps]), sum([s.load_s for s in steps]), sum([s.d2h_s for s in steps]))


class Replay(NamedTuple):
    """What ``simulate`` returns: the step's end, each visit's compute end, the AdamW workers' end."""

    end: float
    compute_end: list[float]
    adam_end: float


def simulate(steps: list[BlockVisit], slots: int, depth: int, gated: bool = True) -> Replay:
    """Replay the three streams and the AdamW workers.

    load i is issued when block i - depth starts computing (at most ``depth`` blocks ahead) and
    block i - slots has finished (its slot is free); compute i starts when its load is done, the
    previous compute is done, and the drain it depends on (grad buffer / checkpoint staging) is done;
    a drain starts when its data exists, the D2H stream is free and (eager mode) a host slab is free;
    AdamW of a block starts when its drain is done and the CPU workers are free. ``gated``: a load waits for
    its ``earliest_load`` too (deferred AdamW); without, the same replay with none.

    The search replays every plan it times, so this loop is its hottest: each max(a, b) is written out as
    ``b if b > a else a``, which is what max returns (the first of equals), without a call per term.
    """
    n = len(steps)
    # cstart and cend start with depth and slots zeros: cstart[i] here is compute start i - depth (0 before the
    # first), cend[i] compute end i - slots
    cstart = [0.0] * (depth + n)
    cend = [0.0] * (slots + n)
    dend = [0.0] * n
    aend = [0.0] * n
    h2d_free = comp_free = d2h_free = cpu_free = 0.0
    for i, s in enumerate(steps):
        after_start, after_end = cstart[i], cend[i]
        issue = after_end if after_end > after_start else after_start  # max(cstart[i - depth], cend[i - slots])
        if gated and s.earliest_load > issue:                            # max(issue, earliest_load)
            issue = s.earliest_load
        if s.load_s > 0:
            load_end = h2d_free = (issue if issue > h2d_free else h2d_free) + s.load_s  # max(h2d_free, issue) + load
        else:
            load_end = issue
        start = load_end if load_end > comp_free else comp_free          # max(comp_free, load_end, dep)
        if s.wait_d2h_of is not None and dend[s.wait_d2h_of] > start:
            start = dend[s.wait_d2h_of]
        cstart[depth + i] = start
        cend[slots + i] = comp_free = start + s.compute_s
        if s.d2h_s > 0:
            ready = start if s.d2h_at_start else comp_free
            ds = ready if ready > d2h_free else d2h_free                 # max(d2h_free, ready, slab free)
            if s.wait_adam_of is not None and aend[s.wait_adam_of] > ds:
                ds = aend[s.wait_adam_of]
            dend[i] = d2h_free = ds + s.d2h_s
        else:
            dend[i] = comp_free
        if s.adam_s > 0:
            aend[i] = cpu_free = (dend[i] if dend[i] > cpu_free else cpu_free) + s.adam_s  # max(cpu_free, dend) + adam
    return Replay(d2h_free if d2h_free > comp_free else comp_free, cend[slots:], cpu_free)


class HostSlabs:
    """Eager mode: each drain lands in one of S host slabs; a slab frees when its AdamW ends."""

    def __init__(self, plan: Plan) -> None:
        self.eager = plan.optimizer_mode == "eager"
        self.count = plan.host_grad_slabs
        self.users: list[int] = []

    def take(self, step_index: int) -> int | None:
        """The step whose AdamW must end before step ``step_index``'s drain has a slab (eager mode)."""
        if not self.eager:  # deferred: the drains land in the gradient arena, no slab to wait for
            return None
        wait_for = self.users[-self.count] if len(self.users) >= self.count else None
        self.users.append(step_index)
        return wait_for
