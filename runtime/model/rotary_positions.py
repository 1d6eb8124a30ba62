"""What a decoder layer takes besides its input, per micro-batch: RoPE's cos and sin, and the documents.

One fp32 cos/sin table per RoPE and sequence length (rope.py), the latest few kept. Each layer type
(``layer_types.py``) reads its RoPE from its own configuration (Gemma 3's sliding layers have another base and
no scaling); types with the same RoPE share one table. Packed rows gather the table's rows by position id on the
device ([Note: document attention]), once per distinct table.
"""
from __future__ import annotations

from typing import Any

import torch

from megatrain.models.layers.attention import Documents
from megatrain.models.layers.rope import attention_scaling, inverse_frequencies, rotary_tables

from megatrain.runtime.config import ModelConfig
from megatrain.runtime.model.layer_types import distinct_layer_types, layer_config

# What a layer takes besides its input, per micro-batch: cos, sin and the documents (None: the whole row).
Positions = tuple[torch.Tensor, torch.Tensor, "Documents | None"]
# Per layer type (None: every layer alike), each micro-batch's Positions.
LayerPositions = dict["str | None", list[Positions]]

TABLES_KEPT = 4  # sequence lengths whose tables stay cached per RoPE (each 2 x seq x head_dim / 2 fp32)


class RotaryPositions:
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        # Per layer type, the configuration its RoPE is read from.
        self.ropes = {t: layer_config(config, t) for t in distinct_layer_types(config)}
        self.tables: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # per (RoPE, length): cos, sin

    @staticmethod
    def _rope(rope: ModelConfig) -> tuple[Any, ...]:
        """What a RoPE's tables depend on besides the length."""
        return rope.rope_theta, rope.rope_scaling

    def table(self, seq: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin for ``seq`` positions of the layers of ``layer_type``, one pair per RoPE and length (the
        latest few kept)."""
        rope = self.ropes[layer_type]
        key = (*self._rope(rope), seq)
        if key not in self.tables:
            if len(self.tables) >= TABLES_KEPT * len(self.ropes):
                self.tables.pop(next(iter(self.tables)))
            inv_freq = inverse_frequencies(rope, seq)
            self.tables[key] = rotary_tables(inv_freq, seq, self.device, attention_scaling(rope))
        return self.tables[key]

    def positions(self, seq: int, micro: list[slice], position_ids: torch.Tensor | None,
                  documents: list[Documents | None] | None) -> LayerPositions:
        """Per layer type, each micro-batch's cos, sin and documents. Packed rows: the table's rows gathered by
        position id on the device ([b, S, head_dim / 2], the values transformers computes for those positions),
        no host sync."""
        out: LayerPositions = {}
        gathered: dict[tuple[Any, ...], list[Positions]] = {}  # per RoPE: types with the same one share it
        for kind, rope in self.ropes.items():
            key = self._rope(rope)
            if key not in gathered:
                gathered[key] = self._micro_batches(self.table(seq, kind), micro, position_ids, documents)
            out[kind] = gathered[key]
        return out

    @staticmethod
    def _micro_batches(table: tuple[torch.Tensor, torch.Tensor], micro: list[slice], position_ids: torch.Tensor | None,
                       documents: list[Documents | None] | None) -> list[Positions]:
        cos, sin = table
        if position_ids is None or documents is None:
            return [(cos, sin, None)] * len(micro)
        return [(cos[0][position_ids[rows]], sin[0][position_ids[rows]], docs) for rows, docs in zip(micro, documents)]
