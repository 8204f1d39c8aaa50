"""`assay bench rollout`: the native engine beside transformers' `generate` and vLLM, on the same model,
prompts, dtype and thread count. Each (backend, workload) runs in a process of its own, started
fresh, and the backends alternate over rounds, so no run inherits another's caches, allocator or
thread pools and drift on a shared machine falls on every backend alike. Ratios are what to read.

Workloads (random prompt tokens, temperature 1, every sample runs to its token limit):
- GRPO groups: P prompts of L tokens (uniform in a range) x G samples, up to N new tokens each.
  transformers: `generate(num_return_sequences=G)` on the left-padded batch; engine and vLLM: one
  request of n = G per prompt.
- multi-turn: S sessions x T turns; each turn appends an observation of O tokens and samples up
  to N. transformers re-feeds each whole history, all sessions in lockstep; engine and vLLM run the
  sessions online: a session's next turn joins the running batch as soon as its last one ended, as
  the online agent loop does.
Each row also reports the backend's start-up time, the process's peak resident memory, and what the
machine's CPUs did during the timed part (from /proc/stat, every process together): seconds busy and
seconds stolen by the hypervisor, so that a slow run can be told from a slow machine.
"""

from __future__ import annotations

import io
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from assay.bench.cpu_stat import BUSY, cpu_ticks, tick_s, tree_cpu_s
from assay.core import heap
from assay.core.errors import AssayError
from assay.rollout.base import GenRequest, OnlineBackend, SamplingParams

# engine-torch: the engine on torch.mm instead of oneDNN (rollout.gemm: torch); engine-bf16: on bf16 GEMMs
# (rollout.weights: bf16); vllm-B: vLLM with KV blocks of B tokens
BACKENDS = ("hf", "engine", "engine-torch", "engine-bf16", "vllm-32", "vllm-128")
ROW_MARK = "assay-bench-row "  # prefixes the one stdout line a measuring process reports
LABELS = {"hf": "HF generate", "engine": "assay engine", "engine-bf16": "assay engine, bf16", "vllm-32": "vLLM, block 32",
          "vllm-128": "vLLM, block 128"}


@dataclass(frozen=True)
class ModelShape:
    hidden: int = 768
    layers: int = 8
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048
    vocab: int = 8192


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # grpo | multiturn
    max_tokens: int
    prompts: int = 0  # grpo
    group: int = 0
    prompt_len: tuple[int, int] = (0, 0)
    sessions: int = 0  # multiturn
    turns: int = 0
    first_prompt: int = 0
    observation: int = 0


WORKLOADS = (
    Workload("grpo 32x8", "grpo", max_tokens=128, prompts=32, group=8, prompt_len=(200, 400)),
    Workload("grpo 16x16", "grpo", max_tokens=96, prompts=16, group=16, prompt_len=(500, 700)),
    Workload("multi-turn 8x5", "multiturn", max_tokens=48, sessions=8, turns=5, first_prompt=200, observation=120),
)
QUICK_MODEL = ModelShape(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128, vocab=512)  # head size 32
QUICK_WORKLOADS = (
    Workload("grpo 3x4", "grpo", max_tokens=8, prompts=3, group=4, prompt_len=(20, 40)),
    Workload("multi-turn 2x3", "multiturn", max_tokens=6, sessions=2, turns=3, first_prompt=10, observation=10),
)


@dataclass
class Row:
    workload: str
    backend: str
    tokens: int
    seconds: float
    startup_s: float = 0.0
    peak_rss_mb: float = 0.0
    hit_rate: float | None = None
    note: str = ""
    busy_s: float | None = None  # the machine's CPU-seconds busy during the timed part (all processes)
    steal_s: float | None = None  # CPU-seconds the hypervisor gave to other guests meanwhile
    own_s: float | None = None  # CPU-seconds of the measuring process and its children meanwhile
    page_faults: int | None = None  # minor page faults of the measuring process meanwhile

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Settings:
    model: ModelShape = field(default_factory=ModelShape)
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 0  # 0: torch's default
    seed: int = 0
    kv_cache_mb: int = 2048  # the same budget for the engine and vLLM


