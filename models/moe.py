"""Mixture-of-experts layers as data: their config rules, parameter table and on-disk names. Pure stdlib.

A sparse MLP (transformers' ``*SparseMoeBlock``) is a router ``mlp.gate.weight`` [E, hidden] and the experts,
kept fused as transformers 5 keeps them in memory: ``mlp.experts.gate_up_proj`` [E, 2 x I, hidden] (each
expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` [E, hidden, I]; Qwen2-MoE adds a shared
expert (a gated MLP of width ``shared_expert_intermediate_size``) with its sigmoid gate ``shared_expert_gate``
[1, hidden]. On disk transformers writes one tensor per expert and projection (Mixtral's
``block_sparse_moe.experts.N.w1/w3/w2``, Qwen-MoE's ``mlp.experts.N.gate_proj/up_proj/down_proj``): each is
a contiguous range of the fused tensor, so ``disk_tensors`` names the ranges and the HF I/O streams them.

``ModelConfig`` fields (megatrain's own names, the same for every family): ``num_experts`` (0: a dense MLP),
``num_experts_per_tok``, ``moe_intermediate_size`` (an expert's width), ``norm_topk_prob`` (the top-k weights
renormalised to sum to 1), ``shared_expert_intermediate_size`` (0: none), ``router_aux_loss_coef`` (None: no
load-balancing loss; else its weight in the loss, transformers' ``output_router_logits`` true).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from .config_fields import boolean, integer, number
from .errors import HFConfigError
from .parameters import DiskTensor, Param, linear, llama_layer

# The ModelConfig fields of a dense model.
DENSE = {"num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0, "norm_topk_prob": False,
         "shared_expert_intermediate_size": 0, "router_aux_loss_coef": None}


def expert_count(model_type: str, data: Mapping[str, Any], names: tuple[str, ...], default: int) -> int:
    """The number of experts: the first of ``names`` (the keys the family's transformers config reads) the config
    has, else ``default``. A config holding both ``num_experts`` and ``num_local_experts`` with different values
    (which one a reader takes differs by family) is refused in one line."""
    both = [data[k] for k in ("num_experts", "num_local_experts") if k in data]
    if len(both) == 2 and both[0] != both[1]:
        raise HFConfigError(f"num_experts={both[0]!r} and num_local_experts={both[1]!r} disagree for model_type="
                            f"{model_type!r}; keep one of them in the config")
    name = next((k for k in names if k in data), names[0])
    return integer(name, data.get(name, default))


def read_experts(model_type: str, data: Mapping[str, Any], *, experts: int, width: int, norm_topk_prob: bool,
                 shared: int = 0) -> dict[str, Any]:
    """The expert fields, checked: ``experts``, ``width``, ``shared`` are the numbers transformers read (its
    config names differ by family); ``norm_topk_prob`` its renormalisation; ``output_router_logits`` true: the
    router's load-balancing loss with ``router_aux_loss_coef`` (absent: transformers' 0.001) as its weight.
    Router jitter is refused (one line)."""
    top_k = integer("num_experts_per_tok", data.get("num_experts_per_tok", 2))
    if experts < 1 or not 1 <= top_k <= experts:
        raise HFConfigError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts}) "
                            f"for model_type={model_type!r}; fix it in the config")
    if width < 1:
        raise HFConfigError(f"the experts' width {width} must be a positive integer; fix it in the config")
    coef = None  # output_router_logits false: no load-balancing loss
    if boolean("output_router_logits", data.get("output_router_logits", False)):
        coef = number("router_aux_loss_coef", data.get("router_aux_loss_coef", 0.001))
        if not 0 <= coef < float("inf"):
            raise HFConfigError(f"router_aux_loss_coef={coef!r} must be a number >= 0; fix it in the config")
    if number("router_jitter_noise", data.get("router_jitter_noise", 0.0)) != 0.0:
        raise HFConfigError(f"router_jitter_noise={data['router_jitter_noise']!r} is not supported; megatrain "
                            "routes without jitter: set it to 0.0")
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": width,
            "norm_topk_prob": norm_topk_prob, "shared_expert_intermediate_size": shared,
            "router_aux_loss_coef": coef}


def write_experts(config: Any) -> dict[str, Any]:
    """The config.json fields every MoE family writes (besides its own names for the expert count and width)."""
    coef = config.router_aux_loss_coef
    return {"num_experts_per_tok": config.num_experts_per_tok, "output_router_logits": coef is not None,
            **({} if coef is None else {"router_aux_loss_coef": coef})}


def moe_layer(dims: Mapping[str, Any], *, router_first: bool) -> tuple[Param, ...]:
    """A decoder layer with a sparse MLP: attention as Llama's, then the router and the experts in the order
    transformers registers them (``router_first``: Mixtral and Qwen2-MoE; Qwen3-MoE registers the experts
    first), then Qwen2-MoE's shared expert and its gate, then the two norms."""
    dense = llama_layer({**dims, "intermediate_size": 1, "mlp_bias": False})
    attention = tuple(p for p in dense if p.name.startswith("self_attn."))
    norms = tuple(p for p in dense if p.name.endswith("layernorm.weight"))
    h, e, i = dims["hidden_size"], dims["num_experts"], dims["moe_intermediate_size"]
    router = (Param("mlp.gate.weight", (e, h)),)
    experts = (Param("mlp.experts.gate_up_proj", (e, 2 * i, h)), Param("mlp.experts.down_proj", (e, h, i)))
    mlp = router + experts if router_first else experts + router
    shared = dims.get("shared_expert_intermediate_size") or 0
    if shared:
        mlp += tuple(linear("mlp.shared_expert.gate_proj", h, shared, False)
                     + linear("mlp.shared_expert.up_proj", h, shared, False)
                     + linear("mlp.shared_expert.down_proj", shared, h, False)
                     + linear("mlp.shared_expert_gate", h, 1, False))
    return attention + mlp + norms


