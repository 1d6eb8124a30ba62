"""The training checkpoint's on-disk format: zarr v3 arrays, the manifest, a direct shard reader, CRC32s.

A step directory holds three 1-d zarr v3 arrays (float32; bf16 AdamW state as int16 bits), ``master``, ``exp_avg`` and
``exp_avg_sq`` (every block's flat buffer in block order, as the host store keeps
them; written by tensorstore: shards of up to 256 MiB of raw little-endian 4 MiB
inner chunks, the shard index at the end), and ``manifest.json``: the format and
version, the optimizer step, what rebuilds the engine (model config, optimizer,
plan, compute dtype, seed, the per-block AdamW step counts, the Hugging Face
config), the caller's ``extra``, the block and tensor tables, the CRC32 of each
64 MiB of each array, and the size of every file. How a directory is committed
is ``training_checkpoint``'s.

[Note: checkpoint I/O speed]
Each array moves in pieces, with at most one extra copy in flight: a
whole-array tensorstore read or write of a sharded array would hold every shard
it touches at once (one extra copy of the array), and a CRC32 pass after the
transfer would read the array a second time. So:

* Reads: for exactly the layout ``spec`` writes (checked field by field in
  ``zarr.json``; anything else goes through tensorstore, in the same pieces)
  each 4 MiB inner chunk is ``preadv``-ed from its shard file (offset from the
  shard's index) straight into the destination, and a worker thread computes
  its CRC32 while the next chunk is read: the bytes tensorstore would read,
  without its intermediate buffer (benchmarks/checkpoint_io.py measures it
  against a plain ``readinto``). The manifest's CRC32s are verified over the
  destination: a bad index or chunk is a checksum error or a one-line "cannot
  read" error.
* Writes: tensorstore, one shard (``write_chunk``, up to 256 MiB) at a time,
  its CRC32 computed while tensorstore encodes it (a spilled kind's blocks are
  gathered into whole shards: no shard is rewritten); the arrays one after
  another, each fsynced in the background while the next is encoded. Write
  speed is the disk's (fsync), as for a plain write.

Extra RAM: one shard while writing (two for a spilled kind), a few 4 MiB chunks
while reading (plus one block for a spilled kind).

Only JSON and the arrays' raw little-endian float32 chunks are read back (by
tensorstore or directly): no pickle.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import json
import math
import os
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import torch

from megatrain.plan.buffer_kinds import STATE_KINDS, BufferKind

from megatrain.runtime.errors import InputError
from megatrain.runtime.paths import confined
from megatrain.runtime.io.crc32s import CRC_CHUNK_BYTES, Crc32s

if TYPE_CHECKING:
    from megatrain.runtime.state.host_store import HostStore
    from megatrain.runtime.state.model_state import ModelState

FORMAT = "megatrain-checkpoint"
VERSION = 1
ARRAYS = tuple(k.value for k in STATE_KINDS)  # one array per state kind, named after it
MANIFEST = "manifest.json"
READ_PIECE_BYTES = 4 * 2**20  # reads move whole inner chunks of at least this many bytes...
READS_IN_FLIGHT = 2  # ...this many at a time (the CRC of one while the next is read)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# The zarr data type an array of each dtype is stored as: bf16 (AdamW state) as its raw 16-bit patterns, which
# numpy and tensorstore move without a bfloat16 type; the manifest's "dtype" says what the bits are.
ZARR_TYPES = {torch.float32: "float32", torch.bfloat16: "int16"}


# ---------------------------------------------------------------------- the manifest
def build_manifest(state: "ModelState", step: int, settings: dict[str, Any], extra: Any) -> dict[str, Any]:
    """The manifest of ``state`` at optimizer step ``step`` (its ``arrays`` and ``files`` come with the write).
    ``settings``: the engine's arguments, ``engine_settings``' dict."""
    return {
        "format": FORMAT, "version": VERSION, "step": step,
        "engine": {
            **settings,
            "step_count": step,
            "block_steps": [float(s) for s in state.steps],  # AdamW step per block (float32, exact in JSON)
            "hf_config": state.hf_config,
        },
        "extra": extra,
        "blocks": state.block_table(),
        "tensors": state.tensor_table(),
    }


def live_arrays(store: "HostStore") -> dict[str, "torch.Tensor | SpilledArena"]:
    """The store's state kinds as the checkpoint's arrays: a RAM arena whole, or a spilled kind block by block."""
    out: dict[str, torch.Tensor | SpilledArena] = {}
    for name in ARRAYS:
        arena = store.arena(BufferKind(name))
        out[name] = SpilledArena(store, BufferKind(name)) if arena is None else arena.tensor
    return out


class SpilledArena:
    """A spilled kind as a checkpoint array: the arena's bytes in block order, one block in RAM at a time, in the
    kind's dtype (bf16 m and v stay bf16: the same array as from RAM)."""

    def __init__(self, store: Any, kind: BufferKind) -> None:
        self.store, self.kind = store, kind
        self.dtype: torch.dtype = store.dtype(kind)

    def numel(self) -> int:
        return self.store.total_numel

    def pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        for b in range(len(self.store.numels)):
            yield self.store.offsets[b], self.store.read_block(self.kind, b)


