"""The Engine's constructor arguments, checked where they enter: one line per mistake, saying how to fix it.

Defaults are filled in (``OptimizerConfig()``, the default plan: ``default_plan``, whose micro-batch the first
training step's batch sets, so a batch is never split unless a plan says so), a plan made for another model or
dtype is refused, and the device is picked: this rank's under data parallelism (joining the process group the
environment describes), else the GPU when there is one.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from megatrain.plan.plan import Plan, PlanError, default_plan, host_device_choices
from megatrain.plan.plan_checks import check_resident_blocks
from megatrain.plan.workload_fingerprint import shape_digest

from megatrain.runtime.config import ModelConfig, OptimizerConfig
from megatrain.runtime.distributed.process_group import Topology, join as join_ranks, rank_device
from megatrain.runtime.errors import ConfigError

COMPUTE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


class Arguments(NamedTuple):
    """The checked arguments, defaults filled in."""
    optimizer: OptimizerConfig
    plan: Plan
    plan_given: bool  # False: the default plan, its micro-batch still open (step_inputs.StepInputs)
    topology: Topology | None  # several ranks: this one's place ([Note: collectives]); None: one process
    device: torch.device


def check_arguments(model_config: object, optimizer: object, plan: object, compute_dtype: object,
                    device: str | torch.device | None, seed: object) -> Arguments:
    """Every argument of ``Engine(...)`` checked, in the order they are listed."""
    if not isinstance(model_config, ModelConfig):
        raise ConfigError(f"model_config is a {type(model_config).__name__}; build one with ModelConfig(...) or "
                          "ModelConfig.from_hf(path)")
    optimizer = optimizer if optimizer is not None else OptimizerConfig()
    if not isinstance(optimizer, OptimizerConfig):
        raise ConfigError(f"optimizer is a {type(optimizer).__name__}; pass OptimizerConfig(...)")
    plan_given = plan is not None
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"plan is a {type(plan).__name__}; pass a Plan (e.g. Plan.load('plan.json')) or None")
    plan = plan if plan is not None else default_plan(optimizer.clipping)
    if plan.optimizer_mode == "eager" and optimizer.clipping:
        raise PlanError(
            f"optimizer_mode='eager' cannot clip gradients (max_grad_norm={optimizer.max_grad_norm}): "
            "use optimizer_mode='deferred', or OptimizerConfig(max_grad_norm=None)"
        )
    if not isinstance(compute_dtype, torch.dtype) or compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(
            f"compute_dtype={compute_dtype!r} is not supported; use torch.bfloat16 (fast) or torch.float32 (exact)"
        )
    plan.check_kept_layers(model_config.num_hidden_layers)
    check_resident_blocks(plan, model_config.num_hidden_layers + 2)  # the embedding, the layers, the head
    if plan.compiled_layers and model_config.num_experts:
        raise PlanError(f"compiled_layers compiles dense decoder layers, but this model's MLPs are sparse "
                        f"(num_experts={model_config.num_experts}: the routing changes their shapes every step); "
                        "set compiled_layers to false")
    if plan.workload is not None:  # a plan's memory bounds hold only for the model and dtype it was made for
        plan.workload.check_model(shape_digest(model_config.to_dict()), str(compute_dtype).removeprefix("torch."))
    # Several ranks (a process group, or torchrun's environment): this rank's shards ([Note: collectives]).
    topology = join_ranks()
    if topology is not None and optimizer.state_dtype != "fp32":
        raise ConfigError("state_dtype='bf16' is not supported with data parallelism yet; use state_dtype='fp32'")
    _check_resident(plan, optimizer)
    picked = pick_device(rank_device(topology, device))
    if not plan_given:  # the default plan's AdamW thread and copies follow the device
        plan = default_plan(optimizer.clipping, device_is_host=picked.type == "cpu" and topology is None)
    elif plan.adam_thread == "compute" and picked.type != "cpu":
        raise PlanError("adam_thread='compute' is for a CPU device: on a GPU it would wait for every gradient copy; "
                        "use adam_thread='worker' (megatrain-plan plan picks it on a GPU machine)")
    elif plan.compute_in_place and (picked.type != "cpu" or topology is not None):
        raise PlanError("compute_in_place is for one process on a CPU device, whose weights are in host RAM "
                        "already; set compute_in_place to false")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**40:
        raise ConfigError(f"seed={seed!r} must be an integer in [0, 2**40)")
    return Arguments(optimizer, plan, plan_given, topology, picked)


def resumed_plan(plan: Plan | None, device: str | torch.device | None) -> Plan | None:
    """A checkpoint's recorded plan for where it resumes: its CPU device's choices (compute in place, AdamW on
    the compute thread: the same bits either way) turned off on a GPU, which refuses both, or with several ranks,
    which refuse computing in place and whose plans keep AdamW on its worker."""
    if plan is None or not (plan.compute_in_place or plan.adam_thread == "compute"):
        return plan
    topology = join_ranks()  # as check_arguments then finds it (the group is joined once)
    host = topology is None and pick_device(device).type == "cpu"
    return plan if host else plan.replace(**host_device_choices(False, plan.optimizer_mode, plan.spill))


def pick_device(device: str | torch.device | None) -> torch.device:
    """The device to compute on: the one asked for, checked; None: the current GPU, else the CPU."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device={device!r} is not a device; use 'cuda', 'cuda:0', 'cpu' or None (auto)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA GPU; use device=None (auto) or 'cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"device={device!r} is not supported; use 'cuda' or 'cpu'")
    return dev


def _check_resident(plan: Plan, optimizer: OptimizerConfig) -> None:
    """What a plan's resident blocks ([Note: resident blocks]) are not built for yet: fp32 AdamW state only."""
    why = "bf16 AdamW state" if optimizer.state_dtype != "fp32" else None
    if plan.resident_blocks and why:
        raise ConfigError(f"resident_blocks (optimizer state on the device) is not supported with {why} yet; "
                          "plan again with megatrain-plan plan, or drop resident_blocks from the plan")
