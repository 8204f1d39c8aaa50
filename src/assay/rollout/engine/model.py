"""The Qwen2/Qwen3/Llama forward pass over a paged KV cache, on the very tensors of a Hugging Face model.

No weight is copied: the engine reads the parameters of the `PreTrainedModel` it was given, so the
trainer's optimizer steps (or `update_weights` copying into them) are what the engine runs next (on
oneDNN through packed copies, remade when a parameter changes: `onednn.py`).
Supported: RMSNorm, RoPE with every Hugging Face scaling type (the frequencies and attention
factor come from the model's own rotary module, so linear, dynamic, yarn and llama3 match it
exactly within max_position_embeddings), grouped-query attention, SwiGLU (the model's activation),
QKV and MLP biases, tied embeddings, and Qwen3's RMSNorm of each head's queries and keys.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from assay.core.errors import AssayError
from assay.rollout.engine import cpu_kernel, onednn
from assay.rollout.engine.attention import AttentionGroup, paged_attention

SUPPORTED = ("qwen2", "qwen3", "llama")
_FEW_ROWS = 64  # up to this many rows, a CPU GEMM runs as weight @ x.T (see _linear)


@dataclass
class Batch:
    tokens: Tensor  # [T] every token computed this step, sequence after sequence
    positions: Tensor  # [T]
    slots: Tensor  # [T] cache slot (block * block_size + offset) each token's K/V is written to
    groups: list[AttentionGroup]
    logits_at: Tensor  # [N] packed indices whose next-token logits are needed


class PagedModel:
    def __init__(self, model: PreTrainedModel, num_blocks: int, block_size: int, gemm: str = "auto",
                 weights: str = "float32", int8_head: bool = False, int8_rows: int = 0) -> None:
        cfg = model.config
        if cfg.model_type not in SUPPORTED:
            raise AssayError(f"the engine runs {', '.join(SUPPORTED)} models, not {cfg.model_type!r}; "
                             "rollout.backend=vllm runs the architectures vLLM supports, rollout.backend=hf "
                             "(transformers generate) any causal LM transformers knows")
        if getattr(cfg, "use_sliding_window", False):
            raise AssayError("the engine does not implement sliding-window attention; use rollout.backend=vllm or hf")
        self.hf = model
        inner = model.model
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        self.block_size = block_size
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head
        self.layers = inner.layers
        self.silu = getattr(cfg, "hidden_act", None) in ("silu", "swish")  # the fused kernels compute SiLU
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.intermediate = cfg.intermediate_size
        # each layer's weights as the C decode step takes them: norm, qkv, o, norm, gate|up, down
        self.step_weights = [(layer.input_layernorm.weight, _side_by_side(a.q_proj, a.k_proj, a.v_proj),
                              _side_by_side(a.o_proj), layer.post_attention_layernorm.weight,
                              _side_by_side(layer.mlp.gate_proj, layer.mlp.up_proj), _side_by_side(layer.mlp.down_proj))
                             for layer in self.layers for a in (layer.self_attn,)]
        # every tensor the decode step's pointers stand for, directly or through a packed copy
        self._step_sources = [t for layer in self.step_weights for part in layer
                              for t in ((part,) if isinstance(part, Tensor) else (*part[0], *part[1])) if t is not None]
        self._pointers: dict[bool, tuple[tuple, ctypes.Array]] = {}  # int8 or not: (the weights' stamp, pointers)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.packs = _packed_weights(gemm, param, _check_weights(weights, param, gemm))
        # the LM head's own packs: float32 unless int8_head (its quantization costs the most quality; in bf16 the
        # logits themselves would be rounded to bf16's 8 bits); int8 ones time their own int8 row limit
        if self.packs is None or self.packs.weights == "float32":
            self.head_packs = self.packs
        else:
            self.head_packs = onednn.PackedWeights("int8" if self.packs.int8 and int8_head else "float32")
        if self.packs is not None:
            # how many rows take the int8 kernel, and past them the float32 one on the dequantized weights: timed
            # over every layer (as a step streams them) and on the head, unless given
            layers = [linear for _, qkv, o, _, gate_up, down in self.step_weights for linear in (qkv, o, gate_up, down)]
            for packs, linears in ((self.packs, layers),
                                   (self.head_packs, [_side_by_side(self.lm_head)])):
                if packs.int8:
                    packs.int8_rows = min(int8_rows, packs.int8_rows) if int8_rows else packs.time_int8_rows(linears)
            for _, qkv, o, _, gate_up, down in self.step_weights:
                for linear in (qkv, o, gate_up, down):
                    self.packs.prepack(*linear)
            self.head_packs.prepack(*_side_by_side(self.lm_head))
        rotary = inner.rotary_emb
        with torch.no_grad():
            pos = torch.arange(self.max_positions, device=self.device, dtype=torch.float32)
            inv_freq = getattr(rotary, "original_inv_freq", rotary.inv_freq)  # as initialized, before any dynamic growth
            freqs = pos[:, None] * inv_freq.to(self.device, torch.float32)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos = (emb.cos() * rotary.attention_scaling).to(self.dtype)
            self.sin = (emb.sin() * rotary.attention_scaling).to(self.dtype)
        shape = (len(self.layers), num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @staticmethod
    def bytes_per_block(model: PreTrainedModel, block_size: int) -> int:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        itemsize = next(model.parameters()).element_size()
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * itemsize

    @staticmethod
    def cache_mb_for(model: PreTrainedModel, tokens: int, floor_mb: int = 512, share_of_free: float = 0.25) -> int:
        """A KV budget that holds `tokens` at once (so a batch runs whole, not a slice at a time behind a
        small cache), at least `floor_mb` and at most `share_of_free` of the memory free now."""
        need = tokens * PagedModel.bytes_per_block(model, 1)
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):  # not a Linux-like system: trust the floor
            free = 0
        return max(floor_mb, min(need, int(free * share_of_free)) >> 20)

    def copy_block(self, src: int, dst: int) -> None:
        self.k_cache[:, dst].copy_(self.k_cache[:, src])
        self.v_cache[:, dst].copy_(self.v_cache[:, src])

    @torch.inference_mode()
    def forward(self, batch: Batch) -> Tensor:
        """Write the K/V of `batch.tokens` into the cache and return float32 logits at `logits_at`."""
        if self.silu and cpu_kernel.fused_usable(self.embed):
            return self._decode_step_in_c(batch) if self._few_decodes(batch) else self._forward_fused(batch)
        h = F.embedding(batch.tokens, self.embed)
        cos, sin = self.cos[batch.positions][:, None, :], self.sin[batch.positions][:, None, :]
        T = h.shape[0]
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = _rms_norm(h, layer.input_layernorm.weight, self.eps)
            q = self._gemm(x, attn.q_proj.weight, attn.q_proj.bias).view(T, self.num_heads, self.head_dim)
            k = self._gemm(x, attn.k_proj.weight, attn.k_proj.bias).view(T, self.num_kv_heads, self.head_dim)
            v = self._gemm(x, attn.v_proj.weight, attn.v_proj.bias).view(T, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: each head's queries and keys are RMS-normalized before RoPE
                q, k = _rms_norm(q, attn.q_norm.weight, self.eps), _rms_norm(k, attn.k_norm.weight, self.eps)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            kc = self.k_cache[i].view(-1, self.num_kv_heads, self.head_dim)
            vc = self.v_cache[i].view(-1, self.num_kv_heads, self.head_dim)
            kc.index_copy_(0, batch.slots, k)  # written before attention reads: a sibling in the same
            vc.index_copy_(0, batch.slots, v)  # batch may attend to these very slots
            out = paged_attention(q, self.k_cache[i], self.v_cache[i], batch.groups)
            h = h + self._gemm(out.view(T, -1), attn.o_proj.weight, attn.o_proj.bias)
            x = _rms_norm(h, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            gate = self._gemm(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
            up = self._gemm(x, mlp.up_proj.weight, mlp.up_proj.bias)
            h = h + self._gemm(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        last = _rms_norm(h[batch.logits_at], self.norm, self.eps)
        return self._head(last)

    def _forward_fused(self, batch: Batch) -> Tensor:
        """`forward` in float32 on the CPU with the elementwise work in C (`cpu_kernel`): the residual
        add folded into each RMSNorm, the projections' biases, RoPE and the KV-cache write in one pass,
        SiLU x up in another. A decode step (few rows) keeps the residual stream and the GEMM outputs
        feature-major, [features, tokens], which is what `weight @ x.T` returns, so no GEMM output is
        transposed or copied; the GEMM inputs the kernels write stay token-major (MKL runs `weight @ x.T`
        on a narrow feature-major x two to four times slower at 4-8 rows)."""
        T = batch.tokens.shape[0]
        few = self.packs is None and T <= _FEW_ROWS  # oneDNN's kernels want no turning around
        h = F.embedding(batch.tokens, self.embed)
        if few:
            h = h.t().contiguous().t()
        x = torch.empty(h.shape, dtype=h.dtype)  # the normalized input of each block, token-major
        delta: Tensor | None = None  # the last block's output, added to h by the next norm
        bias: Tensor | None = None
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            cpu_kernel.add_rms_norm(h, delta, bias, layer.input_layernorm.weight, x, self.eps)
            (q, bq), (k, bk), (v, bv) = self._projections(x, (attn.q_proj, attn.k_proj, attn.v_proj), few)
            if hasattr(attn, "q_norm"):
                q = _rms_norm(_biased(q, bq).reshape(T, self.num_heads, self.head_dim), attn.q_norm.weight, self.eps)
                k = _rms_norm(_biased(k, bk).reshape(T, self.num_kv_heads, self.head_dim), attn.k_norm.weight,
                              self.eps)
                q, k, bq, bk = q.view(T, -1), k.view(T, -1), None, None
            q = cpu_kernel.qkv_rope(q, k, v, (bq, bk, bv), self.cos, self.sin, batch.positions, batch.slots,
                                    self.k_cache[i], self.v_cache[i], self.num_heads)
            out = paged_attention(q, self.k_cache[i], self.v_cache[i], batch.groups)
            delta, bias = self._project(out.view(T, -1), attn.o_proj, few)
            cpu_kernel.add_rms_norm(h, delta, bias, layer.post_attention_layernorm.weight, x, self.eps)
            (gate, bg), (up, bu) = self._projections(x, (mlp.gate_proj, mlp.up_proj), few)
            delta, bias = self._project(cpu_kernel.silu_mul(gate, up, bg, bu), mlp.down_proj, few)
        cpu_kernel.add_rms_norm(h, delta, bias, self.norm, x, self.eps)
        return self._head(x[batch.logits_at])

    def _few_decodes(self, batch: Batch) -> bool:
        """Only decoding rows, few enough for the C kernels' panels, of a model whose every op the C step has."""
        T, g = batch.tokens.shape[0], batch.groups
        return (self.packs is not None and not self.qk_norm and 0 < T <= self.packs.c_rows and len(g) == 1
                and g[0].start == 0 and g[0].rows is not None and tuple(g[0].rows.shape) == (T, 1))

    def _decode_step_in_c(self, batch: Batch) -> Tensor:
        """`_forward_fused` of a few decoding rows as one C call over every layer (`cpu_kernel.decode_step`):
        the same kernels in the same order, so the same results, without returning to Python between them."""
        g = batch.groups[0]
        h = F.embedding(batch.tokens, self.embed)
        x = torch.empty_like(h)
        s = g.shared
        int8 = h.shape[0] <= self.packs.int8_rows
        cpu_kernel.decode_step(self._step_pointers(int8), h, x, self.norm, self.cos, self.sin, batch.positions,
                               batch.slots, self.k_cache, self.v_cache, g.block_tables, g.lengths,
                               None if s is None else (s.tables, s.lengths, s.targets), self.num_heads,
                               self.intermediate, self.eps, int8=int8)
        return self._head(x[batch.logits_at])

    def _step_pointers(self, int8: bool) -> ctypes.Array:
        """The addresses of each layer's norms and current packed weights (`cpu_kernel.weight_pointers`): int8
        panels and their scales, or float32 panels (of the dequantized weights, on int8 packs). Remade only when a
        weight has moved since the last step (an in-place write bumps its version): asking every pack whether it
        is current cost ~0.3 ms a step, a few percent of a decode step."""
        stamp = tuple((t._version, t.data_ptr()) for t in self._step_sources)
        if self._pointers.get(int8, ((),))[0] != stamp:
            tensors: list[Tensor | None] = []
            for norm, qkv, o, post_norm, gate_up, down in self.step_weights:
                p = [self.packs.panels(*w, int8) for w in (qkv, o, gate_up, down)]
                w = [part.int8_panels if int8 else part.float_panels for part in p]
                tensors += [norm, w[0], p[0].bias, w[1], p[1].bias, post_norm, w[2], p[2].bias, w[3], p[3].bias,
                            *(part.scales if int8 else None for part in p)]
            self._pointers[int8] = (stamp, cpu_kernel.weight_pointers(tensors))
        return self._pointers[int8][1]

    def _head(self, x: Tensor) -> Tensor:
        w, b = self.lm_head.weight, self.lm_head.bias
        return (_linear(x, w, b) if self.head_packs is None else self.head_packs.linear(x, w, b)).float()

    def _gemm(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return _linear(x, weight, bias) if self.packs is None else self.packs.linear(x, weight, bias)

    def _projections(self, x: Tensor, linears: tuple[torch.nn.Linear, ...],
                     few: bool) -> list[tuple[Tensor, Tensor | None]]:
        """`_project` of each of several projections of x; on oneDNN one GEMM over their weights side by
        side, each output a column slice of its result (token-major, rows strided), biases added."""
        if self.packs is None:
            return [self._project(x, linear, few) for linear in linears]
        y = self.packs.linear_cat(x, tuple(m.weight for m in linears), tuple(m.bias for m in linears))
        return [(part, None) for part in y.split([m.weight.shape[0] for m in linears], dim=1)]

    def _project(self, x: Tensor, linear: torch.nn.Linear, few: bool) -> tuple[Tensor, Tensor | None]:
        """(x @ weight.T, the bias still to add): for few rows (on MKL only) as weight @ x.T, left
        feature-major and without its bias (the next fused kernel adds it); otherwise `_gemm`,
        token-major, bias added."""
        if few:
            return torch.mm(linear.weight, x.t()).t(), linear.bias
        return self._gemm(x, linear.weight, linear.bias), None


def _check_weights(weights: str, param: Tensor, gemm: str) -> str:
    """`weights: int8` runs on the C kernels and oneDNN, `bf16` on oneDNN: a float32 model on the CPU, gemm auto or
    onednn."""
    if weights not in ("float32", "int8", "bf16"):
        raise AssayError(f"engine weights must be float32, int8 or bf16, got {weights!r}")
    if weights == "float32":
        return weights
    c_kernels = weights == "bf16" or cpu_kernel.int8_rows()  # bf16 needs none
    if param.device.type != "cpu" or param.dtype != torch.float32 or gemm == "torch" or not onednn.available() \
            or not c_kernels:
        kernels = f", C kernels {'built' if c_kernels else 'unavailable'}" if weights == "int8" else ""
        raise AssayError(f"engine weights {weights} run a float32 model on the CPU with oneDNN (gemm auto or onednn)"
                         f"{' and the C kernels' if weights == 'int8' else ''}; this model is {param.dtype} on "
                         f"{param.device.type}, gemm {gemm!r}{kernels}, oneDNN {onednn.available()}: use weights float32")
    return weights


def _packed_weights(gemm: str, param: Tensor, weights: str = "float32") -> onednn.PackedWeights | None:
    """`rollout.gemm`: auto takes oneDNN wherever it runs (float32 on the CPU), torch keeps torch.mm (MKL)."""
    if gemm not in ("auto", "onednn", "torch"):
        raise AssayError(f"rollout.gemm must be auto, onednn or torch, got {gemm!r}")
    usable = param.device.type == "cpu" and param.dtype == torch.float32 and onednn.available()
    if gemm == "onednn" and not usable:
        raise AssayError(f"rollout.gemm: onednn runs float32 models on the CPU with a torch built with oneDNN; "
                         f"this model is {param.dtype} on {param.device.type} (oneDNN in this torch: "
                         f"{onednn.available()}): use rollout.gemm: auto or torch")
    return onednn.PackedWeights(weights) if usable and gemm != "torch" else None


def _side_by_side(*linears: torch.nn.Linear) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
    return tuple(m.weight for m in linears), tuple(m.bias for m in linears)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T + bias. For a few rows on the CPU (decoding) the GEMM runs as weight @ x.T: the
    same product, which MKL computes faster in that orientation (measured in docs/architecture.md)."""
    if x.shape[0] > _FEW_ROWS or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    y = torch.mm(weight, x.t()).t().contiguous()
    return y if bias is None else y.add_(bias)


def _biased(x: Tensor, bias: Tensor | None) -> Tensor:
    return x if bias is None else x + bias


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)  # in float32, as HF does


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
