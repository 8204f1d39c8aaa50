"""repo: repository-level tasks for long-horizon coding agents, in a sandboxed workspace.

Each task is a small generated Python package (3-15 files, by seed and difficulty; see `_repo_gen`)
with unittest tests under tests/. Five levels:

1. one module (or a leaf and the module importing it) with a wrong operator or an off-by-one; a
   visible test of that module fails.
2. the symptom in the top module's tests, the cause in a module below it: swapped arguments across
   a call, a wrong import, or an operator or off-by-one in a leaf.
3. a feature: a function that only raises NotImplementedError, to write against the docstring the
   prompt quotes; visible tests check a few plain cases, hidden tests the whole specification.
4. 9-12 files: the task's stack plus whole distractor stacks and a stale copy of a broken module,
   and two faults in different modules, one of them a missing case.
5. a refactor in a package of whole stacks: rename a function that another module imports, at its
   definition, imports, calls and mentions, keeping behaviour; hidden tests check every module's
   behaviour and that no module keeps the old name (no alias left behind).

Tools: `bash`, `read(path, start?, end?)`, `write(path, content)`, `patch(path, search, replace)`
(one exact occurrence), `apply_diff(diff)` (a unified diff over any files, matched by content, all or
nothing; see `_unidiff`), `run_tests()` (the visible tests, in the episode's sandbox) and `submit()`;
and, unless the environment is made with `checkpoints=0`, `checkpoint()` and `rollback(id)`: the
workspace saved and restored through the sandbox's own snapshots (O(1), whole-workspace, exact), at
most `checkpoints` kept; a rollback drops the checkpoints taken after the one it returns to.
Paths are relative to /workspace; absolute paths, `..` and symbolic links out of it are refused.

Staged verification (`milestones`, see `assay.envs.milestones`): `reproduced` (run_tests reported
failures while the visible tests were as given), `visible_pass` (the verifier found every visible test
passing in the final workspace: progress) and `submitted`. The reference reaches all three: it runs the
tests before its patch (that observation comes from running them, once per task, like terminal's).

Verification never trusts the policy's sandbox: it snapshots the final workspace into a fresh
sandbox and runs a harness there (`python3 -I`, the script on stdin, never a file) that imports the
package and evaluates every visible and hidden test expression; only encoded results come out,
tagged with a fresh nonce, and the comparison with the expected values happens here, so neither the
hidden tests' expected values nor any test file the policy could edit ever decides. A task passes
when every visible and every hidden test does; a sandbox failure is a Reward status, never a 0."""

from __future__ import annotations

import inspect
import json
import math
import random
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from assay.core.errors import AssayError
from assay.core.types import OK, SANDBOX_ERROR, Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.envs.builtin._common import check_difficulty, draw_seed, task_id, task_rng
from assay.envs.builtin._pyjudge import _result_line, encode
from assay.envs.builtin._repo_gen import build
from assay.envs.builtin._terminal_tasks import format_result
from assay.envs.builtin._unidiff import DEV_NULL, DiffError, apply_hunks, parse_diff
from assay.envs.builtin.terminal import populate
from assay.envs.milestones import Milestone, first_call
from assay.envs.registry import env_hash, register
from assay.envs.tools import object_schema, validate_call
from assay.sandbox import Limits, open_sandbox
from assay.sandbox.base import SANDBOX_ERROR as EXEC_SANDBOX_ERROR
from assay.sandbox.base import TIMEOUT, ExecResult, Sandbox

_PATH = {"type": "string", "description": "a path relative to /workspace, e.g. acme/cart.py"}
BASH = ToolSpec("bash", "Run a bash command in /workspace and get its output and exit code.",
                object_schema({"command": {"type": "string", "description": "the command, e.g. ls -R"}}))
READ = ToolSpec("read", "Read a text file with line numbers; start and end (1-based, inclusive) pick a range of lines.",
                {"type": "object", "properties": {"path": _PATH, "start": {"type": "integer", "minimum": 1},
                                                  "end": {"type": "integer", "minimum": 1}},
                 "required": ["path"], "additionalProperties": False})
WRITE = ToolSpec("write", "Write a file (created with its directories, or replaced) with the given content.",
                 object_schema({"path": _PATH, "content": {"type": "string"}}))
