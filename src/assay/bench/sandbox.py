"""`assay bench sandbox`: latency (p50/p99) and throughput of the namespace sandbox, each beside an
unsandboxed baseline measured in the same run (a plain subprocess; for snapshot and restore, the copying
ProcessSandbox), with the ratio between them."""

from __future__ import annotations

import io
import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from assay.sandbox import Limits, NamespaceSandbox, ProcessSandbox
from assay.sandbox.namespace import BASE_ENV

PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else shutil.which("python3") or "python3"


@dataclass
class Timing:
    p50_ms: float
    p99_ms: float
    n: int


def measure(fn: Callable[[], object], seconds: float, max_n: int = 2000, before: Callable[[], object] | None = None,
            ) -> Timing:
    """Call fn repeatedly for about `seconds` (at least 5 times); `before` runs untimed before each call."""
    samples: list[float] = []
    end = time.monotonic() + seconds
    while len(samples) < 5 or (time.monotonic() < end and len(samples) < max_n):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    samples.sort()
    return Timing(statistics.median(samples) * 1000, samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1000,
                  len(samples))


def throughput(make_worker: Callable[[], Callable[[], object]], threads: int, seconds: float) -> float:
    """Calls per second with `threads` threads, each looping its own worker until the time is up."""
    workers = [make_worker() for _ in range(threads)]
    counts = [0] * threads
    start = time.monotonic()
    end = start + seconds

    def loop(i: int) -> None:
        while time.monotonic() < end:
            workers[i]()
            counts[i] += 1

    pool = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(counts) / (time.monotonic() - start)


def _plain(argv: list[str]) -> Callable[[], object]:
    return lambda: subprocess.run(argv, env=BASE_ENV, stdin=subprocess.DEVNULL, capture_output=True, check=True)


def _checked(sbx: NamespaceSandbox, argv: list[str]) -> Callable[[], object]:
    def call() -> None:
        r = sbx.exec(argv)
        if not r.ok:
            raise RuntimeError(f"sandboxed {argv} failed: {r.status} {r.stderr.strip()}")
    return call


def _create_exec_destroy() -> None:
    with NamespaceSandbox(Limits()) as sbx:
        _checked(sbx, ["true"])()


def run_sandbox_bench(seconds: float = 1.0, concurrency: Sequence[int] = (1, 8, 32)) -> str:
    """Measure and return the table as text. `seconds` is spent on each side of each row."""
    limits = Limits()
    rows: list[tuple[str, Timing | float, Timing | float]] = []
    with NamespaceSandbox(limits) as warm, ProcessSandbox(limits) as copying:
        _checked(warm, ["true"])()  # start the launcher before timing anything
        rows.append(("create + exec true + destroy", measure(_create_exec_destroy, seconds),
                     measure(_plain(["true"]), seconds)))
        rows.append(("exec true", measure(_checked(warm, ["true"]), seconds), measure(_plain(["true"]), seconds)))
        rows.append(("exec python -c pass", measure(_checked(warm, ["python3", "-c", "pass"]), seconds),
                     measure(_plain([PYTHON, "-c", "pass"]), seconds)))
        for i in range(50):  # a small project's worth of files, for the copying baseline
            copying.write_file(f"src/f{i}.py", "x = 1\n" * 20)
            warm.write_file(f"src/f{i}.py", "x = 1\n" * 20)
        base, copy_base = warm.snapshot(), copying.snapshot()

        def dirty() -> None:
            warm.restore(base)
            warm.write_file("changed.txt", "x")

        rows.append(("snapshot", measure(warm.snapshot, seconds, max_n=200, before=dirty),
                     measure(copying.snapshot, seconds, max_n=200)))
        rows.append(("restore", measure(lambda: warm.restore(base), seconds),
                     measure(lambda: copying.restore(copy_base), seconds, max_n=200)))
    for c in concurrency:
        rows.append((f"throughput, {c} concurrent (exec true / s)", _sandboxed_throughput(limits, c, seconds),
                     throughput(lambda: _plain(["true"]), c, seconds)))
    return _render(rows)


def _sandboxed_throughput(limits: Limits, threads: int, seconds: float) -> float:
    boxes: list[NamespaceSandbox] = []

    def make() -> Callable[[], object]:
        boxes.append(NamespaceSandbox(limits))
        return _checked(boxes[-1], ["true"])

    try:
        return throughput(make, threads, seconds)
    finally:
        for b in boxes:
            b.close()


def _render(rows: list[tuple[str, Timing | float, Timing | float]]) -> str:
    table = Table(title="assay bench sandbox (latency in ms; ratio = sandbox / baseline)")
    for col in ("", "sandbox p50", "sandbox p99", "baseline p50", "baseline p99", "ratio"):
        table.add_column(col, justify="left" if not col else "right")
    for name, sbx, base in rows:
        if isinstance(sbx, Timing) and isinstance(base, Timing):
            table.add_row(name, f"{sbx.p50_ms:.2f}", f"{sbx.p99_ms:.2f}", f"{base.p50_ms:.2f}", f"{base.p99_ms:.2f}",
                          f"{sbx.p50_ms / base.p50_ms:.2f}x")
        else:
            table.add_row(name, f"{sbx:.0f}", "", f"{base:.0f}", "", f"{float(sbx) / float(base):.2f}x")
    out = io.StringIO()
    Console(file=out, width=120).print(table)
    return out.getvalue()
