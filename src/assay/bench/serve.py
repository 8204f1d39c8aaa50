"""`assay bench serve`: the serving profiles side by side on one model, each behind its own OpenAI-compatible
server on 127.0.0.1 in this process, driven by concurrent streaming chat clients.

Per profile and concurrency: time to first token and inter-token latency (p50, p99) and completion tokens/s
over the level's wall time. Each client sends its requests one after another; the profiles are alternated
within every round (the order flips each round), so load on the machine hits them alike, and the fast /
standard ratio of tokens/s is reported per round (median and spread). A streamed chunk may carry several
tokens (speculative decoding accepts drafts): the chunk's gap is spread evenly over its tokens, counted from
the chunk's logprobs. vLLM's OpenAI server is not started yet: the table says why it has no column."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.core.errors import AssayError
from assay.serve.profile import get_profile
from assay.serve.server import RunningServer, ServeOptions, build_state, start_server

# Chat prompts cycled over the clients: questions, and edits of a given text (where prompt lookup has
# something to copy), as a served assistant gets both.
PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Rewrite this sentence in the past tense: The team ships a new release every week and the users "
    "report bugs on the forum.",
    "Write a Python function that returns the largest of three numbers.",
    "Fix the typos in this text and return it: Teh quick brown fox jumsp over the lazy dog, and then it "
    "runs bakc to the forest.",
    "List three uses of a hash table.",
    "Translate to French: Good morning, how are you today?",
    "Add type hints to this function and return it: def area(width, height): return width * height",
    "Explain in two sentences what a prime number is.",
)


@dataclass
class Level:
    """One profile at one concurrency in one round."""

    profile: str
    concurrency: int
    round: int
    wall_s: float
    tokens: int
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass(frozen=True)
class Row:
    profile: str
    concurrency: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens_per_s: float  # median over rounds
    tokens_per_s_rounds: list[float]
    ratio_to_standard: list[float] | None  # tokens/s over standard's, per round; None for standard itself


async def _request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
                   ) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, tokens) of one streamed chat completion, greedy."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "logprobs": True}
    t0 = time.perf_counter()
    first, last, gaps, tokens = None, 0.0, [], 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise AssayError(f"bench serve: the server answered {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            n = sum(len((c.get("logprobs") or {}).get("content") or []) for c in chunk.get("choices", []))
            if n == 0:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - t0
                gaps += [0.0] * (n - 1)  # the rest of the first chunk came with it
            else:
                gaps += [(now - last) / n] * n
            last, tokens = now, tokens + n
    if first is None:
        raise AssayError("bench serve: a streamed response carried no token")
    return first, gaps, tokens


async def _drive(url: str, model: str, concurrency: int, per_client: int, max_tokens: int) -> tuple[float, list]:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one_client(i: int) -> list[tuple[float, list[float], int]]:
            return [await _request(client, url, model, PROMPTS[(i + j) % len(PROMPTS)], max_tokens)
                    for j in range(per_client)]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
        return time.perf_counter() - t0, [r for client_results in results for r in client_results]


def measure(url: str, model: str, profile: str, concurrency: int, per_client: int, max_tokens: int,
            round_: int) -> Level:
    wall, results = asyncio.run(_drive(url, model, concurrency, per_client, max_tokens))
    return Level(profile, concurrency, round_, wall, sum(t for _, _, t in results), [f for f, _, _ in results],
                 [g for _, gaps, _ in results for g in gaps])


def vllm_status() -> str:
    """Why the vLLM column is empty."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here (the `vllm` extra): no vLLM column"
    return "vLLM is installed, but this bench does not start vLLM's server yet: no vLLM column"


def start_profiles(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, profiles: list[str],
                   max_queue: int) -> dict[str, RunningServer]:
    servers: dict[str, RunningServer] = {}
    try:
        for name in profiles:
            state = build_state(model, tokenizer, "bench", get_profile(name), ServeOptions(max_queue=max_queue))
            servers[name] = start_server(state)
    except BaseException:
        for s in servers.values():
            s.close()
        raise
    return servers


def run_serve_bench(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, profiles: list[str],
                    concurrency: list[int], rounds: int, per_client: int, max_tokens: int) -> list[Row]:
    if rounds < 1 or per_client < 1 or max_tokens < 1 or not concurrency or min(concurrency) < 1 or not profiles:
        raise AssayError("bench serve: rounds, requests per client, max tokens and every concurrency must be at "
                         "least 1, with at least one profile")
    servers = start_profiles(model, tokenizer, profiles, max_queue=max(concurrency) + 8)
    levels: list[Level] = []
    try:
        for r in range(rounds):
            for c in concurrency:
                for name in (profiles if r % 2 == 0 else profiles[::-1]):
                    levels.append(measure(servers[name].url, "bench", name, c, per_client, max_tokens, r))
    finally:
        for s in servers.values():
            s.close()
    return summarize(levels, profiles, concurrency)


def summarize(levels: list[Level], profiles: list[str], concurrency: list[int]) -> list[Row]:
    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) * 1000 if xs else float("nan")

    rows = []
    for c in concurrency:
        base = {lv.round: lv.tokens_per_s for lv in levels if lv.profile == "standard" and lv.concurrency == c}
        for name in profiles:
            mine = [lv for lv in levels if lv.profile == name and lv.concurrency == c]
            ttft = [t for lv in mine for t in lv.ttft_s]
            itl = [t for lv in mine for t in lv.itl_s]
            tps = [lv.tokens_per_s for lv in mine]
            ratio = [lv.tokens_per_s / base[lv.round] for lv in mine] if base and name != "standard" else None
            rows.append(Row(name, c, pct(ttft, 50), pct(ttft, 99), pct(itl, 50), pct(itl, 99), statistics.median(tps),
                            tps, ratio))
    return rows


def table(rows: list[Row], note: str | None) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    t = Table(title="assay serve, streaming chat clients (tokens/s over each level's wall time; spread over rounds)")
    for col in ("clients", "profile", "TTFT p50/p99 ms", "ITL p50/p99 ms", "tok/s med [min-max]",
                "÷ standard med [min-max]"):
        t.add_column(col, no_wrap=True, min_width=len(col))
    for r in rows:
        ratio = "" if r.ratio_to_standard is None else \
            f"{statistics.median(r.ratio_to_standard):.2f} [{min(r.ratio_to_standard):.2f}-{max(r.ratio_to_standard):.2f}]"
        t.add_row(str(r.concurrency), r.profile, f"{r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f}",
                  f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f}",
                  f"{r.tokens_per_s:.1f} [{min(r.tokens_per_s_rounds):.1f}-{max(r.tokens_per_s_rounds):.1f}]", ratio)
    buf = StringIO()
    Console(file=buf, width=160).print(t)
    return buf.getvalue() + (f"vLLM: {note}\n" if note else "")


def rows_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
