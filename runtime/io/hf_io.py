"""Hugging Face model directories in and out: config.json plus safetensors shards.

[Note: streaming safetensors]
A safetensors file is an 8-byte little-endian header length, a JSON header
(name -> dtype, shape, byte range) and the tensors' bytes. We parse the header
ourselves and read each tensor with ``readinto`` straight into its fp32 master
view (float32 files: no copy at all) or into one temporary tensor that is then
converted (bf16 / fp16 files). Peak extra RAM while loading is one tensor; no
file is memory-mapped, so nothing of a shard stays resident in the process.
Export streams the same way: one converted tensor at a time is written into a
shard. Only safetensors and JSON are read: no pickle.

Names: Hugging Face state-dict names (``model.layers.3.mlp.up_proj.weight``).
With tied embeddings there is one tensor, ``model.embed_tokens.weight``; a
``lm_head.weight`` in the files is accepted and skipped (transformers writes
none). Unexpected tensors, missing tensors, wrong shapes, non-float dtypes and
truncated files are errors that name the file and tensor: never a partial load.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import shutil
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatrain.models import registry
from megatrain.models.parameters import DiskTensor, Param
from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.config import ModelConfig, read_config_json
from megatrain.runtime.errors import CheckpointError, ConfigError, InputError
from megatrain.runtime.io import finite_weights, mxfp4
from megatrain.runtime.paths import confined, user_path

if TYPE_CHECKING:
    from megatrain.runtime.state.model_state import ModelState

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default "5GB"
_HEADER_LIMIT = 100 * 2**20  # safetensors' own bound on the JSON header

_DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                   "F64": torch.float64}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_OTHER_DTYPES = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL", "F8_E4M3", "F8_E5M2")
# Buffers some older checkpoints carry that are not parameters (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------- reading
@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: str) -> list[TensorInfo]:
    """Parse and validate one safetensors file's header; the tensors in file order."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise InputError(f"{path} is truncated ({size} bytes, no header); re-download or re-export it")
            (n,) = struct.unpack("<Q", raw)
            if n > _HEADER_LIMIT or 8 + n > size:
                raise InputError(f"{path} has a header length of {n} bytes in a {size}-byte file; "
                                 "it is truncated or not a safetensors file: re-download or re-export it")
            header = json.loads(f.read(n))
    except OSError as e:
        raise InputError(f"cannot read {path}: {e.strerror}; check the path and permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InputError(f"{path} has a corrupt header (not JSON); re-download or re-export it") from None
    if not isinstance(header, dict):
        raise InputError(f"{path} has a corrupt header (not a JSON object); re-download or re-export it")
    data_start, data_size = 8 + n, size - 8 - n
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise InputError(f"{path}: the header entry of {name} is malformed; re-download or re-export it") from None
        if dtype_name == "U8" and name.endswith(mxfp4.SUFFIXES):
            dtype = torch.uint8  # MXFP4 blocks and scales (mxfp4.py)
        elif dtype_name not in _DTYPES:
            kind = "an integer/bool/fp8" if dtype_name in _OTHER_DTYPES else "an unknown"
            raise InputError(f"{path}: {name} has {kind} dtype {dtype_name}; megatrain loads F32, BF16, F16 or F64 weights")
        else:
            dtype = _DTYPES[dtype_name]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end and end - begin == nbytes):
            raise InputError(f"{path}: {name} claims bytes [{begin}, {end}) for {nbytes} bytes of data; "
                             "the file is corrupt: re-download or re-export it")
        if end > data_size:
            raise InputError(f"{path} is truncated: {name} needs bytes up to {data_start + end}, the file has {size}; "
                             "re-download or re-export it")
        out.append(TensorInfo(name, dtype, shape, data_start + begin, nbytes))
    return sorted(out, key=lambda t: t.start)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a model directory, checked to be a supported causal LM."""
    data = read_config_json(path)
    archs = data.get("architectures") or []
    if archs and not any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs):
        raise ConfigError(f"{os.fspath(path)}: architectures={archs} is not a causal language model; megatrain loads "
                          f"{', '.join(f.architecture for f in registry.families())}")
    return data


def find_shards(path: str | os.PathLike) -> list[str]:
    """The safetensors files of a model directory: those the index names, else every *.safetensors."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise InputError(f"{path} is not a directory; pass a Hugging Face model directory (config.json + *.safetensors)")
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise InputError(f"{index} is corrupt (no valid weight_map); re-download or re-export the model") from None
        files = [confined(path, n, index) for n in names]  # an index from a hub is untrusted: no path out
        missing = [n for n, f in zip(names, files) if not os.path.isfile(f)]
        if missing:
            raise InputError(f"{index} names {missing[0]}, which is not in {path}; download every shard")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        bins = glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt"))
        hint = ("; it holds pickle checkpoints, which megatrain does not load: convert them to safetensors"
                if bins else "; pass a Hugging Face model directory")
        raise InputError(f"no *.safetensors file in {path}{hint}")
    return files


