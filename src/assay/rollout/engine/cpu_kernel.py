"""The C kernels for float32 on the CPU (`kernels.h` and the C files beside it): paged attention, the
elementwise work between a layer's GEMMs, the GEMM of a decode step's few rows, a whole decode step, and
sampling a token per row.

Decoding is memory-bound on the CPU, and the PyTorch path first gathers every row's keys and
values into a padded copy, then reads the copy: three passes over the cache where the kernel makes
one. A decode step's other work is many small elementwise ops (the residual add and RMSNorm, the
biases, RoPE, the KV-cache write, SiLU x up), each a PyTorch dispatch and an allocation; the fused
kernels do each group in one pass over preallocated or in-place memory. The kernels are compiled with the system
C compiler on first use (about a second) into a cache keyed by the source, the flags and the CPU, and loaded
with ctypes, which releases the GIL while it runs. They are compiled for this CPU (-march=native) with IEEE
semantics kept (no -ffast-math: the kernels use infinities as sentinels, which finite-math would leave
undefined). The cache directory may be shared between machines (a home directory on a cluster): each
CPU keeps its own build, and a build only ever replaces an older build for the same CPU. ASSAY_CPU_MARCH
builds for another target than this CPU (e.g. x86-64-v3: AVX2 and FMA, no AVX-512), to run or time the
kernels as an older CPU's build would be.
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

_SOURCES = tuple(Path(__file__).with_name(name)
                 for name in ("paged_attention.c", "elementwise.c", "skinny_linear.c", "int8_linear.c", "decode_step.c",
                              "sampling.c"))
_HEADER = Path(__file__).with_name("kernels.h")
# -fno-math-errno: no kernel reads errno, so sqrtf and the like may compile to one instruction; unlike
# -ffast-math it assumes nothing about infinities or NaNs
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
# glibc's vector expf and logf (libmvec), which -ffast-math would have declared: kernels.h declares them
_LIBMVEC = platform.machine() == "x86_64" and platform.libc_ver()[0] == "glibc"
if _LIBMVEC:
    _FLAGS.append("-DASSAY_LIBMVEC")
_LIBS = ["-lmvec", "-lm"] if _LIBMVEC else ["-lm"]
_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # name: (argument types, result type)
    "paged_attention_f32": ([_P] * 7 + [_I] * 7 + [_F, _INT], _INT),
    "paged_attention_shared_f32": ([_P] * 8 + [_I] * 9 + [_F, _INT], _INT),
    "paged_prefill_f32": ([_P] * 4 + [_I] * 2 + [_P] + [_I] * 6 + [_F, _INT], _INT),
    "add_rms_norm_f32": ([_P] * 5 + [_I] * 6 + [_F, _INT], None),
    "silu_mul_f32": ([_P] * 5 + [_I] * 5 + [_INT, _INT], None),
    "qkv_rope_f32": ([_P, _I, _I] * 3 + [_P] * 10 + [_I] * 6 + [_INT], _INT),
    "skinny_linear_f32": ([_P, _I, _P, _P, _P, _I, _I, _I, _INT], _INT),
    "skinny_panel_f32": ([], _INT),
    "skinny_rows_f32": ([], _INT),
    "int8_linear_f32": ([_P, _I, _P, _P, _P, _P, _I, _I, _I, _INT], _INT),
    "int8_panel_f32": ([], _INT),
    "int8_rows_f32": ([], _INT),
    "sample_rows_f32": ([_P, _I, _I, _P, _P, _P, _P, _INT], _INT),
    "decode_step_f32": ([_P, _I] + [_P] * 9 + [_I] * 2 + [_P] * 2 + [_I] + [_P] * 3 + [_I] * 10 + [_F, _F, _INT], _INT),
}


def usable(q: Tensor, k_cache: Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == k_cache.dtype == torch.float32 and _library() is not None


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor,
                    lengths: Tensor, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """q [R, Hkv, nq, D]; caches [blocks, block_size, Hkv, D]; tables [R, M]; lengths [R] ->
    (out [R, Hkv, nq, D], log-sum-exp [R, Hkv, nq, 1]), each row over its first `lengths` keys.
    `out`, a contiguous tensor of q's shape, receives the result in place."""
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
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError("paged_attention: out must be a contiguous float32 tensor of the queries' shape")
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


