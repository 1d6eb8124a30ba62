"""Training checkpoints of a data-parallel run: every rank writes its shards into the same arrays.

[Note: sharded checkpoints]
The checkpoint is the single-process one (checkpoint_format.py): the same three
arrays of every block's whole flat layout, the same manifest, the same commit
protocol (training_checkpoint.py), so any world size, one process included,
loads it. Saving, every rank calls ``save`` (blocking); rank 0 runs the commit
and, in its array-writing phase, hands over to the ranks:

1. rank 0 has made ``step-<N>.tmp`` and created the three arrays; it broadcasts
   "go" (or, having failed before, "fail" with its one-line error);
2. the ranks write their pieces (rank r: elements [r*s, (r+1)*s) of each block,
   cut at the block's end) at their offsets, in turn, rank 0 first, a barrier
   between turns: a zarr shard file may hold several ranks' pieces and
   tensorstore rewrites a shard file whole, so two ranks never write at once;
   each rank writes one transaction per shard file it touches (extra RAM: one
   shard file, 256 MiB at most);
3. each rank computes the CRC32 of its pieces (cut at the manifest's 64 MiB CRC
   boundaries) while it writes; rank 0 gathers them and combines them, in
   offset order, into the manifest's CRC32s (``crc32_combine``), then fsyncs,
   writes the manifest, points ``latest`` and renames, as one process does;
4. rank 0 broadcasts "done" (or "fail"): every rank returns the committed path
   or raises the same one-line error.

Collectives have the process group's timeout: a rank that dies fails the others.

Loading, every rank reads each array block by block in order (the CRC32s are
verified over the whole array on every rank) and keeps its shard of each block:
the checkpoint's world size does not matter (resharding on load).
"""
from __future__ import annotations

import concurrent.futures as cf
import functools
import os
import zlib
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist

from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.io import checkpoint_format
from megatrain.runtime.io.checkpoint_format import ARRAYS, CRC_CHUNK_BYTES, Crc32s
from megatrain.runtime.errors import CheckpointError, InputError
from megatrain.runtime.paths import confined
from megatrain.runtime.io.training_checkpoint import CheckpointWriter, Restored, restore as restore_checkpoint

if TYPE_CHECKING:
    from megatrain.runtime.distributed.sharded_state import ShardedModelState


def save(state: "ShardedModelState", writer: CheckpointWriter, step: int, settings: dict[str, Any],
         directory: str | os.PathLike, extra: Mapping[str, Any] | None, keep: int) -> str:
    """Every rank: write this rank's shards into ``directory/step-<N>``; rank 0 commits. The committed path."""
    state.settle()
    if state.shards.rank == 0:
        return _lead(state, writer, step, settings, directory, extra, keep)
    return _follow(state)


def _lead(state, writer, step, settings, directory, extra, keep) -> str:
    phase = {"started": False}

    def write_arrays(tmp: str) -> dict[str, Any]:
        import tensorstore as ts

        for name in ARRAYS:
            ts.open(checkpoint_format.spec(os.path.join(tmp, name), state.full_numel)).result()
        phase["started"] = True
        _broadcast(["go", tmp])
        crcs, error = _write_own(state, tmp)
        everyone = [None] * state.shards.world_size
        dist.all_gather_object(everyone, (crcs, error))
        errors = [e for _, e in everyone if e is not None]
        if errors:
            raise CheckpointError(errors[0])
        return {name: {"path": name, "dtype": "float32", "shape": [state.full_numel],
                       "crc32_chunk_bytes": CRC_CHUNK_BYTES,
                       "crc32": combine_crcs([p for c, _ in everyone for p in c[name]], state.full_numel * 4)}
                for name in ARRAYS}

    try:
        handle = writer.save(state, step, settings, directory, extra, keep, blocking=True, write_arrays=write_arrays)
        path = handle.wait()
    except BaseException as e:
        _broadcast(["fail", _one_line(e)])  # "go" not sent yet: the first message; else the last one
        raise
    _broadcast(["done", path])
    return path


def _follow(state: "ShardedModelState") -> str:
    kind, value = _receive()
    if kind == "fail":
        raise CheckpointError(value)
    crcs, error = _write_own(state, value)
    dist.all_gather_object([None] * state.shards.world_size, (crcs, error))
    kind, value = _receive()
    if kind == "fail":
        raise CheckpointError(value)
    return value


def _write_own(state: "ShardedModelState", tmp: str) -> tuple[dict[str, list], str | None]:
    """This rank's turn among the ranks' turns (a barrier between turns): its pieces of every array, and their
    CRC32s as (byte offset, byte length, crc) cut at the manifest's CRC boundaries; or the error, as a line."""
    crcs: dict[str, list] = {name: [] for name in ARRAYS}
    error = None
    for turn in range(state.shards.world_size):
        if turn == state.shards.rank:
            try:
                for name in ARRAYS:
                    crcs[name] = _write_pieces(state, os.path.join(tmp, name), BufferKind(name))
            except Exception as e:
                error = f"rank {state.shards.rank} could not write its part of {tmp}: {_one_line(e)}"
        dist.barrier()
    return crcs, error