def load_weights(state: "ModelState", files: list[str]) -> None:
    """Stream every tensor of ``files`` into the model's fp32 masters (see [Note: streaming safetensors])."""
    state.settle()
    headers = {f: read_header(f) for f in files}  # every header checked before any byte is loaded
    present = {t.name for infos in headers.values() for t in infos}
    pieces = {(b.index, e.local_name): mxfp4.quantized_pieces(e.hf_name, e.shape, present)
              or _disk_tensors(state, b, e, present) for b in state.blocks for e in b.layout.entries}
    expected = {d.name: (b, e, d) for b in state.blocks for e in b.layout.entries
                for d in pieces[(b.index, e.local_name)]}
    where = _check_tensors(state, headers, expected)
    handles: dict[str, Any] = {}
    try:
        for f in files:
            handles[f] = open(f, "rb", buffering=0)
        for block in state.blocks:  # a spilled master goes through RAM one block at a time, read and written once
            with state.edit_block(block.index) as master:
                for entry in block.layout.entries:
                    if mxfp4.is_quantized(pieces[(block.index, entry.local_name)]):
                        mxfp4.load(lambda name, at, out: _read_part(handles, where, name, at, out),
                                   pieces[(block.index, entry.local_name)],
                                   master[entry.offset:entry.offset + entry.numel].view(entry.shape))
                        continue
                    for d in pieces[(block.index, entry.local_name)]:
                        f, t = where[d.name]
                        dst = master[entry.offset + d.start:entry.offset + d.start + d.numel]
                        if t.dtype == torch.float32:
                            _read_into(handles[f], f, t, dst)
                        else:
                            tmp = torch.empty(d.numel, dtype=t.dtype)
                            _read_into(handles[f], f, t, tmp)
                            dst.copy_(tmp)
                finite_weights.check_loaded_block(block, master, pieces, where)
    finally:
        for fh in handles.values():
            fh.close()


def _disk_tensors(state: "ModelState", block: Any, entry: Any, present: set[str] | None = None
                  ) -> tuple[DiskTensor, ...]:
    """The tensors ``entry`` is in a Hugging Face directory, as transformers writes them (the family's: per-expert
    tensors of fused experts); files holding the parameter whole under its own name (``present``) are read so."""
    whole = (DiskTensor(entry.hf_name, entry.shape, 0),)
    if present is not None and entry.hf_name in present:
        return whole
    family = registry.family(state.config.model_type)
    return family.disk_tensors(block.kind.value, block.layer, Param(entry.local_name, entry.shape))


def _check_tensors(state: "ModelState", headers: dict[str, list[TensorInfo]],
                   expected: dict[str, tuple[Any, Any, DiskTensor]]) -> dict[str, tuple[str, TensorInfo]]:
    """Each expected tensor's (file, header entry), every name and shape checked across all files first."""
    tied = state.config.tie_word_embeddings
    seen: dict[str, tuple[str, TensorInfo]] = {}
    for f, infos in headers.items():
        for t in infos:
            if t.name in seen:
                raise InputError(f"{t.name} appears in both {seen[t.name][0]} and {f}; remove the duplicate shard")
            seen[t.name] = (f, t)
            if t.name in expected:
                shape = expected[t.name][2].shape
                if t.shape != shape:
                    raise InputError(f"{f}: {t.name} has shape {t.shape}, the config implies {shape}; "
                                     "the config.json does not match the weights")
            elif not ((tied and t.name == "lm_head.weight") or t.name.endswith(_IGNORED_SUFFIXES)):
                raise InputError(f"{f}: unexpected tensor {t.name} for a {state.config.model_type} model; "
                                 "the config.json does not match the weights")
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(f"{missing[0]}{more} is in no safetensors file of {os.path.dirname(next(iter(headers)))}; "
                         "download every shard or check config.json")
    return seen


def _read_part(handles: dict[str, Any], where: dict[str, tuple[str, TensorInfo]], name: str, at: int,
               dst: torch.Tensor) -> None:
    """Bytes [at, at + dst's bytes) of the tensor ``name`` into ``dst``, whose dtype it must have."""
    f, t = where[name]
    if t.dtype != dst.dtype:
        raise InputError(f"{f}: {name} has dtype {t.dtype}, {dst.dtype} expected; re-download or re-export it")
    _read_into(handles[f], f, TensorInfo(name, t.dtype, t.shape, t.start + at, dst.numel() * dst.element_size()), dst)


def _read_into(fh: Any, path: str, t: TensorInfo, dst: torch.Tensor) -> None:
    view = memoryview(dst.view(torch.uint8).numpy())
    got, pos = 0, t.start
    while got < t.nbytes:
        n = os.preadv(fh.fileno(), [view[got:]], pos + got)
        if n == 0:
            raise InputError(f"{path} is truncated inside {t.name}; re-download or re-export it")
        got += n