PATCH = ToolSpec("patch", "Replace the one occurrence of search in a file with replace. search must match the file "
                          "exactly, indentation included, and occur once.",
                 object_schema({"path": _PATH, "search": {"type": "string", "minLength": 1},
                                "replace": {"type": "string"}}))
APPLY_DIFF = ToolSpec("apply_diff", "Apply a unified diff (as diff -u or git diff write it, paths relative to /workspace, "
                                    "a/ and b/ prefixes allowed) to one or more files: changed, new (--- /dev/null) or "
                                    "deleted (+++ /dev/null). Each hunk is matched by its ' ' and '-' lines; if any hunk "
                                    "does not apply, no file changes.",
                      object_schema({"diff": {"type": "string", "minLength": 1}}))
RUN_TESTS = ToolSpec("run_tests", "Run the visible tests (tests/test_*.py) and get a summary with each failure.",
                     object_schema({}))
SUBMIT = ToolSpec("submit", "Submit the workspace as it is; the episode ends.", object_schema({}))
CHECKPOINT = ToolSpec("checkpoint", "Save the whole workspace as it is now; returns an id that rollback returns to.",
                      object_schema({}))
ROLLBACK = ToolSpec("rollback", "Return the whole workspace to a checkpoint (files written since are gone, files "
                                "changed since are back); checkpoints taken after it are dropped.",
                    object_schema({"id": {"type": "string", "description": "a checkpoint's id, e.g. cp1"}}))
TOOLS = (BASH, READ, WRITE, PATCH, APPLY_DIFF, RUN_TESTS, SUBMIT)
CHECKPOINT_TOOLS = (CHECKPOINT, ROLLBACK)
MAX_CHECKPOINTS = 4  # the default bound: each checkpoint holds a frozen layer of the workspace until the episode ends
SYSTEM = ("You are working on a Python repository in /workspace, in a Linux shell with bash, coreutils, grep, sed and "
          "python3, and no network. Tools: bash, read, write, patch (search and replace), apply_diff (a unified "
          "diff), run_tests (the visible tests) and submit (ends the episode). Paths are relative to /workspace.")
SYSTEM_CHECKPOINTS = ("You are working on a Python repository in /workspace, in a Linux shell with bash, coreutils, grep, "
                      "sed and python3, and no network. Tools: bash, read, write, patch (search and replace), apply_diff "
                      "(a unified diff), run_tests (the visible tests), checkpoint (saves the workspace), rollback (returns it to a checkpoint) and "
                      "submit (ends the episode). Paths are relative to /workspace.")
SUBMITTED = "submitted: the workspace is verified now"
MAX_READ_LINES = 200  # lines one read returns; more are read with start
MAX_FILE_BYTES = 128 * 1024  # larger files are refused by read and patch (bash can still page them)

# ---- file tools: run in the episode's sandbox, never trusting what the policy left there -----------------------------

# One call reads, writes or patches one file. The path is resolved there (symbolic links included) and
# must stay inside the workspace; a FIFO or device where a file should be is refused without blocking.
_FILES = r'''
import json, os, stat, sys
req = json.load(sys.stdin)
LIMIT = int(req["limit"])
root = os.path.realpath(os.getcwd())

def done(**kw):
    sys.stdout.write(json.dumps(kw))
    sys.exit(0)

full = os.path.realpath(os.path.join(root, req["path"]))
if not (full == root or full.startswith(root + os.sep)):
    done(error="escapes")

def read_text():
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        done(error="missing")
    except OSError as e:
        done(error="os", detail=e.strerror or "cannot open")
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            done(error="directory", entries=sorted(os.listdir(full))[:50])
        if not stat.S_ISREG(st.st_mode):
            done(error="special")
        if st.st_size > LIMIT:
            done(error="large", size=st.st_size)
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        done(error="binary")

def write_text(text):
    if os.path.isdir(full):
        done(error="directory", entries=[])
    try:
        os.makedirs(os.path.dirname(full), exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as e:
        done(error="os", detail=e.strerror or "cannot write")

op = req["op"]
if op == "read":
    done(text=read_text())
if op == "write":
    write_text(req["content"])
    done(ok=True)
if op == "delete":
    read_text()  # a regular text file, or the error that says what is there instead
    os.unlink(full)
    done(ok=True)
text = read_text()
count = text.count(req["search"])
if count != 1:
    done(error="count", count=count)
at = text.index(req["search"])
write_text(text[:at] + req["replace"] + text[at + len(req["search"]):])
done(ok=True, line=text[:at].count("\n") + 1)
'''

