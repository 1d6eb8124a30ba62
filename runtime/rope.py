"""Rotary position embeddings: inverse frequencies (plain, linear, Llama-3) and cos/sin tables.

Computed as Hugging Face transformers computes them, so that the blocks match
its Llama / Qwen / Mistral implementations on the same weights.
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 on the CPU."""
    dim = config.head_dim
    assert dim is not None
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
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


def rotary_tables(
    inv_freq: torch.Tensor, seq_len: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [1, seq_len, head_dim] in ``dtype`` for positions 0..seq_len-1."""
    positions = torch.arange(seq_len, device=device)[None, :]  # [1, S]
    freqs = positions[..., None].float() * inv_freq.to(device=device, dtype=torch.float)  # [1, S, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, Hq, S, D], k: [B, Hkv, S, D]; cos/sin: [1, S, D]."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)
