"""Data parallelism in the planner: one rank's memory, the collectives' time, the predicted scaling efficiency.

W = G x N ranks (G per node, N nodes), one per GPU (or CPU process). The runtime's layout
(runtime/state/shards.py, DESIGN.md section 10): each rank holds a 1/W shard of every block's fp32
master, m, v, grads and compute-dtype shadow; per block the shards are all-gathered into the slot,
the fp32 gradient reduce-scattered, AdamW run on the shard. Symbols as in memory_model.py, plus:

  W    ranks;  G ranks per node;  N_W  elements of one rank's shards = sum over blocks of
       align64(ceil(n_b / W));  Bmax_W = align64(ceil(Bmax / W))
  r    ring factor (W - 1) / W: the share of a collective's bytes each rank sends and receives
  bw   bus bandwidth per rank: intra-node (NVLink, PCIe, loopback) with one node; with several,
       min(intra, network per node / G) (each GPU's share of the node's network)

Memory per rank: memory_model.estimate at the rank's batch (B / W), with the host state (master,
m, v, shadow, full grad arena, spill files) at N_W instead of N, slabs and staging at Bmax_W, slots and
gradient accumulators of whole padded blocks, a resident block's device state at its shard, and on a GPU
(grad buffers + 1) fp32 gradient shards ([Note: per-rank buffers]). Per node: G x that.

Time per rank (``rank_cost``, what the search times a rank's plans by): the single-process estimate at the
rank's batch with each resident block's device update at its shard (cost_model.estimate(..., W)), then per phase

  on a GPU: phase_W = max(compute, H2D / W, D2H / W, AdamW x G / W, comm) + stall
  on a CPU: phase_W = compute x G + H2D / W + D2H / W + AdamW x G / W + comm + rest
  step_W   = max(phase_W(forward) + phase_W(backward), disk x G / W)   (the AdamW a phase waits for is inside it)
  exposed_W = max(0, exposed - (AdamW - AdamW x G / W))   (the AdamW the step waits for, less what sharding sheds)
  comm_fwd = blocks x lat + r x c x (N + tied E) / bw        (all-gathers of the forward loads)
  comm_bwd = blocks x lat + r x (c x L x layer + 4 x N) / bw  (backward all-gathers + fp32 reduce-scatter)
  stall    = the single-process phase's time beyond its busiest resource (fill and drain)
  rest     = the single-process phase's time beyond the sum of its resources (a CPU runs them one after another;
             what is left is waiting for the disk)

A rank copies its shard of each block (H2D, D2H: / W) and updates its shard (AdamW: / W) on the CPU cores its
node's G ranks share (x G; the profile's AdamW rate is all cores'); on a CPU the ranks share the cores for compute
too (x G). A resident block (``Plan.resident_blocks``) has no H2D, D2H or CPU update, its device update is its
shard's (28 bytes a parameter of align64(ceil(n_b / W)), 36 with clipping), and it is all-gathered and reduce-scattered like any
other block (the runtime's [Note: collectives]: its shard cast into its place in the slot on the device, its
gradient's shard copied from the reduce-scatter into its device buffer). The disk: a node's G ranks each read and
write their shards' spill files, G / W of one process's bytes and seconds. Scaling efficiency = t_1 / (W x t_W) with t_1 one
process's step on the whole global batch. First-order: the collectives are assumed to overlap compute fully
within a phase on a GPU (the runtime runs them on their own stream, prefetched like the loads); unverified on GPUs.

Collective timeout ([Note: collective timeout]): how long a rank's collective waits for the others before
every rank stops, when --collective-timeout is not given:

  timeout = max(FLOOR, STEPS x step_W + save_W)
  save_W  = (master + m + v bytes of one rank) / disk write rate   (a checkpoint written between two collectives;
            ``hw`` with disk figures: sizing.with_disk gives an unmeasured disk the rate the search assumes)

with FLOOR = 120 s (a rank's first step, a slow file system, a loaded machine) and STEPS = 20 (the rate
figures are rough: a step several times slower than predicted is no hang).

Pure stdlib.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatrain.planner.costs import cost_model, memory_model, resident_blocks
from megatrain.plan.block_parameters import aligned
from megatrain.planner.costs.spill_placement import block_numels
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.costs.cost_model import CostEstimate, PhaseTime
from megatrain.planner.costs.memory_model import Component, MemoryEstimate, Overrun
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.costs.stream_units import grad_numel
from megatrain.planner.shapes.workload import Workload, WorkloadError

# Bus bandwidths (GB/s per rank) assumed when none is given: stated in every report.
NVLINK_GBPS = 300.0    # NVLink 4 all-gather / reduce-scatter bus bandwidth, H100/H200 SXM class
PCIE_PEER_FACTOR = 0.5  # GPUs without NVLink: peer traffic through the host, ~half the H2D rate
LOOPBACK_GBPS = 1.0    # CPU ranks: gloo over loopback TCP
NETWORK_GBPS = 50.0    # per node: one 400 Gb/s NIC
# Fixed cost of one collective (launch, synchronisation): NCCL / gloo.
COLLECTIVE_LATENCY_S = {"gpu": 30e-6, "cpu": 300e-6}
COLLECTIVE_TIMEOUT_FLOOR_S = 120.0
COLLECTIVE_TIMEOUT_STEPS = 20
STATE_COMPONENTS = ("fp32 master", "Adam m", "Adam v", "compute-dtype shadow", "fp32 grads (full arena)")


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    nodes: int
    intra_gbps: float      # bus bandwidth per rank inside a node
    network_gbps: float    # per node
    source: str            # where the bandwidths come from

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def bus_gbps(self) -> float:
        if self.nodes == 1:
            return self.intra_gbps
        return min(self.intra_gbps, self.network_gbps / self.gpus_per_node)


def topology(hw: HardwareProfile, gpus_per_node: int, nodes: int, intra_gbps: float | None = None,
             network_gbps: float | None = None) -> Topology:
    """The ranks and their bandwidths: given, else assumed from the hardware (NVLink, PCIe, CPU loopback)."""
    if intra_gbps is None:
        if hw.device_is_host:
            intra_gbps, what = LOOPBACK_GBPS, f"assumed {LOOPBACK_GBPS:g} GB/s (gloo, loopback)"
        elif "nvlink" in hw.interconnect.lower() or "SXM" in hw.gpu_name or "H200" in hw.gpu_name:
            intra_gbps, what = NVLINK_GBPS, f"assumed {NVLINK_GBPS:g} GB/s (NVLink)"
        else:
            intra_gbps = hw.h2d_gbps * PCIE_PEER_FACTOR
            what = f"assumed {intra_gbps:.0f} GB/s (PCIe peer, {PCIE_PEER_FACTOR:g} x H2D)"
    else:
        what = f"{intra_gbps:g} GB/s (given)"
    net = NETWORK_GBPS if network_gbps is None else network_gbps
    if nodes > 1:
        what += f"; network {net:g} GB/s per node ({'assumed' if network_gbps is None else 'given'})"
    return Topology(gpus_per_node, nodes, intra_gbps, net, f"in a node {what}")


def rank_workload(work: Workload, topo: Topology) -> Workload:
    """One rank's share of the step: batch / W sequences."""
    if work.batch % topo.world:
        raise WorkloadError(f"batch {work.batch} does not divide among {topo.world} ranks; pass a multiple of "
                            f"{topo.world}")
    return dataclasses.replace(work, batch=work.batch // topo.world)


def shard_numel(numel: int, world: int) -> int:
    """One rank's shard of a block (the runtime's rule: runtime/state/shards.py)."""
    return aligned(-(-numel // world))


def memory(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, topo: Topology) -> MemoryEstimate:
    """One rank's buffers for ``work`` (the global step) with ``plan`` (the rank's plan); with one rank, the
    single process's. [Note: per-rank buffers]"""
    W = topo.world
    est = memory_model.estimate(model, rank_workload(work, topo), plan, hw)
    if W == 1:
        return est
    return MemoryEstimate(tuple(rank_components(model, plan, hw, W, est.components)))


def rank_components(model: ModelShape, plan: Plan, hw: HardwareProfile, W: int,
                    components: tuple[Component, ...]) -> list[Component]:
    """The single-process ``components`` at the rank's batch made one rank's of W.

    [Note: per-rank buffers]
    What a rank holds, each the runtime's buffer (tests/test_rank_memory.py checks them one by one):
    - host state (master, m, v, shadow, full grad arena, spill files): x N_W / N; with resident blocks
      (``Plan.resident_blocks``) x Nh_W / Nh, Nh the elements of the blocks not resident (the host holds none of a
      resident block) and Nh_W the sum of their shards;
    - resident optimizer state: each resident block's shard, 16 x Nr_W = 16 x sum over them of align64(ceil(n_b /
      W)): a rank's master, m, v and gradient of a resident block are its shard's (runtime/state/shards.py builds
      the device state from the shard blocks as the host store);
    - chunk-bounded host buffers (grad slabs, spill staging): x Bmax_W / Bmax (with resident blocks the slab is the
      largest host block's shard: x Bh_W / Bh);
    - weight slots and grad accumulators: whole padded blocks, K x W x Bmax_W x c and G x W x Bg_W x 4 (a slot
      holds the gathered block; the accumulator the whole gradient the collectives reduce; Bg: Bmax, or with a
      tied embedding the largest block but it, ``stream_units.grad_numel``, resident blocks included: a rank's
      resident gradient is the reduce-scatter's shard of the accumulator, copied in); a tied embedding's gradient
      W x E_W x 4 (resident or not);
    - gradient shards: (G + 1) x Bmax_W x 4 on a GPU (NCCL reduce-scatters into them); none on CPU ranks, where
      the gradient is all-reduced in place and the shard is a view of it;
    - collective staging: none on CPU ranks (gloo's gather and reduce-scatter would each allocate a whole padded
      block per call: the runtime gathers by broadcasts into the slot and reduces in place instead; on a GPU
      NCCL's buffers are its own, in the CUDA context's term);
    - the process (Python, torch, the engine's libraries): each rank is one.
    The rest (checkpoints, activations, working sets, logits) is the memory model's at the rank's batch."""
    numels, on_device = block_numels(model), frozenset(plan.resident_blocks)
    N = sum(n for b, n in enumerate(numels) if b not in on_device)  # the host's blocks (all, without resident ones)
    NW = sum(shard_numel(n, W) for b, n in enumerate(numels) if b not in on_device)
    NrW = sum(shard_numel(numels[b], W) for b in on_device)
    h = "h" if on_device else ""  # the symbols' subscript: Nh, Bh where resident blocks leave the host
    Bmax = model.numel_largest_block
    BW = shard_numel(Bmax, W)
    Bh = resident_blocks.largest_host_block(model, plan) if on_device else Bmax  # what a slab holds
    BhW = shard_numel(Bh, W)
    E_W = shard_numel(model.numel_embedding, W)
    K, G = plan.num_slots, plan.device_grad_buffers
    out: list[Component] = []
    for comp in components:
        if comp.name in STATE_COMPONENTS or comp.name.endswith("(spill file)"):
            comp = dataclasses.replace(comp, nbytes=comp.nbytes * NW // N if N else 0,
                                       formula=f"{comp.formula}, sharded: x N{h}_W / N{h} = x {NW} / {N}")
        elif comp.name in ("fp32 grad slabs", "spill staging"):
            comp = dataclasses.replace(comp, nbytes=-(-comp.nbytes * BhW // Bh) if Bh else 0,
                                       formula=f"{comp.formula}, sharded: x B{h or 'max'}_W / B{h or 'max'} = "
                                               f"x {BhW} / {Bh}")
        elif comp.name == "resident optimizer state":
            comp = dataclasses.replace(comp, nbytes=16 * NrW, formula=f"16 x Nr_W = 16 x {NrW} (each resident block's "
                                                                      "shard)")
        elif comp.name == "weight slots":
            c = comp.nbytes // (K * Bmax)
            comp = dataclasses.replace(comp, nbytes=K * W * BW * c,
                                       formula=f"K x W x Bmax_W x c = {K} x {W} x {BW} x {c} (whole padded blocks)")
        elif comp.name == "grad accumulators":
            Bg, unit = grad_numel(model, plan.replace(resident_blocks=()))  # a rank's resident gradients pass here
            BgW = shard_numel(Bg, W)
            comp = dataclasses.replace(comp, nbytes=G * W * BgW * 4, formula=f"G x W x {unit}_W x 4 = {G} x {W} x "
                                       f"{BgW} x 4 (whole padded blocks)")
        elif comp.name == "tied embedding grad":
            comp = dataclasses.replace(comp, nbytes=W * E_W * 4, formula=f"W x E_W x 4 = {W} x {E_W} x 4")
        out.append(comp)
    if hw.device_is_host:
        out.append(Component("gradient shards", "device", 0, "0: views of the grad accumulators (gloo, in place)"))
        out.append(Component("collective staging", "device", 0,
                             "0: gathers by broadcast into the slot, gradients all-reduced in place (gloo)"))
    else:
        out.append(Component("gradient shards", "device", (G + 1) * BW * 4,
                             f"(G + 1) x Bmax_W x 4 = {G + 1} x {BW} x 4"))
    return out


def node_memory(mem: MemoryEstimate, hw: HardwareProfile, topo: Topology) -> MemoryEstimate:
    """What a node holds for its G ranks: G x each rank's host (and NVMe) components; the device's stay one
    GPU's (without a GPU they live in the node's RAM too, so G x them as well)."""
    G = topo.gpus_per_node
    return MemoryEstimate(tuple(
        c if c.where == "device" and not hw.device_is_host
        else dataclasses.replace(c, nbytes=G * c.nbytes, formula=f"{G} ranks x ({c.formula})")
        for c in mem.components))


def node_demands(mem: MemoryEstimate, hw: HardwareProfile, topo: Topology) -> list[Overrun]:
    """What one rank's ``mem`` needs of each budget where G ranks share a node: its device buffers of one GPU;
    G x its host bytes (its shards and its own buffers; without a GPU, its device buffers too) of the node's host
    RAM."""
    G = topo.gpus_per_node
    node = G * (mem.host_bytes + (mem.device_bytes if hw.device_is_host else 0))
    gpu = [] if hw.device_is_host else [Overrun("gpu memory", mem.device_bytes, hw.gpu_mem_bytes)]
    return gpu + [Overrun("host RAM", node, hw.host_budget_bytes)]


@dataclass(frozen=True)
class Scaling:
    """One rank's predicted step and the efficiency against one process on the whole global batch."""

    step_seconds: float
    single_step_seconds: float   # one process, the whole global batch, the same plan
    comm_seconds: float          # the collectives of one step, were they not overlapped
    tokens: int                  # global tokens per step
    world: int
    bus_gbps: float
    collectives_bound: bool = False   # the collectives are the busiest resource of the longer phase

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds

    @property
    def efficiency(self) -> float:
        return self.single_step_seconds / (self.world * self.step_seconds)

    @property
    def speedup(self) -> float:
        return self.single_step_seconds / self.step_seconds

    def to_dict(self) -> dict[str, float]:
        return {"step_seconds": self.step_seconds, "single_step_seconds": self.single_step_seconds,
                "comm_seconds": self.comm_seconds, "tokens_per_second": self.tokens_per_second,
                "speedup": self.speedup, "efficiency": self.efficiency, "world": self.world,
                "bus_gbps": self.bus_gbps, "collectives_bound": self.collectives_bound}


def scaling(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, topo: Topology) -> Scaling:
    """The step of W ranks on ``work`` (global) with the rank's ``plan`` (``rank_cost``), and of one process on all
    of it."""
    single = cost_model.estimate(model, work, plan, hw)
    if topo.world == 1:
        return Scaling(single.step_seconds, single.step_seconds, 0.0, work.tokens, 1, topo.bus_gbps)
    rank, comm, bound = _rank_step(model, work, plan, hw, topo)
    return Scaling(rank.step_seconds, single.step_seconds, comm, work.tokens, topo.world, topo.bus_gbps, bound)


def rank_cost(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile,
              topo: Topology | None) -> CostEstimate:
    """One rank's step for ``work`` (the global step) with ``plan`` (the rank's): the cost model's estimate at the
    rank's batch, its phases the rank's with the collectives (the module's formulas), its bytes the rank's shard
    of them; with one rank (``topo`` None: one process), the single process's estimate."""
    if topo is None or topo.world == 1:
        return cost_model.estimate(model, work, plan, hw)
    return _rank_step(model, work, plan, hw, topo)[0]


def collective_seconds(model: ModelShape, work: Workload, hw: HardwareProfile, topo: Topology) -> tuple[float, float]:
    """(comm_fwd, comm_bwd): the all-gathers of the forward's loads; the backward's all-gathers and fp32
    reduce-scatters (every block's, resident ones too), a latency per block and phase."""
    c, ring, bw = work.compute_bytes, (topo.world - 1) / topo.world, topo.bus_gbps * 1e9
    lat = (model.num_layers + 2) * COLLECTIVE_LATENCY_S["cpu" if hw.device_is_host else "gpu"]
    tied = model.numel_embedding if model.tie_word_embeddings else 0
    comm_fwd = lat + ring * c * (model.numel_total + tied) / bw
    comm_bwd = lat + ring * (c * model.num_layers * model.numel_layer + 4 * model.numel_total) / bw
    return comm_fwd, comm_bwd


def _rank_step(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile,
               topo: Topology) -> tuple[CostEstimate, float, bool]:
    """(the rank's estimate, the step's collectives were they not overlapped, whether they are the busiest
    resource of the longer phase), W > 1."""
    W, G = topo.world, topo.gpus_per_node
    rank = cost_model.estimate(model, rank_workload(work, topo), plan, hw, W)  # a resident block: its shard's update
    comm_fwd, comm_bwd = collective_seconds(model, work, hw, topo)

    def phase(p: PhaseTime, comm: float) -> tuple[PhaseTime, bool]:
        """The rank's phase, and whether the collectives are its busiest resource."""
        # the rank's share of each resource, its PhaseTime built once (the search times thousands of a rank's plans)
        compute, h2d, d2h = p.compute_s * (G if hw.device_is_host else 1), p.h2d_s / W, p.d2h_s / W
        adam = p.adam_s * G / W
        if hw.device_is_host:  # one after another on the node's shared cores
            rest = max(0.0, p.seconds - (p.compute_s + p.h2d_s + p.d2h_s + p.adam_s))
            return PhaseTime(compute + h2d + d2h + adam + comm + rest, compute, h2d, d2h, adam), False
        stall = max(0.0, p.seconds - max(p.compute_s, p.h2d_s, p.d2h_s, p.adam_s))
        mine = PhaseTime(max(compute, h2d, d2h, adam, comm) + stall, compute, h2d, d2h, adam)
        return mine, collectives_bind(mine, comm, False)

    (fwd, fwd_comm), (bwd, bwd_comm) = phase(rank.forward, comm_fwd), phase(rank.backward, comm_bwd)
    # the single process's exposed AdamW, less what the rank's shard takes off the update
    shed = rank.forward.adam_s + rank.backward.adam_s - fwd.adam_s - bwd.adam_s
    disk = rank.disk_seconds * G / W
    cost = dataclasses.replace(
        rank, step_seconds=max(fwd.seconds + bwd.seconds, disk), forward=fwd, backward=bwd,
        optimizer_exposed_seconds=max(0.0, rank.optimizer_exposed_seconds - shed), h2d_bytes=rank.h2d_bytes / W,
        d2h_bytes=rank.d2h_bytes / W, disk_read_bytes=rank.disk_read_bytes / W,
        disk_write_bytes=rank.disk_write_bytes / W, disk_seconds=disk)
    return cost, comm_fwd + comm_bwd, fwd_comm if fwd.seconds >= bwd.seconds else bwd_comm


def collectives_bind(phase: PhaseTime, comm: float, device_is_host: bool) -> bool:
    """Whether a rank's collectives (``comm`` seconds) are the busiest resource of its ``phase`` (the rank's
    shares of the others), so bound it: on a GPU, where they overlap the rest; never on CPU ranks, which run them
    one after another with everything else on the node's shared cores."""
    return not device_is_host and comm > max(phase.compute_s, phase.h2d_s, phase.d2h_s, phase.adam_s)


def collective_timeout_s(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, topo: Topology) -> float:
    """Seconds a collective waits for the other ranks before the run stops ([Note: collective timeout] above):
    max(FLOOR, STEPS x the rank's predicted step + one rank's checkpoint write). ``hw`` has disk figures (a spill
    plan's step needs them; sizing.with_disk)."""
    step = scaling(model, work, plan, hw, topo).step_seconds
    state = sum(c.nbytes for c in memory(model, work, plan, hw, topo).components
                if c.name.split(" (")[0] in ("fp32 master", "Adam m", "Adam v"))  # in RAM and in spill files
    save = state / (hw.disk_write_gbps * 1e9) if hw.disk_write_gbps > 0 else 0.0
    return max(COLLECTIVE_TIMEOUT_FLOOR_S, COLLECTIVE_TIMEOUT_STEPS * step + save)