# The visible tests, run with unittest; a summary and each failure's message, nothing that varies by run.
_RUNNER = r'''
import os, sys, unittest
sys.path.insert(0, os.getcwd())
if not os.path.isdir("tests"):
    print("no tests/ directory in /workspace: the visible tests are gone")
    sys.exit(1)
result = unittest.TestResult()
unittest.defaultTestLoader.discover("tests", top_level_dir="tests").run(result)

def why(tb, error):
    lines = tb.rstrip("\n").split("\n")
    last = max((i for i, ln in enumerate(lines) if ln.startswith("  File ")), default=-1)
    rest = [ln for ln in lines[last + 1:] if not ln.startswith("    ")]
    where = [lines[last].strip()] if error and last >= 0 else []
    return where + rest[:12]

out = []
for label, items in (("FAIL", result.failures), ("ERROR", result.errors)):
    for test, tb in items[:30]:
        out.append(label + " " + test.id())
        out += ["  " + ln for ln in why(tb, label == "ERROR")]
bad = len(result.failures) + len(result.errors)
n = result.testsRun
out.append(f"{n} tests: {n - bad} passed" + (f", {len(result.failures)} failed, {len(result.errors)} errors" if bad else ""))
print("\n".join(out))
sys.exit(1 if bad or not n else 0)
'''


# The visible tests' files as they are now (tests/, recursively), to tell a reproduced failure from tests the
# policy broke itself.
_TEST_FILES = r'''
import json, os
out = {}
for d, dirs, files in os.walk("tests"):
    dirs[:] = sorted(x for x in dirs if x != "__pycache__")
    for f in sorted(files):
        p = os.path.join(d, f)
        try:
            with open(p, encoding="utf-8") as fh:
                out[p] = fh.read()
        except (OSError, UnicodeDecodeError):
            out[p] = None
print(json.dumps(out))
'''


def tests_passed(n: int) -> str:
    """What run_tests shows when all `n` visible tests pass (the reference's observation)."""
    return f"{n} tests: {n} passed\n[exit code 0]"


def check_path(tool: str, path: str) -> str | None:
    """Why `path` is refused before it reaches the sandbox, or None."""
    if not path or not path.strip():
        return f"{tool}: the path is empty; give a path relative to /workspace, e.g. acme/cart.py"
    if "\0" in path:
        return f"{tool}: the path contains a NUL character"
    if path.startswith("/"):
        return f"{tool}: {path!r} is absolute; paths are relative to /workspace (write {path.lstrip('/')!r} for a file there)"
    if ".." in path.split("/"):
        return f"{tool}: {path!r} climbs out with '..'; the tools reach only files under /workspace"
    return None


def file_error(tool: str, path: str, report: dict[str, Any]) -> str:
    error = report.get("error")
    if error == "escapes":
        return f"{tool}: {path!r} leads out of /workspace through a symbolic link; the tools reach only the workspace"
    if error == "missing":
        return f"{tool}: no file {path!r} in /workspace (list files with bash: ls -R)"
    if error == "directory":
        entries = report.get("entries") or []
        listing = f" (it holds {', '.join(entries)})" if entries else ""
        return f"{tool}: {path!r} is a directory{listing}; give a file's path"
    if error == "special":
        return f"{tool}: {path!r} is not a regular file"
    if error == "large":
        return f"{tool}: {path!r} has {report.get('size')} bytes, over {MAX_FILE_BYTES}; page it with bash (sed -n)"
    if error == "binary":
        return f"{tool}: {path!r} is not UTF-8 text"
    if error == "count":
        if report.get("count") == 0:
            return (f"patch: search text not found in {path!r}; it must match the file exactly, indentation and "
                    "line breaks included, without read's line numbers (read the file and copy the lines)")
        return (f"patch: search text occurs {report.get('count')} times in {path!r}; include surrounding lines so it "
                "occurs once")
    return f"{tool}: {path!r}: {report.get('detail') or error}"


