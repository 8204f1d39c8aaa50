"""The generated task families of the terminal environment: find, records, config, repair.

Each family is a function of (rng, level) that returns the workspace files, the instruction, the
hidden check (what verification compares against) and the reference: bash commands with the very
observations the episode returns for them (made by `format_result`, which the episode uses too), so
a reference needs no sandbox to be written. terminal.py documents what each level changes."""

from __future__ import annotations

import inspect
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from assay.envs.builtin._pyjudge import encode
from assay.sandbox.base import DISK, EXITED, OOM, OUTPUT_TRUNCATED, PIDS, TIMEOUT

ANSWER = "answer.txt"
OUTPUT_CHARS = 2000  # per stream: a small policy's context is short
_NOTES = {TIMEOUT: "killed: it ran past the time limit", OOM: "killed: out of memory",
          PIDS: "killed: too many processes", DISK: "stopped: disk or file size limit",
          OUTPUT_TRUNCATED: "output cut at the sandbox's limit"}


# ---- what the policy sees ------------------------------------------------------------------------------------------

def clip(text: str, limit: int = OUTPUT_CHARS) -> str:
    """Head and tail of a long output: errors tend to be at the end, context at the start."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def format_result(stdout: str, stderr: str, exit_code: int, status: str = EXITED) -> str:
    """One command's observation: its output, its errors, then how it ended. The reference's tool
    messages are made by this function too, so SFT sees exactly what the episode returns."""
    parts = [clip(stdout).rstrip("\n")]
    if stderr.strip():
        parts.append("[stderr]\n" + clip(stderr).rstrip("\n"))
    note = _NOTES.get(status)
    parts.append(f"[exit code {exit_code}{'; ' + note if note else ''}]")
    return "\n".join(p for p in parts if p)


def _step(command: str, stdout: str = "", stderr: str = "", exit_code: int = 0) -> dict[str, str]:
    """A reference call and the observation it gets (the generator knows every output it causes)."""
    return {"command": command, "output": format_result(stdout, stderr, exit_code)}


def _heredoc(path: str, text: str) -> str:
    return f"cat > {path} <<'EOF'\n{text.rstrip(chr(10))}\nEOF"


@dataclass
class Generated:
    instruction: str
    files: dict[str, str]
    check: dict[str, Any]  # hidden: what verification compares against
    solution: list[dict[str, str]]
    summary: str  # the reference's final message


# ---- find: which file holds a value --------------------------------------------------------------------------------

_DIRS = ("notes", "logs", "data", "archive", "docs", "reports", "backup", "misc")
_STEMS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "zeta", "iota", "rho", "tau")
_EXTS = (".txt", ".log", ".md", ".cfg")
_OWNERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi")
_STATUSES = ("open", "closed", "pending")
_FIND_SHAPE = {1: (3, 0), 2: (6, 1), 3: (9, 2), 4: (12, 2)}  # level -> (files, deepest directory nesting)
_WORD_CHAR = "A-Za-z0-9_"  # grep -w's word constituents


def _paths(rng: random.Random, n: int, depth: int) -> list[str]:
    paths: list[str] = []
    while len(paths) < n:
        name = rng.choice(_STEMS) + rng.choice(_EXTS)
        path = "/".join([*rng.sample(_DIRS, rng.randint(0, depth)), name])
        if path not in paths:
            paths.append(path)
    return paths


def _code(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2)) + f"-{rng.randint(1000, 9999)}"


def _record(rng: random.Random, refs: list[str], owner: str, status: str) -> str:
    lines = [f"owner: {owner}", f"status: {status}", *(f"ref: {r}" for r in refs), f"size: {rng.randint(1, 999)}"]
    return "\n".join(lines) + "\n"


def _find(rng: random.Random, level: int) -> Generated:
    n, depth = _FIND_SHAPE[level]
    paths = _paths(rng, n, depth)
    target = rng.randrange(n)
    if level == 4:
        return _find_two_lines(rng, paths, target)
    codes: set[str] = set()
    while len(codes) < 3 * n + 1:
        codes.add(_code(rng))
    pool = sorted(codes)
    rng.shuffle(pool)
    code = pool.pop()
    refs = [[pool.pop() for _ in range(rng.randint(1, 3))] for _ in paths]
    refs[target].insert(rng.randint(0, len(refs[target])), code)
    if level == 3:  # longer codes that start with the target: plain substring search finds them too
        for i in rng.sample([i for i in range(n) if i != target], 2):
            refs[i].append(code + str(rng.randint(0, 9)))
    files = {p: _record(rng, r, rng.choice(_OWNERS), rng.choice(_STATUSES)) for p, r in zip(paths, refs, strict=True)}
    word = re.compile(f"(?<![{_WORD_CHAR}]){re.escape(code)}(?![{_WORD_CHAR}])")
    assert [p for p, text in files.items() if word.search(text)] == [paths[target]]
    similar = "" if level < 3 else f" (as a whole code: longer codes that start with it, like {code}7, are other codes)"
    instruction = (f"Exactly one file under /workspace (subdirectories included) contains the code {code}{similar}. "
                   f"Write that file's path, relative to /workspace (like dir/file.txt), to {ANSWER}.")
    return _found(instruction, files, paths[target], f"grep -rlw -- '{code}' . | sort")


def _find_two_lines(rng: random.Random, paths: list[str], target: int) -> Generated:
    owner = rng.choice(_OWNERS)
    others = [o for o in _OWNERS if o != owner]
    rest = [i for i in range(len(paths)) if i != target]
    rng.shuffle(rest)
    files = {}
    for k, i in enumerate(rest):  # decoys: the owner with another status, and "open" with another owner
        who, status = (owner, rng.choice(_STATUSES[1:])) if k < 3 else (rng.choice(others), rng.choice(_STATUSES))
        files[paths[i]] = _record(rng, [_code(rng)], who, status)
    files[paths[target]] = _record(rng, [_code(rng)], owner, "open")
    files = {p: files[p] for p in paths}
    instruction = (f"Exactly one file under /workspace (subdirectories included) has both the line 'owner: {owner}' "
                   f"and the line 'status: open'. Write that file's path, relative to /workspace (like "
                   f"dir/file.txt), to {ANSWER}.")
    search = f"grep -rlx 'owner: {owner}' . | sort | xargs grep -lx 'status: open'"
    return _found(instruction, files, paths[target], search)


def _found(instruction: str, files: dict[str, str], path: str, search: str) -> Generated:
    solution = [_step(search, f"./{path}\n"), _step(f"echo '{path}' > {ANSWER} && cat {ANSWER}", f"{path}\n")]
    return Generated(instruction, files, {"answer": path, "kind": "path"}, solution, f"{ANSWER} names {path}.")


# ---- records: count or sum with standard tools ---------------------------------------------------------------------

_LEVELS = ("INFO", "DEBUG", "WARN", "ERROR")
_MESSAGES = {"INFO": ("request served", "cache warmed", "job finished", "session opened"),
             "DEBUG": ("retry scheduled", "payload parsed", "pool resized"),
             "WARN": ("slow response", "disk usage high", "queue growing"),
             "ERROR": ("connection refused", "db timeout", "invalid token", "write failed")}
_DECOYS = ("previous {} cleared", "{} count reset", "no {} since restart")  # INFO messages naming a level
_COMPONENTS = ("auth", "db", "api", "cache", "worker")
_REGIONS = ("north", "south", "east", "west")
_CUSTOMERS = ("acme", "globex", "initech", "umbrella", "hooli", "vandelay", "stark", "wayne")
_LOOKALIKE = {"north": "northwind", "south": "southgate", "east": "eastwood", "west": "westfield"}


def _log_lines(rng: random.Random, n: int, users: list[str] | None = None) -> list[str]:
    """Log lines in time order (`<time> <LEVEL> <component>: <message>`); a user field ends each when given."""
    t = rng.randint(0, 20000)
    out = []
    for _ in range(n):
        t += rng.randint(1, 400)
        level = rng.choices(_LEVELS, weights=(5, 2, 2, 2))[0]
        ts = f"2024-05-{1 + t // 86400:02d}T{t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}"
        line = f"{ts} {level} {rng.choice(_COMPONENTS)}: {rng.choice(_MESSAGES[level])}"
        out.append(line + (f" user={rng.choice(users)}" if users else ""))
    return out


def _records(rng: random.Random, level: int) -> Generated:
    while True:  # redraw until the answer is not a number the instruction shows
        g = (_count_level, _count_region, _sum_status, _distinct_users)[level - 1](rng)
        if not re.search(rf"\b{g.check['answer']}\b", g.instruction):
            return g


def _head(text: str, n: int = 5) -> str:
    return "".join(text.splitlines(keepends=True)[:n])


def _counted(instruction: str, files: dict[str, str], look: tuple[str, str], compute: str, answer: int) -> Generated:
    """`look` is a first command and its output; `compute` prints the answer, which goes to answer.txt."""
    solution = [_step(*look), _step(f"{compute} > {ANSWER} && cat {ANSWER}", f"{answer}\n")]
    return Generated(instruction + f" Write the number to {ANSWER}.", files,
                     {"answer": str(answer), "kind": "number"}, solution, f"{ANSWER} holds {answer}.")


# The question varies (level, status, file names) so that one task's procedure does not answer another's.

def _count_level(rng: random.Random) -> Generated:
    wanted, path = rng.choice(("ERROR", "WARN", "DEBUG")), rng.choice(("app.log", "server.log", "jobs.log"))
    lines = _log_lines(rng, rng.randint(16, 24))
    n = sum(line.split(" ")[1] == wanted for line in lines)
    if n < 2:
        return _count_level(rng)
    files = {path: "".join(line + "\n" for line in lines)}
    return _counted(f"How many lines of {path} have the level {wanted}?", files,
                    (f"head -n 5 {path}", _head(files[path])),
                    f"awk '$2 == \"{wanted}\" {{n++}} END {{print n+0}}' {path}", n)


def _orders(rng: random.Random, n: int, with_status: bool) -> list[list[Any]]:
    rows = []
    for i in range(n):
        row: list[Any] = [i + 1, rng.choice(_CUSTOMERS), rng.choice(_REGIONS)]
        if with_status:
            row.append(rng.choice(("paid", "paid", "refunded", "refunded", "pending")))
        rows.append([*row, rng.randint(5, 500)])
    return rows


def _csv(header: str, rows: list[list[Any]]) -> str:
    return header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows)


def _count_region(rng: random.Random) -> Generated:
    region, path = rng.choice(_REGIONS), rng.choice(("orders.csv", "sales.csv"))
    rows = _orders(rng, rng.randint(16, 22), with_status=False)
    decoy = rng.choice([r for r in rows if r[2] != region] or rows)  # grep for the word would count it
    decoy[1:3] = [_LOOKALIKE[region], rng.choice([g for g in _REGIONS if g != region])]
    n = sum(r[2] == region for r in rows)
    if n < 2:
        return _count_region(rng)
    files = {path: _csv("id,customer,region,amount", rows)}
    return _counted(f"How many orders in {path} are from the region {region}?", files,
                    (f"head -n 5 {path}", _head(files[path])),
                    f"awk -F, 'NR > 1 && $3 == \"{region}\" {{n++}} END {{print n+0}}' {path}", n)


def _sum_status(rng: random.Random) -> Generated:
    region, status = rng.choice(_REGIONS), rng.choice(("paid", "refunded"))
    path = rng.choice(("orders.csv", "sales.csv"))
    rows = _orders(rng, rng.randint(18, 24), with_status=True)
    hits = [r for r in rows if r[2] == region and r[3] == status]
    if len(hits) < 2 or not any(r[2] == region and r[3] != status for r in rows):
        return _sum_status(rng)
    files = {path: _csv("id,customer,region,status,amount", rows)}
    return _counted(f"What is the total amount of the {status} orders from the region {region} in {path}?", files,
                    (f"head -n 5 {path}", _head(files[path])),
                    f"awk -F, 'NR > 1 && $3 == \"{region}\" && $4 == \"{status}\" {{s += $5}} END {{print s+0}}' "
                    f"{path}", sum(r[4] for r in hits))


def _distinct_users(rng: random.Random) -> Generated:
    wanted, where = rng.choice(("ERROR", "WARN")), rng.choice(("logs", "var/log"))
    users = rng.sample(_OWNERS, 6)
    decoy = users[0]  # seen only in INFO lines that name the level: counting lines that contain it counts them too
    logs = {}
    for name in ("auth", "web", "worker"):
        lines = _log_lines(rng, rng.randint(8, 11), users)
        logs[f"{where}/{name}.log"] = [ln for ln in lines
                                       if not (ln.endswith(f" user={decoy}") and ln.split(" ")[1] == wanted)]
    first = logs[f"{where}/auth.log"]
    at = rng.randrange(len(first))
    note = rng.choice(_DECOYS).format(wanted)
    first.insert(at, first[at].split(" ")[0] + f" INFO api: {note} user={decoy}")
    hit = {ln.rsplit("user=", 1)[1] for lines in logs.values() for ln in lines if ln.split(" ")[1] == wanted}
    if not hit:
        return _distinct_users(rng)
    files = {p: "".join(ln + "\n" for ln in lines) for p, lines in logs.items()}
    listing = "".join(p.rsplit("/", 1)[1] + "\n" for p in sorted(files))
    return _counted(f"How many distinct users have at least one line with the level {wanted} in the log files "
                    f"under {where}/?", files,
                    (f"ls {where} && head -n 5 {where}/auth.log", listing + _head(files[f"{where}/auth.log"])),
                    f"awk '$2 == \"{wanted}\" && !seen[$NF]++ {{n++}} END {{print n+0}}' {where}/*.log", len(hit))


# ---- config: make run.py start ---------------------------------------------------------------------------------------

_SERVICES = ("api", "billing", "search", "mailer", "gateway", "indexer")
_MODES = ("fast", "safe", "debug")
_LOGS = ("debug", "info", "warn", "error")
_NESTED = {"name": "server.name", "port": "server.port", "mode": "pool.mode", "workers": "pool.workers",
           "log": "log.level"}


def check_config(text: str, fmt: str, path: str, keys: tuple) -> tuple:
    """(exit code, message) of the service for a config text: 0 and its ready line only if it is valid."""
    choices = {"mode": ("fast", "safe", "debug"), "log": ("debug", "info", "warn", "error")}
    choices["level"] = choices["log"]
    cfg = {}
    if fmt == "json":
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError):
            return 1, f"error: {path} is not valid JSON"
        if not isinstance(raw, dict):
            return 1, f"error: {path}: the top level must be an object"
        for key, value in raw.items():  # one level of sections: {"server": {"port": 80}} is server.port
            if isinstance(value, dict):
                cfg.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                cfg[key] = value
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                if "=" not in line:
                    return 1, f"error: {path}: line {n}: expected key = value"
                key, value = line.split("=", 1)
                cfg[key.strip()] = value.strip()
    for key in cfg:
        if key not in keys:
            return 1, f"error: {path}: unknown key {key!r}"
    ready = []
    for key in keys:
        if key not in cfg:
            return 1, f"error: {path}: missing key {key!r}"
        field, value = key.rsplit(".", 1)[-1], cfg[key]
        if fmt == "kv" and field in ("port", "workers") and value.isascii() and value.isdigit():
            value = int(value)
        if field == "name":
            ok, rule = isinstance(value, str) and value.isascii() and value.isalpha() and value.islower(), \
                "lower-case letters"
        elif field in ("port", "workers"):
            low, high = (1024, 65535) if field == "port" else (1, 64)
            ok, rule = type(value) is int and low <= value <= high, f"an integer from {low} to {high}"
        else:
            ok, rule = isinstance(value, str) and value in choices[field], "one of " + ", ".join(choices[field])
        if not ok:
            return 1, f"error: {path}: {key} must be {rule}, got {value!r}"
        ready.append(value if field == "name" else f"{field}={value}")
    return 0, "ready: " + " ".join(ready)


_RUN_MAIN = '''

def main():
    try:
        with open(CONFIG, encoding="utf-8") as f:
            text = f.read(65536)
    except (OSError, ValueError) as e:
        print(f"error: cannot read {CONFIG}: {e}", file=sys.stderr)
        sys.exit(1)
    code, message = check_config(text, FORMAT, CONFIG, KEYS)
    print(message, file=sys.stderr if code else sys.stdout)
    sys.exit(code)


main()
'''


def _run_py(service: str, path: str, fmt: str, keys: tuple[str, ...]) -> str:
    return (f'"""Start the {service} service: read {path}, check it, print the ready line."""\n\n'
            f"import json\nimport sys\n\nCONFIG = {path!r}\nFORMAT = {fmt!r}\nKEYS = {keys!r}\n\n\n"
            + inspect.getsource(check_config) + _RUN_MAIN)


def _render(values: dict[str, Any], fmt: str, nested: bool, service: str) -> str:
    if fmt == "kv":
        return f"# settings of the {service} service\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
    if not nested:
        return json.dumps(values, indent=2) + "\n"
    tree: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, leaf = key.split(".")
        tree.setdefault(section, {})[leaf] = value
    return json.dumps(tree, indent=2) + "\n"


def _draw_values(rng: random.Random, with_log: bool) -> dict[str, Any]:
    values = {"name": rng.choice(_SERVICES), "port": rng.randint(7000, 9999), "mode": rng.choice(_MODES),
              "workers": rng.randint(2, 16)}
    if with_log:
        values["log"] = rng.choice(_LOGS)
    return values


def _loud_fault(rng: random.Random, values: dict[str, Any], keys: dict[str, str], fmt: str) -> str:
    """Break one entry so run.py refuses to start; the field broken."""
    field = rng.choice([f for f in keys if f != "name"])
    kind = rng.choice(("missing", "typo", "invalid"))
    key = keys[field]
    if kind == "missing":
        del values[key]
    elif kind == "typo":
        leaf = key.rsplit(".", 1)[-1]
        typo = leaf[0] + leaf[2] + leaf[1] + leaf[3:]
        values[key[: len(key) - len(leaf)] + typo] = values.pop(key)
    elif field == "port":
        values[key] = values[key] * 10 + rng.randint(0, 9)
    elif field == "workers":
        values[key] = str(values[key]) if fmt == "json" else rng.choice(("four", "many", "auto"))
    else:
        good = values[key]
        values[key] = good[1] + good[0] + good[2:]
    return field


def _silent_fault(rng: random.Random, values: dict[str, Any], keys: dict[str, str], loud: str) -> None:
    """A valid but wrong value: run.py starts, with the wrong ready line."""
    field = rng.choice([f for f in ("port", "mode", "workers") if f != loud])
    key = keys[field]
    if field == "mode":
        values[key] = rng.choice([m for m in _MODES if m != values[key]])
    else:
        values[key] += rng.randint(1, 9)


def _config(rng: random.Random, level: int) -> Generated:
    fmt, nested = ("kv" if level <= 2 else "json"), level == 4
    path = "app.conf" if fmt == "kv" else "config.json"
    good = _draw_values(rng, with_log=level >= 2)
    keys = {f: (_NESTED[f] if nested else f) for f in good}
    service = good["name"]
    good_flat = {keys[f]: v for f, v in good.items()}
    broken = dict(good_flat)
    loud = _loud_fault(rng, broken, keys, fmt)
    if level in (2, 4):
        _silent_fault(rng, broken, keys, loud)
    fixed_text = _render(good_flat, fmt, nested, service)
    broken_text = _render(broken, fmt, nested, service)
    if fmt == "json":  # a trailing comma: the file does not even parse
        at = broken_text.rindex("\n}")
        broken_text = broken_text[:at] + "," + broken_text[at:]
    key_order = tuple(keys.values())
    code, expected = check_config(fixed_text, fmt, path, key_order)
    broken_code, error = check_config(broken_text, fmt, path, key_order)
    assert code == 0 and broken_code == 1, (expected, error)
    files = {path: broken_text, "run.py": _run_py(service, path, fmt, key_order)}
    if nested:  # a decoy: valid, with other values
        example = {keys[f]: v for f, v in _draw_values(rng, True).items()}
        files["config.example.json"] = _render(example, fmt, nested, service)
    instruction = (f"`python3 run.py` should start the {service} service, but it fails. Fix {path} (do not change "
                   f"run.py) so that `python3 run.py` exits with status 0 and prints exactly:\n{expected}")
    solution = [_step("python3 run.py", stderr=error + "\n", exit_code=1), _step(f"cat {path}", broken_text),
                _step(_heredoc(path, fixed_text)), _step("python3 run.py", expected + "\n")]
    return Generated(instruction, files, {"program": files["run.py"], "expected": expected}, solution,
                     f"Fixed {path}; run.py now starts the service.")


# ---- repair: fix a module against hidden tests ---------------------------------------------------------------------

@dataclass(frozen=True)
class Func:
    name: str
    args: str
    doc: str
    good: str  # the return expression
    bad: str  # the same, with the bug
    inputs: Callable[[random.Random], list[Any]]


def _nums(rng: random.Random) -> list[Any]:
    return [[rng.randint(0, 12) for _ in range(rng.randint(1, 6))]]


def _spaced(rng: random.Random) -> list[Any]:
    words = rng.sample(("red", "fox", "sky", "tea", "owl", "sun", "cat"), rng.randint(1, 4))
    return [" " * rng.randint(0, 2) + "".join(w + " " * rng.randint(1, 3) for w in words)[:-1]]


def _maybe_palindrome(rng: random.Random) -> list[Any]:
    half = "".join(rng.choice("abcde") for _ in range(rng.randint(1, 3)))
    word = half + rng.choice(("", "x")) + half[::-1] if rng.random() < 0.7 else half + "yz"
    return ["".join(c.upper() if rng.random() < 0.3 else c for c in word)]


def _name(rng: random.Random) -> list[Any]:
    return [" ".join(rng.sample(("ada", "alan", "grace", "linus", "barbara", "ken", "dennis"), rng.randint(1, 3)))]


FUNCS = (
    Func("clamp", "x, lo, hi", "x limited to the range lo..hi (lo <= hi).", "max(lo, min(x, hi))",
         "min(lo, max(x, hi))", lambda r: [r.randint(-5, 25), lo := r.randint(0, 10), lo + r.randint(1, 10)]),
    Func("mean", "xs", "The average of the numbers in xs (not empty).", "sum(xs) / len(xs)", "sum(xs) // len(xs)",
         _nums),
    Func("count_words", "s", "The number of words in s; words are separated by any run of spaces.",
         "len(s.split())", "len(s.split(' '))", _spaced),
    Func("is_palindrome", "s", "True if s reads the same backwards, ignoring upper/lower case.",
         "s.lower() == s.lower()[::-1]", "s == s[::-1]", _maybe_palindrome),
    Func("range_sum", "a, b", "The sum of the integers from a to b, both included (a <= b).",
         "sum(range(a, b + 1))", "sum(range(a, b))", lambda r: [a := r.randint(-5, 10), a + r.randint(0, 10)]),
    Func("initials", "name", "The first letter of each word of name, in upper case.",
         "''.join(w[0].upper() for w in name.split())", "''.join(w[0] for w in name.split())", _name),
    Func("dedupe", "xs", "The items of xs without repeats, in the order they first appear.",
         "list(dict.fromkeys(xs))", "sorted(set(xs))", lambda r: [[r.randint(0, 6) for _ in range(r.randint(2, 8))]]),
    Func("last_n", "xs, n", "The last n items of xs (all of xs when n > len(xs)); n >= 1.", "xs[-n:]",
         "xs[-n + 1:]", lambda r: [[r.randint(0, 9) for _ in range(r.randint(1, 6))], r.randint(1, 7)]),
    Func("percent", "part, whole", "part as a percentage of whole, rounded to the nearest integer.",
         "round(100 * part / whole)", "round(part / whole) * 100",
         lambda r: [r.randint(0, whole := r.randint(2, 50)), whole]),
    Func("total_price", "items", "The total of quantity * price over items, a list of [quantity, price] pairs.",
         "sum(q * p for q, p in items)", "sum(q + p for q, p in items)",
         lambda r: [[[r.randint(1, 5), r.randint(1, 20)] for _ in range(r.randint(1, 4))]]),
    Func("capitalize_words", "s", "s with each word's first letter in upper case and the rest in lower case.",
         "' '.join(w.capitalize() for w in s.split())", "' '.join(w.upper() for w in s.split())", _name),
    Func("even_squares", "xs", "The squares of the even items of xs, in order.", "[x * x for x in xs if x % 2 == 0]",
         "[x * x for x in xs if x % 2]", _nums),
    Func("safe_div", "a, b", "a divided by b rounded down, or 0 when b is 0.", "a // b if b else 0",
         "a // b if a else 0", lambda r: [r.randint(0, 30), r.choice((0, r.randint(1, 7)))]),
)
_REPAIR_SHAPE = {1: ((2,), 1), 2: ((3,), 2), 3: ((2, 2), 2), 4: ((3, 2), 3)}  # level -> (functions per module, bugs)
_MODULE_NAMES = ("utils", "helpers", "toolkit", "textops", "numops")
N_HIDDEN = 6


def _outcome(fn: Callable[..., Any], args: list[Any]) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Exception as e:  # our own buggy reference code (safe_div), never model output
        return "error", type(e).__name__


def _compile(func: Func, body: str) -> Callable[..., Any]:
    ns: dict[str, Any] = {}
    exec(f"def {func.name}({func.args}):\n    return {body}", ns)  # our own code: the expected values come from it
    return ns[func.name]


def _draw_cases(rng: random.Random, func: Func, buggy: bool) -> tuple[list[Any], list[list[Any]]]:
    """The docstring's example and the hidden inputs, all distinct, with at least two different expected
    outputs (so no constant passes, the example's included); when `buggy`, the example and at least two
    hidden inputs tell the bug apart."""
    good, bad = _compile(func, func.good), _compile(func, func.bad)
    while True:
        seen: list[list[Any]] = []
        for _ in range(300):
            args = json.loads(json.dumps(func.inputs(rng)))  # as the harness will receive them
            if args not in seen:
                seen.append(args)
            if len(seen) == N_HIDDEN + 1:
                break
        telling = [a for a in seen if _outcome(good, a) != _outcome(bad, a)]
        if buggy and len(telling) < 3:
            continue
        example = telling[0] if buggy else seen[0]
        hidden = [a for a in seen if a != example]
        if len({repr(good(*a)) for a in hidden}) > 1:
            return example, hidden


def _module(doc: str, defs: list[tuple[Func, str, list[Any]]]) -> str:
    out = f'"""{doc}"""\n'
    for func, body, example in defs:
        call = f"{func.name}({', '.join(map(repr, example))})"
        out += (f'\n\ndef {func.name}({func.args}):\n    """{func.doc}\n\n    >>> {call}\n'
                f'    {_compile(func, func.good)(*example)!r}\n    """\n    return {body}\n')
    return out


