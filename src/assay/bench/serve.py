"""`assay bench serve`: the serving profiles side by side on one model, each behind its own OpenAI-compatible
server on 127.0.0.1, driven by concurrent streaming chat clients. The command runs each profile as `assay serve`
in a process of its own, as it is deployed and as vLLM's column runs; `in_process_starters` serves them from
this process instead.

Per profile and concurrency: time to first token and inter-token latency (p50, p99) and completion tokens/s
over the level's wall time. Every server first answers one request that is not recorded (its warm-up: vLLM's
first round ran at a quarter of its later ones). Each client sends its requests one after another, and every level
sends each prompt at least once (`level_requests`); the profiles are alternated
within every round (the order flips each round), so load on the machine hits them alike, and the fast /
standard ratio of tokens/s is reported per round (median and spread). A streamed chunk may carry several
tokens (speculative decoding accepts drafts): the chunk's gap is spread evenly over its tokens, counted from
the chunk's logprobs. With a Python that has vLLM (`--vllm-python`, or this one where it imports vllm), vLLM's own
OpenAI server runs the same float32 weights in a process of its own, on the same threads, as one more column
in the same alternation; the table then also gives each profile's tokens/s over vLLM's."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.bench.rollout import vllm_cpu_env
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
    ratio_to_vllm: list[float] | None = None  # tokens/s over vLLM's, per round, where vLLM ran


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


def level_requests(concurrency: int, per_client: int) -> int:
    """A level's requests: `per_client` from each client, or more where that would leave one of the prompts
    unsent, so every level answers the whole mix (one client sending two requests timed two short answers,
    mostly their prefill)."""
    return max(concurrency * per_client, len(PROMPTS))


async def _drive(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> tuple[float, list]:
    """`requests` over `concurrency` clients in turn, each client sending its share one after another."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def one_client(i: int) -> list[tuple[float, list[float], int]]:
            return [await _request(client, url, model, PROMPTS[k % len(PROMPTS)], max_tokens)
                    for k in range(i, requests, concurrency)]

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_client(i) for i in range(concurrency)))
        return time.perf_counter() - t0, [r for client_results in results for r in client_results]


def measure(url: str, model: str, profile: str, concurrency: int, requests: int, max_tokens: int,
            round_: int) -> Level:
    wall, results = asyncio.run(_drive(url, model, concurrency, requests, max_tokens))
    return Level(profile, concurrency, round_, wall, sum(t for _, _, t in results), [f for f, _, _ in results],
                 [g for _, gaps, _ in results for g in gaps])


class Server(Protocol):
    url: str

    def close(self) -> None: ...


@dataclass
class ProcessServer:
    """An OpenAI-compatible server in a process (group) of its own, listening on the loopback."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_process_server(cmd: list[str], url: str, log: Path, env: dict[str, str] | None = None,
                         startup_s: float = 900.0, cwd: Path | None = None) -> ProcessServer:
    """Start `cmd` (a server that will listen at `url`) and return once its /health answers 200; its output goes to
    `log`. A server that exits or stays silent for `startup_s` is an error quoting the log's last error line."""
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
    server = ProcessServer(url, process, log)
    deadline = time.monotonic() + startup_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.close()
            lines = log.read_text(errors="replace").strip().splitlines()
            last = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "(empty)")
            why = f"exited with {process.returncode}" if process.returncode is not None else f"did not answer in {startup_s:.0f} s"
            raise AssayError(f"bench serve: the server `{' '.join(cmd[:3])} …` {why}; its log's last error: "
                             f"{last.strip()}")
        time.sleep(0.5)


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_vllm_python(given: str | None) -> str | None:
    """The Python that runs vLLM's server: `given`, else this one where it imports vllm, else None."""
    if given is not None:
        if not Path(given).is_file():
            raise AssayError(f"--vllm-python {given}: no such interpreter; give the python of the environment where "
                             "vLLM and Assay are installed (pip install -e '.[vllm]')")
        return given
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_starter(python: str, model_dir: Path, threads: int, log: Path) -> Callable[[], ProcessServer]:
    """vLLM's OpenAI server on `model_dir` in float32, its OpenMP threads bound to the first `threads` cores
    (vLLM's own advice for the CPU), with the engine's malloc settings (`bench.rollout.vllm_cpu_env`)."""
    def start() -> ProcessServer:
        port = free_loopback_port()
        env = vllm_cpu_env(threads)
        # GiB of KV cache: plenty for the bench's sequences (vLLM would otherwise take most of the memory)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
               "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
        return start_process_server(cmd, f"http://127.0.0.1:{port}", log, env)
    return start