def format_read(path: str, text: str, start: int | None = None, end: int | None = None) -> str:
    """read's observation: the lines start..end (at most MAX_READ_LINES), numbered."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    n = len(lines)
    if n == 0:
        return f"{path}: empty file"
    first = start or 1
    if first > n:
        return f"read: {path!r} has {n} lines; start must be at most {n}"
    last = min(end or n, n, first + MAX_READ_LINES - 1)
    if last < first:
        return f"read: end ({end}) is before start ({first})"
    body = "\n".join(f"{i:>4}  {lines[i - 1]}" for i in range(first, last + 1))
    more = f"; read on with start={last + 1}" if last < n else ""
    return f"{path}: lines {first}-{last} of {n}{more}\n{body}"


def format_patch(path: str, line: int, search: str, replace: str) -> str:
    old, new = search.count("\n") + 1, replace.count("\n") + 1
    return f"patched {path}: lines {line}-{line + old - 1} replaced by {new} line{'s' * (new != 1)}"


def plan_diff(diff: str, read: Callable[[str], str | None]) -> tuple[dict[str, str | None], str]:
    """What apply_diff does, before it touches anything: path -> the file's new text (None: delete it), and the
    observation; a DiffError when the diff is malformed, a path is refused or a hunk does not apply. `read(path)`
    gives a file's text, None when there is no such file."""
    writes: dict[str, str | None] = {}
    done: list[str] = []

    def current(path: str) -> str | None:
        return writes[path] if path in writes else read(path)

    for p in parse_diff(diff):
        for path in {p.old_path, p.new_path} - {DEV_NULL}:
            if why := check_path("apply_diff", path):
                raise DiffError(why.removeprefix("apply_diff: "))
        if p.old_path == DEV_NULL:
            if current(p.new_path) is not None:
                raise DiffError(f"{p.new_path!r} exists already; diff it against its text, not against /dev/null")
            text = ""
        elif (text := current(p.old_path)) is None:
            raise DiffError(f"no file {p.old_path!r} in /workspace (a new file's diff starts with '--- /dev/null')")
        new = apply_hunks(text, p)
        if p.old_path not in (DEV_NULL, p.new_path):  # deleted, or renamed
            writes[p.old_path] = None
        if p.new_path != DEV_NULL:
            writes[p.new_path] = new
        added = sum(len(h.new) for h in p.hunks) - sum(len(h.old) for h in p.hunks)
        if p.old_path == DEV_NULL:
            what = f"{p.new_path} created"
        elif p.new_path == DEV_NULL:
            what = f"{p.old_path} deleted"
        else:
            what = f"{p.old_path} renamed to {p.new_path}" if p.old_path != p.new_path else f"{p.new_path} changed"
        done.append(f"{what} ({len(p.hunks)} hunk{'s' * (len(p.hunks) != 1)}, {added:+d} lines)")
    return writes, "applied the diff: " + "; ".join(done)


def format_write(path: str, content: str) -> str:
    n = content.count("\n") + (not content.endswith("\n") and bool(content))
    return f"wrote {path}: {n} line{'s' * (n != 1)}"


# ---- verification -----------------------------------------------------------------------------------------------------

# Imports the package and evaluates each test expression; only tagged results come out. argv: nonce, then
# [package, modules, expressions] as JSON. Everything it needs is bound before the workspace's code runs.
_HARNESS = '''\
from __future__ import annotations
import importlib, json, os, sys
NONCE, (PKG, MODULES, EXPRS) = sys.argv[1], json.loads(sys.argv[2])
''' + inspect.getsource(encode) + '''

def main():
    write, dumps, enc, name_of, evaluate = os.write, json.dumps, encode, type, eval
    sys.path.insert(0, os.getcwd())
    namespace = {}
    for module in MODULES:
        try:
            namespace[module] = importlib.import_module(PKG + "." + module)
        except BaseException:  # SystemExit too; the expressions naming it fail below
            pass
    results = []
    for expr in EXPRS:
        try:
            results.append({"ok": enc(evaluate(expr, {"__builtins__": {}}, dict(namespace)))})
        except BaseException as e:
            try:
                results.append({"error": name_of(e).__name__})
            except BaseException:
                results.append({"error": "?"})
    write(1, ("\\n" + NONCE + dumps({"results": results}) + "\\n").encode())


main()
'''


