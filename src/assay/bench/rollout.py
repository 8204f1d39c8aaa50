"""`assay bench rollout`: the native engine beside Hugging Face `generate` on the same model, prompts,
dtype and thread count, in one run; ratios are what to read (absolute speeds drift on shared machines).

(a) GRPO: P prompts of 200-400 tokens x G samples, up to 128 new tokens each. Baseline:
    `generate(num_return_sequences=G)` on the left-padded batch.
(b) Multi-turn: S sessions x T turns; each turn appends ~100 tokens of observation and samples up
    to 64. Baseline: `generate` re-fed the whole history every turn.
Also transformers' own paged `generate_batch` on (a) when the installed version has it.
"""

from __future__ import annotations

import io
import sys
import time
from dataclasses import asdict, dataclass

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine, EngineConfig


@dataclass
class Shape:
    hidden: int = 768
    layers: int = 8
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 8192
    prompts: int = 32
    group: int = 8
    prompt_len: tuple[int, int] = (200, 400)
    max_tokens: int = 128
    sessions: int = 16
    turns: int = 6
    first_prompt: int = 100
    observation: int = 100
    turn_tokens: int = 64
    paged_prompts: int = 4  # transformers' paged generate_batch is timed on this many of the prompts (it is slow)


QUICK = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512, prompts=3, group=4,
              prompt_len=(20, 40), max_tokens=8, sessions=2, turns=3, first_prompt=10, observation=10, turn_tokens=6,
              paged_prompts=2)


@dataclass
class Row:
    workload: str
    backend: str
    tokens: int
    seconds: float
    hit_rate: float | None = None
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def build_model(shape: Shape, dtype: torch.dtype, device: str = "cpu") -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                      intermediate_size=shape.intermediate, max_position_embeddings=2048, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    cfg._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def _ids(g: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=g).tolist()  # 0 pad and 1 stop never appear in prompts


def _sampling(max_tokens: int, n: int = 1) -> GenerationConfig:
    """Plain temperature-1 sampling for the transformers baselines: 0 pads, 1 stops."""
    return GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                            num_return_sequences=n, eos_token_id=1, pad_token_id=0, bos_token_id=None)


