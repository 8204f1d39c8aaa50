"""Grade a model-written Python function against hidden tests, in a sandbox, without trusting it.

Only the test *inputs* enter the sandbox. The harness there defines the candidate, calls `f` on
each input and writes the results, strictly encoded (exact builtin types, tagged, so True is not 1
and an object with a lying __eq__ cannot be encoded at all), on one line tagged with a fresh nonce.
The expected outputs never leave this process and the comparison happens here, so printing
"PASS", exiting early (sys.exit, os._exit: no result line), or editing the tests wins nothing:
the only way to produce the right line is to compute the right answers.

A verification is one short Python process, so its start-up is most of its cost: the harness runs
as `python3 -I -S` (no site, no environment) and imports nothing it does not need; the inputs go in
as a Python literal and the results come out as one, read back by `ast.literal_eval` (no json
import in the sandbox: 11 ms of start-up instead of 24 on the development machine)."""

from __future__ import annotations

import ast
import inspect
import json
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from assay.core.types import SANDBOX_ERROR, Reward
from assay.sandbox.base import SANDBOX_ERROR as EXEC_SANDBOX_ERROR
from assay.sandbox.base import Sandbox

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


_HARNESS = '''\
from __future__ import annotations
import os as _os
_NONCE = {nonce!r}
_SRC = {source!r}
_INPUTS = {inputs}
{encode}

def _main():
    write, text, enc, name_of = _os.write, repr, encode, type  # bound before the candidate runs

    def report(obj):
        write(1, ("\\n" + _NONCE + text(obj) + "\\n").encode())

    ns = {{"__name__": "__candidate__"}}
    try:
        exec(compile(_SRC, "solution.py", "exec"), ns)
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
    for args in _INPUTS:
        try:
            results.append({{"ok": enc(fn(*args))}})
        except BaseException as e:
            try:
                results.append({{"error": name_of(e).__name__}})
            except BaseException:
                results.append({{"error": "?"}})
    report({{"results": results}})

_main()
'''


_ENCODE_SOURCE = inspect.getsource(encode)


def build_harness(source: str, inputs: Sequence[Sequence[Any]], nonce: str) -> str:
    # Through JSON first, as a stored task's inputs are (tuples become lists; no inf or nan, which a
    # literal cannot spell), then as a literal.
    plain = json.loads(json.dumps(list(inputs), allow_nan=False))
    return _HARNESS.format(nonce=nonce, source=source, inputs=repr(plain),
                           encode=_ENCODE_SOURCE)


def _result_line(stdout: str, nonce: str, decode: Callable[[str], Any] = json.loads) -> dict[str, Any] | None:
    lines = [ln[len(nonce):] for ln in stdout.splitlines() if ln.startswith(nonce)]
    if len(lines) != 1:  # none: the run ended before the harness reported; several: a forgery
        return None
    try:
        obj = decode(lines[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # the candidate can forge the
        return None  # line: distrust its shape too
    return obj if isinstance(obj, dict) else None


def judge(source: str, inputs: Sequence[Sequence[Any]], expected: Sequence[Any], sandbox: Sandbox,
          timeout: float) -> Reward:
    """Score = fraction of hidden tests whose output equals the expected one exactly; passed = all."""
    n = len(expected)
    if not source.strip():
        return Reward(0.0, False, details={"reason": "no code in the answer", "tests": n})
    nonce = f"@@assay-{secrets.token_hex(8)}@@"
    try:
        res = sandbox.exec(["python3", "-I", "-S", "-"], stdin=build_harness(source, inputs, nonce), timeout=timeout)
    except OSError as e:  # the sandbox itself broke: an infrastructure failure, never a wrong answer
        return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": f"sandbox: {e}"})
    if res.status == EXEC_SANDBOX_ERROR:
        return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": res.stderr[-500:]})
    report = _result_line(res.stdout, nonce, ast.literal_eval)
    if report is None or not isinstance(report.get("results"), list) or len(report["results"]) != n:
        reason = (report.get("error") or "malformed result") if report else \
            f"no result ({res.status}, exit {res.exit_code})"
        return Reward(0.0, False, details={"reason": str(reason), "status": res.status, "tests": n,
                                           "stderr": res.stderr[-300:]})
    passed = 0
    failures: list[str] = []
    for i, (got, want) in enumerate(zip(report["results"], expected, strict=True)):
        if isinstance(got, dict) and "ok" in got and got["ok"] == encode(want):
            passed += 1
        else:
            failures.append(f"test {i}: " + (str(got.get("error")) if isinstance(got, dict) and "error" in got
                                             else "wrong output"))
    return Reward(passed / n, passed == n, details={"passed": passed, "tests": n, "failures": failures[:3]})