def grade(payload: dict[str, Any], sandbox: Sandbox) -> Reward:
    """Every visible and hidden test expression, evaluated in `sandbox`, against the expected values here."""
    tests = payload["visible"] + payload["hidden"]
    nonce = f"@@assay-{secrets.token_hex(8)}@@"
    arg = json.dumps([payload["pkg"], payload["modules"], [e for e, _ in tests]])
    res = sandbox.exec(["python3", "-I", "-", nonce, arg], stdin=_HARNESS)
    if res.status == EXEC_SANDBOX_ERROR:
        return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": res.stderr[-500:]})
    report = _result_line(res.stdout, nonce)
    results = report.get("results") if report else None
    if not isinstance(results, list) or len(results) != len(tests):
        # The workspace's code runs in that process: an exit, a hang or a forgery is its failure, not ours.
        return Reward(0.0, False, details={"reason": f"no results ({res.status}, exit {res.exit_code})",
                                           "stderr": res.stderr[-300:]})
    ok = [isinstance(got, dict) and "ok" in got and got["ok"] == want for got, (_, want) in zip(results, tests,
                                                                                              strict=True)]
    n_visible = len(payload["visible"])
    visible, hidden = sum(ok[:n_visible]), sum(ok[n_visible:])
    passed = all(ok)
    # Counts only: the hidden expressions stay out of anything a run records.
    return Reward(float(passed), passed, details={"visible": f"{visible}/{n_visible}",
                                                  "hidden": f"{hidden}/{len(ok) - n_visible}"})


# ---- the episode ------------------------------------------------------------------------------------------------------