def paged_attention_shared(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                           members: Tensor, out: Tensor, lse: Tensor) -> None:
    """Merge each cluster's shared prefix into its members' own parts, in place. q, out [B, Hkv, nq, D]
    and lse [B, Hkv, nq, 1] as `paged_attention` returned them for the members' own blocks; tables
    [C, P] and lengths [C] the clusters' prefixes; members [C, G] int64, each cluster's rows (-1: none).
    Each member ends with attention over its prefix and its own keys together."""
    B, Hkv, nq, D = q.shape
    C, G = members.shape
    if not (q.is_contiguous() and out.is_contiguous() and lse.is_contiguous()) or out.shape != q.shape \
            or lse.shape != (B, Hkv, nq, 1) or k_cache.shape[2:] != (Hkv, D):
        raise ValueError("paged_attention_shared: q, out and lse must be contiguous and fit the caches")
    if any(t.dtype != torch.int64 for t in (tables, lengths, members)) or tables.shape[0] != C or lengths.shape != (C,):
        raise ValueError("paged_attention_shared: tables, lengths and members must be int64, one row per cluster")
    tables, lengths, members = tables.contiguous(), lengths.contiguous(), members.contiguous()
    rc = _library().paged_attention_shared_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lengths.data_ptr(),
        members.data_ptr(), out.data_ptr(), lse.data_ptr(), C, G, B, Hkv, nq, D, k_cache.shape[1], tables.shape[1],
        k_cache.shape[0], D ** -0.5, torch.get_num_threads())
    if rc == -2:
        raise ValueError("paged_attention_shared: a block table names a block outside the cache, a length exceeds "
                         "its table, or a member is not a row")
    if rc != 0:
        raise MemoryError("paged_attention_shared: out of memory for the attention scores")


def prefill_usable(q: Tensor, k_cache: Tensor) -> bool:
    return usable(q, k_cache) and q.shape[-1] in (64, 128) and q.is_contiguous()


def paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, first: int, out: Tensor) -> None:
    """Causal attention of one sequence's prefill chunk, into `out`: q and out [n, H, D] (D 64 or 128,
    contiguous), the chunk's queries at positions first .. first + n - 1; their keys 0 .. first + n - 1
    sit in the cache (one layer's [blocks, block_size, Hkv, D]) at the blocks of `table` [M] int64."""
    n, H, D = q.shape
    Hkv = k_cache.shape[2]
    if not (q.is_contiguous() and out.is_contiguous() and out.shape == q.shape and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k_cache.shape == v_cache.shape and k_cache.shape[3] == D):
        raise ValueError(f"paged_prefill: queries {tuple(q.shape)} and output {tuple(out.shape)} must be contiguous "
                         f"and fit the caches {tuple(k_cache.shape)}")
    if table.dtype != torch.int64 or table.dim() != 1:
        raise ValueError("paged_prefill: the block table must be one int64 row")
    table = table.contiguous()
    rc = _library().paged_prefill_f32(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), first, n, out.data_ptr(), H, Hkv, D,
        k_cache.shape[1], table.shape[0], k_cache.shape[0], D ** -0.5, torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"paged_prefill: {first + n} keys of head size {D} with {H} query and {Hkv} KV heads do "
                         "not fit the block table and cache (head size 64 or 128, query heads a multiple of KV heads)")
    if rc != 0:
        raise MemoryError("paged_prefill: out of memory for the attention scores")


# -- the fused elementwise kernels ------------------------------------------------------------------
# Activations are logical [T, n] tensors (token, feature), token-major (contiguous) or feature-major
# (the transpose of a contiguous [n, T], what `weight @ x.T` returns); the kernels read the strides.


