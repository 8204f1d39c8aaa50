"""Candidates graded in one sandboxed run: the same verdicts as alone, and nothing of one reaches another."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from assay.core.coalesce import Coalescer
from assay.envs.builtin._pyjudge import _HARNESS_CODE, Candidate, build_stdin, judge, judge_batch, judge_joined
from assay.sandbox import Limits, ProcessSandbox, open_sandbox

LIMITS = Limits(timeout_s=1.0, cpu_s=1, memory_mb=256, max_procs=16, file_size_mb=1)
INPUTS, EXPECTED = [[1], [2], [5]], [4, 5, 8]
RIGHT = "def f(x):\n    return x + 3"


def cand(source: str) -> Candidate:
    return Candidate(source, INPUTS, EXPECTED)


# Each leaves a trace of itself (its code, in every place a later candidate could look) and still answers right.
LEAVE_TRACES = RIGHT + """
import os, subprocess, ctypes
SECRET = "sibling-secret-" + "7f3a"
open("/tmp/trace", "w").write(SECRET)
os.makedirs("/workspace/d/e", exist_ok=True)
open("/workspace/d/e/trace", "w").write(SECRET)
os.chmod("/workspace/d", 0)
libc = ctypes.CDLL(None)
shm = libc.shmget(4242, 4096, 0o1666)  # IPC_CREAT | 0666
libc.semget(4243, 1, 0o1666)
libc.msgget(4244, 0o1666)
if os.fork() == 0:  # a process left behind, holding the secret
    os.setsid()
    import time
    time.sleep(30)
    os._exit(0)
"""

# Looks everywhere a trace could be; passes only if it finds none (f returns what it found, plus 3).
LOOK_FOR_TRACES = """
import os, ctypes
found = []
for top in ("/tmp", "/workspace"):
    for root, dirs, files in os.walk(top):
        found += files + dirs
libc = ctypes.CDLL(None)
for key, get in ((4242, lambda k: libc.shmget(k, 0, 0)), (4243, lambda k: libc.semget(k, 0, 0)),
                 (4244, lambda k: libc.msgget(k, 0))):
    if get(key) >= 0:
        found.append(f"ipc {key}")
me, parent = os.getpid(), os.getppid()
for name in os.listdir("/proc"):
    if name.isdigit() and int(name) not in (1, me, parent):
        found.append(f"process {name}")
for path in (f"/proc/{parent}/mem", f"/proc/{parent}/fd/0", f"/proc/1/mem", "/proc/1/fd/0"):
    try:
        with open(path, "rb") as fh:
            fh.read(1)
        found.append(path)
    except OSError:
        pass
if libc.mq_open(b"/q", 0o100 | 2, 0o600, None) >= 0:  # O_CREAT | O_RDWR: a queue would outlive us
    found.append("mqueue")
def f(x):
    return x + 3 if not found else str(found)
