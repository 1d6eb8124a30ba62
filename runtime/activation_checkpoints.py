"""Activation checkpoints at block boundaries: each decoder layer's input, per micro-batch.

Forward saves x[layer][m]; backward recomputes the layer from it. The plan puts
them on the device (kept as the tensors forward produced: no copy) or in host
memory (pinned on CUDA): drained on the d2h stream as forward produces them,
and loaded back on the h2d stream together with the layer's weights, into a
staging area tied to the weight slot (so the slot's ``loaded`` event covers
both). Memory: device placement, n_layers x tokens x hidden x compute bytes on
the device; host placement, the same in host RAM plus K staging areas of
tokens x hidden on the device.
"""
from __future__ import annotations

import torch

from .host_store import HostArena
from .step_timer import StepTimer
from .streams import Event, Streams


class DeviceCheckpoints:
    def __init__(self) -> None:
        self._saved: dict[tuple[int, int], torch.Tensor] = {}

    def begin(self, n_layers: int, batch: int, seq: int, hidden: int) -> None:
        self._saved.clear()

    def save(self, layer: int, m: int, rows: slice, x: torch.Tensor) -> None:
        self._saved[(layer, m)] = x

    def end_forward_block(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def load_into_slot(self, layer: int, slot: int) -> None:
        pass

    def get(self, layer: int, m: int, rows: slice) -> torch.Tensor:
        return self._saved.pop((layer, m))


class HostCheckpoints:
    def __init__(self, num_slots: int, dtype: torch.dtype, device: torch.device, streams: Streams, pin: bool,
                 timer: StepTimer) -> None:
        self.num_slots, self.dtype, self.device, self.streams, self.pin = num_slots, dtype, device, streams, pin
        self.timer = timer
        self._arena: HostArena | None = None
        self._host: torch.Tensor | None = None  # [n_layers, B, S, hidden] in host memory
        self._staging: list[torch.Tensor] = []  # per slot: [B, S, hidden] on the device
        self._pending: list[tuple[torch.Tensor, Event]] = []  # device tensors still being drained
        self._previous: list[tuple[torch.Tensor, Event]] = []
        self._drained: dict[int, list[Event]] = {}  # per layer: the drains its reload must wait for
        self._slot_of: dict[int, int] = {}  # per reloaded layer: the weight slot whose staging area holds it

    def begin(self, n_layers: int, batch: int, seq: int, hidden: int) -> None:
        shape = (n_layers, batch, seq, hidden)
        if self._host is None or self._host.shape != shape:
            # Sized for this batch shape; reallocated only when the shape changes.
            if self._arena is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the last step's copies may still use it (rare)
                self._arena.close()
            numel = n_layers * batch * seq * hidden
            self._arena = HostArena(numel, self.dtype, self.pin, "activation checkpoints")
            self._host = self._arena.tensor.view(shape)
            self._staging = [torch.empty(shape[1:], dtype=self.dtype, device=self.device) for _ in range(self.num_slots)]

    def save(self, layer: int, m: int, rows: slice, x: torch.Tensor) -> None:
        """Drain x ([rows, S, hidden], produced on the compute stream) to host memory."""
        assert self._host is not None
        ready = self.streams.recorded(self.streams.compute)
        with self.streams.d2h.use():
            self.streams.d2h.wait_event(ready)
            with self.timer.copy("d2h", self.streams.d2h, "ckpt"):
                self._host[layer, rows].copy_(x, non_blocking=True)
            done = self.streams.recorded(self.streams.d2h)
        self._pending.append((x, done))
        self._drained.setdefault(layer, []).append(done)

    def end_forward_block(self) -> None:
        """Let go of the device tensors drained one block ago, once the compute stream is past their copies.

        Bound: two blocks' worth of micro-batch inputs stay referenced while their drains run.
        """
        for _, done in self._previous:
            with self.timer.stall("ckpt", self.streams.compute):
                self.streams.compute.wait_event(done)
        self._previous, self._pending = self._pending, []

    def flush(self) -> None:
        self.end_forward_block()
        self.end_forward_block()

    def load_into_slot(self, layer: int, slot: int) -> None:
        """On the h2d stream, inside the slot's load: this layer's checkpoints into the slot's staging area."""
        assert self._host is not None
        for done in self._drained.pop(layer, []):
            self.streams.h2d.wait_event(done)
        with self.timer.copy("h2d", self.streams.h2d, "ckpt"):
            self._staging[slot].copy_(self._host[layer], non_blocking=True)
        self._slot_of[layer] = slot

    def get(self, layer: int, m: int, rows: slice) -> torch.Tensor:
        """Micro-batch m's input of ``layer``, from the staging area of the slot its load went to."""
        return self._staging[self._slot_of[layer]][rows]

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
