"""What a decoder layer takes besides its input, per micro-batch: RoPE's cos and sin, and the documents.

One fp32 cos/sin table per sequence length (rope.py), the latest few kept; packed rows gather the table's
rows by position id on the device ([Note: document attention]).
"""
from __future__ import annotations

import torch

from megatrain.models.layers.attention import Documents
from megatrain.models.layers.rope import attention_scaling, inverse_frequencies, rotary_tables

from megatrain.runtime.config import ModelConfig

# What a layer takes besides its input, per micro-batch: cos, sin and the documents (None: the whole row).
Positions = tuple[torch.Tensor, torch.Tensor, "Documents | None"]

TABLES_KEPT = 4  # sequence lengths whose tables stay cached (each 2 x seq x head_dim / 2 fp32)


class RotaryPositions:
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per length: fp32 cos, sin

    def table(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin for ``seq`` positions, one pair per length (the latest few kept)."""
        if seq not in self.tables:
            if len(self.tables) >= TABLES_KEPT:
                self.tables.pop(next(iter(self.tables)))
            inv_freq = inverse_frequencies(self.config, seq)
            self.tables[seq] = rotary_tables(inv_freq, seq, self.device, attention_scaling(self.config))
        return self.tables[seq]

    def positions(self, seq: int, micro: list[slice], position_ids: torch.Tensor | None,
                  documents: list[Documents | None] | None) -> list[Positions]:
        """Each micro-batch's cos, sin and documents. Packed rows: the table's rows gathered by position id on
        the device ([b, S, head_dim / 2], the values transformers computes for those positions), no host sync."""
        cos, sin = self.table(seq)
        if position_ids is None or documents is None:
            return [(cos, sin, None)] * len(micro)
        return [(cos[0][position_ids[rows]], sin[0][position_ids[rows]], docs) for rows, docs in zip(micro, documents)]
