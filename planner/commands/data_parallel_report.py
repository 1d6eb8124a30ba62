"""``megatrain-plan plan|size|ram --gpus-per-node G --nodes N``: the options and the figures of a data-parallel plan.

The numbers are planner/data_parallel.py's; this module reads the options and writes the text and JSON:
per-rank (per-GPU) memory, per-node host RAM and NVMe against the host's, the step with the collectives,
and the predicted scaling efficiency against one GPU at the same global batch.

Pure stdlib.
"""
from __future__ import annotations

import argparse
from typing import Any

from megatrain.planner.costs import data_parallel
from megatrain.planner.commands import report
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload


def add_arguments(p: argparse.ArgumentParser, positive_int: Any, positive_float: Any) -> None:
    """--gpus-per-node, --nodes and the bandwidths: plan, size and ram take them alike."""
    g = p.add_argument_group("several GPUs and nodes (data parallel, one rank per GPU)")
    g.add_argument("--gpus-per-node", type=positive_int, default=1, help="ranks per node (1)")
    g.add_argument("--nodes", type=positive_int, default=1, help="nodes (1)")
    g.add_argument("--intra-gbps", type=positive_float, help="collective bus bandwidth per GPU inside a node, GB/s "
                                                             "(default: NVLink 300, else half the H2D rate)")
    g.add_argument("--network-gbps", type=positive_float, help=f"network bandwidth per node, GB/s (default "
                                                               f"{data_parallel.NETWORK_GBPS:g})")


def topology_of(args: argparse.Namespace, hw: HardwareProfile) -> data_parallel.Topology | None:
    """The ranks the options ask for; None for one."""
    if args.gpus_per_node * args.nodes == 1:
        return None
    return data_parallel.topology(hw, args.gpus_per_node, args.nodes, args.intra_gbps, args.network_gbps)


def checked_topology(args: argparse.Namespace, work: Workload, hw: HardwareProfile) -> data_parallel.Topology | None:
    """The ranks the options ask for on ``hw`` (None for one); ``work.batch`` (global) must divide among them."""
    topo = topology_of(args, hw)
    if topo is not None:
        data_parallel.rank_workload(work, topo)   # one line, exit 2, when the batch does not divide
    return topo


def ram_heading(topo: data_parallel.Topology) -> str:
    """What ``ram``'s table means with ranks."""
    return (f"data parallel: {topo.world} ranks ({topo.gpus_per_node} per node x {topo.nodes} node"
            f"{'s' if topo.nodes > 1 else ''}): host RAM and NVMe per node ({topo.gpus_per_node} ranks: their shards "
            f"and each one's buffers), the batch global, the throughput all ranks' with the collectives at "
            f"{topo.bus_gbps:.0f} GB/s per rank ({topo.source}); efficiency against one GPU on the same global batch")


def figures(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile,
            topo: data_parallel.Topology) -> dict[str, Any]:
    """The JSON of one rank's plan among ``topo``: per GPU, per node (G ranks), the step and the efficiency."""
    mem = data_parallel.memory(model, work, plan, hw, topo)
    G = topo.gpus_per_node
    node_ram = G * (mem.host_bytes + (mem.device_bytes if hw.device_is_host else 0))
    return {"world": topo.world, "gpus_per_node": G, "nodes": topo.nodes, "bandwidth": topo.source,
            "rank_batch": work.batch // topo.world, "per_gpu_bytes": mem.device_bytes,
            "per_node_host_bytes": node_ram, "per_node_nvme_bytes": G * mem.nvme_bytes,
            "node_host_fits": node_ram <= hw.host_budget_bytes,
            **data_parallel.scaling(model, work, plan, hw, topo).to_dict()}


def section(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile,
            topo: data_parallel.Topology) -> tuple[dict[str, Any], str]:
    """JSON and text of one rank's memory, the node's, and the step with its collectives."""
    mem = data_parallel.memory(model, work, plan, hw, topo)
    s = data_parallel.scaling(model, work, plan, hw, topo)
    G = topo.gpus_per_node
    data = {**figures(model, work, plan, hw, topo), "rank_memory": mem.rows()}
    node_ram, node_nvme, fits = data["per_node_host_bytes"], data["per_node_nvme_bytes"], data["node_host_fits"]
    text = "\n".join([
        f"data parallel: {topo.world} ranks ({G} per node x {topo.nodes} node{'s' if topo.nodes > 1 else ''}), "
        f"{work.batch // topo.world} sequences per rank; collectives at {topo.bus_gbps:.0f} GB/s per rank "
        f"({topo.source})",
        f"per GPU {report.gib(mem.device_bytes)}; per node: host RAM {report.gib(node_ram)} "
        f"({'fits' if fits else 'does NOT fit'} in {report.gib(hw.host_budget_bytes)}), NVMe {report.gib(node_nvme)}",
        f"step {report.seconds(s.step_seconds)} ({report.seconds(s.comm_seconds)} of collectives, overlapped), "
        f"{report.rate(s.tokens_per_second)} in all; one GPU on the same global batch: "
        f"{report.seconds(s.single_step_seconds)}: speed-up {s.speedup:.2f}x, scaling efficiency {s.efficiency:.0%}",
    ])
    return data, text