def fused_usable(x: Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and _library() is not None


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_layout(name: str, *ts: Tensor | None) -> None:
    for t in ts:
        if t is None:
            continue
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 2:
            raise ValueError(f"{name}: float32 CPU activations [tokens, features] expected, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
        if not (_token_major(t) or t.t().is_contiguous()):
            raise ValueError(f"{name}: an activation must be token-major (rows may be strided: a column slice "
                             "of a wider GEMM output) or feature-major, not strided otherwise")


def _token_major(t: Tensor) -> bool:
    return t.is_contiguous() or (t.stride(1) == 1 and t.stride(0) >= t.shape[1])


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape, strict=True) if n > 1)


def _check_vector(name: str, n: int, *vs: Tensor | None) -> None:
    for v in vs:
        if v is not None and (v.dtype != torch.float32 or v.shape != (n,) or not v.is_contiguous()):
            raise ValueError(f"{name}: a bias or weight must be a contiguous float32 vector of {n}")


def add_rms_norm(h: Tensor, delta: Tensor | None, bias: Tensor | None, weight: Tensor, out: Tensor,
                 eps: float) -> None:
    """In place: h += delta (+ bias) when delta is given; out = weight * rms_norm(h). h and delta
    [T, n] share one layout; out, of h's shape, may have the other."""
    _check_layout("add_rms_norm", h, delta, out)
    T, n = h.shape
    if (delta is not None and not _same_layout(delta, h)) or out.shape != h.shape:
        raise ValueError("add_rms_norm: h and delta must have one shape and one layout, out h's shape")
    _check_vector("add_rms_norm", n, bias, weight)
    _library().add_rms_norm_f32(h.data_ptr(), _ptr(delta), _ptr(bias), weight.data_ptr(), out.data_ptr(), T, n,
                                h.stride(0), h.stride(1), out.stride(0), out.stride(1), eps, torch.get_num_threads())


def silu_mul(gate: Tensor, up: Tensor, bias_gate: Tensor | None, bias_up: Tensor | None) -> Tensor:
    """silu(gate + bias_gate) * (up + bias_up): token-major [T, n], whatever the layout of gate (up's
    must match it)."""
    _check_layout("silu_mul", gate, up)
    T, n = gate.shape
    if not _same_layout(up, gate):
        raise ValueError("silu_mul: gate and up must have one shape and one layout")
    _check_vector("silu_mul", n, bias_gate, bias_up)
    act = torch.empty((T, n), dtype=gate.dtype)
    # gate and up as [rows, cols] with contiguous rows `gate_rs` apart; act's strides in those terms
    token_major = _token_major(gate)
    rows, cols, row_stride, col_stride, axis = (T, n, n, 1, 1) if token_major else (n, T, 1, n, 0)
    gate_rs = gate.stride(0) if token_major else gate.stride(1)
    _library().silu_mul_f32(gate.data_ptr(), up.data_ptr(), _ptr(bias_gate), _ptr(bias_up), act.data_ptr(), rows,
                            cols, gate_rs, row_stride, col_stride, axis, torch.get_num_threads())
    return act


def qkv_rope(q: Tensor, k: Tensor, v: Tensor, biases: tuple[Tensor | None, Tensor | None, Tensor | None],
             cos: Tensor, sin: Tensor, positions: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
             num_heads: int) -> Tensor:
    """q [T, H * D], k and v [T, Hkv * D] (any layout), plus their biases -> RoPE at `positions` (cos,
    sin [max positions, D]) -> returns q [T, H, D]; k and v are written into the caches (one layer's
    [blocks, block_size, Hkv, D]) at `slots`."""
    _check_layout("qkv_rope", q, k, v)
    T = q.shape[0]
    Hkv, D = k_cache.shape[2:]
    if q.shape != (T, num_heads * D) or k.shape != (T, Hkv * D) or v.shape != (T, Hkv * D):
        raise ValueError(f"qkv_rope: projections {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} do not fit "
                         f"{num_heads} heads and a cache of {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("qkv_rope: the caches must be contiguous and of one shape")
    if cos.shape != sin.shape or cos.shape[1] != D or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("qkv_rope: cos and sin must be contiguous [positions, head_dim]")
    if positions.dtype != torch.int64 or slots.dtype != torch.int64 or positions.shape != (T,) or slots.shape != (T,):
        raise ValueError("qkv_rope: positions and slots must be int64, one per token")
    for b, n in zip(biases, (num_heads * D, Hkv * D, Hkv * D), strict=True):
        _check_vector("qkv_rope", n, b)
    out = torch.empty((T, num_heads, D), dtype=q.dtype)
    positions, slots = positions.contiguous(), slots.contiguous()
    rc = _library().qkv_rope_f32(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), *(_ptr(b) for b in biases), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
        slots.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), T, num_heads, Hkv, D,
        cos.shape[0], k_cache.shape[0] * k_cache.shape[1], torch.get_num_threads())
    if rc != 0:
        raise ValueError("qkv_rope: a position is outside the rotary tables or a slot outside the cache")
    return out


