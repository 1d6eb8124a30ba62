"""megatrain with its planner's plan: weights and AdamW state in host memory, blocks streamed to the device.

bf16 compute on CUDA, fp32 on a CPU (a CPU's bf16 matmuls are slow). The plan is the
planner's best for this machine (``detect()``: host limits measured, GPU rates from its
preset) and this workload, with clipping and without spill; when the planner finds none,
``Plan(micro_batch_size=<the peers' micro-batch>)`` runs and the details say so.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from .spec import RunSpec

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def import_megatrain() -> str:
    """Make ``megatrain.runtime`` / ``.planner`` importable: installed (``pip install -e .``), or else
    straight from this checkout, mapping the folders as pyproject.toml does. Returns which."""
    if importlib.util.find_spec("megatrain") is not None:
        try:
            if importlib.util.find_spec("megatrain.runtime") is not None:
                return "installed"
        except ModuleNotFoundError:
            pass
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import megatrain

    for sub in ("planner", "runtime", "tools"):  # planner first: the runtime imports its Plan
        name = f"megatrain.{sub}"
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, sub, "__init__.py"),
                                                      submodule_search_locations=[os.path.join(ROOT, sub)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        setattr(megatrain, sub, module)
        spec.loader.exec_module(module)
    return f"from the checkout at {ROOT} (not installed)"


def plan_for(spec: RunSpec, clipping: bool = True) -> tuple[Any, dict[str, Any]]:
    """The planner's plan for this run, and what the planner said (its prediction, or why it has none)."""
    return planner_plan(spec.config, spec.seq, spec.batch, spec.device, spec.micro_batch, clipping)


def planner_plan(config: dict[str, Any], seq: int, batch: int, device: str, fallback_micro_batch: int,
                 clipping: bool = True) -> tuple[Any, dict[str, Any]]:
    """The planner's plan for ``batch`` sequences of ``seq`` tokens of ``config`` on this machine (bf16 on
    CUDA, fp32 on a CPU), and what it said; ``Plan(micro_batch_size=fallback_micro_batch)`` where none fits."""
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.choice import search
    from megatrain.planner.profiling.profiler import detect
    from megatrain.planner.shapes.workload import Workload
    from megatrain.runtime import Plan

    work = Workload(seq, batch, compute_dtype="bf16" if device == "cuda" else "fp32", clipping=clipping,
                    spill="none")
    result = search.search(model_shapes.from_config(config), work, detect())
    if result.best is None:
        plan = Plan(micro_batch_size=fallback_micro_batch)
        return plan, {"planner": f"no plan fits ({result.reason()}); ran Plan(micro_batch_size={fallback_micro_batch})"}
    best = result.best
    said: dict[str, Any] = {"planner": "best of the search",
                            "predicted_device_bytes": best.memory.device_bytes,
                            "predicted_host_bytes": best.memory.host_bytes}
    if best.cost is not None:
        said.update(predicted_step_seconds=best.cost.step_seconds, predicted_bottleneck=best.cost.bottleneck)
    return best.plan, said


class MegatrainTrainer:
    def __init__(self, spec: RunSpec) -> None:
        import torch

        from .weights import InitialWeights

        how = import_megatrain()
        from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

        self.cuda = spec.device == "cuda"
        dtype = torch.bfloat16 if self.cuda else torch.float32
        plan, said = plan_for(spec)
        optimizer = OptimizerConfig(lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                                    max_grad_norm=spec.max_grad_norm)
        # _skip_init: every weight is loaded next (what from_pretrained does); saves a full random init.
        self.engine = Engine(ModelConfig.from_hf(spec.config), optimizer=optimizer, plan=plan, compute_dtype=dtype,
                             device=spec.device, seed=spec.seed, _skip_init=True)
        # The initial weights by the Hugging Face names and shapes of megatrain's own block table (the names the
        # other systems draw theirs by, from transformers' model; a name that differed would draw other numbers
        # and the first losses would disagree): no transformers import, its time and memory, in this run.
        shapes = {e.hf_name: e.shape for block in self.engine.templates.blocks for e in block.layout.entries}
        self.engine.load_state_dict(InitialWeights(shapes, spec))
        self.params = self.engine.num_parameters
        self.details = {"compute_dtype": str(dtype).replace("torch.", ""), "plan": plan.to_dict(), **said,
                        "megatrain": how,
                        "optimizer": "megatrain CPU AdamW (torch fused CPU kernel), fp32 masters and state in host RAM"}

    def step(self, ids) -> float:
        self.engine.time_next_step()  # breakdown() reads every step's
        # .item(): the step's end as a training loop that logs its loss sees it; the deferred
        # AdamW of this step may still run, overlapping the next step's forward (drain() waits for it).
        return self.engine.step(ids, ids).item()

    def drain(self) -> None:
        self.engine.synchronize()

    def breakdown(self) -> dict[str, float] | None:
        return getattr(self.engine, "last_step_breakdown", None)

    def pinned_bytes(self) -> int | None:
        # the arenas registered with the driver (the store's, the host checkpoints'); 0 without CUDA
        return self.engine.store.pinned_bytes + self.engine.executor.checkpoints.pinned_bytes

    def close(self) -> None:
        self.engine.close()


def build(spec: RunSpec) -> MegatrainTrainer:
    return MegatrainTrainer(spec)
