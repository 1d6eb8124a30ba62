"""MXFP4 expert tensors (gpt-oss's published checkpoints), dequantized on load into the fp32 masters.

A fused expert tensor W [E, C, R] (gpt-oss's ``gate_up_proj`` [E, hidden, 2I], ``down_proj`` [E, I, hidden], as
transformers keeps them in memory) is stored as ``{name}_blocks`` uint8 [E, R, C / 32, 16] and
``{name}_scales`` uint8 [E, R, C / 32]: row r of expert e is cut along C into groups of 32 values, one scale byte
per group and 16 bytes of two FP4 (e2m1) codes each, the low nibble element 2j and the high nibble element 2j + 1;
W[e, c, r] = ``FP4_VALUES[code]`` x 2^(scale - 127). That is transformers' ``convert_moe_packed_tensors``
(integrations/mxfp4.py) computed in float32 (its ``ldexp`` on the looked-up values), so the masters hold what
transformers' model loaded in float32 holds. Streamed as every tensor is loaded: one expert's blocks and scales
at a time are read into temporaries (R x C / 2 + R x C / 32 bytes) and decoded into the master's view.
Export writes the dequantized tensors under their own names (plain floats, no ``quantization_config``).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from megatrain.models.parameters import DiskTensor
from megatrain.runtime.errors import InputError

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUFFIXES = ("_blocks", "_scales")
GROUP = 32  # values per scale


def quantized_pieces(hf_name: str, shape: tuple[int, ...], present: Iterable[str]
                     ) -> tuple[DiskTensor, DiskTensor] | None:
    """The blocks and scales tensors holding parameter ``hf_name`` [E, C, R] when the files hold it in MXFP4
    (None: they do not)."""
    if hf_name + SUFFIXES[0] not in present:
        return None
    if len(shape) != 3 or shape[1] % GROUP:
        raise InputError(f"{hf_name} is stored in MXFP4 but its shape {shape} is not [experts, a multiple of "
                         f"{GROUP}, width]; the config.json does not match the weights")
    e, c, r = shape
    return (DiskTensor(hf_name + SUFFIXES[0], (e, r, c // GROUP, GROUP // 2), 0),
            DiskTensor(hf_name + SUFFIXES[1], (e, r, c // GROUP), 0))


def is_quantized(pieces: tuple[DiskTensor, ...]) -> bool:
    return len(pieces) == 2 and pieces[0].name.endswith(SUFFIXES[0]) and pieces[1].name.endswith(SUFFIXES[1])


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G x 32], each row's values in order."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(*blocks.shape, 2, dtype=torch.float32)
    out[..., 0] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1] = lut[(blocks >> 4).to(torch.int)]
    out = out.reshape(*blocks.shape[:-1], GROUP)
    torch.ldexp(out, (scales.to(torch.int32) - 127)[..., None], out=out)
    return out.reshape(*blocks.shape[:-2], -1)


def load(read: Callable[[str, int, torch.Tensor], None], pieces: tuple[DiskTensor, ...], dst: torch.Tensor) -> None:
    """Dequantize ``pieces`` (``quantized_pieces``) into ``dst`` [E, C, R] float32, one expert at a time;
    ``read(name, byte offset in that tensor, out)`` fills the uint8 tensor ``out`` from the files."""
    blocks, scales = pieces
    e, r, g, b = blocks.shape
    block_bytes = torch.empty(r, g, b, dtype=torch.uint8)
    scale_bytes = torch.empty(r, g, dtype=torch.uint8)
    for n in range(e):
        read(blocks.name, n * block_bytes.numel(), block_bytes)
        read(scales.name, n * scale_bytes.numel(), scale_bytes)
        dst[n].copy_(dequantize(block_bytes, scale_bytes).T)
