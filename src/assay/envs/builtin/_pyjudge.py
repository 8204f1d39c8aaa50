"""Grade model-written Python functions against hidden tests, in a sandbox, without trusting them.

Only the test *inputs* enter the sandbox. The harness there defines the candidate, calls `f` on
each input and writes the results, strictly encoded (exact builtin types, tagged, so True is not 1
and an object with a lying __eq__ cannot be encoded at all), on one line tagged with a fresh nonce.
The expected outputs never leave this process and the comparison happens here, so printing
"PASS", exiting early (sys.exit, os._exit: no result line), or editing the tests wins nothing:
the only way to produce the right line is to compute the right answers.

A verification's cost is mostly the interpreter's start, so one sandboxed run grades a batch: a
warm harness (`python3 -I -S`, nothing imported it does not need) forks a child per candidate. The
child reads its own candidate from stdin and the parent never does, and the parent is not dumpable,
so no candidate can read another's code or results from the parent's memory or its open files (the
seccomp filter refuses ptrace and process_vm_readv). Between children the parent kills every other
process in the sandbox's PID namespace and removes what they left: the files of /tmp and
/workspace and SysV IPC objects (POSIX queues are refused by the filter). A candidate sees the
sandbox as it would alone, and whatever it does to the batch (kill the parent, flood the output,
exhaust memory) only sends the candidates it left unsettled to be graded again, the first alone: a
verdict never depends on the batch it was graded in (tested). A result line counts only from a child the
parent saw end, so a candidate that kills the parent gets no result, however fast its orphan reports."""

from __future__ import annotations

import ast
import inspect
import json
import re
import secrets
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from assay.core.coalesce import Coalescer
from assay.core.types import SANDBOX_ERROR, Reward
from assay.sandbox import Limits, NamespaceSandbox, isolation_problem, open_sandbox
from assay.sandbox.base import EXITED, TIMEOUT, Sandbox
from assay.sandbox.base import SANDBOX_ERROR as EXEC_SANDBOX_ERROR
from assay.sandbox.pool import LeasedSandbox

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^(def |import |from |class |@)", re.MULTILINE)


def extract_code(text: str) -> str:
    """The last fenced block that defines something (else the last fenced block); unfenced text is
    taken from its first line that starts code. An unclosed fence (the model ran out of tokens) counts."""
    blocks = [b for b in _FENCE.findall(text) if b.strip()]
    if blocks:
        defining = [b for b in blocks if "def " in b]
        return (defining or blocks)[-1].strip("\n")
    m = _CODE_START.search(text)
    return text[m.start():].strip("\n") if m else text.strip()