def build_model(shape: ModelShape, dtype: torch.dtype, device: str = "cpu") -> Qwen2ForCausalLM:
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
    """Plain temperature-1 sampling for the transformers baselines: 0 pads, nothing stops (every backend runs
    each sample to its token limit, so all do the same work)."""
    return GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, num_return_sequences=n, eos_token_id=None, pad_token_id=0,
                            bos_token_id=None)


def _hf_sample(model: Qwen2ForCausalLM, prompts: list[list[int]], max_tokens: int, n: int = 1) -> list[list[int]]:
    """`generate` on the left-padded batch: each row's sampled tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             generation_config=_sampling(max_tokens, n))
    return out[:, width:].tolist()


NO_STOP = [2**31 - 1]  # a stop id no sample can be: every backend runs each sample to its limit


def machine_cpu_s() -> tuple[float, float] | None:
    """The machine's (busy, stolen) CPU-seconds since boot, summed over CPUs; None where /proc/stat is not."""
    ticks = cpu_ticks()
    if ticks is None:
        return None
    return sum(ticks[k] for k in BUSY) * tick_s(), ticks["steal"] * tick_s()


def _params(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=NO_STOP, seed=seed)


def _inputs(w: Workload, vocab: int, seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """The workload's prompts (grpo) or first prompts and observations (multiturn), the same for every backend."""
    g = torch.Generator().manual_seed(seed)
    if w.kind == "grpo":
        lo, hi = w.prompt_len
        return [_ids(g, vocab, int(torch.randint(lo, hi + 1, (1,), generator=g))) for _ in range(w.prompts)], []
    firsts = [_ids(g, vocab, w.first_prompt) for _ in range(w.sessions)]
    return firsts, [[_ids(g, vocab, w.observation) for _ in range(w.turns)] for _ in range(w.sessions)]


def _sessions_online(backend: OnlineBackend, firsts: list[list[int]], obs: list[list[list[int]]], w: Workload,
                     seed: int) -> int:
    """Every session's turns through the online API: a turn is submitted as soon as the session's last ended."""
    histories = [list(f) for f in firsts]
    turn = [0] * len(firsts)
    owner: dict[int, int] = {}
    tokens = 0

    def submit(i: int) -> None:
        owner[backend.add_request(GenRequest(histories[i], _params(w.max_tokens, seed + turn[i]), stream=i))] = i

    for i in range(len(firsts)):
        submit(i)
    while owner:
        for rid, results in backend.step():
            i = owner.pop(rid)
            sample = results[0].token_ids
            tokens += len(sample)
            histories[i] += sample + obs[i][turn[i]]
            turn[i] += 1
            if turn[i] < w.turns:
                submit(i)
    return tokens


def _start(backend: str, model: Qwen2ForCausalLM, s: Settings):  # -> the backend, or None for transformers
    if backend == "hf":
        return None
    if backend in ("engine", "engine-torch", "engine-bf16"):
        from assay.rollout.engine import Engine, EngineConfig

        gemm = "torch" if backend == "engine-torch" else "auto"
        weights = "bf16" if backend == "engine-bf16" else "float32"
        return Engine(model, None, EngineConfig(kv_cache_bytes=s.kv_cache_mb * 2**20, gemm=gemm, weights=weights))
    if backend.startswith("vllm-"):
        from assay.rollout.vllm import VLLMBackend

        return VLLMBackend(model, None, block_size=int(backend.split("-")[1]),
                           kv_cache_bytes=s.kv_cache_mb * 2**20)
    raise AssayError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def measure(backend: str, w: Workload, s: Settings) -> Row:
    """One backend on one workload, in this process: start-up, a warm-up call, then the timed workload."""
    if s.threads > 0:
        torch.set_num_threads(s.threads)
    model = build_model(s.model, {"float32": torch.float32, "bfloat16": torch.bfloat16}[s.dtype], s.device)
    t0 = time.perf_counter()
    engine = _start(backend, model, s)
    startup = time.perf_counter() - t0
    prompts, obs = _inputs(w, s.model.vocab, s.seed)
    if engine is None:
        _hf_sample(model, [prompts[0][:8]], 2, n=2)  # warm-up: first calls pay one-off costs
    else:
        engine.generate([GenRequest(prompts[0][:8], _params(2, s.seed), n=2)])
        engine.take_stats()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu0, own0, t0 = machine_cpu_s(), tree_cpu_s(), time.perf_counter()
    if w.kind == "grpo":
        if engine is None:
            tokens = sum(len(r) for r in _hf_sample(model, prompts, w.max_tokens, n=w.group))
        else:
            res = engine.generate([GenRequest(p, _params(w.max_tokens, s.seed), n=w.group) for p in prompts])
            tokens = sum(len(r.token_ids) for grp in res for r in grp)
    elif engine is None:
        histories, tokens = [list(f) for f in prompts], 0
        for turn in range(w.turns):
            for h, sample, o in zip(histories, _hf_sample(model, histories, w.max_tokens), obs, strict=True):
                tokens += len(sample)
                h += sample + o[turn]
    else:
        tokens = _sessions_online(engine, prompts, obs, w, s.seed)
    seconds, cpu1, own1 = time.perf_counter() - t0, machine_cpu_s(), tree_cpu_s()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    busy, steal = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]) if cpu0 and cpu1 else (None, None)
    own = own1 - own0 if own0 is not None and own1 is not None else None
    hit = engine.take_stats().get("prefix_hit_rate") if engine is not None else None
    if engine is not None and hasattr(engine, "close"):
        engine.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return Row(w.name, backend, tokens, seconds, startup, rss, hit, busy_s=busy, steal_s=steal, own_s=own,
               page_faults=faults)