# ---------------------------------------------------------------------- writing
def save_pretrained(state: "ModelState", path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, allow_nonfinite: bool = False) -> None:
    """Write config.json and safetensors shards (+ index when several) that transformers loads. A tensor holding NaN
    or infinity once in ``dtype`` (a diverged run, or a finite value past the dtype's range) is refused
    (``NonFiniteError``, no file left behind) unless ``allow_nonfinite``."""
    if dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ConfigError(f"dtype={dtype} is not supported for export; use torch.bfloat16, torch.float16 or torch.float32")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ConfigError(f"max_shard_bytes={max_shard_bytes!r} must be a positive integer (bytes)")
    config = hf_config_dict(state, dtype)
    state.settle()
    path = user_path(path, "path")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the export directory {path}: {e.strerror}; choose a writable "
                              "directory") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    entries = [(b, e, d) for b in state.blocks for e in b.layout.entries for d in _disk_tensors(state, b, e)]
    shards: list[list[tuple[Any, Any, DiskTensor]]] = [[]]
    size = 0
    for be in entries:
        nbytes = be[2].numel * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(be)
        size += nbytes
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(d.numel for _, _, d in entries) * itemsize
    weight_map = {}
    try:  # each file is written as <name>.tmp and renamed: a failure leaves no partial file behind
        for name, shard in zip(names, shards):
            _write_shard(state, os.path.join(path, name), shard, dtype, allow_nonfinite)
            weight_map.update({d.name: name for _, _, d in shard})
        for stale in glob.glob(os.path.join(path, "model-*-of-*.safetensors")) + [os.path.join(path, SINGLE_FILE),
                                                                                    os.path.join(path, INDEX_FILE)]:
            if os.path.basename(stale) not in names and os.path.exists(stale):
                os.remove(stale)  # a previous export's shards would shadow or mix with this one
        if len(shards) > 1:
            _write_json(os.path.join(path, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(os.path.join(path, "config.json"), config)
    except OSError as e:
        raise _export_error(e, path, total) from None


def _write_shard(state: "ModelState", path: str, shard: list[tuple[Any, Any, DiskTensor]], dtype: torch.dtype,
                 allow_nonfinite: bool = False) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, _, d in shard:
        header[d.name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(d.shape),
                          "data_offsets": [offset, offset + d.numel * itemsize]}
        offset += d.numel * itemsize
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            cached: tuple[int, torch.Tensor] | None = None  # a spilled block is read once for all its tensors
            for block, e, d in shard:
                if cached is None or cached[0] != block.index:
                    cached = (block.index, state.read_block(BufferKind.MASTER, block.index))
                src = cached[1][e.offset + d.start:e.offset + d.start + d.numel]
                t = src if dtype == torch.float32 else src.to(dtype)  # one tensor converted at a time
                if not allow_nonfinite:
                    finite_weights.check_written(d.name, t, _DTYPE_NAMES[dtype])
                f.write(memoryview(t.view(torch.uint8).numpy()))
        os.replace(tmp, path)
    except BaseException as e:
        _remove_quietly(tmp)
        if isinstance(e, OSError) and not e.filename:
            e.filename = path  # a failed write() names no file
        raise


def _write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException as e:
        _remove_quietly(tmp)
        if isinstance(e, OSError) and not e.filename:
            e.filename = path
        raise


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _export_error(err: OSError, directory: str, total: int) -> CheckpointError:
    """An export's OSError as one line naming the file; for a full disk, the space the weights need."""
    where = err.filename or directory
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f"{_size(shutil.disk_usage(directory).free)} free"
        except OSError:
            free = "free space unknown"
        return CheckpointError(f"cannot write {where}: the disk is full (the export needs {_size(total)}, "
                               f"{free}); free space or export elsewhere")
    return CheckpointError(f"cannot write {where}: {err.strerror or err}; check the directory's permissions")


def hf_config_dict(state: "ModelState", dtype: torch.dtype) -> dict[str, Any]:
    """The config.json to export: the one the model was loaded from, else one built from its ModelConfig (the
    family writes its own fields).

    Either way it must read back as the model's ModelConfig, or the export would be a different model.
    """
    c = state.config
    family = registry.family(c.model_type)
    if state.hf_config is not None:
        data = dict(state.hf_config)
    else:
        data = {
            "model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
            "max_position_embeddings": c.max_position_embeddings, "pad_token_id": c.pad_token_id,
            "initializer_range": c.initializer_range, "hidden_act": c.hidden_act,
            "rope_theta": c.rope_theta,
            "rope_parameters": {"rope_theta": c.rope_theta, **(dict(c.rope_scaling) if c.rope_scaling else
                                                                 {"rope_type": "default"})},
        }
        data.update(family.write(c))
    if isinstance(data.get("quantization_config"), dict) and data["quantization_config"].get("quant_method") == "mxfp4":
        del data["quantization_config"]  # the export is dequantized (mxfp4.py)
    data.setdefault("architectures", [family.architecture])
    data["dtype"] = data["torch_dtype"] = str(dtype).removeprefix("torch.")
    again = ModelConfig.from_hf(data)
    if again != c:
        diff = [f for f in c.to_dict() if getattr(again, f) != getattr(c, f)]
        raise ConfigError(f"this ModelConfig has no {c.model_type} equivalent in transformers ({', '.join(diff)} "
                          "cannot be expressed); change model_type or those fields")
    return data