def assay_starter(profile: str, model_dir: Path, threads: int, max_queue: int, log: Path
                  ) -> Callable[[], ProcessServer]:
    """`assay serve` of `model_dir` under `profile` in a process of its own, on `threads` torch threads."""
    get_profile(profile)  # an unknown profile fails here, before any server starts

    def start() -> ProcessServer:
        port = free_loopback_port()
        cmd = [sys.executable, "-m", "assay.cli", "serve", str(model_dir), "--profile", profile, "--port", str(port),
               "--threads", str(threads), "--max-queue", str(max_queue), "--served-model-name", "bench"]
        return start_process_server(cmd, f"http://127.0.0.1:{port}", log)
    return start


def in_process_starters(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, profiles: list[str],
                        max_queue: int) -> dict[str, Callable[[], RunningServer]]:
    """Each profile on a server of its own in this process (profiles registered from Python, quick tests)."""
    def starter(profile: str) -> Callable[[], RunningServer]:
        spec = get_profile(profile)
        return lambda: start_server(build_state(model, tokenizer, "bench", spec, ServeOptions(max_queue=max_queue)))
    return {name: starter(name) for name in profiles}


def run_serve_bench(columns: dict[str, Callable[[], Server]], concurrency: list[int], rounds: int, per_client: int,
                    max_tokens: int) -> list[Row]:
    """Each column (its name: what starts its server, serving the model as "bench"), warmed up by one request,
    then alternated within every round; ratios are taken against the columns named "standard" and "vllm"."""
    if rounds < 1 or per_client < 1 or max_tokens < 1 or not concurrency or min(concurrency) < 1 or not columns:
        raise AssayError("bench serve: rounds, requests per client, max tokens and every concurrency must be at "
                         "least 1, with at least one profile")
    servers: dict[str, Server] = {}
    names = list(columns)
    levels: list[Level] = []
    try:
        for name, start in columns.items():
            servers[name] = start()
        for name in names:  # one request each, not recorded: a server's first requests pay its warm-up
            measure(servers[name].url, "bench", name, 1, 1, max_tokens, -1)
        for r in range(rounds):
            for c in concurrency:
                for name in (names if r % 2 == 0 else names[::-1]):
                    levels.append(measure(servers[name].url, "bench", name, c, level_requests(c, per_client),
                                          max_tokens, r))
    finally:
        for s in servers.values():
            s.close()
    return summarize(levels, names, concurrency)


def summarize(levels: list[Level], profiles: list[str], concurrency: list[int]) -> list[Row]:
    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) * 1000 if xs else float("nan")

    def ratios(mine: list[Level], name: str, to: str) -> list[float] | None:
        base = {lv.round: lv.tokens_per_s for lv in levels if lv.profile == to and lv.concurrency == mine[0].concurrency}
        return [lv.tokens_per_s / base[lv.round] for lv in mine] if base and name != to else None

    rows = []
    for c in concurrency:
        for name in profiles:
            mine = [lv for lv in levels if lv.profile == name and lv.concurrency == c]
            ttft = [t for lv in mine for t in lv.ttft_s]
            itl = [t for lv in mine for t in lv.itl_s]
            tps = [lv.tokens_per_s for lv in mine]
            rows.append(Row(name, c, pct(ttft, 50), pct(ttft, 99), pct(itl, 50), pct(itl, 99), statistics.median(tps),
                            tps, ratios(mine, name, "standard"), ratios(mine, name, "vllm")))
    return rows


def table(rows: list[Row], note: str | None) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    def spread(xs: list[float] | None) -> str:
        return "" if xs is None else f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"

    t = Table(title="assay serve, streaming chat clients (tokens/s over each level's wall time; spread over rounds)")
    with_vllm = any(r.profile == "vllm" for r in rows)
    for col in ("clients", "profile", "TTFT p50/p99 ms", "ITL p50/p99 ms", "tok/s med [min-max]",
                "÷ standard med [min-max]", *(["÷ vLLM med [min-max]"] if with_vllm else [])):
        t.add_column(col, no_wrap=True, min_width=len(col))
    for r in rows:
        t.add_row(str(r.concurrency), r.profile, f"{r.ttft_p50_ms:.0f} / {r.ttft_p99_ms:.0f}",
                  f"{r.itl_p50_ms:.1f} / {r.itl_p99_ms:.1f}",
                  f"{r.tokens_per_s:.1f} [{min(r.tokens_per_s_rounds):.1f}-{max(r.tokens_per_s_rounds):.1f}]",
                  spread(r.ratio_to_standard), *([spread(r.ratio_to_vllm)] if with_vllm else []))
    buf = StringIO()
    Console(file=buf, width=180).print(t)
    return buf.getvalue() + (f"{note}\n" if note else "")


def rows_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)
