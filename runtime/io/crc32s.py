"""CRC32s of a byte stream cut at fixed boundaries: what a checkpoint's manifest records per array."""
from __future__ import annotations

import zlib

import torch

CRC_CHUNK_BYTES = 64 * 2**20  # one CRC32 per 64 MiB of an array: names the corrupt range, cheap to verify


class Crc32s:
    """CRC32 of each CRC_CHUNK_BYTES of a byte stream fed in order, piece by piece (zlib releases the GIL)."""

    def __init__(self) -> None:
        self.crcs: list[int] = []
        self.current, self.filled = 0, 0

    def update(self, piece: torch.Tensor) -> None:
        raw = memoryview(piece.view(torch.uint8).numpy())  # pieces are contiguous: no copy
        i = 0
        while i < len(raw):
            take = min(CRC_CHUNK_BYTES - self.filled, len(raw) - i)
            self.current = zlib.crc32(raw[i:i + take], self.current)
            self.filled, i = self.filled + take, i + take
            if self.filled == CRC_CHUNK_BYTES:
                self.crcs.append(self.current)
                self.current, self.filled = 0, 0

    def digest(self) -> list[int]:
        return self.crcs + ([self.current] if self.filled else [])
