"""The engine's float32 CPU GEMMs on prepacked weights: oneDNN's blocked layout, and for a decode step's
few rows the C kernel's panels (`cpu_kernel.skinny_linear`).

On some CPUs MKL's sgemm (what `torch.mm` calls) takes a generic path: on the development machine's
AMD EPYC (Zen 5, AVX-512) it ran 80-90 GFLOP/s a core where oneDNN's prepacked kernels ran 150-210 at
the engine's shapes. A packed copy is made once per weight and made again
whenever the weight changed: torch bumps a tensor's version counter on every in-place write (an
optimizer step, `copy_weights`), so the engine still runs whatever the model's parameters hold.
At a few rows oneDNN streamed the weights at about half the rate the machine reads memory; the C
kernel reaches it, for one more copy of the weights.

With `int8` (the engine's `weights: int8`) every weight stands for its weight-only int8 quantization
(`cpu_kernel.quantize_int8`, per output feature): a decode step's few rows run the int8 C kernel,
which reads a quarter of the bytes, and more rows (prefill) run oneDNN on the dequantized float32
copy, so prefill and decode compute with the same weights. The model's own parameters stay float32.

With `bf16` (the engine's `weights: bf16`, for a CPU with AMX) every GEMM runs on oneDNN with a bf16 copy
of the weights and the input rounded to bf16, its output returned in float32 (the residual stream, norms,
attention and sampling stay float32); no row count takes the float32 C kernel, so every step computes with
the same weights. At the engine's shapes on AMX these GEMMs ran 3.9-7.6x faster than float32. Where this
torch's oneDNN has no bf16 GEMM for the CPU (`bf16_available`), torch's own bf16 `F.linear` computes the same
products, slowly."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from assay.rollout.engine import cpu_kernel


@functools.cache
def available() -> bool:
    """oneDNN's packed linear exists in this torch build and agrees with F.linear on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    try:
        y = _linear(x, _pack(w), b)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5))


@functools.cache
def bf16_available() -> bool:
    """oneDNN runs a bf16 GEMM on packed weights here, within bf16's rounding of the float32 result."""
    if not available():
        return False
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(24, 64, generator=g)
    try:
        y = _linear(x.to(torch.bfloat16), _pack(w.to(torch.bfloat16)), None).float()
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), rtol=0.05, atol=0.1))