def run_rollout_bench(settings: Settings, workloads: Sequence[Workload] = WORKLOADS,
                      backends: Sequence[str] = ("hf", "engine"), rounds: int = 1,
                      python: dict[str, str] | None = None, echo: bool = True) -> list[Row]:
    """Every (backend, workload) in a fresh process, `rounds` times, the backends' order rotating each round.
    `python` names another interpreter for a backend (vLLM installed in an environment of its own)."""
    python = python or {}
    rows: list[Row] = []
    for r in range(rounds):
        order = list(backends[r % len(backends):]) + list(backends[:r % len(backends)])
        for w in workloads:
            for b in order:
                rows.append(_in_process_of_its_own(b, w, settings, python.get(b, sys.executable)))
                if echo:
                    _progress(rows[-1], r)
    return rows


def vllm_cpu_env(threads: int) -> dict[str, str]:
    """This environment for a vLLM process on the CPU, with what the caller has not set itself: vLLM's own
    advice, its OpenMP threads bound to the first `threads` cores (0: vLLM's choice), and the engine's malloc
    settings (core/heap.py), without which vLLM ran multi-turn slower on glibc's defaults."""
    env = dict(os.environ)
    if threads > 0:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("GLIBC_TUNABLES", heap.GLIBC_TUNABLES)
    return env


def _in_process_of_its_own(backend: str, w: Workload, s: Settings, python: str) -> Row:
    job = json.dumps({"backend": backend, "workload": asdict(w), "settings": asdict(s)})
    env = vllm_cpu_env(s.threads) if backend.startswith("vllm") else dict(os.environ)
    proc = subprocess.run([python, "-m", "assay.bench.rollout", job], capture_output=True, text=True, env=env)
    # the row is the last stdout line that is one (vLLM may log to stdout after it)
    row = next((line for line in reversed(proc.stdout.splitlines()) if line.startswith(ROW_MARK)), None)
    if proc.returncode != 0 or row is None:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Row(w.name, backend, 0, 0.0, note=f"failed: {tail}"[:160])
    return Row(**json.loads(row[len(ROW_MARK):]))


def _progress(row: Row, round_: int) -> None:
    print(f"round {round_ + 1} | {row.workload} | {LABELS.get(row.backend, row.backend)}: {row.tokens} tokens in "
          f"{row.seconds:.1f} s ({row.tokens_per_s:.0f}/s), start {row.startup_s:.1f} s, peak RSS "
          f"{row.peak_rss_mb:.0f} MB{_cpu_note(row)}{'' if row.page_faults is None else f', page faults {row.page_faults}'}"
          f" {row.note}", file=sys.stderr, flush=True)


