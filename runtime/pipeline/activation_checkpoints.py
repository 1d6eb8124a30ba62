"""Activation checkpoints at block boundaries: each recomputed decoder layer's input, per micro-batch.

Forward saves x[layer][m]; backward recomputes the layer from it. A kept layer ([Note: kept layers] in
kept_layers.py) saves none: its forward graph holds its input. The plan puts
them on the device (kept as the tensors forward produced: no copy) or in host
memory (pinned on CUDA), moved in pieces on the checkpoint stream
([Note: host checkpoints in pieces]).

[Note: host checkpoints in pieces]
A micro-batch's input x ([b, S, h], b x S = t tokens) is cut into pieces of at
most ``Plan.checkpoint_piece_tokens`` tokens (rows of x viewed as [t, h]; None:
one piece). Each piece is one copy on the checkpoint stream with its own event,
so a layer's gigabytes never hold a copy engine in one block: the weight loads
on the h2d stream interleave between pieces, and a piece's reload waits only
for that piece's drain.

Drain (forward): the pieces are read from x itself, no device staging. x stays
referenced until its last piece is on the host; the compute stream waits for
that (usually long past) just before it saves the same micro-batch of the next
layer. So the drains hold at most one input per micro-batch beyond the live
activations: T x h x c bytes (T the batch's tokens), the memory model's
"checkpoint drains in flight".

Reload (backward): the recompute reads the micro-batch's whole input (attention
mixes every token of a row), so each is assembled whole on the device: two
reload buffers of t x h (the largest micro-batch), one read by the recompute
while the next input in backward order comes back into the other, piece by
piece. A buffer is refilled only after the compute stream is past the recompute
that read it (its ``released`` event). Device memory: 2 x t x h x c, the memory
model's "checkpoint staging", whatever the layer count, slots or micro-batches.
The first two reloads are issued when forward ends, so they overlap the head.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.state.host_store import HostArena
from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.device.streams import Event, Streams

RELOAD_BUFFERS = 2  # one read by the recompute, one filling: [Note: host checkpoints in pieces]


def pieces(tokens: int, piece_tokens: int | None) -> list[tuple[int, int]]:
    """(first token, tokens) of each piece of ``tokens``, in order: at most ``piece_tokens`` each (None: one)."""
    step = tokens if piece_tokens is None else piece_tokens
    return [(lo, min(step, tokens - lo)) for lo in range(0, tokens, step)]


class DeviceCheckpoints:
    pinned_bytes = 0  # nothing in host memory

    def __init__(self) -> None:
        self._saved: dict[tuple[int, int], torch.Tensor] = {}

    def begin(self, layers: Sequence[int], batch: int, seq: int, hidden: int, micro: list[slice]) -> None:
        self._saved.clear()

    def save(self, layer: int, m: int, rows: slice, x: torch.Tensor) -> None:
        self._saved[(layer, m)] = x

    def flush(self) -> None:
        pass

    def get(self, layer: int, m: int, rows: slice) -> torch.Tensor:
        return self._saved.pop((layer, m))


class HostCheckpoints:
    """Host-resident checkpoints moved in pieces on the checkpoint stream: [Note: host checkpoints in pieces]."""

    def __init__(self, piece_tokens: int | None, dtype: torch.dtype, device: torch.device, streams: Streams,
                 pin: bool, timer: StepTimer, log: EventLog) -> None:
        self.piece_tokens, self.dtype, self.device, self.streams, self.pin = piece_tokens, dtype, device, streams, pin
        self.timer, self.log = timer, log
        self._arena: HostArena | None = None
        self._host: torch.Tensor | None = None  # [recomputed layers, B, S, hidden] in host memory
        self._row: dict[int, int] = {}  # decoder layer -> its row of _host
        self.staging: list[torch.Tensor] = []  # RELOAD_BUFFERS x [t_max x hidden] on the device
        self._released: list[Event] = []  # per reload buffer: the compute stream is past its last reader
        self._loaded: list[list[Event]] = []  # per reload buffer: its pieces' events, for the item it holds
        self._held: dict[int, tuple[torch.Tensor, Event]] = {}  # per micro-batch: x drained, its last piece's event
        self._drained: dict[tuple[int, int], list[Event]] = {}  # per (layer, m): each piece's drain
        self._order: list[tuple[int, int]] = []  # backward's (layer, m), in the order the recompute asks
        self._micro: list[slice] = []
        self._seq = self._hidden = 0
        self._reloaded = 0  # reloads issued this step (indices into _order)
        self._got = 0  # get() calls this step
        self.step = 0
        self.held_peak_bytes = 0  # the most bytes of drained inputs held at once (tests compare the memory model)

    def begin(self, layers: Sequence[int], batch: int, seq: int, hidden: int, micro: list[slice]) -> None:
        """A step whose recomputed layers are ``layers`` (in forward order) over ``micro``'s rows of [batch, seq]."""
        n_layers = len(layers)
        self._row = {layer: i for i, layer in enumerate(layers)}
        shape = (n_layers, batch, seq, hidden)
        t_max = max(r.stop - r.start for r in micro) * seq
        if self._host is None or self._host.shape != shape or self.staging[0].shape[0] != t_max:
            # Sized for this batch shape; reallocated only when the shape changes.
            if self._arena is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the last step's copies may still use it (rare)
                self._arena.close()
            self._arena = HostArena(n_layers * batch * seq * hidden, self.dtype, self.pin, "activation checkpoints")
            self._host = self._arena.tensor.view(shape)
            self.staging = [torch.empty(t_max, hidden, dtype=self.dtype, device=self.device)
                            for _ in range(RELOAD_BUFFERS)]
            self._released = [self.streams.event() for _ in range(RELOAD_BUFFERS)]
            self._loaded = [[] for _ in range(RELOAD_BUFFERS)]
        for m in list(self._held):  # a step that stopped in its forward left these (none after a whole step)
            self._let_go(m)
        self._drained.clear()
        self._micro, self._seq, self._hidden = list(micro), seq, hidden
        self._order = [(layer, m) for layer in reversed(layers) for m in range(len(micro))]
        self._reloaded = self._got = 0
        self.step += 1

    def save(self, layer: int, m: int, rows: slice, x: torch.Tensor) -> None:
        """Drain x ([rows, S, hidden], produced on the compute stream) to host memory, piece by piece."""
        assert self._host is not None
        self._let_go(m)  # the previous layer's input of this micro-batch: its drain is done by now
        flat = x.reshape(-1, self._hidden)  # [t, hidden]; held (with its storage) until the last piece is out
        host = self._host[self._row[layer], rows].view(-1, self._hidden)
        ready = self.streams.recorded(self.streams.compute)
        done: list[Event] = []
        with self.streams.ckpt.use():
            self.streams.ckpt.wait_event(ready)
            for i, (lo, n) in enumerate(pieces(flat.shape[0], self.piece_tokens)):
                with self.timer.copy("d2h", self.streams.ckpt, "ckpt"):
                    host[lo:lo + n].copy_(flat[lo:lo + n], non_blocking=True)
                done.append(self.streams.recorded(self.streams.ckpt))
                self.log.record("ckpt_drain", self.step, layer + 1, micro=m, piece=i)
        self._drained[(layer, m)] = done
        self._held[m] = (flat, done[-1])
        held = sum(t.numel() * t.element_size() for t, _ in self._held.values())
        self.held_peak_bytes = max(self.held_peak_bytes, held)

    def _let_go(self, m: int) -> None:
        """Drop the drained input held for micro-batch m, once the compute stream is past its last piece."""
        if m in self._held:
            _, done = self._held.pop(m)
            with self.timer.stall("ckpt", self.streams.compute):
                self.streams.compute.wait_event(done)

    def flush(self) -> None:
        """Forward is over: let every drained input go, and start backward's first reloads (they overlap the head)."""
        for m in list(self._held):
            self._let_go(m)
        for b in range(RELOAD_BUFFERS):  # the compute stream has issued every reader of the last step's buffers
            self._released[b] = self.streams.recorded(self.streams.compute)
        self._reload_ahead()

    def _reload_ahead(self) -> None:
        """Issue the reloads whose buffer is free: item k goes to buffer k % 2, free once item k - 2's recompute
        is issued (the get of item k - 1 has come)."""
        while self._reloaded < len(self._order) and self._reloaded < RELOAD_BUFFERS + max(self._got - 1, 0):
            self._reload(self._reloaded)
            self._reloaded += 1

    def _reload(self, k: int) -> None:
        assert self._host is not None
        layer, m = self._order[k]
        rows, b = self._micro[m], k % RELOAD_BUFFERS
        host = self._host[self._row[layer], rows].view(-1, self._hidden)
        out = self.staging[b]
        drained = self._drained.pop((layer, m))
        loaded: list[Event] = []
        with self.streams.ckpt.use():
            self.streams.ckpt.wait_event(self._released[b])
            for i, (lo, n) in enumerate(pieces(host.shape[0], self.piece_tokens)):
                self.streams.ckpt.wait_event(drained[i])  # the same cut as the drain: piece i waits for piece i
                with self.timer.copy("h2d", self.streams.ckpt, "ckpt"):
                    out[lo:lo + n].copy_(host[lo:lo + n], non_blocking=True)
                loaded.append(self.streams.recorded(self.streams.ckpt))
                self.log.record("ckpt_reload", self.step, layer + 1, slot=b, micro=m, piece=i)
        self._loaded[b] = loaded

    def get(self, layer: int, m: int, rows: slice) -> torch.Tensor:
        """Micro-batch m's input of ``layer`` ([rows, S, hidden] on the device), for its recompute. Calls come in
        backward order; the previous call's recompute has been issued, so its buffer is released here."""
        k = self._got
        assert self._order[k] == (layer, m), (self._order[k], layer, m)
        if k >= 1:
            self._released[(k - 1) % RELOAD_BUFFERS] = self.streams.recorded(self.streams.compute)
        self._got += 1
        b = k % RELOAD_BUFFERS
        with self.timer.stall("ckpt", self.streams.compute):
            for loaded in self._loaded[b]:
                self.streams.compute.wait_event(loaded)
        self.log.record("ckpt_use", self.step, layer + 1, slot=b, micro=m)
        self._reload_ahead()  # the next input in backward order, into the buffer released above
        t = (rows.stop - rows.start) * self._seq
        return self.staging[b][:t].view(rows.stop - rows.start, self._seq, self._hidden)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena the checkpoints live in (0 before the first step)."""
        return 0 if self._arena is None else self._arena.nbytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of that arena registered with the driver now (CUDA, after the first step; else 0)."""
        return self.host_bytes if self._arena is not None and self._arena.pinned else 0

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