def _pack(weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _linear(x: Tensor, packed: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass
class _Pack:
    """The packed copies of one version of some joined weights; each layout is made when first needed."""

    stamp: tuple  # the (version, address) of each weight and bias it was made from
    bias: Tensor | None  # the biases joined (zeros where one is missing)
    rows: int  # output features
    onednn: Tensor | None = None  # oneDNN's blocked layout, for many rows
    # the C kernels' layouts, for a decode step's few rows: int8 (int8 weights) and float32 (of the weights, or of
    # the int8 weights' dequantized values)
    int8_panels: Tensor | None = None
    float_panels: Tensor | None = None
    scales: Tensor | None = None  # int8: each output feature's scale


class PackedWeights:
    """x @ weight.T + bias on a packed copy of each weight, kept current with the weight. `linear_cat`
    runs several projections of one input (q, k and v; gate and up) as one GEMM on their weights packed
    side by side: at a decode step's few rows a GEMM is bound by reading its weight, and one wide GEMM
    streams it faster than three narrow ones. Up to `cpu_kernel.skinny_rows()`
    rows run on the C kernel's panels instead, which stream a weight faster than oneDNN does at so few
    rows. The engine makes both layouts as it starts (`prepack`); a newer version of the weights
    gets each layout the first time a call needs it."""

    def __init__(self, weights: str = "float32") -> None:
        self._packs: dict[tuple[int, ...], _Pack] = {}  # key: ids of the weights and biases
        self.weights = weights  # float32, int8 or bf16
        self.int8, self.bf16 = weights == "int8", weights == "bf16"
        self._onednn_bf16 = self.bf16 and bf16_available()  # else torch's bf16 F.linear (see the module doc)
        # the most rows the float32 C kernel takes (its panels ran out of registers past 2 on AVX2; a speculative
        # step verifies 1 + draft rows); bf16 none
        self.skinny_rows = 0 if self.bf16 else cpu_kernel.skinny_rows()
        # int8: the most rows the int8 kernel takes (it widens each weight once for up to 8 rows), lowered where
        # the float32 kernel on the dequantized weights is faster (`time_int8_rows`)
        self.int8_rows = cpu_kernel.int8_rows() if self.int8 else 0

    @property
    def c_rows(self) -> int:
        """The most rows a C kernel takes, and so a decode step of the whole-step C kernel."""
        return max(self.int8_rows, self.skinny_rows)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return self.linear_cat(x, (weight,), (bias,))

    def linear_cat(self, x: Tensor, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...]) -> Tensor:
        """x @ cat(weights).T + cat(biases): [T, sum of the weights' rows]; a missing bias counts as zeros."""
        if 0 < x.shape[0] <= self.c_rows and x.stride(-1) == 1:
            int8 = x.shape[0] <= self.int8_rows
            pack = self.panels(weights, biases, int8)
            if int8:
                return cpu_kernel.int8_linear(x, pack.int8_panels, pack.scales, pack.bias, pack.rows)
            return cpu_kernel.skinny_linear(x, pack.float_panels, pack.bias, pack.rows)
        pack = self.blocked(weights, biases)
        if self.bf16:  # bf16 out: widened back, the bias added in float32
            xb = x.to(torch.bfloat16).contiguous()
            y = (_linear(xb, pack.onednn, None) if self._onednn_bf16 else F.linear(xb, pack.onednn)).float()
            return y if pack.bias is None else y.add_(pack.bias)
        return _linear(x.contiguous(), pack.onednn, pack.bias)

    def prepack(self, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...]) -> None:
        """Make every layout these weights will need now, as the engine starts, and not in its first
        steps: at the bench model's 57M parameters, packing cost the first long prefill ~0.2-0.4 s."""
        self.blocked(weights, biases)
        if self.int8_rows:
            self.panels(weights, biases, int8=True)
        if self.int8_rows < self.skinny_rows:
            self.panels(weights, biases, int8=False)

    def time_int8_rows(self, linears: Sequence[tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]],
                       reps: int = 5) -> int:
        """Lower `int8_rows` to the most rows at which, and at every count below, the int8 kernel ran these
        projections no slower than the float32 kernel on their dequantized weights (what those rows run
        otherwise), timed here on this CPU: the fastest of `reps` alternated passes of each over all of them. Give
        every layer's: a pass then streams the model's weights from memory as a decode step does, where one
        layer's would stay in the cache and flatter the float32 kernel, whose weights are 4x the bytes. Only up to
        the float32 kernel's rows: past them the alternative leaves the whole-step C kernel."""
        g = torch.Generator().manual_seed(0)
        for rows in range(1, min(self.skinny_rows, self.int8_rows) + 1):
            int8_calls, float32_calls = [], []
            for weights, biases in linears:
                pack = self.panels(weights, biases, int8=True)
                self.panels(weights, biases, int8=False)
                x = torch.randn(rows, weights[0].shape[1], generator=g)
                int8_calls.append(functools.partial(cpu_kernel.int8_linear, x, pack.int8_panels, pack.scales,
                                                    pack.bias, pack.rows))
                float32_calls.append(functools.partial(cpu_kernel.skinny_linear, x, pack.float_panels, pack.bias,
                                                       pack.rows))
            int8_s, float32_s = _race(functools.partial(_in_turn, int8_calls),
                                      functools.partial(_in_turn, float32_calls), reps)
            if int8_s > float32_s:
                self.int8_rows = rows - 1
                break
        if self.int8_rows >= self.skinny_rows:  # the float32 kernel takes no rows: its panels were for timing only
            for weights, biases in linears:
                self._current(weights, biases).float_panels = None
        return self.int8_rows

    def blocked(self, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...]) -> _Pack:
        """The current pack of these weights side by side, with oneDNN's blocked layout made."""
        pack = self._current(weights, biases)
        if pack.onednn is None:
            w = _join(weights)
            if self.bf16:
                pack.onednn = _pack(w.to(torch.bfloat16)) if self._onednn_bf16 else w.to(torch.bfloat16)
            else:
                pack.onednn = _pack(self._float(weights))
        return pack

    def panels(self, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...], int8: bool) -> _Pack:
        """The current pack of these weights side by side, with one of the C kernels' layouts made: the int8
        kernel's (`int8_panels`, `scales`) or the float32 kernel's (`float_panels`)."""
        pack = self._current(weights, biases)
        if int8 and pack.int8_panels is None:
            q, pack.scales = cpu_kernel.quantize_int8(_join(weights))
            pack.int8_panels = cpu_kernel.pack_int8_panels(q)
        if not int8 and pack.float_panels is None:
            pack.float_panels = cpu_kernel.pack_panels(self._float(weights))
        return pack

    def _float(self, weights: tuple[Tensor, ...]) -> Tensor:
        """The float32 weights side by side: int8 ones dequantized, so every path computes with the same values."""
        w = _join(weights)
        return cpu_kernel.dequantize_int8(*cpu_kernel.quantize_int8(w)) if self.int8 else w

    def _current(self, weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...]) -> _Pack:
        tensors = weights + tuple(b for b in biases if b is not None)
        key = tuple(id(t) for t in tensors)
        stamp = tuple((t._version, t.data_ptr()) for t in tensors)
        pack = self._packs.get(key)
        if pack is None or pack.stamp != stamp:
            pack = self._packs[key] = _Pack(stamp, _joined_bias(weights, biases), sum(w.shape[0] for w in weights))
        return pack


def _in_turn(calls: Sequence[Callable[[], object]]) -> None:
    for call in calls:
        call()


def _race(a: Callable[[], object], b: Callable[[], object], reps: int) -> tuple[float, float]:
    """The fastest of `reps` calls of each, alternated (after one warm-up call each), in seconds."""
    a(), b()
    best = [math.inf, math.inf]
    for _ in range(reps):
        for i, fn in enumerate((a, b)):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best[0], best[1]


def _join(weights: tuple[Tensor, ...]) -> Tensor:
    return weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])


def _joined_bias(weights: tuple[Tensor, ...], biases: tuple[Tensor | None, ...]) -> Tensor | None:
    if all(b is None for b in biases):
        return None
    return _join(tuple(b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases, strict=True)))
