"""What ``megatrain-plan plan`` prints: the plan, its memory table, its time table and bottleneck, as text and
as JSON (the same keys ``megatrain-train`` records). Pure stdlib; formatting only."""
from __future__ import annotations

from typing import Any

from megatrain.planner.costs import data_parallel
from megatrain.planner.commands import data_parallel_report
from megatrain.planner.shapes import model_shapes
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.planner.choice.plan_request import ChosenPlan
from megatrain.planner.commands.report import (choice_json, gib, hardware_line, memory_table, rate, seconds, spill_text,
                                               step_bound_by, time_table, with_attention_tflops)
from megatrain.planner.choice.search import Ranks
from megatrain.planner.shapes.workload import Workload


def page(model: ModelShape, work: Workload, chosen: ChosenPlan, ranks: Ranks,
         saved_to: str | None) -> tuple[dict[str, Any], str]:
    """(JSON, text) of the chosen plan."""
    best, hw = chosen.choice, chosen.hardware
    assert best.cost is not None
    data = {"params": model.params, "model": model.summary(), **choice_json(best),
            "plan": best.plan.to_dict(), "memory": best.memory.rows(), "time": best.cost.to_dict(),
            "workload": {"seq_len": work.seq_len, "batch": work.batch, "tokens": work.tokens,
                         "compute_dtype": work.compute_dtype, "clipping": work.clipping, "spill": work.spill},
            "disk": {"spill_dir": work.spill_dir, "free_bytes": work.spill_free_bytes,
                     "read_gbps": hw.disk_read_gbps, "write_gbps": hw.disk_write_gbps},
            "hardware": {"gpu_name": hw.gpu_name, "source": hw.source}, "plans_considered": chosen.considered}
    c, p = best.cost, best.plan
    share = work if ranks is None else data_parallel.rank_workload(work, ranks)   # one rank's batch
    # a rank's forward and backward collectives; the ranks that share the global step
    comm = None if ranks is None else data_parallel.collective_seconds(model, work, hw, ranks)
    world = 1 if ranks is None else ranks.world
    bound = step_bound_by(c, comm, hw.device_is_host)  # the collectives where they bind the rank's step
    if p.spill != "none":
        free = f", {gib(work.spill_free_bytes)} free" if work.spill_free_bytes is not None else ""
        spill = (f"spill: {spill_text(best)}, in {p.spill_dir} (read {hw.disk_read_gbps:.1f} / write "
                 f"{hw.disk_write_gbps:.1f} GB/s{free})")
    else:
        spill = "spill: nothing on disk" + ("" if work.spill_dir or work.spill == "none"
                                            else " (pass --spill-dir DIR to allow it)")
    text = "\n".join([
        f"{model.name} ({model_shapes.params_label(model.params)} params), {work.batch} x {work.seq_len} tokens "
        f"per step, {work.compute_dtype}, clipping {'on' if work.clipping else 'off'}",
        f"hardware: {hardware_line(hw)}",
        f"  source: {hw.source}", "",
        f"plan: {p.micro_batch_size} sequences x {share.micro_batches(p.micro_batch_size)} micro-batches, "
        f"{p.num_slots} slots (prefetch {p.prefetch_depth}), checkpoints on {p.checkpoints}"
        f"{f' (copied in pieces of {p.checkpoint_piece_tokens} tokens)' if p.checkpoint_piece_tokens else ''}, "
        f"optimizer {p.optimizer_mode}{' on the compute thread' if p.adam_thread == 'compute' else ''}, "
        f"{'computing in place, ' if p.compute_in_place else ''}loss chunk {p.loss_chunk_tokens} tokens"
        + (f", MLP tiles of {p.mlp_tile_tokens} tokens" if p.mlp_tile_tokens else "")
        + (f", attention projection tiles of {p.attention_tile_tokens} tokens" if p.attention_tile_tokens else "")
        + (("" if not model.experts.num_experts else f", experts in groups of {p.expert_group_size}"
            if p.expert_group_size else ", experts streamed with their whole layer"))
        + (f", {len(p.kept_layers)} of {model.num_layers} layers kept (no recompute)" if p.kept_layers else "")
        + (", weights rounded from the fp32 master on the device" if p.weights_cast == "device"
           and work.compute_bytes != 4 else "")
        + (f", layers compiled ({hw.compiled_speedup(work.compute_dtype) or 1.0:.2f}x eager as profiled)"
           if p.compiled_layers else "")
        + (f", saved to {saved_to}" if saved_to else ""), spill, "",
        *([] if ranks is None else [f"one rank of {ranks.world} (its shards of the host state; a node holds "
                                    f"{ranks.gpus_per_node} ranks'):"]),
        memory_table(best.memory), "",
        time_table(c, comm, hw.device_is_host), "",
        f"step {seconds(c.step_seconds)}, {rate(c.tokens_per_second)}{'' if ranks is None else ' per rank'}, "
        f"model {c.model_tflops:.0f} "
        f"TFLOP/s without attention (6 x N_matmul per token), {with_attention_tflops(c):.0f} with attention FLOPs, "
        f"MFU {c.mfu:.1%}; bottleneck: {bound}; "
        f"{seconds(1e9 / (c.tokens_per_second * world))} per billion tokens"
        + ("" if ranks is None else f" on the {world} ranks"),
    ])
    if ranks is not None:
        data["bottleneck"] = bound
        data["data_parallel"], more = data_parallel_report.section(model, work, p, hw, ranks)
        text += "\n\n" + more
    return data, text
