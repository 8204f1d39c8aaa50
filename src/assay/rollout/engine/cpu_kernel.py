"""The C paged-attention kernel (`paged_attention.c`) for float32 on the CPU.

Decoding is memory-bound on the CPU, and the PyTorch path first gathers every row's keys and
values into a padded copy, then reads the copy: three passes over the cache where the kernel makes
one. It is compiled with the system C compiler on first use (about a second) into a cache keyed by
the source, the flags and the CPU, and loaded with ctypes, which releases the GIL while it runs.
Without a compiler, or with ASSAY_CPU_KERNEL=0, the PyTorch path runs instead, with the same
results up to float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from assay.core.atomic import atomic_path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
_ARGS = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int]


def usable(q: Tensor, k_cache: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == k_cache.dtype == torch.float32 and _library() is not None


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                    lengths: Tensor) -> tuple[Tensor, Tensor]:
    """q [R, Hkv, nq, D]; caches [blocks, block_size, Hkv, D]; tables [R, M]; lengths [R] ->
    (out [R, Hkv, nq, D], log-sum-exp [R, Hkv, nq, 1]), each row over its first `lengths` keys."""
    R, Hkv, nq, D = q.shape
    if tables.dtype != torch.int64 or lengths.dtype != torch.int64 or lengths.shape != (R,):
        raise ValueError("paged_attention: tables and lengths must be int64, one row per query row")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != (Hkv, D):
        raise ValueError(f"paged_attention: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit "
                         f"queries {tuple(q.shape)}")
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k_cache, v_cache)):
        raise ValueError("paged_attention: the kernel takes float32 CPU tensors")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: the caches must be contiguous")
    q, tables, lengths = q.contiguous(), tables.contiguous(), lengths.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((R, Hkv, nq, 1), dtype=q.dtype)
    rc = _library().paged_attention_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
        out.data_ptr(), lse.data_ptr(), R, Hkv, nq, D, k_cache.shape[1], tables.shape[1], k_cache.shape[0],
        D ** -0.5, torch.get_num_threads())
    if rc == -2:
        raise ValueError("paged_attention: a block table names a block outside the cache, or a length exceeds "
                         "its table")
    if rc != 0:
        raise MemoryError("paged_attention: out of memory for the attention scores")
    return out, lse


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ASSAY_CPU_KERNEL", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as e:  # no build problem may stop the engine: it has the PyTorch path
        log.warning("the C attention kernel is unavailable (%s: %s); the engine uses the PyTorch path",
                    type(e).__name__, e)
        return None
    lib.paged_attention_f32.argtypes = _ARGS
    lib.paged_attention_f32.restype = ctypes.c_int
    return lib


def _build() -> Path:
    """Compile once per (source, flags, compiler, CPU); a concurrent build is harmless (atomic rename)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    key = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), " ".join(_FLAGS).encode(), cc.encode(),
                                     _cpu_signature().encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("ASSAY_CACHE_DIR", Path.home() / ".cache" / "assay")) / "kernels"
    target = cache / f"paged_attention-{key}.so"
    if target.exists():
        return target
    with atomic_path(target) as built:
        proc = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[:300]}")
    for stale in cache.glob("paged_attention-*.so"):  # builds of older sources or flags (loaded copies stay valid)
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _cpu_signature() -> str:
    """-march=native code must not run on another CPU sharing the cache directory."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()