@dataclass
class RepoEpisode:
    task: Task
    sandbox: Sandbox | None  # None only when it could not be opened (setup_error says why)
    owns_sandbox: bool  # a caller's sandbox (a pool's) is the caller's to close
    verify_limits: Limits
    test_timeout_s: float
    setup_error: str | None = None
    tool_errors: int = 0
    calls: int = 0
    submitted: bool = False
    max_checkpoints: int = MAX_CHECKPOINTS  # 0: the environment offers no checkpoint tools
    checkpoints: dict[str, object] = field(default_factory=dict, repr=False)  # id -> sandbox snapshot, oldest first
    checkpoint_count: int = 0  # checkpoints taken (ids are never reused)
    rollbacks: int = 0
    reproduced: bool = False  # run_tests failed while the visible tests were as given (a milestone)
    checker: Sandbox | None = None
    closed: bool = False
    _reward: Reward | None = field(default=None, repr=False)

    def step(self, call: ToolCall) -> Observation:
        if self.setup_error is not None:
            return Observation(f"sandbox failure: {self.setup_error}", status=SANDBOX_ERROR)
        error = validate_call(call, TOOLS + (CHECKPOINT_TOOLS if self.max_checkpoints else ()))
        if error is None and (self.closed or self.submitted):
            error = "the episode is over (submitted)"
        if error is None and call.name == "bash" and "\0" in call.arguments["command"]:
            error = "bash: the command contains a NUL character"
        if error is None and "path" in call.arguments:
            error = check_path(call.name, call.arguments["path"])
        if error is not None:
            return self._error(error)
        assert self.sandbox is not None
        try:
            obs = getattr(self, f"_{call.name}")(**call.arguments)
        except OSError as e:
            return Observation(f"sandbox failure: {e}", status=SANDBOX_ERROR)
        self.calls += 1
        self.tool_errors += obs.is_error
        return obs

    def _error(self, text: str) -> Observation:
        self.tool_errors += 1
        return Observation(f"error: {text}", is_error=True)

    def _exec(self, cmd: list[str], stdin: str | None = None, timeout: float | None = None) -> ExecResult:
        assert self.sandbox is not None
        res = self.sandbox.exec(cmd, stdin=stdin, timeout=timeout)
        if res.status == EXEC_SANDBOX_ERROR:  # the sandbox broke, not the call: never a wrong answer
            raise OSError(res.stderr[-300:] or "the sandbox failed")
        return res

    def _file_op(self, **req: Any) -> dict[str, Any]:
        """The file helper's report: what it did, or {"error": ...} (the helper's own failure included)."""
        res = self._exec(["python3", "-I", "-c", _FILES], stdin=json.dumps({**req, "limit": MAX_FILE_BYTES}))
        try:
            report = json.loads(res.stdout)
        except ValueError:
            report = None
        if not isinstance(report, dict):
            return {"error": "helper", "detail": f"the file operation failed ({res.status}): {res.stderr[-200:]}"}
        return report

    def _files(self, tool: str, **req: Any) -> dict[str, Any] | Observation:
        report = self._file_op(**req)
        if "error" in report:
            return Observation(f"error: {file_error(tool, req['path'], report)}", is_error=True)
        return report

    def _bash(self, command: str) -> Observation:
        res = self._exec(["bash", "-c", command])
        return Observation(format_result(res.stdout, res.stderr, res.exit_code, res.status))

    def _read(self, path: str, start: int | None = None, end: int | None = None) -> Observation:
        got = self._files("read", op="read", path=path)
        if isinstance(got, Observation):
            return got
        text = format_read(path, got["text"], start, end)
        return Observation(text, is_error=text.startswith("read: "))

    def _write(self, path: str, content: str) -> Observation:
        if len(content.encode()) > MAX_FILE_BYTES:
            return Observation(f"error: write: the content is over {MAX_FILE_BYTES} bytes", is_error=True)
        got = self._files("write", op="write", path=path, content=content)
        return got if isinstance(got, Observation) else Observation(format_write(path, content))

    def _patch(self, path: str, search: str, replace: str) -> Observation:
        got = self._files("patch", op="patch", path=path, search=search, replace=replace)
        return got if isinstance(got, Observation) else Observation(format_patch(path, got["line"], search, replace))

    def _apply_diff(self, diff: str) -> Observation:
        def read(path: str) -> str | None:
            report = self._file_op(op="read", path=path)
            if report.get("error") == "missing":
                return None
            if "error" in report:
                raise DiffError(file_error("apply_diff", path, report).removeprefix("apply_diff: "))
            return report["text"]

        try:
            writes, summary = plan_diff(diff, read)
        except DiffError as e:
            return Observation(f"error: apply_diff: {e}", is_error=True)
        for path, text in writes.items():
            if text is not None and len(text.encode()) > MAX_FILE_BYTES:
                return Observation(f"error: apply_diff: {path!r} would grow over {MAX_FILE_BYTES} bytes; nothing "
                                   "was changed", is_error=True)
        for path, text in writes.items():
            got = self._files("apply_diff", op="delete", path=path) if text is None else \
                self._files("apply_diff", op="write", path=path, content=text)
            if isinstance(got, Observation):
                return got
        return Observation(summary)

    def _run_tests(self) -> Observation:
        res = self._exec(["python3", "-I", "-B", "-c", _RUNNER], timeout=self.test_timeout_s)  # -B: no __pycache__
        if res.status == TIMEOUT:
            return Observation(f"run_tests: timed out after {self.test_timeout_s:g}s (an endless loop?)", is_error=True)
        if res.exit_code != 0 and not self.reproduced:
            self.reproduced = self._tests_as_given()
        return Observation(format_result(res.stdout, res.stderr, res.exit_code, res.status))

    def _tests_as_given(self) -> bool:
        given = {p: t for p, t in self.task.payload["files"].items() if p.startswith("tests/")}
        res = self._exec(["python3", "-I", "-B", "-c", _TEST_FILES])
        try:
            return bool(given) and json.loads(res.stdout) == given
        except ValueError:
            return False

    def _checkpoint(self) -> Observation:
        assert self.sandbox is not None
        if len(self.checkpoints) >= self.max_checkpoints:
            kept = ", ".join(self.checkpoints)
            return Observation(f"error: checkpoint: {self.max_checkpoints} checkpoints are kept already ({kept}); "
                               "roll back to one of them (that drops the later ones) before taking another",
                               is_error=True)
        self.checkpoint_count += 1
        cp = f"cp{self.checkpoint_count}"
        self.checkpoints[cp] = self.sandbox.snapshot()
        return Observation(f"checkpoint {cp} saved: the whole workspace as it is now; rollback(id={cp!r}) returns "
                           f"to it ({len(self.checkpoints)} of {self.max_checkpoints} checkpoints kept)")

    def _rollback(self, id: str) -> Observation:  # noqa: A002 - the tool's argument is named id
        assert self.sandbox is not None
        if not self.checkpoints:
            return Observation("error: rollback: there is no checkpoint to return to; call checkpoint before an edit "
                               "you may want to undo", is_error=True)
        if id not in self.checkpoints:
            return Observation(f"error: rollback: no checkpoint {id!r}; the checkpoints kept are "
                               f"{', '.join(self.checkpoints)}", is_error=True)
        self.sandbox.restore(self.checkpoints[id])
        ids = list(self.checkpoints)
        dropped = ids[ids.index(id) + 1:]
        for later in dropped:
            del self.checkpoints[later]
        self.rollbacks += 1
        note = f"; dropped the later checkpoint{'s' * (len(dropped) > 1)} {', '.join(dropped)}" if dropped else ""
        return Observation(f"rolled back to {id}: the workspace is as it was then (files written since are gone, "
                           f"files changed since are back){note}")

    def _submit(self) -> Observation:
        self.submitted = True
        return Observation(SUBMITTED, done=True)

    def verify(self, final: list[Message]) -> Reward:
        """Grade the final workspace (the messages do not matter); once: the sandboxes close after it."""
        if self._reward is None:
            try:
                self._reward = self._grade()
            finally:
                self.close()
            self._reward.details.update(calls=self.calls, tool_errors=self.tool_errors, submitted=self.submitted,
                                        reproduced=self.reproduced, checkpoints=self.checkpoint_count,
                                        rollbacks=self.rollbacks)
        return self._reward

    def _grade(self) -> Reward:
        if self.setup_error is not None or self.sandbox is None:
            return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": self.setup_error})
        try:
            self.checker = open_sandbox(self.verify_limits, template=self.sandbox.snapshot())
            return grade(self.task.payload, self.checker)
        except OSError as e:
            return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": f"sandbox: {e}"})

    def close(self) -> None:
        """End the episode: its processes die with their calls; this frees the workspaces."""
        self.checkpoints.clear()  # the frozen layers go with the workspace
        if self.checker is not None:
            self.checker.close()
        if self.owns_sandbox and self.sandbox is not None and not self.closed:
            self.sandbox.close()
        self.closed = True