def _repair(rng: random.Random, level: int) -> Generated:
    sizes, n_bugs = _REPAIR_SHAPE[level]
    funcs = rng.sample(FUNCS, sum(sizes))
    names = rng.sample(_MODULE_NAMES, len(sizes))
    owner = [m for m, size in zip(names, sizes, strict=True) for _ in range(size)]
    # Every module gets a bug; the rest go anywhere.
    first = [owner.index(m) for m in names]
    buggy = set(first + rng.sample([i for i in range(len(funcs)) if i not in first], n_bugs - len(first)))
    calls, expected, broken, fixed = [], [], {}, {}
    for i, func in enumerate(funcs):
        example, hidden = _draw_cases(rng, func, i in buggy)
        good = _compile(func, func.good)
        for args in hidden:
            calls.append([owner[i], func.name, args])
            expected.append(json.loads(json.dumps(encode(good(*args)))))
        broken.setdefault(owner[i], []).append((func, func.bad if i in buggy else func.good, example))
        fixed.setdefault(owner[i], []).append((func, func.good, example))
    doc = "Small helpers used across the project."
    files = {f"{m}.py": _module(doc, broken[m]) for m in names}
    fixes = {f"{m}.py": _module(doc, fixed[m]) for m in names}
    paths = " ".join(files)
    listed = " and ".join(files)
    instruction = (f"Some functions in {listed} do not do what their docstrings say. Fix them so that every "
                   "function behaves as documented: hidden tests will call each one with other inputs. Keep the "
                   "names and signatures.")
    solution = [_step(f"cat {paths}", "".join(files.values())),
                *(_step(_heredoc(p, text)) for p, text in fixes.items()),
                _step(f"python3 -m doctest {paths} && echo all doctests pass", "all doctests pass\n")]
    check = {"calls": calls, "expected": expected,
             "buggy": sorted(f"{owner[i]}.{funcs[i].name}" for i in buggy)}
    return Generated(instruction, files, check, solution, f"Fixed the bugs in {listed}.")


FAMILIES: dict[str, Callable[[random.Random, int], Generated]] = {
    "config": _config, "find": _find, "records": _records, "repair": _repair}
