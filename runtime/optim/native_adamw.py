"""The bf16-state AdamW update as one compiled loop ([Note: bf16 optimizer state]): its C++ source, its build into
the user's cache on first use, and its call through ctypes.

One pass per element: widen bf16 m and v, AdamW on the fp32 master, stochastic rounding of the new m and v
(stochastic_rounding.py's noise, computed in the loop), narrow, write; nothing else touches memory. Built with
``-O3 -ffp-contract=off`` (no fused multiply-add: every product and sum is rounded on its own, so the bits do not
depend on the instruction set, and ``bf16_adamw.torch_update`` computes the same ones op by op) and
``-fno-math-errno`` (lets sqrt vectorize; changes no result), with clones for x86-64-v4 (AVX-512 with BW and VL:
the 16-bit narrowing in one instruction; a plain AVX-512F clone ran 20% slower here), x86-64-v3 (AVX2) and plain
x86-64 picked at load (a compiler that refuses the clones builds the plain loop: the same bits). The loop is split
over the calling thread's OpenMP team, torch's own intra-op threads (the library links the ``libgomp.so.1`` torch
has already loaded): as many threads as ``torch.get_num_threads()`` on that thread, and the same bits on any
number of them (each element is computed from its own inputs and index). Built in about a second (0.9 s on this
project's 2-core CPU), loaded from the cache in about 25 ms.

The shared library is cached under ``$XDG_CACHE_HOME/megatrain/kernels`` (``~/.cache`` by default), named by a
hash of the source, the flags and the compiler's version; a build writes a temporary file and renames it into
place, so processes building at once never load a half-written one. Without a C++ compiler (``$CXX``, else
``g++``), or where the build fails, ``load`` returns None and the caller computes the same bits in torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <omp.h>

namespace {
inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

struct Hyper { float clip, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bias2_sqrt, eps; };

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(NO_CLONES)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
void update_range(float* __restrict__ p, const float* __restrict__ g, uint16_t* __restrict__ m,
                  uint16_t* __restrict__ v, int64_t lo, int64_t hi, uint32_t base, Hyper h) {
  const bool clip = h.clip != 1.0f, decay = h.decay != 1.0f;  // invariant: the loop is unswitched on them
  for (int64_t i = lo; i < hi; ++i) {
    float gi = clip ? g[i] * h.clip : g[i];
    float pi = decay ? p[i] * h.decay : p[i];
    float mi = float_of(uint32_t(m[i]) << 16) * h.beta1 + gi * h.one_minus_beta1;
    float vi = float_of(uint32_t(v[i]) << 16) * h.beta2 + (gi * gi) * h.one_minus_beta2;
    float denom = std::sqrt(vi) * h.inv_bias2_sqrt + h.eps;
    p[i] = pi - (mi * h.step_size) / denom;
    uint32_t x = base + uint32_t(i);
    x ^= x >> 16; x *= MIX1; x ^= x >> 15; x *= MIX2; x ^= x >> 16;
    m[i] = uint16_t((bits_of(mi) + (x & 0xffffu)) >> 16);
    v[i] = uint16_t((bits_of(vi) + (x >> 16)) >> 16);
  }
}
}  // namespace

extern "C" void bf16_adamw(float* p, const float* g, uint16_t* m, uint16_t* v, int64_t n, uint32_t base,
                           float clip, float decay, float beta1, float one_minus_beta1, float beta2,
                           float one_minus_beta2, float step_size, float inv_bias2_sqrt, float eps) {
  Hyper h{clip, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, inv_bias2_sqrt, eps};
  if (n <= GRAIN || omp_in_parallel() || omp_get_max_threads() == 1) {
    update_range(p, g, m, v, 0, n, base, h);
    return;
  }
#pragma omp parallel
  {
    int64_t threads = omp_get_num_threads();
    int64_t per = ((n + threads - 1) / threads + 63) / 64 * 64;
    int64_t lo = per * omp_get_thread_num();
    if (lo < n) update_range(p, g, m, v, lo, lo + per < n ? lo + per : n, base, h);
  }
}
"""
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
# Elements below which the loop runs on the calling thread alone (torch's own grain size for elementwise ops).
GRAIN = 32768
_ARGS = ([ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_uint32] + [ctypes.c_float] * 9)


class BuildFailed(Exception):
    """The kernel could not be built or loaded here (the caller falls back to torch)."""


def cache_dir() -> Path:
    """Where built kernels are kept: ``$XDG_CACHE_HOME/megatrain/kernels``, ``~/.cache`` by default."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatrain" / "kernels"


def source(mix: tuple[int, int]) -> str:
    """The C++ source with the noise hash's two odd multipliers (stochastic_rounding.MIX) and the grain."""
    return (f"#define MIX1 {mix[0]:#x}u\n#define MIX2 {mix[1]:#x}u\n#define GRAIN {GRAIN}\n" + SOURCE)


def build(mix: tuple[int, int]) -> Path:
    """The shared library's path, built into ``cache_dir()`` unless it is there already. Raises BuildFailed."""
    compiler = shutil.which(os.environ.get("CXX") or "g++")
    if compiler is None:
        raise BuildFailed(f"no C++ compiler ({os.environ.get('CXX') or 'g++'}) on PATH")
    text = source(mix)
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildFailed(f"{compiler} --version failed: {e}") from None
    digest = hashlib.sha256("\0".join((text, *FLAGS, version, os.uname().machine)).encode()).hexdigest()[:16]
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="megatrain-kernels-"))
    lib = folder / f"bf16_adamw-{digest}.so"
    if lib.exists():
        return lib
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = Path(tmp) / "bf16_adamw.cpp", Path(tmp) / "bf16_adamw.so"
        src.write_text(text)
        try:
            for extra in ((), ("-DNO_CLONES",)):  # without the clones where the compiler refuses them
                done = subprocess.run([compiler, *FLAGS, *extra, str(src), "-o", str(out)], capture_output=True,
                                      text=True, timeout=600)
                if done.returncode == 0:
                    break
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildFailed(f"{compiler} failed: {e}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise BuildFailed(f"{compiler} exited {done.returncode}: {last}")
        os.replace(out, lib)  # atomic: another process loads the whole file or builds its own
    return lib


@functools.cache
def load(mix: tuple[int, int]) -> tuple[Callable[..., None] | None, str]:
    """(the kernel, "") once built and loaded in this process; (None, why) where it cannot be. The arguments:
    master (fp32), gradient (fp32), m, v (bf16) data pointers, elements, the noise index of the first element
    (stochastic_rounding.noise_base), then the fp32 constants of ``bf16_adamw.Constants`` in its field order."""
    import torch  # noqa: F401  (loaded first: the kernel links the OpenMP runtime torch brought)
    try:
        fn = ctypes.CDLL(str(build(mix))).bf16_adamw
    except BuildFailed as e:
        return None, str(e)
    except OSError as e:
        return None, f"loading the built kernel failed: {e}"
    fn.restype = None
    fn.argtypes = _ARGS
    return fn, ""