def encode(x: Any, depth: int = 0) -> Any:
    """A tagged, JSON-able form of a value made only of exact builtin types (runs in the sandbox too)."""
    if depth > 20:
        raise ValueError("value nested too deeply")
    t = type(x)
    if x is None:
        return None
    if t is bool or t is int or t is str:
        return [t.__name__, x]
    if t is float:
        return ["float", repr(x)]
    if t is list or t is tuple:
        return [t.__name__, [encode(v, depth + 1) for v in x]]
    if t is dict:
        return ["dict", sorted(([encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()), key=repr)]
    raise TypeError(f"f returned a {t.__name__}; only int, str, bool, float, None, list, tuple, dict compare")


# The sandbox side: argv is (count, timeout); stdin holds `count` frames, each ten digits of length and then an
# ASCII literal (nonce, source, inputs). The parent writes "@ran I timeout" or "@ran I EXIT" to stderr for each
# child it saw finish; only it holds stderr.
_HARNESS = '''\
from __future__ import annotations
import os, select, sys, time
import ctypes
_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: our memory and /proc/<pid>/fd stay closed to the candidates
_libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us, to be reaped before the next candidate
{encode}

def _read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            raise EOFError("stdin ended inside a frame")
        data += chunk
    return data

def _candidate():
    frame = _read(int(_read(10)))
    out = os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):  # the candidate gets no frame but its own, and prints to nowhere
        os.dup2(null, fd)
    os.close(null)
    nonce, src, inputs = eval(frame, {{"__builtins__": {{}}}})
    del frame
    write, text, enc, name_of = os.write, repr, encode, type  # bound before the candidate runs

    def report(obj):
        write(out, ("\\n" + nonce + text(obj) + "\\n").encode())

    ns = {{"__name__": "__candidate__"}}
    try:
        exec(compile(src, "solution.py", "exec"), ns)
        fn = ns.get("f")
        if not callable(fn):
            raise NameError("the solution defines no function f")
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the candidate does not end the run
        try:
            report({{"error": (name_of(e).__name__ + ": " + str(e))[:200]}})
        except BaseException:
            report({{"error": "the solution failed to load"}})
        return
    results = []
    for args in inputs:
        try:
            results.append({{"ok": enc(fn(*args))}})
        except BaseException as e:
            try:
                results.append({{"error": name_of(e).__name__}})
            except BaseException:
                results.append({{"error": "?"}})
    report({{"results": results}})

def _others(me):  # zombies too: even a zombie's name and exit code could carry a few bytes to the next
    return [name for name in os.listdir("/proc") if name.isdigit() and int(name) not in (1, me)]

def _scrub(top):
    for entry in os.scandir(top):
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, 0o700)
            _scrub(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)

def _reset():
    # Nothing of one candidate may reach the next: its processes, files or IPC objects.
    me = os.getpid()
    deadline = time.monotonic() + 2.0
    while True:
        try:
            os.kill(-1, 9)  # every process we may signal but pid 1 and ourselves
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not _others(me):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("processes survived SIGKILL")
        time.sleep(0.001)
    for top in ("/tmp", "/workspace"):
        _scrub(top)
    for kind, remove in (("shm", lambda i: _libc.shmctl(i, 0, None)), ("msg", lambda i: _libc.msgctl(i, 0, None)),
                         ("sem", lambda i: _libc.semctl(i, 0, 0))):
        with open("/proc/sysvipc/" + kind) as f:
            for line in f.read().splitlines()[1:]:
                if remove(int(line.split()[1])) != 0:
                    raise OSError(ctypes.get_errno(), "cannot remove a SysV " + kind)

def _main():
    count, timeout = int(sys.argv[1]), float(sys.argv[2])
    if count > 1 and os.getppid() != 1:
        raise SystemExit("a batch runs only as the child of a PID namespace's init")
    started = time.monotonic()
    for i in range(count):
        if i and time.monotonic() - started > timeout:
            return  # the rest go to another run: one slow candidate does not hold a whole batch
        pid = os.fork()
        if pid == 0:
            try:
                _candidate()
            finally:
                os._exit(0)
        exited = os.pidfd_open(pid)
        done = select.select([exited], [], [], timeout)[0]
        os.close(exited)
        if not done:
            os.kill(pid, 9)
        status = os.waitpid(pid, 0)[1]
        os.write(2, ("@ran %d %s\\n" % (i, os.waitstatus_to_exitcode(status) if done else "timeout")).encode())
        if i + 1 < count:
            _reset()

_main()
'''

_ENCODE_SOURCE = inspect.getsource(encode)
_HARNESS_CODE = _HARNESS.format(encode=_ENCODE_SOURCE)
_RAN = re.compile(r"^@ran (\d+) (timeout|-?\d+)$", re.MULTILINE)


@dataclass(frozen=True)
class Candidate:
    source: str  # the model's code
    inputs: Sequence[Sequence[Any]]  # the hidden tests' arguments: these enter the sandbox
    expected: Sequence[Any]  # their outputs: these never do


def build_stdin(candidates: Sequence[Candidate], nonces: Sequence[str]) -> str:
    """The harness's frames. Inputs go through JSON first, as a stored task's do (tuples become lists; no inf
    or nan, which a literal cannot spell), then as an ASCII literal, so a frame's length in characters is its
    length in bytes."""
    frames = []
    for c, nonce in zip(candidates, nonces, strict=True):
        body = ascii((nonce, c.source, json.loads(json.dumps(list(c.inputs), allow_nan=False))))
        frames.append(f"{len(body):010d}{body}")
    return "".join(frames)


def _result_line(stdout: str, nonce: str, decode: Callable[[str], Any] = json.loads) -> dict[str, Any] | None:
    lines = [ln[len(nonce):] for ln in stdout.splitlines() if ln.startswith(nonce)]
    if len(lines) != 1:  # none: the run ended before the harness reported; several: a forgery
        return None
    try:
        obj = decode(lines[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # the candidate can forge the
        return None  # line: distrust its shape too
    return obj if isinstance(obj, dict) else None


def _score(c: Candidate, report: dict[str, Any]) -> Reward:
    n = len(c.expected)
    if not isinstance(report.get("results"), list) or len(report["results"]) != n:
        return Reward(0.0, False, details={"reason": str(report.get("error") or "malformed result"), "tests": n})
    passed = 0
    failures: list[str] = []
    for i, (got, want) in enumerate(zip(report["results"], c.expected, strict=True)):
        if isinstance(got, dict) and "ok" in got and got["ok"] == encode(want):
            passed += 1
        else:
            failures.append(f"test {i}: " + (str(got.get("error")) if isinstance(got, dict) and "error" in got
                                             else "wrong output"))
    return Reward(passed / n, passed == n, details={"passed": passed, "tests": n, "failures": failures[:3]})


def _run(candidates: Sequence[Candidate], sandbox: Sandbox, timeout: float) -> list[Reward | None]:
    """One sandboxed run of the harness over `candidates`; None for each one it left unsettled (only in a batch
    of two or more: a candidate alone always gets its verdict)."""
    nonces = [f"@@assay-{secrets.token_hex(8)}@@" for _ in candidates]
    alone = len(candidates) == 1
    try:
        res = sandbox.exec(["python3", "-I", "-S", "-c", _HARNESS_CODE, str(len(candidates)), repr(float(timeout))],
                           stdin=build_stdin(candidates, nonces), timeout=2 * timeout + 5.0)
    except OSError as e:  # the sandbox itself broke: an infrastructure failure, never a wrong answer
        return [Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": f"sandbox: {e}"}) for _ in candidates]
    if res.status == EXEC_SANDBOX_ERROR:
        return [Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": res.stderr[-500:]}) for _ in candidates]
    ran = {int(i): how for i, how in _RAN.findall(res.stderr)}
    out: list[Reward | None] = []
    for i, (c, nonce) in enumerate(zip(candidates, nonces, strict=True)):
        # A line counts only from a child the parent saw end: one that outlived its killed parent raced the
        # sandbox's teardown, and its verdict would hang on that race.
        report = _result_line(res.stdout, nonce, ast.literal_eval) if i in ran else None
        if report is not None:
            out.append(_score(c, report))
        elif alone or (res.status == EXITED and i in ran):  # it ran, in a run nobody broke, and said nothing
            # past its time: the parent's clock, or the kernel's RLIMIT_CPU (SIGXCPU), as the sandbox itself reports
            status = TIMEOUT if ran.get(i) in ("timeout", str(-signal.SIGXCPU)) else res.status
            code = int(ran[i]) if i in ran and ran[i] != "timeout" else res.exit_code
            out.append(Reward(0.0, False, details={"reason": f"no result ({status}, exit {code})", "status": status,
                                                   "tests": len(c.expected), "stderr": res.stderr[-300:]}))
        else:
            out.append(None)
    return out


def isolates(sandbox: Sandbox | None) -> bool:
    """Whether candidates may share one run in this sandbox: it must be a PID namespace of its own, where the
    harness's kill(-1) reaches nothing but the sandbox (never the unsafe process sandbox: there it would be
    every process of this user). None: the one `judge_batch` opens, where this host can isolate."""
    return isinstance(sandbox, (NamespaceSandbox, LeasedSandbox)) or (sandbox is None and isolation_problem() is None)


def judge_batch(candidates: Sequence[Candidate], sandbox: Sandbox | None, timeout: float,
                limits: Limits | None = None) -> list[Reward]:
    """Score each candidate = fraction of its hidden tests whose output equals the expected one exactly; passed =
    all. In one run where the sandbox isolates; what a run leaves unsettled is graded again, the first of it
    alone, so each round settles at least one. `sandbox` None: one is opened with `limits` and closed after."""
    if sandbox is None:
        with open_sandbox(limits) as own:
            return judge_batch(candidates, own, timeout)
    rewards: list[Reward | None] = [
        None if c.source.strip() else Reward(0.0, False, details={"reason": "no code in the answer",
                                                                  "tests": len(c.expected)})
        for c in candidates]
    todo = [i for i, r in enumerate(rewards) if r is None]
    together = isolates(sandbox)
    while todo:
        batch = todo if together else todo[:1]
        unsettled = []
        for i, r in zip(batch, _run([candidates[i] for i in batch], sandbox, timeout), strict=True):
            if r is None:
                unsettled.append(i)
            rewards[i] = r
        if unsettled:
            rewards[unsettled[0]] = _run([candidates[unsettled[0]]], sandbox, timeout)[0]
        todo = unsettled[1:] + todo[len(batch):]
    return rewards  # type: ignore[return-value]


def judge(source: str, inputs: Sequence[Sequence[Any]], expected: Sequence[Any], sandbox: Sandbox,
          timeout: float) -> Reward:
    """One candidate, one sandboxed run."""
    return judge_batch([Candidate(source, inputs, expected)], sandbox, timeout)[0]


MAX_BATCH = 16  # candidates in one run: more only lengthens the wait of the first
MAX_RUNNING = 2  # runs at once per set of limits (about the cores a small machine has for verifying)
_joined: dict[tuple, Coalescer] = {}
_joined_lock = threading.Lock()


def judge_joined(candidate: Candidate, sandbox: Sandbox | None, limits: Limits) -> Reward:
    """`judge`, with candidates that arrive from other threads while runs are busy graded together in the next
    run (in the sandbox of whichever of them leads it). Alone it costs what `judge` costs; under load a batch
    pays one interpreter start. A sandbox that cannot isolate grades its candidate alone, at once."""
    if not isolates(sandbox):
        return judge_batch([candidate], sandbox, limits.timeout_s, limits)[0]
    key = tuple(vars(limits).values())
    with _joined_lock:
        if key not in _joined:
            _joined[key] = Coalescer(lambda items, sbx: judge_batch(items, sbx, limits.timeout_s, limits),
                                     MAX_BATCH, MAX_RUNNING)
    return _joined[key].submit(candidate, sandbox)