"""


@pytest.fixture
def sandbox(isolated):
    with open_sandbox(LIMITS) as sbx:
        yield sbx


MIXED = {
    "right": RIGHT,
    "wrong": "def f(x):\n    return x",
    "half": "def f(x):\n    return 4 if x == 1 else 0",
    "raises": "def f(x):\n    raise ValueError(x)",
    "no_f": "def g(x):\n    return x",
    "syntax": "def f(x) return x",
    "os_exit": "import os\nos._exit(0)",
    "loop": "def f(x):\n    while True:\n        pass",
    "sleep_at_import": "import time\ntime.sleep(5)",
    "memory_bomb": "def f(x):\n    return [0] * (10 ** 10)",
    "kills_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + RIGHT,
    "stops_parent": "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n" + RIGHT,
    "floods_every_fd": "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'x' * 100000)\n"
                       "    except OSError:\n        pass\n" + RIGHT,
    "fork_bomb": "import os\nfor _ in range(40):\n    try:\n        os.fork()\n    except OSError:\n        break\n"
                 + RIGHT,
    "leaves_traces": LEAVE_TRACES,
    "right_again": RIGHT,
}


def _verdict(r):
    return r.score, r.passed, r.status


def test_a_batch_gives_each_candidate_its_verdict_alone(sandbox):
    names = list(MIXED)
    alone = {n: judge(MIXED[n], INPUTS, EXPECTED, sandbox, LIMITS.timeout_s) for n in names}
    together = judge_batch([cand(MIXED[n]) for n in names], sandbox, LIMITS.timeout_s)
    assert {n: _verdict(r) for n, r in zip(names, together, strict=True)} == \
        {n: _verdict(r) for n, r in alone.items()}
    assert alone["right"].passed and alone["right_again"].passed and alone["leaves_traces"].passed
    assert alone["half"].score == pytest.approx(1 / 3) and not alone["wrong"].passed
    assert alone["loop"].details["status"] == "timeout"


def test_a_candidate_that_kills_the_harness_gets_no_result_however_fast_its_orphan_reports(sandbox):
    # Its child outlives the killed harness and prints the right answers while the sandbox is torn down. Whether
    # that line arrived hung on the race (1.0 in 39 of 40 runs, 0.0 in one), so a line counts only from a child
    # the harness saw end.
    verdicts = {_verdict(judge(MIXED["kills_parent"], INPUTS, EXPECTED, sandbox, LIMITS.timeout_s)) for _ in range(8)}
    assert verdicts == {(0.0, False, "ok")}, verdicts


def test_nothing_of_one_candidate_reaches_the_next(sandbox):
    # The looker passes only if it finds no file, IPC object, process or parent memory the one before left.
    alone = judge(LOOK_FOR_TRACES, INPUTS, EXPECTED, sandbox, LIMITS.timeout_s)
    assert alone.passed, alone.details
    rewards = judge_batch([cand(LEAVE_TRACES), cand(LOOK_FOR_TRACES), cand(LEAVE_TRACES), cand(LOOK_FOR_TRACES)],
                          sandbox, LIMITS.timeout_s)
    assert all(r.passed for r in rewards), [r.details for r in rewards]


@pytest.mark.usefixtures("isolated")
def test_a_candidate_cannot_see_its_siblings_code():
    # Siblings' frames stay in the pipe and in pid 1, neither of which a candidate can read; it finds its own alone.
    spy = ("import os, gc\nme = open('/proc/self/cmdline', 'rb').read()\n"
           "seen = [o for o in gc.get_objects() if isinstance(o, str) and 'marker-' in o and 'spy' not in o]\n"
           "def f(x):\n    return x + 3 if not seen else str(seen)[:100]\n")
    others = [cand(f"# marker-{i}\n" + RIGHT) for i in range(3)]
    with open_sandbox(LIMITS) as sbx:
        rewards = judge_batch([others[0], cand(spy), *others[1:]], sbx, LIMITS.timeout_s)
    assert all(r.passed for r in rewards), [r.details for r in rewards]


def test_the_frames_carry_inputs_but_no_expected_output():
    stdin = build_stdin([Candidate("def f(x):\n    return x", [[1], [2]], [31337, 62674])], ["@@n@@"])
    assert "31337" not in stdin and "62674" not in stdin and "def f(x)" in stdin
    with ProcessSandbox(Limits(timeout_s=2)) as sbx:  # no isolation: graded one by one, the same verdicts
        rs = judge_batch([Candidate("def f(x):\n    return x * 31337", [[1], [2]], [31337, 62674]),
                          Candidate("def f(x):\n    return x", [[1], [2]], [31337, 62674])], sbx, 2.0)
    assert [r.passed for r in rs] == [True, False]


def test_the_harness_refuses_a_batch_outside_a_pid_namespace():
    # Its kill(-1) would reach every process of this user: it must not get there. A process of ours stays alive.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        res = subprocess.run([sys.executable, "-I", "-S", "-c", _HARNESS_CODE, "2", "1.0"], capture_output=True,
                             text=True, timeout=30,
                             input=build_stdin([cand(RIGHT), cand(RIGHT)], ["@@a@@", "@@b@@"]))
        assert res.returncode != 0 and "PID namespace" in res.stderr and "@@a@@" not in res.stdout
        time.sleep(0.2)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


@pytest.mark.usefixtures("isolated")
def test_concurrent_calls_are_graded_together():
    k = 12
    candidates = [cand(RIGHT if i % 2 == 0 else "def f(x):\n    return x") for i in range(k)]
    out: list = [None] * k

    def call(i: int) -> None:
        with open_sandbox(LIMITS) as sbx:
            out[i] = judge_joined(candidates[i], sbx, LIMITS)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.passed for r in out] == [i % 2 == 0 for i in range(k)]


def test_the_coalescer_batches_what_waits_and_passes_on_errors():
    batches: list[list[int]] = []
    gate = threading.Event()

    def run(items: list[int], context: str) -> list[int]:
        batches.append(list(items))
        if items[0] == 0:
            gate.wait(5)  # hold the first batch until the rest are waiting
        if -1 in items:
            raise ValueError("bad item")
        return [i * 10 for i in items]

    co: Coalescer[int, str, int] = Coalescer(run, max_batch=3, max_running=1)
    results: dict[int, object] = {}

    def call(i: int) -> None:
        try:
            results[i] = co.submit(i, "ctx")
        except ValueError as e:
            results[i] = e

    first = threading.Thread(target=call, args=(0,))
    first.start()
    while not batches:
        time.sleep(0.001)
    rest = [threading.Thread(target=call, args=(i,)) for i in (1, 2, 3, 4)]
    for t in rest:
        t.start()
    while len(co._waiting) < 4:
        time.sleep(0.001)
    gate.set()
    for t in [first, *rest]:
        t.join()
    assert batches[0] == [0] and sorted(sum(batches[1:], [])) == [1, 2, 3, 4]
    assert max(len(b) for b in batches) == 3  # waiting items went together, up to max_batch
    assert results == {0: 0, 1: 10, 2: 20, 3: 30, 4: 40}
    with pytest.raises(ValueError, match="bad item"):
        co.submit(-1, "ctx")
    with pytest.raises(ValueError):
        Coalescer(run, max_batch=0, max_running=1)