# ---- staged verification ----------------------------------------------------------------------------------------------

def _reproduced(task: Task, messages: Sequence[Message], reward: Reward) -> bool:
    return reward.details.get("reproduced") is True


def _visible_pass(task: Task, messages: Sequence[Message], reward: Reward) -> bool:
    n = len(task.payload["visible"])  # counted by the verifier on the task's own expressions, not the test files
    return n > 0 and reward.details.get("visible") == f"{n}/{n}"


def _submitted(task: Task, messages: Sequence[Message], reward: Reward) -> bool:
    return reward.details.get("submitted") is True


def _first_failing_run(task: Task, messages: Sequence[Message]) -> int | None:
    """The turn of the first run_tests that reported failures (where `reproduced` is reached)."""
    k = 0
    for m in messages:
        k += m.role == "assistant"
        if k and m.role == "tool" and m.name == "run_tests" and not m.is_error and \
                not m.content.endswith("[exit code 0]"):
            return k
    return None


MILESTONES = (
    Milestone("reproduced", "run_tests reported failures while the visible tests were as given", _reproduced,
              turn=_first_failing_run),
    Milestone("visible_pass", "every visible test passes in the final workspace (verified)", _visible_pass,
              progress=True),
    Milestone("submitted", "the policy called submit", _submitted, turn=first_call("submit")),
)


# ---- the environment --------------------------------------------------------------------------------------------------