def _write_pieces(state: "ShardedModelState", path: str, kind: BufferKind) -> list[tuple[int, int, int]]:
    import tensorstore as ts

    arr = ts.open(checkpoint_format.spec(path), open=True, write=True).result()
    outer = arr.chunk_layout.write_chunk.shape[0]
    crcs: list[tuple[int, int, int]] = []
    txn, txn_shard = None, -1
    for lo, piece in own_pieces(state, kind):
        pos = 0  # cut at shard-file and CRC boundaries
        while pos < piece.numel():
            at = lo + pos
            end = min(lo + piece.numel(), (at // outer + 1) * outer,
                      (at * 4 // CRC_CHUNK_BYTES + 1) * CRC_CHUNK_BYTES // 4)
            part = piece[pos:end - lo]
            if at // outer != txn_shard:
                if txn is not None:
                    txn.commit_async().result()
                txn, txn_shard = ts.Transaction(), at // outer
            arr.with_transaction(txn)[at:end].write(part.numpy()).result()
            crcs.append((4 * at, 4 * (end - at), zlib.crc32(memoryview(part.view(torch.uint8).numpy()))))
            pos = end - lo
    if txn is not None:
        txn.commit_async().result()
    return crcs


def own_pieces(state: "ShardedModelState", kind: BufferKind):
    """(element offset in the checkpoint array, this rank's piece of a block's ``kind``), block by block."""
    shards = state.shards
    for block in state.blocks:
        b = block.index
        n, s = block.layout.numel, shards.numel(b)
        start = shards.rank * s
        take = max(0, min(s, n - start))
        if take:
            yield state.full_offsets[b] + start, state.read_shard(kind, b)[:take].contiguous()


def combine_crcs(pieces: list[tuple[int, int, int]], nbytes: int) -> list[int]:
    """The CRC32 of each CRC_CHUNK_BYTES of an array of ``nbytes`` bytes from the CRC32s of pieces that cover it
    exactly once and do not cross a chunk boundary: (byte offset, byte length, crc)."""
    out: list[int] = []
    pos = 0
    for offset, length, crc in sorted(pieces):
        assert offset == pos, f"the ranks' pieces leave a gap or overlap at byte {pos}"
        if offset % CRC_CHUNK_BYTES == 0:
            out.append(crc)
        else:
            out[-1] = crc32_combine(out[-1], crc, length)
        pos += length
    assert pos == nbytes, f"the ranks' pieces cover {pos} of {nbytes} bytes"
    return out


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine, which Python does not expose)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four
    while True:  # apply len2 zero bytes to crc1, squaring the operator per bit of len2
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def _gf2_times(mat: list[int], vec: int) -> int:
    total, i = 0, 0
    while vec:
        if vec & 1:
            total ^= mat[i]
        vec >>= 1
        i += 1
    return total


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


# ---------------------------------------------------------------------- loading
def restore(state: "ShardedModelState", path: str, manifest: dict[str, Any]) -> Restored:
    """Every rank: read the checkpoint at ``path`` (any world size's) and keep this rank's shard of every block."""
    return restore_checkpoint(state, path, manifest, lambda name, meta, crc_worker: _read_array(
        state, path, meta, BufferKind(name), crc_worker))


def _read_array(state: "ShardedModelState", path: str, meta: dict[str, Any], kind: BufferKind,
                crc_worker: cf.Executor) -> None:
    import tensorstore as ts

    full = confined(path, meta["path"], os.path.join(path, checkpoint_format.MANIFEST))
    crc = Crc32s()
    try:
        layout = checkpoint_format.direct_layout(full)
        if layout is not None:
            shape = (layout[0],)
            read = functools.partial(checkpoint_format.read_direct, full, layout, crc_worker=crc_worker)
        else:
            src = ts.open(checkpoint_format.spec(full), open=True, read=True).result()
            shape, read = tuple(src.shape), functools.partial(checkpoint_format.read_into, src)
        if shape != (state.full_numel,):
            raise InputError(f"{full} has shape {shape}, this model needs ({state.full_numel},); "
                             "the checkpoint does not match its manifest")
        shards = state.shards
        for block in state.blocks:  # every block whole, in order (the CRC32s cover the array), then our shard
            b = block.index
            whole = torch.zeros(shards.padded(b), dtype=torch.float32)
            read(state.full_offsets[b], whole[:block.layout.numel], crc)
            state.store.write_block(kind, b, whole[shards.own(b)])
    except InputError:
        raise
    except Exception as err:
        raise InputError(f"cannot read {full} ({str(err).splitlines()[0][:200]}); the checkpoint is corrupt: "
                         "load the previous step directory instead") from None
    if crc.digest() != meta["crc32"]:
        raise InputError(f"{full}: checksum mismatch; the checkpoint is corrupt: load the previous step directory "
                         "instead")


# ---------------------------------------------------------------------- rank 0 speaks
def _broadcast(message: list) -> None:
    dist.broadcast_object_list(message, src=0)


def _receive() -> list:
    message: list = [None, None]
    dist.broadcast_object_list(message, src=0)
    return message


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
