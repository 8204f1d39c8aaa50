"""terminal: multi-turn tasks in a sandboxed workspace with one tool, `bash`, graded by a hidden check.

In the spirit of Terminal-Bench. The policy acts in /workspace through `bash` (each call runs
`bash -c <command>` in the episode's sandbox and returns its output and exit code) and ends with a
message without a tool call. Four generated families, each at levels 1-4:

- find: one file under the workspace holds a code; write its path to answer.txt. More files and
  deeper directories by level; from level 3 longer codes that start with the target (grep -w
  needed); at level 4 the file is the one with two given lines (two conditions).
- records: count or sum records with standard tools and write the number to answer.txt.
  1: lines of a log at a level; 2: CSV rows of a region (customer names contain region words);
  3: sum of a column under two conditions; 4: distinct users with a line at a level across log
  files (INFO lines that name the level are decoys). The question's level, status, region and
  file names vary, so one task's procedure does not answer another.
- config: `python3 run.py` fails; fix the config so it exits 0 and prints a given line.
  1: key=value, one bad entry; 2: plus a valid but wrong value (run.py then succeeds with the
  wrong line); 3: JSON with a syntax error and a bad entry; 4: nested JSON, all three faults,
  and an example config with other values as a decoy.
- repair: functions in a Python module do not do what their docstrings say; hidden tests call
  them. 1: 2 functions, 1 bug; 2: 3 functions, 2 bugs; 3: 4 functions in two modules, 2 bugs;
  4: 5 functions in two modules, 3 bugs. Score = share of the broken functions fixed, 0 if a
  working one was broken.

Verification never trusts the policy's sandbox: `verify` freezes the final workspace, opens a
fresh sandbox on that snapshot, and runs the check there, the check's script passed on stdin and
run with `python3 -I` (so neither the workspace nor user site-packages are on its path). Expected
values never enter any sandbox: the check reports what it sees (file contents, the original
run.py's output, function results tagged with a fresh nonce) and the comparison happens here.
A sandbox failure or a broken check is a Reward status, never a silent 0. Both sandboxes are
closed after verification.

Bring your own tasks with `TerminalEnv(tasks_dir=...)` (env_args: {tasks_dir: PATH}): one
subdirectory per task, holding

    instruction.md   the task, given to the policy as the user message
    workspace/       the files the policy starts with (text files; executable bits are kept)
    verify.py        run as `python3 -I verify.py` (from a private temp dir) in a fresh sandbox
                     made from the final workspace, with the workspace as working directory;
                     exit code 0 = pass. The workspace is not on its sys.path: import from it
                     explicitly if you mean to. The policy never sees this file.
    solution.sh      the reference: split into bash calls at blank lines (a paragraph of lines is
                     one call; a heredoc is never split; a `#!` line and comment-only paragraphs
                     are dropped); replayed, it must make verify.py pass
    task.json        optional: {"difficulty": 2} (default 1)

With tasks_dir, `generate` draws among these tasks (seeded) at the nearest difficulty present, as
jsonl does; the reference's tool outputs come from running solution.sh in a sandbox."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import random
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from assay.core.errors import AssayError
from assay.core.types import OK, SANDBOX_ERROR, VERIFIER_ERROR, Message, Observation, Reward, Task, ToolCall, ToolSpec
from assay.envs.builtin._common import check_difficulty, draw_seed, task_id, task_rng
from assay.envs.builtin._pyjudge import _result_line, encode
from assay.envs.builtin._terminal_tasks import ANSWER, FAMILIES, format_result
from assay.envs.registry import env_hash, register
from assay.envs.tools import object_schema, validate_call
from assay.sandbox import Limits, open_sandbox
from assay.sandbox.base import EXITED, ExecResult, Sandbox
from assay.sandbox.base import SANDBOX_ERROR as EXEC_SANDBOX_ERROR

BASH = ToolSpec("bash", "Run a bash command in /workspace and get its output and exit code.",
                object_schema({"command": {"type": "string", "description": "the command, e.g. ls -la"}}))
SYSTEM = ("You are in a Linux shell in /workspace, with bash, coreutils, grep, sed, awk and python3, and no "
          "network. Run commands with the bash tool. When the task is done, reply without a tool call.")


# ---- verification: run in a fresh sandbox, compared here -----------------------------------------------------------

# Reads files without ever blocking (a FIFO or a device where a file should be is the policy's doing).
_OBSERVE = '''\
import json, os, stat, sys
NONCE, PATHS = sys.argv[1], json.loads(sys.argv[2])


def read_regular(path, limit=4096):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        return {"error": e.strerror or "cannot open"}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {"error": "not a regular file"}
        return {"text": os.read(fd, limit).decode("utf-8", "replace")}
    finally:
        os.close(fd)


print("\\n" + NONCE + json.dumps({p: read_regular(p) for p in PATHS}))
'''

# Calls the workspace's functions on the hidden inputs; only results come out, tagged (see _pyjudge).
_HARNESS = '''\
from __future__ import annotations
import importlib, json, os, sys
NONCE, CALLS = sys.argv[1], json.loads(sys.argv[2])
''' + inspect.getsource(encode) + '''

def main():
    write, dumps, enc, name_of = os.write, json.dumps, encode, type  # bound before workspace code runs
    sys.path.insert(0, os.getcwd())
    modules, results = {}, []
    for module, function, args in CALLS:
        try:
            if module not in modules:
                modules[module] = importlib.import_module(module)
            results.append({"ok": enc(getattr(modules[module], function)(*args))})
        except BaseException as e:  # SystemExit too: the workspace's code does not end the run
            try:
                results.append({"error": name_of(e).__name__})
            except BaseException:
                results.append({"error": "?"})
    write(1, ("\\n" + NONCE + dumps({"results": results}) + "\\n").encode())


main()
'''

# A user's verify.py, written only now, in this call's private /tmp.
_USER_VERIFY = ('d=$(mktemp -d -p /tmp) && cat > "$d/verify.py" && python3 -I "$d/verify.py"; '
                'rc=$?; rm -rf "$d"; exit $rc')


def _python(sandbox: Sandbox, script: str, *args: str) -> ExecResult:
    return sandbox.exec(["python3", "-I", "-", *args], stdin=script)


def _infra(res: ExecResult) -> Reward | None:
    if res.status == EXEC_SANDBOX_ERROR:
        return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": res.stderr[-500:]})
    return None


def _normalize(answer: str, kind: str) -> str:
    answer = answer.strip()
    if kind == "path":
        answer = answer.removeprefix("/workspace/").removeprefix("./")
    return answer


def grade_answer(check: dict[str, Any], sandbox: Sandbox) -> Reward:
    """answer.txt against the expected value. Only our own reader runs, so no report is a broken check."""
    nonce = f"@@assay-{secrets.token_hex(8)}@@"
    res = _python(sandbox, _OBSERVE, nonce, json.dumps([ANSWER]))
    infra = _infra(res)
    if infra is not None:
        return infra
    report = _result_line(res.stdout, nonce)
    seen = report.get(ANSWER) if report else None
    if not isinstance(seen, dict):
        return Reward(0.0, False, status=VERIFIER_ERROR, details={
            "reason": f"the answer reader reported nothing ({res.status})", "stderr": res.stderr[-300:]})
    if "text" not in seen:
        return Reward(0.0, False, details={"reason": f"{ANSWER}: {seen.get('error')}"})
    got = _normalize(str(seen["text"]), check["kind"])
    ok = got == check["answer"]
    return Reward(float(ok), ok, details={"got": got[:200], "expected": check["answer"]})


def grade_config(check: dict[str, Any], sandbox: Sandbox) -> Reward:
    """The original run.py (the policy's copy may be edited) on the final config: exit 0 and the ready line."""
    res = _python(sandbox, check["program"])
    infra = _infra(res)
    if infra is not None:
        return infra
    ok = res.status == EXITED and res.exit_code == 0 and res.stdout.strip() == check["expected"]
    return Reward(float(ok), ok, details={"exit_code": res.exit_code, "status": res.status,
                                          "stdout": res.stdout[-200:], "stderr": res.stderr[-200:]})


def grade_repair(check: dict[str, Any], sandbox: Sandbox) -> Reward:
    """Share of the broken functions that now pass all their hidden tests; 0 if a working one broke."""
    nonce = f"@@assay-{secrets.token_hex(8)}@@"
    res = _python(sandbox, _HARNESS, nonce, json.dumps(check["calls"]))
    infra = _infra(res)
    if infra is not None:
        return infra
    report = _result_line(res.stdout, nonce)
    results = report.get("results") if report else None
    if not isinstance(results, list) or len(results) != len(check["calls"]):
        # The workspace's code runs in this process: an exit, a hang or a forgery is its failure, not ours.
        return Reward(0.0, False, details={"reason": f"no results ({res.status}, exit {res.exit_code})",
                                           "stderr": res.stderr[-300:]})
    passing: dict[str, bool] = {}
    for (module, function, _), got, want in zip(check["calls"], results, check["expected"], strict=True):
        ok = isinstance(got, dict) and "ok" in got and got["ok"] == want
        name = f"{module}.{function}"
        passing[name] = passing.get(name, True) and ok
    buggy = check["buggy"]
    fixed = [f for f in buggy if passing[f]]
    broke = [f for f, ok in passing.items() if f not in buggy and not ok]
    score = 0.0 if broke else len(fixed) / len(buggy)
    return Reward(score, score == 1.0, details={"fixed": fixed, "still_broken": [f for f in buggy if not passing[f]],
                                                "newly_broken": broke})


def grade_script(check: dict[str, Any], sandbox: Sandbox) -> Reward:
    """A directory task: the user's verify.py decides by its exit code."""
    res = sandbox.exec(["bash", "-c", _USER_VERIFY], stdin=check["verify"])
    infra = _infra(res)
    if infra is not None:
        return infra
    ok = res.status == EXITED and res.exit_code == 0
    return Reward(float(ok), ok, details={"exit_code": res.exit_code, "status": res.status,
                                          "output": (res.stdout + res.stderr)[-500:]})


GRADERS: dict[str, Callable[[dict[str, Any], Sandbox], Reward]] = {
    "config": grade_config, "find": grade_answer, "records": grade_answer, "repair": grade_repair,
    "dir": grade_script}


# ---- directory tasks -------------------------------------------------------------------------------------------------

_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")


def split_solution(script: str) -> list[str]:
    """solution.sh as bash calls: one per paragraph (lines between blank lines); a heredoc is never split."""
    lines = script.splitlines()
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    calls: list[str] = []
    block: list[str] = []
    until: str | None = None

    def flush() -> None:
        if any(ln.strip() and not ln.strip().startswith("#") for ln in block):
            calls.append("\n".join(block))
        block.clear()

    for line in lines:
        if until is not None:
            block.append(line)
            until = None if line.strip() == until else until
        elif not line.strip():
            flush()
        else:
            block.append(line)
            m = _HEREDOC.search(line)
            until = m.group(2) if m else None
    flush()
    return calls


@dataclass(frozen=True)
class DirTask:
    name: str
    instruction: str
    files: dict[str, str]
    executable: list[str]
    verify: str
    solution: list[str]
    difficulty: int


def _text(path: Path, root: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise AssayError(f"terminal tasks_dir: {path.relative_to(root)} is not UTF-8 text") from e


def load_task(task_dir: Path, root: Path) -> DirTask:
    missing = [n for n in ("instruction.md", "verify.py", "solution.sh") if not (task_dir / n).is_file()]
    if missing:
        raise AssayError(f"terminal tasks_dir: task {task_dir.name!r} lacks {', '.join(missing)}; each task "
                         "directory holds instruction.md, workspace/, verify.py, solution.sh (and task.json)")
    files, executable = {}, []
    workspace = task_dir / "workspace"
    for path in sorted(workspace.rglob("*")) if workspace.is_dir() else []:
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise AssayError(f"terminal tasks_dir: {path.relative_to(root)}: only plain files and directories")
        if path.is_file():
            rel = path.relative_to(workspace).as_posix()
            files[rel] = _text(path, root)
            if path.stat().st_mode & stat.S_IXUSR:
                executable.append(rel)
    difficulty = 1
    if (task_dir / "task.json").is_file():
        try:
            meta = json.loads(_text(task_dir / "task.json", root))
        except json.JSONDecodeError as e:
            raise AssayError(f"terminal tasks_dir: {task_dir.name}/task.json is not valid JSON ({e.msg})") from e
        difficulty = meta.get("difficulty", 1) if isinstance(meta, dict) else None
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty < 1:
            raise AssayError(f"terminal tasks_dir: {task_dir.name}/task.json: difficulty must be an integer >= 1")
    solution = split_solution(_text(task_dir / "solution.sh", root))
    if not solution:
        raise AssayError(f"terminal tasks_dir: {task_dir.name}/solution.sh has no commands")
    return DirTask(task_dir.name, _text(task_dir / "instruction.md", root).strip(), files, executable,
                   _text(task_dir / "verify.py", root), solution, difficulty)


def load_tasks(root: Path) -> list[DirTask]:
    if not root.is_dir():
        raise AssayError(f"terminal environment: no directory {str(root)!r}; set env_args.tasks_dir to a directory "
                         "of task directories")
    tasks = [load_task(d, root) for d in sorted(root.iterdir()) if d.is_dir()]
    if not tasks:
        raise AssayError(f"terminal environment: {root} holds no task directories")
    return tasks


def _fingerprint(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file():
            h.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_mode & 0o111}\0".encode())
            h.update(path.read_bytes())
    return h.hexdigest()


# ---- the episode -----------------------------------------------------------------------------------------------------

# Writes the workspace in one call (one launch, not one per file).
_UNPACK = ("import json, os, sys\n"
           "for path, (text, mode) in json.load(sys.stdin).items():\n"
           "    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)\n"
           "    with open(path, 'w', encoding='utf-8') as f:\n"
           "        f.write(text)\n"
           "    os.chmod(path, mode)\n")


def populate(sandbox: Sandbox, files: dict[str, str], executable: list[str]) -> str | None:
    """Write the task's files into the workspace; why not, if that failed."""
    spec = {p: [text, 0o755 if p in executable else 0o644] for p, text in files.items()}
    try:
        res = sandbox.exec(["python3", "-I", "-c", _UNPACK], stdin=json.dumps(spec))
    except OSError as e:
        return f"sandbox: {e}"
    return None if res.ok else f"writing the workspace failed ({res.status}): {res.stderr[-300:]}"


@dataclass
class TerminalEpisode:
    task: Task
    sandbox: Sandbox | None  # None only when it could not be opened (setup_error says why)
    owns_sandbox: bool  # a caller's sandbox (a pool's) is the caller's to close
    verify_limits: Limits
    setup_error: str | None = None
    tool_errors: int = 0
    commands: int = 0
    checker: Sandbox | None = None
    closed: bool = False
    _reward: Reward | None = field(default=None, repr=False)

    def step(self, call: ToolCall) -> Observation:
        if self.setup_error is not None:
            return Observation(f"sandbox failure: {self.setup_error}", status=SANDBOX_ERROR)
        error = validate_call(call, [BASH])
        if error is None and "\0" in call.arguments["command"]:
            error = "bash: the command contains a NUL character"
        if error is None and self.closed:
            error = "the episode is over"
        if error is not None:
            self.tool_errors += 1
            return Observation(f"error: {error}", is_error=True)
        assert self.sandbox is not None
        try:
            res = self.sandbox.exec(["bash", "-c", call.arguments["command"]])
        except OSError as e:
            return Observation(f"sandbox failure: {e}", status=SANDBOX_ERROR)
        if res.status == EXEC_SANDBOX_ERROR:  # the sandbox broke, not the command: never a wrong answer
            return Observation(f"sandbox failure: {res.stderr[-300:]}", status=SANDBOX_ERROR)
        self.commands += 1
        return Observation(format_result(res.stdout, res.stderr, res.exit_code, res.status))

    def verify(self, final: list[Message]) -> Reward:
        """Grade the final workspace (the messages do not matter); once: the sandboxes close after it."""
        if self._reward is None:
            try:
                self._reward = self._grade()
            finally:
                self.close()
            self._reward.details.update(commands=self.commands, tool_errors=self.tool_errors)
        return self._reward

    def _grade(self) -> Reward:
        if self.setup_error is not None or self.sandbox is None:
            return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": self.setup_error})
        try:
            self.checker = open_sandbox(self.verify_limits, template=self.sandbox.snapshot())
            return GRADERS[self.task.payload["family"]](self.task.payload["check"], self.checker)
        except OSError as e:
            return Reward(0.0, False, status=SANDBOX_ERROR, details={"reason": f"sandbox: {e}"})

    def close(self) -> None:
        """End the episode: its processes die with their calls; this frees the workspaces."""
        if self.checker is not None:
            self.checker.close()
        if self.owns_sandbox and self.sandbox is not None and not self.closed:
            self.sandbox.close()
        self.closed = True


# ---- the environment -------------------------------------------------------------------------------------------------

@register
class TerminalEnv:
    name = "terminal"
    version = "7"  # 4-7: only shared modules changed (_pyjudge: codegen's batches, then its results; _common:
    # the answer line's parsing, then its integer bound); 3's tasks
    task_stream = "terminal@3"  # the version whose draws (tasks, ids, partition) this one repeats
    category = "terminal"
    qa_kind = "terminal"
    tools: tuple[ToolSpec, ...] = (BASH,)
    hash_deps = ("assay.envs.builtin._common", "assay.envs.builtin._pyjudge", "assay.envs.builtin._terminal_tasks",
                 "assay.envs.tools")

    def __init__(self, tasks_dir: str | None = None, timeout_s: float = 5.0, memory_mb: int = 256) -> None:
        # Declared, the framework hands each episode's workspace a warm pooled sandbox.
        self.sandbox_limits = Limits(timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb,
                                     max_procs=32, file_size_mb=1, output_bytes=8 * 1024, workspace_mb=16)
        self.verify_limits = Limits(timeout_s=10.0, cpu_s=10, memory_mb=memory_mb, max_procs=32, file_size_mb=1,
                                    output_bytes=64 * 1024, workspace_mb=16)
        self.tasks_dir = Path(tasks_dir) if tasks_dir is not None else None
        self.by_level: dict[int, list[DirTask]] = {}
        self._fingerprint = ""
        self._references: dict[str, list[dict[str, str]]] = {}  # task_id -> solution with outputs
        if self.tasks_dir is not None:
            for t in load_tasks(self.tasks_dir):
                self.by_level.setdefault(t.difficulty, []).append(t)
            self._fingerprint = _fingerprint(self.tasks_dir)
        self.difficulties = tuple(sorted(set(self.by_level) | {1, 2, 3, 4}))

    def fingerprint(self) -> str:
        """The task directory this instance serves (empty for the generated families): part of its env_hash."""
        return self._fingerprint

    def generate(self, rng: random.Random, difficulty: int) -> Task:
        spec = f"{self.name}@{self.version}"
        if self.by_level:
            return self._generate_dir(rng, difficulty, spec)
        check_difficulty(self.name, difficulty, self.difficulties)
        seed = draw_seed(rng)
        local = task_rng(self.task_stream, difficulty, seed)
        family = local.choice(sorted(FAMILIES))
        g = FAMILIES[family](local, difficulty)
        payload = {"family": family, "files": g.files, "executable": [], "check": g.check,
                   "solution": g.solution, "summary": g.summary}
        return Task(env=spec, task_id=task_id(self.task_stream, difficulty, [family, g.files, g.check]),
                    difficulty=difficulty, prompt=[Message("system", SYSTEM), Message("user", g.instruction)],
                    tools=list(self.tools), payload=payload, seed=seed, env_hash=env_hash(self))

    def _generate_dir(self, rng: random.Random, difficulty: int, spec: str) -> Task:
        if difficulty < 1:
            raise AssayError(f"terminal environment: difficulty must be >= 1, got {difficulty}")
        level = min(self.by_level, key=lambda lv: (abs(lv - difficulty), lv))
        seed = draw_seed(rng)
        pool = self.by_level[level]
        t = pool[task_rng(self.task_stream, level, seed).randrange(len(pool))]
        payload = {"family": "dir", "name": t.name, "files": t.files, "executable": t.executable,
                   "check": {"verify": t.verify}, "solution": [{"command": c} for c in t.solution],
                   "summary": "Done.", "level": level}
        # Labelled with the requested difficulty, as jsonl does, so a curriculum sees what it asked for.
        return Task(env=spec, task_id=task_id(self.task_stream, level, [self._fingerprint[:12], t.name]),
                    difficulty=difficulty, prompt=[Message("system", SYSTEM), Message("user", t.instruction)],
                    tools=list(self.tools), payload=payload, seed=seed, env_hash=env_hash(self))

    def secrets(self, task: Task) -> list[str]:
        """What the QA gate checks the policy never sees: the hidden tests' calls and expected
        results. (Answers found by working, such as a path grep prints, are meant to be seen.)"""
        check = task.payload.get("check", {})
        return [json.dumps(check[k]) for k in ("calls", "expected") if isinstance(check.get(k), list)]

    def reference_solution(self, task: Task) -> list[Message]:
        steps = task.payload["solution"]
        if any("output" not in s for s in steps):  # a directory task: its outputs come from running it
            steps = self._run_reference(task)
        out: list[Message] = []
        for i, s in enumerate(steps):
            out += [Message("assistant", "", [ToolCall("bash", {"command": s["command"]}, id=f"call_{i}")]),
                    Message("tool", s["output"], name="bash")]
        out.append(Message("assistant", task.payload["summary"]))
        return out

    def _run_reference(self, task: Task) -> list[dict[str, str]]:
        if task.task_id not in self._references:
            episode = self.start(task, None)
            try:
                steps = []
                for s in task.payload["solution"]:
                    obs = episode.step(ToolCall("bash", {"command": s["command"]}))
                    if obs.status != OK:
                        raise AssayError(f"terminal: running the reference of {task.payload.get('name')}: "
                                         f"{obs.content}")
                    steps.append({"command": s["command"], "output": obs.content})
            finally:
                episode.close()
            self._references[task.task_id] = steps
        return self._references[task.task_id]

    def start(self, task: Task, sandbox: Sandbox | None) -> TerminalEpisode:
        episode = TerminalEpisode(task, sandbox, sandbox is None, self.verify_limits)
        try:
            episode.sandbox = open_sandbox(self.sandbox_limits) if sandbox is None else sandbox
        except OSError as e:  # a launcher hiccup is this episode's infrastructure failure, not the batch's
            episode.setup_error = f"sandbox: {e}"
            return episode
        episode.setup_error = populate(episode.sandbox, task.payload["files"], task.payload.get("executable", []))
        return episode