def per_expert_names(prefix: str, projections: tuple[str, str, str]
                     ) -> Callable[[int, Param], tuple[DiskTensor, ...] | None]:
    """The on-disk tensors of a layer's MLP parameter when transformers writes the experts one tensor per
    expert: ``model.layers.L.{prefix}.experts.N.{projection}.weight`` with ``projections`` the names of (gate,
    up, down), and the router as ``{prefix}.gate.weight``; None: the parameter's own name."""
    gate, up, down = projections

    def disk_tensors(layer: int, param: Param) -> tuple[DiskTensor, ...] | None:
        base = f"model.layers.{layer}.{prefix}"
        if param.name == "mlp.gate.weight" and prefix != "mlp":
            return (DiskTensor(f"{base}.gate.weight", param.shape, 0),)
        if not param.name.startswith("mlp.experts."):
            return None
        e, rows, cols = param.shape
        if param.name.endswith("gate_up_proj"):
            half = rows // 2 * cols
            return tuple(DiskTensor(f"{base}.experts.{n}.{name}.weight", (rows // 2, cols), n * 2 * half + k * half)
                         for n in range(e) for k, name in enumerate((gate, up)))
        return tuple(DiskTensor(f"{base}.experts.{n}.{down}.weight", (rows, cols), n * rows * cols)
                     for n in range(e))

    return disk_tensors


def every_layer_sparse(model_type: str, data: Mapping[str, Any]) -> None:
    """Qwen-MoE's layer layout: megatrain builds every layer alike, so a config with dense layers among the
    sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` > 1) is refused with one line."""
    step = integer("decoder_sparse_step", data.get("decoder_sparse_step", 1))
    dense = data.get("mlp_only_layers") or []
    if step != 1 or dense:
        raise HFConfigError(f"model_type={model_type!r} with dense layers among the sparse ones (decoder_sparse_step="
                            f"{step}, mlp_only_layers={dense!r}) is not supported; megatrain trains models whose "
                            "every layer is sparse (decoder_sparse_step 1, mlp_only_layers [])")