def _cpu_note(row: Row) -> str:
    if row.busy_s is None or row.steal_s is None:
        return ""
    own = "" if row.own_s is None else f" (this run {row.own_s:.1f})"
    return f", machine busy {row.busy_s:.1f} CPU-s{own}, stolen {row.steal_s:.2f}"


def summarize(rows: list[Row]) -> list[dict]:
    """Per workload and backend: median tokens/s with its range over rounds, × transformers, × the faster vLLM."""
    out = []
    for w in dict.fromkeys(r.workload for r in rows):
        speeds: dict[str, list[float]] = {}
        for r in rows:
            if r.workload == w and r.tokens:
                speeds.setdefault(r.backend, []).append(r.tokens_per_s)
        med = {b: statistics.median(v) for b, v in speeds.items()}
        vllm = max((v for b, v in med.items() if b.startswith("vllm")), default=None)
        for b in dict.fromkeys(r.backend for r in rows if r.workload == w):
            mine = [r for r in rows if r.workload == w and r.backend == b]
            ok = [r for r in mine if r.tokens]
            if not ok:
                out.append({"workload": w, "backend": b, "note": mine[-1].note})
                continue
            out.append({"workload": w, "backend": b, "runs": len(ok), "tokens_per_s": med[b],
                        "min": min(speeds[b]), "max": max(speeds[b]),
                        "x_hf": med[b] / med["hf"] if "hf" in med else None,
                        "x_vllm": med[b] / vllm if vllm else None,
                        "startup_s": statistics.median(r.startup_s for r in ok),
                        "peak_rss_mb": max(r.peak_rss_mb for r in ok),
                        "hit_rate": statistics.median(r.hit_rate for r in ok) if ok[0].hit_rate is not None else None,
                        "note": f"{len(mine) - len(ok)} run(s) failed" if len(ok) < len(mine) else ""})
    return out


def table(rows: list[Row], settings: Settings) -> str:
    from rich.console import Console
    from rich.table import Table

    with torch.device("meta"):  # counted, not allocated: this process measures nothing itself
        params_m = sum(p.numel() for p in build_model(settings.model, torch.float32, "meta").parameters()) / 1e6
    t = Table(title=f"rollout: {params_m:.1f}M-parameter qwen2, {settings.dtype}, {settings.device}, "
                    f"{settings.threads or torch.get_num_threads()} threads, torch {torch.__version__}; "
                    "medians over rounds, each run a fresh process")
    for col in ("workload", "backend", "runs", "tokens/s", "range", "× HF", "× best vLLM", "start s", "peak RSS MB",
                "prefix hit", "note"):
        t.add_column(col, justify="left" if col in ("workload", "backend", "note") else "right")

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for s in summarize(rows):
        if "runs" not in s:
            t.add_row(s["workload"], LABELS.get(s["backend"], s["backend"]), *["-"] * 8, s["note"])
            continue
        t.add_row(s["workload"], LABELS.get(s["backend"], s["backend"]), str(s["runs"]), f"{s['tokens_per_s']:.0f}",
                  f"{s['min']:.0f}–{s['max']:.0f}", num(s["x_hf"], ".2f"), num(s["x_vllm"], ".2f"),
                  f"{s['startup_s']:.1f}", f"{s['peak_rss_mb']:.0f}", num(s["hit_rate"], ".3f"), s["note"])
    console = Console(width=180, record=True, file=io.StringIO())
    console.print(t)
    return console.export_text()


if __name__ == "__main__":  # one measurement, in a process of its own: a JSON job in, a JSON row out
    job = json.loads(sys.argv[1])
    st = job["settings"]
    settings = Settings(**{**st, "model": ModelShape(**st["model"])})
    workload = Workload(**{**job["workload"], "prompt_len": tuple(job["workload"]["prompt_len"])})
    print(ROW_MARK + json.dumps(asdict(measure(job["backend"], workload, settings))))