def _hf_sample(model: Qwen2ForCausalLM, prompts: list[list[int]], max_tokens: int, n: int = 1) -> list[list[int]]:
    """`generate` on the left-padded batch: each row's sampled tokens, up to and including its stop."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=_sampling(max_tokens, n))
    return [row[: _useful(row)] for row in out[:, width:].tolist()]


def _useful(row: list[int]) -> int:
    return row.index(1) + 1 if 1 in row else len(row)


def run_rollout_bench(shape: Shape | None = None, dtype: str = "float32", hf_paged: bool = True,
                      seed: int = 0, device: str = "cpu") -> tuple[list[Row], dict]:
    shape = shape or Shape()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = build_model(shape, torch_dtype, device)
    params = SamplingParams(temperature=1.0, max_tokens=shape.max_tokens, stop_token_ids=[1], seed=seed)
    g = torch.Generator().manual_seed(seed)
    lo, hi = shape.prompt_len
    prompts = [_ids(g, shape.vocab, int(torch.randint(lo, hi + 1, (1,), generator=g))) for _ in range(shape.prompts)]
    engine = Engine(model, None, EngineConfig(kv_cache_bytes=4 * 2**30))
    rows: list[Row] = []
    _hf_sample(model, [prompts[0][:8]], 2, n=2)  # warm-up: first calls pay one-off costs
    engine.generate([GenRequest(prompts[0][:8], params, n=2)])

    t0 = time.perf_counter()
    tokens = sum(len(r) for r in _hf_sample(model, prompts, shape.max_tokens, n=shape.group))
    rows.append(Row("a: GRPO", "HF generate", tokens, time.perf_counter() - t0))
    _progress(rows[-1])

    t0 = time.perf_counter()
    res = engine.generate([GenRequest(p, params, n=shape.group) for p in prompts])
    rows.append(Row("a: GRPO", "assay engine", sum(len(r.token_ids) for grp in res for r in grp),
                    time.perf_counter() - t0, engine.last_stats["prefix_hit_rate"]))
    _progress(rows[-1])

    obs = [[_ids(g, shape.vocab, shape.observation) for _ in range(shape.turns)] for _ in range(shape.sessions)]
    firsts = [_ids(g, shape.vocab, shape.first_prompt) for _ in range(shape.sessions)]
    for backend in ("HF generate", "assay engine"):
        histories = [list(f) for f in firsts]
        tokens, cached, prompt_tokens = 0, 0.0, 0.0
        t0 = time.perf_counter()
        for turn in range(shape.turns):
            turn_params = SamplingParams(temperature=1.0, max_tokens=shape.turn_tokens, stop_token_ids=[1],
                                         seed=seed + turn)
            if backend == "HF generate":
                samples = _hf_sample(model, histories, shape.turn_tokens)
            else:
                samples = [r[0].token_ids for r in engine.generate([GenRequest(h, turn_params) for h in histories])]
                cached += engine.last_stats["cached_prompt_tokens"]
                prompt_tokens += engine.last_stats["prompt_tokens"]
            for h, s, o in zip(histories, samples, obs, strict=True):
                tokens += len(s)
                h += s + o[turn]
        rows.append(Row("b: multi-turn", backend, tokens, time.perf_counter() - t0,
                        cached / prompt_tokens if prompt_tokens else None))
        _progress(rows[-1])

    if hf_paged:  # last: it is by far the slowest
        rows.insert(2, _hf_paged(model, prompts, shape))
        _progress(rows[2])

    meta = {"params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1), "dtype": dtype, "device": device,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "shape": asdict(shape)}
    return rows, meta


def _progress(row: Row) -> None:
    """Each row as soon as it is measured (a long run keeps what it has if stopped)."""
    print(f"{row.workload} | {row.backend}: {row.tokens} tokens in {row.seconds:.1f} s "
          f"({row.tokens_per_s:.0f} tokens/s) {row.note}", file=sys.stderr, flush=True)


def _hf_paged(model: Qwen2ForCausalLM, prompts: list[list[int]], shape: Shape) -> Row:
    if not hasattr(model, "generate_batch"):
        return Row("a: GRPO", "HF generate_batch (paged)", 0, 0.0, note="not in this transformers version")
    cfg = _sampling(shape.max_tokens)
    inputs = [p for p in prompts[: shape.paged_prompts] for _ in range(shape.group)]
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate_batch(inputs=inputs, generation_config=cfg)
    except Exception as e:  # reported, not hidden: the baseline's own failure is a result too
        return Row("a: GRPO", "HF generate_batch (paged)", 0, 0.0, note=f"failed: {type(e).__name__}: {e}"[:120])
    tokens = sum(_useful(list(o.generated_tokens)) for o in out.values())
    return Row("a: GRPO", "HF generate_batch (paged)", tokens, time.perf_counter() - t0,
               note=f"on {min(shape.paged_prompts, len(prompts))} of the {len(prompts)} prompts")


def table(rows: list[Row], meta: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"rollout: {meta['params_M']}M-parameter qwen2, {meta['dtype']}, {meta['threads']} threads, "
                    f"torch {meta['torch']}")
    for col in ("workload", "backend", "tokens", "seconds", "tokens/s", "× HF generate", "prefix hit rate", "note"):
        t.add_column(col, justify="left" if col in ("workload", "backend", "note") else "right")
    base = {r.workload: r.tokens_per_s for r in rows if r.backend == "HF generate"}
    for r in rows:
        ratio = f"{r.tokens_per_s / base[r.workload]:.2f}" if r.tokens and base.get(r.workload) else "-"
        hit = f"{r.hit_rate:.3f}" if r.hit_rate is not None else "-"
        t.add_row(r.workload, r.backend, str(r.tokens), f"{r.seconds:.1f}", f"{r.tokens_per_s:.0f}", ratio, hit, r.note)
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(t)
    return console.export_text()
