"""`assay bench verify`: codegen verification with a sandboxed run per candidate beside candidates graded
together (`judge_joined`, what codegen episodes do), on the same candidates and threads, rounds alternated;
the verdicts of the two must agree one for one."""

from __future__ import annotations

import io
import random
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.table import Table

from assay.envs import get_env
from assay.envs.builtin._pyjudge import Candidate, extract_code, judge, judge_joined
from assay.sandbox import Limits
from assay.sandbox.pool import LeasedSandbox, shared_pool


def candidates(n: int, seed: int = 0) -> list[Candidate]:
    """Reference solutions of every level, every other one made wrong (its value plus one, a TypeError where
    that is no number), so half pass."""
    env = get_env("codegen")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        task = env.generate(rng, 1 + i % 4)
        code = task.payload["code"] if i % 2 == 0 else task.payload["code"].replace("return ", "return 1 + (", 1) + ")"
        tests = task.payload["tests"]
        out.append(Candidate(extract_code(code), [t[0] for t in tests], [t[1] for t in tests]))
    return out


def _timed(grade: Callable[[Candidate], bool], items: list[Candidate], threads: int) -> tuple[float, list[bool]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        verdicts = list(pool.map(grade, items))
    return time.perf_counter() - t0, verdicts


def run_verify_bench(n: int = 256, threads: int = 16, rounds: int = 3) -> str:
    limits: Limits = get_env("codegen").sandbox_limits
    pool = shared_pool(limits)
    items = candidates(n)

    def leased(grade: Callable[[Candidate, LeasedSandbox], bool]) -> Callable[[Candidate], bool]:
        def call(c: Candidate) -> bool:
            sandbox = LeasedSandbox(pool)
            try:
                return grade(c, sandbox)
            finally:
                sandbox.close()
        return call

    modes = {
        "a sandboxed run per candidate": leased(lambda c, s: judge(c.source, c.inputs, c.expected, s,
                                                                   limits.timeout_s).passed),
        "graded together (judge_joined)": leased(lambda c, s: judge_joined(c, s, limits).passed),
    }
    for grade in modes.values():  # warm the pool and the launcher's spares
        _timed(grade, items[:threads], threads)
    walls: dict[str, list[float]] = {m: [] for m in modes}
    verdicts: dict[str, list[bool]] = {}
    for _ in range(rounds):
        for mode, grade in modes.items():
            wall, verdicts[mode] = _timed(grade, items, threads)
            walls[mode].append(wall)
    first, second = modes
    if verdicts[first] != verdicts[second]:
        raise AssertionError("batched verdicts differ from those of a run per candidate")
    table = Table("mode", "ms per candidate (median; all rounds)", "speed-up", "passed",
                  title=f"codegen verification: {n} candidates, {threads} threads, {rounds} rounds alternated")
    base = statistics.median(walls[first])
    for mode in modes:
        per = [w / n * 1000 for w in walls[mode]]
        table.add_row(mode, f"{statistics.median(per):.2f} ({', '.join(f'{p:.2f}' for p in per)})",
                      f"{base / statistics.median(walls[mode]):.2f}x", f"{sum(verdicts[mode])}/{n}")
    out = io.StringIO()
    Console(file=out, width=140).print(table)
    return out.getvalue()