def _shards(t: "torch.Tensor | SpilledArena", step: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset, piece) covering t in order, each piece one whole shard of ``step`` elements (the last may be short).

    In RAM the pieces are views; a spilled kind's blocks are gathered into one reused shard-sized buffer, so
    tensorstore never re-reads and rewrites a shard that a block boundary splits."""
    n = t.numel()
    if not isinstance(t, SpilledArena):
        for lo in range(0, n, step):
            yield lo, t[lo:lo + step]
        return
    buf = torch.empty(min(step, n), dtype=t.dtype)
    start, filled = 0, 0
    for _, block in t.pieces():
        i = 0
        while i < block.numel():
            take = min(buf.numel() - filled, block.numel() - i)
            buf[filled:filled + take].copy_(block[i:i + take])
            filled, i = filled + take, i + take
            if filled == buf.numel() or start + filled == n:
                yield start, buf[:filled]  # the caller is done with it before asking for the next
                start, filled = start + filled, 0


# ---------------------------------------------------------------------- writing
def spec(path: str, numel: int | None = None, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
                            "context": {"file_io_sync": False}}  # we fsync every file ourselves, once
    if numel is not None:
        inner = min(numel, 2**20)  # 4 MiB chunks inside shards of up to 256 MiB
        outer = min(-(-numel // inner) * inner, 2**26)
        spec.update(create=True, delete_existing=True, metadata={
            "shape": [numel], "data_type": ZARR_TYPES[dtype],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [outer]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [inner],
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]})
    return spec


def write_array(arr: Any, t: "torch.Tensor | SpilledArena") -> list[int]:
    """Write t into the tensorstore array one shard at a time; its CRC32s, computed while tensorstore writes."""
    crc = Crc32s()
    for lo, piece in _shards(t, arr.chunk_layout.write_chunk.shape[0]):
        pending = arr[lo:lo + piece.numel()].write(_numpy(piece))
        crc.update(piece)
        pending.result()
    return crc.digest()


def write_named_array(directory: str, name: str, t: "torch.Tensor | SpilledArena") -> dict[str, Any]:
    """Write t as the array ``directory/name``; its manifest entry (path, shape, CRC32s)."""
    import tensorstore as ts

    dtype = t.dtype
    arr = ts.open(spec(os.path.join(directory, name), t.numel(), dtype)).result()
    return {"path": name, "dtype": DTYPE_NAMES[dtype], "shape": [t.numel()], "crc32_chunk_bytes": CRC_CHUNK_BYTES,
            "crc32": write_array(arr, t)}


# ---------------------------------------------------------------------- reading
def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of a complete step directory, with every file checked present at its recorded size."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT:
            raise InputError(f"{mpath} is not a megatrain checkpoint manifest; pass a directory save_checkpoint wrote")
        if manifest.get("version") != VERSION:
            raise InputError(f"{mpath} has checkpoint version {manifest.get('version')}; this megatrain reads "
                             f"version {VERSION}: load it with the megatrain that wrote it")
        files = dict(manifest["files"])
        for name in ARRAYS:
            manifest["arrays"][name]["crc32"]
        manifest["engine"]["model_config"]
        counts = [manifest["engine"]["step_count"], *manifest["engine"]["block_steps"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise InputError(f"{mpath} is corrupt or truncated; load the previous step directory instead") from None
    bad = [c for c in counts if not (isinstance(c, (int, float)) and not isinstance(c, bool)
                                     and math.isfinite(c) and c >= 0 and c == int(c))]
    if bad:
        raise InputError(f"{mpath} holds the step count {bad[0]!r} (optimizer steps are whole numbers >= 0): the "
                         "manifest is corrupt; load the previous step directory instead")
    if not all(isinstance(rel, str) and type(size) is int for rel, size in files.items()):
        raise InputError(f"{mpath} lists its files wrongly: the manifest is corrupt; load the previous step "
                         "directory instead")
    for name in ARRAYS:  # every path the manifest names stays in the step directory
        confined(path, manifest["arrays"][name].get("path"), mpath)
    for rel, size in files.items():
        full = confined(path, rel, mpath)
        if not os.path.isfile(full):
            raise InputError(f"{full} is missing from the checkpoint; load the previous step directory instead")
        actual = os.path.getsize(full)
        if actual != size:
            raise InputError(f"{full} has {actual} bytes, the manifest says {size}: the checkpoint is truncated or "
                             "corrupt; load the previous step directory instead")
    return manifest


def read_into(src: Any, lo: int, dst: torch.Tensor, crc: Crc32s) -> None:
    """``src[lo:lo + dst.numel()]`` into dst, in pieces of whole inner chunks, READS_IN_FLIGHT at a time; the CRC32s
    of the bytes that landed in dst fed to crc in order, each while the next pieces are read."""
    import tensorstore as ts

    chunk = src.chunk_layout.read_chunk.shape[0] or 1
    step = chunk * max(1, READ_PIECE_BYTES // (dst.element_size() * chunk))
    n = dst.numel()
    target = ts.array(_numpy(dst), copy=False, write=True)
    inflight: collections.deque = collections.deque()
    try:
        a = 0
        while a < n or inflight:
            if a < n and len(inflight) < READS_IN_FLIGHT:
                b = min(n, ((lo + a) // step + 1) * step - lo)  # piece ends on a chunk boundary of src
                inflight.append((a, b, target[a:b].write(src[lo + a:lo + b])))
                a = b
                continue
            pa, pb, pending = inflight.popleft()
            pending.result()
            crc.update(dst[pa:pb])
    finally:
        for _, _, pending in inflight:  # after an error: nothing may still be writing into dst
            try:
                pending.result()
            except Exception:
                pass


MISSING_CHUNK = 2**64 - 1  # a shard index entry (offset, nbytes) of a chunk never stored: all fill value


def direct_layout(path: str) -> tuple[int, int, int] | None:
    """(numel, elements per shard, per inner chunk) where ``path/zarr.json`` describes exactly the layout ``spec``
    writes (1-d float32 or int16, fill 0, shards of raw little-endian inner chunks, the index at the end); else None."""
    try:
        with open(os.path.join(path, "zarr.json"), encoding="utf-8") as f:
            meta = json.load(f)
        (numel,) = meta["shape"]
        (outer,) = meta["chunk_grid"]["configuration"]["chunk_shape"]
        (codec,) = meta["codecs"]
        config = dict(codec["configuration"])
        (inner,) = config["chunk_shape"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # tensorstore reads it, or says what is wrong
    if not all(type(v) is int and v > 0 for v in (numel, outer, inner)) or outer % inner:
        return None
    fill = meta.get("fill_value")
    if type(fill) not in (int, float) or fill != 0 or str(fill).startswith("-"):  # +0.0: zeros, bit for bit
        return None
    meta["fill_value"] = 0.0
    if meta.get("attributes", {}) == {}:
        meta.pop("attributes", None)
    if meta.get("dimension_names", [None]) == [None]:
        meta.pop("dimension_names", None)
    if config.get("index_location", "end") == "end":
        config.pop("index_location", None)
    if meta.get("chunk_key_encoding") == {"name": "default", "configuration": {"separator": "/"}}:
        meta["chunk_key_encoding"] = {"name": "default"}
    data_type = meta.get("data_type") if meta.get("data_type") in ZARR_TYPES.values() else "float32"
    expected = {"zarr_format": 3, "node_type": "array", "shape": [numel], "data_type": data_type, "fill_value": 0.0,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [outer]}},
                "chunk_key_encoding": {"name": "default"},
                "codecs": [{"name": "sharding_indexed", "configuration": {}}]}
    wanted = spec(path, numel)["metadata"]["codecs"][0]["configuration"]
    if {**meta, "codecs": [{**codec, "configuration": {}}]} != expected or \
            {**config, "chunk_shape": None} != {**wanted, "chunk_shape": None}:
        return None
    return numel, outer, inner


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"the file ends at byte {offset + got}, inside a chunk")
        got += n


def read_direct(path: str, layout: tuple[int, int, int], lo: int, dst: torch.Tensor, crc: Crc32s,
                 crc_worker: cf.Executor) -> None:
    """``[lo, lo + dst.numel())`` of the array at path into dst: one ``preadv`` per inner chunk from its shard file
    (what tensorstore reads, without its intermediate buffer); each chunk's CRC32s computed by crc_worker (one
    thread, in order) while the next is read. A missing chunk or shard file is the fill value, zeros."""
    _, outer, inner = layout
    per_shard = outer // inner
    index_bytes = 16 * per_shard + 4  # (offset, nbytes) little-endian uint64 per inner chunk, then its crc32c
    raw = memoryview(dst.view(torch.uint8).numpy())
    size = dst.element_size()
    pending = []
    try:
        pos, end = lo, lo + dst.numel()
        while pos < end:
            shard = pos // outer
            shard_end = min(end, (shard + 1) * outer)
            try:
                fd = os.open(os.path.join(path, "c", str(shard)), os.O_RDONLY)
            except FileNotFoundError:
                fd = -1  # tensorstore writes no shard that is all fill value (the manifest lists every file)
            try:
                if fd >= 0:
                    data_bytes = os.fstat(fd).st_size - index_bytes
                    if data_bytes < 0:
                        raise ValueError(f"shard {shard} is shorter than its index")
                    index = bytearray(index_bytes)
                    _pread_into(fd, memoryview(index), data_bytes)
                    entries = np.frombuffer(index, dtype="<u8", count=2 * per_shard).reshape(per_shard, 2)
                while pos < shard_end:
                    k = pos // inner - shard * per_shard
                    stop = min(shard_end, (pos // inner + 1) * inner)
                    offset, nbytes = (MISSING_CHUNK, MISSING_CHUNK) if fd < 0 else map(int, entries[k])
                    if (offset, nbytes) == (MISSING_CHUNK, MISSING_CHUNK):
                        dst[pos - lo:stop - lo].zero_()
                    elif nbytes != size * inner or offset + nbytes > data_bytes:
                        raise ValueError(f"shard {shard}'s index puts chunk {k} at bytes [{offset}, {offset + nbytes})"
                                         f" of {data_bytes} (chunks are {size * inner} bytes)")
                    else:
                        _pread_into(fd, raw[size * (pos - lo):size * (stop - lo)], offset + size * (pos % inner))
                    pending.append(crc_worker.submit(crc.update, dst[pos - lo:stop - lo]))
                    pos = stop
            finally:
                if fd >= 0:
                    os.close(fd)
    finally:
        for f in pending:  # in order; all done before dst is used or dropped
            f.result()


def read_array(path: str, meta: dict[str, Any], store: "HostStore", name: str,
               crc_worker: cf.Executor) -> None:
    """One array of the checkpoint at ``path`` into the store's ``name`` (a RAM arena, or a spilled kind block by
    block), its CRC32s verified against ``meta`` (the manifest's entry)."""
    import tensorstore as ts

    dst = live_arrays(store)[name]
    full = confined(path, meta["path"], os.path.join(path, MANIFEST))
    crc = Crc32s()
    try:
        layout = direct_layout(full)
        if layout is not None:
            shape = (layout[0],)
            read = functools.partial(read_direct, full, layout, crc_worker=crc_worker)
        else:  # another layout: tensorstore reads it (the same pieces, one more copy)
            src = ts.open(spec(full), open=True, read=True).result()
            shape, read = tuple(src.shape), functools.partial(read_into, src)
        dtype = dst.dtype
        if meta.get("dtype", "float32") != DTYPE_NAMES[dtype]:
            raise InputError(f"{full} holds {meta.get('dtype')} AdamW state, this engine keeps {DTYPE_NAMES[dtype]}: "
                             "load it with the optimizer settings it was saved with (Engine.load_checkpoint)")
        if shape != (dst.numel(),):
            raise InputError(f"{full} has shape {shape}, this model needs ({dst.numel()},); "
                             "the checkpoint does not match its manifest")
        if isinstance(dst, SpilledArena):
            for b in range(len(store.numels)):  # one block at a time through RAM into its spill file
                lo, n = store.offsets[b], store.numels[b]
                block = torch.empty(n, dtype=dtype)
                read(lo, block, crc)  # CRC of the bytes read, checked below once every block is in
                store.write_block(BufferKind(name), b, block)
        else:
            read(0, dst, crc)
    except InputError:
        raise
    except Exception as err:  # tensorstore and read_direct report I/O and format errors as ValueError and others
        raise InputError(f"cannot read {full} ({str(err).splitlines()[0][:200]}); the checkpoint is corrupt: "
                         "load the previous step directory instead") from None
    got = crc.digest()
    if got != meta["crc32"]:
        bad = next(i for i, (a, b) in enumerate(zip(got, meta["crc32"])) if a != b) if len(got) == len(
            meta["crc32"]) else 0
        lo = bad * CRC_CHUNK_BYTES
        raise InputError(f"{full}: checksum mismatch in bytes [{lo}, {lo + CRC_CHUNK_BYTES}); the checkpoint is "
                         "corrupt: load the previous step directory instead")


def _numpy(t: torch.Tensor) -> np.ndarray:
    """t's bytes as the numpy array of its zarr data type (``ZARR_TYPES``), no copy."""
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