# -- the GEMM of a decode step's few rows ------------------------------------------------------------


def skinny_rows() -> int:
    """The most rows `skinny_linear` takes in this build (0 without the C kernels): 8 with AVX-512,
    2 without, where its broadcasts run out of registers beyond that and oneDNN is faster."""
    lib = _library()
    return lib.skinny_rows_f32() if lib is not None else 0


def pack_panels(weight: Tensor) -> Tensor:
    """weight [N, K] -> [panels, K, P]: P output features side by side per row of K, zeros past N (P is
    the build's panel width), the layout `skinny_linear` streams."""
    N, K = weight.shape
    P = _library().skinny_panel_f32()
    padded = torch.zeros((-(-N // P) * P, K), dtype=weight.dtype)
    padded[:N] = weight
    return padded.view(-1, P, K).transpose(1, 2).contiguous()


def skinny_linear(x: Tensor, panels: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x @ weight.T + bias -> [M, n] token-major, for M <= `skinny_rows()` rows of x [M, K] (rows may
    be strided), on weight packed by `pack_panels`."""
    M, K = x.shape
    if not (1 <= M <= skinny_rows()) or x.stride(1) != 1 or panels.shape[1] != K or n > panels.shape[0] * panels.shape[2]:
        raise ValueError(f"skinny_linear: {M} rows of {K} do not fit panels {tuple(panels.shape)} for {n} features "
                         f"(at most {skinny_rows()} rows, each contiguous)")
    if x.dtype != torch.float32 or panels.dtype != torch.float32 or not panels.is_contiguous():
        raise ValueError("skinny_linear: float32 input and contiguous float32 panels expected")
    _check_vector("skinny_linear", n, bias)
    y = torch.empty((M, n), dtype=x.dtype)
    _library().skinny_linear_f32(x.data_ptr(), x.stride(0), panels.data_ptr(), _ptr(bias), y.data_ptr(), M, n, K,
                                 torch.get_num_threads())
    return y


# -- weight-only int8 ---------------------------------------------------------------------------------


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] float -> (q [N, K] int8, scale [N] float32): per output feature, symmetric,
    scale = max |w| / 127 and q = round(w / scale), so w ~ q * scale within scale / 2 per element.
    A row of zeros gets scale 1 (its q are all 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()


def dequantize_int8(q: Tensor, scale: Tensor) -> Tensor:
    """The float32 weight the int8 one stands for: q * scale, per output feature."""
    return q.float() * scale[:, None]


def int8_rows() -> int:
    """The most rows `int8_linear` takes (0 without the C kernels)."""
    lib = _library()
    return lib.int8_rows_f32() if lib is not None else 0


def pack_int8_panels(q: Tensor) -> Tensor:
    """q [N, K] int8 -> [panels, K, P] int8, P output features side by side per row of K, zeros past N:
    the layout `int8_linear` streams."""
    N, K = q.shape
    P = _library().int8_panel_f32()
    padded = torch.zeros((-(-N // P) * P, K), dtype=torch.int8)
    padded[:N] = q
    return padded.view(-1, P, K).transpose(1, 2).contiguous()


def int8_linear(x: Tensor, panels: Tensor, scale: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """x @ (q * scale).T + bias -> [M, n] token-major, for M <= `int8_rows()` rows of x [M, K] (rows may
    be strided), on q packed by `pack_int8_panels` and its per-feature scales [n]."""
    M, K = x.shape
    if not (1 <= M <= int8_rows()) or x.stride(1) != 1 or panels.shape[1] != K \
            or n > panels.shape[0] * panels.shape[2]:
        raise ValueError(f"int8_linear: {M} rows of {K} do not fit panels {tuple(panels.shape)} for {n} features "
                         f"(at most {int8_rows()} rows, each contiguous)")
    if x.dtype != torch.float32 or panels.dtype != torch.int8 or not panels.is_contiguous():
        raise ValueError("int8_linear: float32 input and contiguous int8 panels expected")
    _check_vector("int8_linear", n, bias, scale)
    y = torch.empty((M, n), dtype=x.dtype)
    _library().int8_linear_f32(x.data_ptr(), x.stride(0), panels.data_ptr(), scale.data_ptr(), _ptr(bias),
                               y.data_ptr(), M, n, K, torch.get_num_threads())
    return y


# -- a whole decode step of few rows -------------------------------------------------------------------


def weight_pointers(tensors: list[Tensor | None]) -> ctypes.Array:
    """The addresses `decode_step` reads each layer's weights at (NULL for a missing bias), in its order:
    input norm, qkv panels, qkv bias, o panels, o bias, post-attention norm, gate|up panels, gate|up bias,
    down panels, down bias, then the qkv, o, gate|up and down scales (NULL: float32 panels; otherwise the
    panels are int8). The tensors must outlive the array."""
    return (ctypes.c_void_p * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))


def decode_step(weights: ctypes.Array, h: Tensor, x: Tensor, final_norm: Tensor, cos: Tensor, sin: Tensor,
                positions: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                prefix: tuple[Tensor, Tensor, Tensor] | None, num_heads: int, intermediate: int, eps: float,
                int8: bool = False) -> None:
    """Every layer of a decode step of M <= `skinny_rows()` rows (`int8_rows()` on int8 weights) in one C
    call (decode_step.c): h [M, n], the embedded tokens, becomes the residual stream and x its final norm.
    Caches [layers, blocks, block_size, Hkv, D]; tables [M, width] and lengths [M] each row's own blocks; prefix: the shared prefixes' tables,
    lengths and members, as `paged_attention_shared` takes them. `weights` from `weight_pointers`, 14 a
    layer (trusted: the model makes them from its own packed weights)."""
    M, n = h.shape
    layers, blocks, bs, Hkv, D = k_cache.shape
    most = int8_rows() if int8 else skinny_rows()
    if not (1 <= M <= most) or not (h.is_contiguous() and x.is_contiguous() and x.shape == h.shape):
        raise ValueError(f"decode_step: {M} contiguous rows of h and x expected, at most {most}")
    if len(weights) != 14 * layers or k_cache.shape != v_cache.shape or not k_cache.is_contiguous() \
            or not v_cache.is_contiguous() or num_heads % Hkv != 0:
        raise ValueError(f"decode_step: {len(weights)} weights and caches {tuple(k_cache.shape)} do not fit "
                         f"{layers} layers of {num_heads} heads")
    if any(t.dtype != torch.int64 for t in (positions, slots, tables, lengths, *(prefix or ()))) or tables.shape[0] != M \
            or lengths.shape != (M,) or positions.shape != (M,) or slots.shape != (M,):
        raise ValueError("decode_step: positions, slots, tables and lengths must be int64, one row each")
    tables, lengths, positions, slots = tables.contiguous(), lengths.contiguous(), positions.contiguous(), \
        slots.contiguous()
    pre_tables, pre_lengths, members = (t.contiguous() for t in prefix) if prefix is not None else (None,) * 3
    rc = _library().decode_step_f32(
        weights, layers, h.data_ptr(), x.data_ptr(), final_norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks, bs,
        tables.data_ptr(), lengths.data_ptr(), tables.shape[1], _ptr(pre_tables), _ptr(pre_lengths), _ptr(members),
        0 if members is None else members.shape[0], 0 if members is None else members.shape[1],
        0 if pre_tables is None else pre_tables.shape[1], M, n, num_heads, Hkv, D, intermediate, cos.shape[0],
        D ** -0.5, eps, torch.get_num_threads())
    if rc == -2:
        raise ValueError("decode_step: a position, slot or block is outside its table or the cache")
    if rc != 0:
        raise MemoryError("decode_step: out of memory for the step's activations")


# -- sampling ------------------------------------------------------------------------------------------


def sample_usable(logits: Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and _library() is not None


def sample_rows(logits: Tensor, temperatures: list[float], uniforms: Tensor) -> tuple[list[int], list[float]]:
    """A token per row of logits [N, V] from softmax(logits / temperature), untruncated, by inverse CDF at
    the row's uniform (float64 [N], in [0, 1)), and its logprob (sampling.c)."""
    N, V = logits.shape
    if len(temperatures) != N or uniforms.shape != (N,) or uniforms.dtype != torch.float64 \
            or any(not t > 0 for t in temperatures):
        raise ValueError(f"sample_rows: {N} rows need {N} positive temperatures and {N} float64 uniforms")
    logits = logits.contiguous()
    inv = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float32)
    uniforms = uniforms.contiguous()
    tokens, logprobs = torch.empty(N, dtype=torch.int64), torch.empty(N, dtype=torch.float32)
    rc = _library().sample_rows_f32(logits.data_ptr(), N, V, inv.data_ptr(), uniforms.data_ptr(), tokens.data_ptr(),
                                    logprobs.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise ValueError("sample_rows: a row of logits holds a NaN or no finite value (the model's output is "
                         "broken: check its weights and inputs)")
    if rc != 0:
        raise MemoryError("sample_rows: out of memory")
    return tokens.tolist(), logprobs.tolist()


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("ASSAY_CPU_KERNEL", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as e:  # no build problem may stop the engine: it has the PyTorch path
        log.warning("the C kernels are unavailable (%s: %s); the engine uses the PyTorch path",
                    type(e).__name__, e)
        return None
    for name, (args, result) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def _build() -> Path:
    """Compile once per (source, flags, compiler, CPU); a concurrent build is harmless (atomic rename).
    Builds are named kernels-<cpu>-<build>.so: a new build removes only its own CPU's older ones."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise OSError("no C compiler (cc) on PATH")
    march = os.environ.get("ASSAY_CPU_MARCH", "native")
    flags = [f"-march={march}" if f == "-march=native" else f for f in _FLAGS]
    target_cpu = _cpu_signature() + ("" if march == "native" else f" target {march}")  # another target's builds apart
    cpu = hashlib.sha256(target_cpu.encode()).hexdigest()[:12]
    key = hashlib.sha256(b"\0".join([*(s.read_bytes() for s in (*_SOURCES, _HEADER)), " ".join(flags).encode(),
                                     cc.encode()])).hexdigest()[:16]
    cache = Path(os.environ.get("ASSAY_CACHE_DIR", Path.home() / ".cache" / "assay")) / "kernels"
    target = cache / f"kernels-{cpu}-{key}.so"
    if target.exists():
        return target
    with atomic_path(target) as built:
        proc = subprocess.run([cc, *flags, *map(str, _SOURCES), "-o", str(built), *_LIBS], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{cc} failed: {proc.stderr.strip()[:300]}")
    for stale in cache.glob(f"kernels-{cpu}-*.so"):  # this CPU's builds of older sources or flags
        if stale != target:  # (copies already loaded stay valid)
            stale.unlink(missing_ok=True)
    return target


def _cpu_signature() -> str:
    """-march=native code must not run on another CPU sharing the cache directory."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return next((line for line in info.splitlines() if line.startswith("flags")), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()
