"""Rotary position embeddings: inverse frequencies (plain, linear, Llama-3, dynamic NTK, YaRN) and cos/sin tables.

Computed as Hugging Face transformers computes them, so that the blocks match
its Llama / Qwen / Mistral implementations on the same weights. Two types depend
on more than the config: "dynamic" on the sequence length (transformers grows
its frequencies with the longest sequence seen; megatrain computes them for each
batch's length, which is what a fresh transformers model does), and "yarn"
scales cos and sin by an attention factor.

Tables stay in fp32 and hold half a head ([1, S, head_dim // 2]: the two halves
of transformers' table are the same numbers), so one table per length serves
every compute dtype; ``apply_rotary`` casts it to the dtype of q and k, which
rounds exactly as transformers' ``cos.to(x.dtype)`` does. At 512k tokens and
head_dim 128 that is 128 MiB each for cos and sin.
"""
from __future__ import annotations

import math

import torch

from megatrain.models.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, seq_len: int | None = None) -> torch.Tensor:
    """[head_dim // 2] float32 on the CPU; ``seq_len`` matters only to "dynamic" (None: max_position_embeddings)."""
    dim = config.head_dim
    assert dim is not None
    scaling = config.rope_scaling
    rope_type = None if scaling is None else scaling["rope_type"]
    if rope_type == "dynamic":
        return _dynamic_ntk(config.rope_theta, dim, scaling["factor"], config.max_position_embeddings, seq_len)
    if rope_type == "yarn":
        return _yarn(config.rope_theta, dim, scaling)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if rope_type == "linear":
        return inv_freq / factor
    # Llama 3: long wavelengths divided by factor, short ones kept, a smooth ramp between.
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def attention_scaling(config: ModelConfig) -> float:
    """The factor on cos and sin: YaRN's attention factor, 1.0 for every other type."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    factor = scaling["factor"]
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def _dynamic_ntk(theta: float, dim: int, factor: float, max_positions: int, seq_len: int | None) -> torch.Tensor:
    """NTK-aware base growth: base x (factor x L / max_positions - (factor - 1)) ^ (dim / (dim - 2)), L >= max."""
    length = max_positions if seq_len is None else max(seq_len, max_positions)
    base = theta * ((factor * length / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, scaling) -> torch.Tensor:
    """YaRN: interpolated (/ factor) below the correction range, extrapolated above, a linear ramp between."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotary_tables(
    inv_freq: torch.Tensor, seq_len: int, device: torch.device, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [1, seq_len, head_dim // 2] float32 for positions 0..seq_len-1, times ``scaling``."""
    positions = torch.arange(seq_len, device=device)[None, :]  # [1, S]
    freqs = positions[..., None].float() * inv_freq.to(device=device, dtype=torch.float)  # [1, S, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos, sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, S, D], k: [B, Hkv, S, D]; cos/sin: [1, S, D/2] fp32 (cast here to q's dtype).

    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): the same products and sums, bit for bit, as
    transformers' ``x * cos + rotate_half(x) * sin`` on the doubled table."""
    cos = cos.to(q.dtype).unsqueeze(1)
    sin = sin.to(q.dtype).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