@register
class RepoEnv:
    name = "repo"
    version = "4"  # 4: only shared modules changed (_common: the answer line's integer bound); 3: apply_diff,
    # refactor tasks (level 5), milestone turns; 2: checkpoints, milestones
    task_stream = "repo@3"  # the version whose draws (tasks, ids, partition) this one repeats
    category = "code"
    qa_kind = "terminal"
    difficulties = (1, 2, 3, 4, 5)
    tools: tuple[ToolSpec, ...] = TOOLS
    milestones = MILESTONES
    hash_deps = ("assay.envs.builtin._common", "assay.envs.builtin._pyjudge", "assay.envs.builtin._repo_gen",
                 "assay.envs.builtin._terminal_tasks", "assay.envs.builtin._unidiff", "assay.envs.builtin.terminal",
                 "assay.envs.tools")

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 256, checkpoints: int = MAX_CHECKPOINTS) -> None:
        if not 0 <= checkpoints <= 32:
            raise AssayError(f"repo: checkpoints must be 0 (no checkpoint tools) to 32, got {checkpoints}")
        self.checkpoints = checkpoints  # the most kept at once per episode; 0: the tools are not offered
        self.tools = TOOLS + (CHECKPOINT_TOOLS if checkpoints else ())
        self._reproductions: dict[str, str] = {}  # task_id -> what run_tests shows on the workspace as given
        # Declared, the framework hands each episode's workspace a warm pooled sandbox.
        self.sandbox_limits = Limits(timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb,
                                     max_procs=32, file_size_mb=1, output_bytes=1024 * 1024, workspace_mb=16)
        # output_bytes: room for a whole file as JSON from the file helper (escapes grow it up to 6x); bash's
        # output is clipped for the policy anyway (format_result)
        self.verify_limits = Limits(timeout_s=10.0, cpu_s=10, memory_mb=memory_mb, max_procs=32, file_size_mb=1,
                                    output_bytes=256 * 1024, workspace_mb=16)
        self.test_timeout_s = timeout_s

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        check_difficulty(self.name, difficulty, self.difficulties)
        spec = f"{self.name}@{self.version}"
        seed = draw_seed(rng)
        g = build(task_rng(self.task_stream, difficulty, seed), difficulty)
        payload = {"kind": g.kind, "pkg": g.pkg, "files": g.files, "modules": g.modules, "visible": g.visible,
                   "hidden": g.hidden, "solution": g.solution, "faults": g.faults}
        return Task(env=spec, task_id=task_id(self.task_stream, difficulty, [g.files, g.hidden]), difficulty=difficulty,
                    prompt=[Message("system", SYSTEM_CHECKPOINTS if self.checkpoints else SYSTEM),
                            Message("user", g.instruction)], tools=list(self.tools),
                    payload=payload, seed=seed, env_hash=env_hash(self))

    def secrets(self, task: Task) -> list[str]:
        """The hidden tests: each expression (distinct from every visible one by construction), and all of them
        with their expected values as the verifier holds them."""
        hidden = task.payload["hidden"]
        return [e for e, _ in hidden] + [json.dumps(hidden)]

    def reference_solution(self, task: Task) -> list[Message]:
        """The reference patch as tool calls, with the observations they get: first run_tests on the workspace as
        given (its failures come from running it, in a sandbox, once per task), then the patch (observations
        computed from the files), run_tests again and submit."""
        files = dict(task.payload["files"])
        out: list[Message] = [Message("assistant", "", [ToolCall("run_tests", {}, id="call_reproduce")]),
                              Message("tool", self._reproduction(task), name="run_tests")]
        for i, step in enumerate(task.payload["solution"]):
            tool, args = step["tool"], step["arguments"]
            if tool == "read":
                seen = format_read(args["path"], files[args["path"]])
            elif tool == "patch":
                text = files[args["path"]]
                at = text.index(args["search"])
                files[args["path"]] = text[:at] + args["replace"] + text[at + len(args["search"]):]
                seen = format_patch(args["path"], text[:at].count("\n") + 1, args["search"], args["replace"])
            elif tool == "apply_diff":
                writes, seen = plan_diff(args["diff"], files.get)
                for path, text in writes.items():
                    if text is None:
                        del files[path]
                    else:
                        files[path] = text
            elif tool == "run_tests":
                seen = tests_passed(len(task.payload["visible"]))
            else:
                seen = SUBMITTED
            out += [Message("assistant", "", [ToolCall(tool, dict(args), id=f"call_{i}")]),
                    Message("tool", seen, name=tool)]
        return out

    def _reproduction(self, task: Task) -> str:
        if task.task_id not in self._reproductions:
            episode = self.start(task, None)
            try:
                obs = episode.step(ToolCall("run_tests", {}))
            finally:
                episode.close()
            if obs.status != OK or not episode.reproduced:
                raise AssayError(f"repo: running the visible tests of task {task.task_id} as given did not fail as "
                                 f"every task's must: {obs.content[-300:]}")
            self._reproductions[task.task_id] = obs.content
        return self._reproductions[task.task_id]

    def start(self, task: Task, sandbox: Sandbox | None) -> RepoEpisode:
        episode = RepoEpisode(task, sandbox, sandbox is None, self.verify_limits, self.test_timeout_s,
                              max_checkpoints=self.checkpoints)
        try:
            episode.sandbox = open_sandbox(self.sandbox_limits) if sandbox is None else sandbox
        except OSError as e:  # a launcher hiccup is this episode's infrastructure failure, not the batch's
            episode.setup_error = f"sandbox: {e}"
            return episode
        episode.setup_error = populate(episode.sandbox, task.payload["files"], [])
        return episode

