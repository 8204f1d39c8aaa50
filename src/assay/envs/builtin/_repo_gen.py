"""The `repo` environment's generator: small multi-module Python packages with seeded faults.

A package is built from *stacks*: three modules, a leaf (no imports), a middle module that imports
the leaf and a top module that imports both, each a few pure functions with docstrings that say
what they do. A template's source marks its fault sites as `⟦kind:correct|wrong⟧` (kind: op, off,
swap, import, case) and its constants as `$NAME`; `$pkg` is the package's name. Rendering picks the
correct text everywhere except at the sites a task mutates.

Expected values come from running the correct package here, on the host, under a private module
name (the code is ours, pure and fast); a fault counts only if some test it would fail is drawn, so
every task's workspace fails its visible tests and its hidden tests and the reference passes both."""

from __future__ import annotations

import difflib
import random
import re
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from assay.envs.builtin._pyjudge import encode

SITE = re.compile(r"⟦(\w+):(.*?)\|(.*?)⟧", re.DOTALL)
CONST = re.compile(r"\$(\w+)")
# Many names: two tasks with one fault at one site share a fix only when they also share the package's name.
PACKAGES = ("acme", "atlas", "beacon", "birch", "campus", "cedar", "comet", "delta_kit", "ember", "fable", "falcon",
            "garnet", "harbor", "helix", "indigo", "juniper", "kestrel", "lantern", "ledger", "marble", "nimbus",
            "onyx", "orchard", "pebble", "quill", "raven", "saffron", "summit", "tessera", "willow")

ArgGen = Callable[[random.Random, dict[str, int]], str]  # the argument list of one call, as source


@dataclass(frozen=True)
class Module:
    name: str
    source: str
    tests: dict[str, ArgGen]  # function -> random arguments
    edges: dict[str, tuple[str, ...]] = field(default_factory=dict)  # function -> fixed edge-case arguments
    features: tuple[str, ...] = ()  # functions no other code calls: an L3 task may ask for one


@dataclass(frozen=True)
class Stack:
    name: str
    modules: tuple[Module, Module, Module]  # leaf, middle, top
    consts: Callable[[random.Random], dict[str, int]]


# ---- argument generators --------------------------------------------------------------------------------------------

def _ints(*ranges: tuple[int, int]) -> ArgGen:
    return lambda r, c: ", ".join(str(r.randint(lo, hi)) for lo, hi in ranges)


def _near(name: str, spread: int = 2) -> ArgGen:
    """One integer at or next to the constant `name`: the boundaries a comparison gets wrong."""
    return lambda r, c: str(c[name] + r.randint(-spread, spread))


def _lines(r: random.Random, c: dict[str, int], lo: int = 0) -> str:
    return repr([(r.randint(50, 999), r.randint(1, 30)) for _ in range(r.randint(lo, 4))])


def _scores(r: random.Random, lo: int = 0) -> list[int]:
    return [r.randint(20, 100) for _ in range(r.randint(lo, 5))]


_WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "amber", "delta", "ember", "frost", "grove", "haven",
          "ivory", "jolly", "karma", "lemon", "north", "oasis", "pearl", "quiet", "a", "an", "of", "to", "sky", "sun")


def _text(r: random.Random, lo: int = 1, hi: int = 9) -> str:
    pool = r.sample(_WORDS, 5)  # few distinct words: counts and ties
    return " ".join(r.choice(pool).capitalize() if r.random() < 0.3 else r.choice(pool) for _ in range(r.randint(lo, hi)))


def _hhmm(m: int) -> str:
    return f"{m // 60 % 24:02d}:{m % 60:02d}"


def _meeting(r: random.Random, wrap: bool = False) -> tuple[str, str]:
    start = r.randrange(6 * 60, 20 * 60, 15)
    if wrap and r.random() < 0.5:
        start = r.randrange(22 * 60, 24 * 60, 15)
        return _hhmm(start), _hhmm(start + r.randrange(30, 180, 15))
    return _hhmm(start), _hhmm(start + r.randrange(15, 180, 15))


def _meetings(r: random.Random, lo: int = 0) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for _ in range(r.randint(lo, 4)):
        if out and r.random() < 0.4:  # one starting when the last ends: touching is not overlapping
            start = out[-1][1]
            out.append((start, _hhmm(_minutes(start) + r.randrange(15, 90, 15))))
        else:
            out.append(_meeting(r))
    return out


def _minutes(hhmm: str) -> int:
    h, m = hhmm.split(":")
    return int(h) * 60 + int(m)


def _touching(r: random.Random, c: dict[str, int]) -> str:
    a = _meeting(r)
    if r.random() < 0.5:
        b = (a[1], _hhmm(_minutes(a[1]) + 30))
    else:
        b = _meeting(r)
    return f"{a!r}, {b!r}"


# ---- the stacks -----------------------------------------------------------------------------------------------------

MONEY = Module("money", '''\
"""Whole-number money helpers (amounts in cents)."""


def percent_of(amount, rate):
    """rate percent of amount, rounded down to a whole cent."""
    return amount * rate ⟦op://|%⟧ 100


def floor_to(amount, step):
    """amount rounded down to a multiple of step."""
    return amount ⟦op:-|+⟧ amount % step


def ceil_to(amount, step):
    """amount rounded up to a multiple of step."""
    return -(-amount // step) * step
''', {"percent_of": _ints((1, 5000), (1, 60)), "floor_to": _ints((0, 999), (2, 25)),
      "ceil_to": _ints((0, 999), (2, 25))})

PRICING = Module("pricing", '''\
"""Prices of order lines: a bulk discount, then rounding."""

from $pkg.money import percent_of, ⟦import:floor_to|ceil_to⟧ as snap

BULK_QTY = $BULK
BULK_RATE = $RATE
SMALL_BULK_QTY = $SMALL
SMALL_BULK_RATE = $SRATE


def bulk_rate(qty):
    """The discount in percent for qty units: BULK_RATE from BULK_QTY units, SMALL_BULK_RATE from
    SMALL_BULK_QTY units, else 0."""
    if qty ⟦op:>=|>⟧ BULK_QTY:
        return BULK_RATE
    ⟦case:if qty >= SMALL_BULK_QTY:
        return SMALL_BULK_RATE
    |⟧return 0


def line_total(price, qty):
    """price * qty less its bulk discount, rounded down to a multiple of $STEP."""
    gross = price * qty
    net = gross - percent_of(gross, bulk_rate(qty))
    return snap(⟦swap:net, $STEP|$STEP, net⟧)
''', {"bulk_rate": lambda r, c: r.choice([_near("BULK"), _near("SMALL"), _ints((1, 30))])(r, c),
      "line_total": lambda r, c: f"{r.randint(50, 999)}, {r.choice([_near('BULK'), _near('SMALL'), _ints((1, 30))])(r, c)}"})

CART = Module("cart", '''\
"""A cart is a list of (price, qty) lines."""

from $pkg.pricing import line_total


def cart_total(lines):
    """The sum of line_total(price, qty) over the cart's lines."""
    total = 0
    for price, qty in lines:
        total += line_total(price, qty)
    return total


def most_expensive(lines):
    """The line with the largest line total (the first such line on a tie); None for an empty cart."""
    ⟦case:if not lines:
        return None
    |⟧best = lines[0]
    for line in lines[⟦off:1|2⟧:]:
        if line_total(*line) ⟦op:>|<⟧ line_total(*best):
            best = line
    return best


def item_count(lines):
    """The number of units in the cart."""
    return sum(qty for _, qty in lines)
''', {"cart_total": _lines, "most_expensive": lambda r, c: _lines(r, c, lo=1), "item_count": _lines},
    edges={"most_expensive": ("[]",), "cart_total": ("[]",)}, features=("most_expensive", "cart_total"))

SHOP = Stack("shop", (MONEY, PRICING, CART), lambda r: (lambda bulk: {
    "BULK": bulk, "SMALL": r.randint(3, bulk - 4), "RATE": r.choice([15, 20, 25]), "SRATE": r.choice([5, 10]),
    "STEP": r.choice([5, 10, 25])})(r.randint(12, 20)))

NUMBERS = Module("numbers", '''\
"""Integer statistics."""


def total(xs):
    """The sum of xs."""
    result = 0
    for x in xs:
        result += x
    return result


def mean(xs):
    """The mean of xs rounded down; 0 for no values."""
    ⟦case:if not xs:
        return 0
    |⟧return total(xs) ⟦op://|%⟧ len(xs)


def clamp(x, lo, hi):
    """x limited to the range lo..hi."""
    return max(lo, min(x, hi))
''', {"total": lambda r, c: repr(_scores(r)), "mean": lambda r, c: repr(_scores(r, lo=1)),
      "clamp": lambda r, c: (lambda lo: f"{r.randint(-50, 150)}, {lo}, {lo + r.randint(0, 100)}")(r.randint(-20, 40))},
    edges={"mean": ("[]",), "total": ("[]",)})

SCORING = Module("scoring", '''\
"""Scores out of $MAX and their letters."""

from $pkg.numbers import clamp

MAX_SCORE = $MAX
A_FROM = $A
B_FROM = $B
C_FROM = $C


def curve(scores, bonus):
    """Each score plus bonus, kept within 0..MAX_SCORE."""
    return [clamp(⟦swap:s + bonus, 0|0, s + bonus⟧, MAX_SCORE) for s in scores]


def letter(score):
    """A from A_FROM, B from B_FROM, C from C_FROM, else F."""
    if score ⟦op:>=|>⟧ A_FROM:
        return "A"
    if score >= B_FROM:
        return "B"
    ⟦case:if score >= C_FROM:
        return "C"
    |⟧return "F"
''', {"curve": lambda r, c: f"{_scores(r, lo=1)!r}, {r.randint(0, 30)}",
      "letter": lambda r, c: r.choice([_near("A"), _near("B"), _near("C"), _ints((0, 100))])(r, c)})

GRADEBOOK = Module("gradebook", '''\
"""Course results."""

from $pkg.numbers import ⟦import:mean|total as mean⟧
from $pkg.scoring import curve, letter

PASS_FROM = $PASS


def report(scores, bonus):
    """A dict: the curved scores' mean, its letter and the best curved score (0 for no scores)."""
    curved = curve(scores, bonus)
    average = mean(curved)
    return {"mean": average, "letter": letter(average), "best": max(curved, default=0)}


def passed(scores, bonus):
    """How many curved scores are at least PASS_FROM."""
    return len([s for s in curve(scores, bonus) if s ⟦op:>=|<=⟧ PASS_FROM])


def ranking(names, scores):
    """The names ordered by score, highest first (the earlier name first on a tie)."""
    order = sorted(range(len(names)), key=lambda i: (-scores[i], i))
    return [names[i] for i in order]
''', {"report": lambda r, c: f"{_scores(r, lo=1)!r}, {r.randint(0, 30)}",
      "passed": lambda r, c: f"{_scores(r, lo=1)!r}, {r.randint(0, 15)}",
      "ranking": lambda r, c: (lambda n: f"{r.sample(['ana', 'bo', 'cy', 'dee', 'eli', 'fay'], n)!r}, "
                                         f"{[r.choice([60, 70, 75, 80, 90]) for _ in range(n)]!r}")(r.randint(1, 5))},
    edges={"report": ("[], 5",), "ranking": ("[], []",)}, features=("passed", "ranking", "report"))

GRADES = Stack("grades", (NUMBERS, SCORING, GRADEBOOK), lambda r: (lambda a: {
    "MAX": 100, "A": a, "B": a - r.randint(8, 12), "C": a - r.randint(18, 25), "PASS": r.randint(45, 65)})(
    r.randint(85, 92)))

WORDS = Module("words", '''\
"""Word helpers."""


def words(text):
    """The lower-cased words of text, split on whitespace."""
    return text.lower().split()


def initials(name):
    """The upper-cased first letters of name's words."""
    return "".join(w[0].upper() for w in name.split())


def shorten(text, width):
    """text if it fits in width characters, else its first width - 3 characters and '...'."""
    if len(text) ⟦op:<=|<⟧ width:
        return text
    return text[:width ⟦off:- 3|- 2⟧] + "..."
''', {"words": lambda r, c: repr(_text(r)), "initials": lambda r, c: repr(_text(r, 1, 4)),
      "shorten": lambda r, c: (lambda t: f"{t!r}, {max(4, len(t) + r.randint(-6, 1))}")(_text(r, 1, 5))})

INDEX = Module("index", '''\
"""Word counts."""

from $pkg.words import words


def counts(text):
    """A dict from each word of text to how often it occurs."""
    result = {}
    for w in words(text):
        result[w] = result.get(w, 0) ⟦op:+|-⟧ 1
    return result


def top(text, k):
    """The k most frequent words, most frequent first, ties alphabetical; none for k <= 0."""
    ⟦case:if k <= 0:
        return []
    |⟧ranked = sorted(counts(text).items(), key=lambda item: (-item[1], item[0]))
    return [w for w, _ in ranked[⟦off::k|:k + 1⟧]]
''', {"counts": lambda r, c: repr(_text(r)), "top": lambda r, c: f"{_text(r, 3)!r}, {r.randint(-1, 3)}"},
    edges={"top": ("'a b c', -1", "'a b c', 0")})

DIGEST = Module("digest", '''\
"""One-line digests of a text."""

from $pkg.index import top
from $pkg.words import initials, shorten, words

WIDTH = $WIDTH


def headline(text):
    """The text shortened to WIDTH characters."""
    return shorten(⟦swap:text, WIDTH|WIDTH, text⟧)


def digest(text, k):
    """A dict: the number of words, the k top words, and the headline."""
    return {"words": len(words(text)), "top": top(text, k), "headline": headline(text)}


def acronym(title):
    """The initials of title's words longer than $MINLEN letters."""
    return initials(" ".join(w for w in title.split() if len(w) ⟦op:>|>=⟧ $MINLEN))
''', {"headline": lambda r, c: repr(_text(r, 1, 8)), "digest": lambda r, c: f"{_text(r, 2, 8)!r}, {r.randint(1, 3)}",
      "acronym": lambda r, c: repr(_text(r, 2, 6))},
    edges={"acronym": ("''",)}, features=("digest", "acronym"))

TEXT = Stack("text", (WORDS, INDEX, DIGEST), lambda r: {"WIDTH": r.randint(14, 24), "MINLEN": r.choice([2, 3, 4])})

CLOCK = Module("clock", '''\
"""Times of day as "HH:MM" strings and minutes since midnight."""

MINUTES_PER_DAY = 1440


def to_minutes(hhmm):
    """Minutes since midnight of an "HH:MM" string."""
    hours, minutes = hhmm.split(":")
    return int(hours) ⟦op:*|+⟧ 60 + int(minutes)


def to_hhmm(minutes):
    """The "HH:MM" string of a number of minutes, wrapping past midnight."""
    hours, mins = divmod(minutes % MINUTES_PER_DAY, 60)
    return f"{hours:02d}:{mins:02d}"
''', {"to_minutes": lambda r, c: repr(_hhmm(r.randrange(0, 1440))), "to_hhmm": _ints((0, 3000))})

SLOTS = Module("slots", '''\
"""Meetings are (start, end) pairs of "HH:MM" strings."""

from $pkg.clock import MINUTES_PER_DAY, to_hhmm, to_minutes


def duration(meeting):
    """The meeting's length in minutes; one that ends before it starts runs past midnight."""
    start, end = to_minutes(meeting[0]), to_minutes(meeting[1])
    ⟦case:if end < start:
        end += MINUTES_PER_DAY
    |⟧return end ⟦op:-|+⟧ start


def overlaps(a, b):
    """Whether meetings a and b share a minute (touching ends do not count)."""
    return to_minutes(a[0]) ⟦op:<|<=⟧ to_minutes(b[1]) and to_minutes(b[0]) < to_minutes(a[1])


def shift(meeting, minutes):
    """The meeting moved later by minutes."""
    return (to_hhmm(to_minutes(meeting[0]) + minutes), to_hhmm(to_minutes(meeting[1]) + minutes))
''', {"duration": lambda r, c: repr(_meeting(r, wrap=True)), "overlaps": _touching,
      "shift": lambda r, c: f"{_meeting(r)!r}, {r.randrange(15, 600, 15)}"})

PLANNER = Module("planner", '''\
"""A day's plan."""

from $pkg.slots import ⟦import:duration|shift as duration⟧, overlaps

MAX_MEETINGS = $MAXM


def busy_minutes(meetings):
    """The total length of the meetings."""
    return sum(duration(m) for m in meetings)


def conflicts(meetings):
    """The index pairs (i, j), i < j, of meetings that overlap, in order."""
    found = []
    for i in range(len(meetings)):
        for j in range(i ⟦off:+ 1|⟧, len(meetings)):
            if overlaps(meetings[i], meetings[j]):
                found.append((i, j))
    return found


def fits(meetings, new):
    """Whether new overlaps none of the meetings and the day stays within MAX_MEETINGS meetings."""
    return len(meetings) ⟦op:<|<=⟧ MAX_MEETINGS and not any(overlaps(m, new) for m in meetings)
''', {"busy_minutes": lambda r, c: repr(_meetings(r, lo=1)), "conflicts": lambda r, c: repr(_meetings(r, lo=2)),
      "fits": lambda r, c: f"{_meetings(r, lo=c['MAXM'] - 1)!r}, {_meeting(r)!r}"},
    edges={"conflicts": ("[]",), "busy_minutes": ("[]",)}, features=("conflicts", "fits", "busy_minutes"))

PLAN = Stack("plan", (CLOCK, SLOTS, PLANNER), lambda r: {"MAXM": r.randint(2, 4)})

STACKS = (SHOP, GRADES, TEXT, PLAN)


# ---- rendering ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Site:
    module: str
    index: int  # the site's place among its module's sites
    kind: str
    correct: str
    wrong: str


def sites(module: Module) -> list[Site]:
    return [Site(module.name, i, m.group(1), m.group(2), m.group(3)) for i, m in enumerate(SITE.finditer(module.source))]


def render(module: Module, pkg: str, consts: dict[str, int], mutate: frozenset[int] = frozenset(),
           mark: bool = False) -> str:
    """The module's source with the sites in `mutate` wrong (between \\0 marks when `mark`)."""
    counter = iter(range(1 << 30))

    def site(m: re.Match[str]) -> str:
        i = next(counter)
        if i not in mutate:
            return m.group(2)
        return f"\0{m.group(3)}\0" if mark else m.group(3)

    return fill(SITE.sub(site, module.source), pkg, consts)


def fill(text: str, pkg: str, consts: dict[str, int]) -> str:
    return CONST.sub(lambda m: pkg if m.group(1) == "pkg" else str(consts[m.group(1)]), text)


def function_span(source: str, name: str) -> tuple[int, int]:
    """Line indices [start, end) of a top-level function's definition (its trailing blank lines excluded)."""
    lines = source.split("\n")
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"def {name}("))
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith((" ", "\t"))),
               len(lines))
    while end > start and not lines[end - 1].strip():
        end -= 1
    return start, end


def stub(source: str, name: str) -> tuple[str, str, str]:
    """`source` with function `name`'s body replaced by a NotImplementedError; (new source, the stub's raise
    line, the body it replaced)."""
    lines = source.split("\n")
    start, end = function_span(source, name)
    doc_end = next(i for i in range(start + 1, end) if lines[i].rstrip().endswith('"""'))
    body = "\n".join(lines[doc_end + 1:end])
    raise_line = f'    raise NotImplementedError("{name}: not written yet")'
    return "\n".join(lines[:doc_end + 1] + [raise_line] + lines[end:]), raise_line, body


# ---- running the package here -----------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_COUNTER = iter(range(1 << 62))


def evaluate(modules: list[Module], consts: dict[str, int], mutate: dict[str, frozenset[int]],
             exprs: list[str], replaced: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Each expression's result ({"ok": encoded} or {"error": type}) on the package rendered with the
    sites in `mutate` wrong, under a private package name (`replaced`: whole module sources instead, `$pkg`
    standing for the package's name)."""
    with _LOCK:
        pkg = f"_assay_repo_{next(_COUNTER)}"
        made = [pkg]
        try:
            sys.modules[pkg] = types.ModuleType(pkg)
            ns: dict[str, Any] = {}
            for mod in modules:  # leaves first: a module's imports are already loaded
                name = f"{pkg}.{mod.name}"
                module = types.ModuleType(name)
                sys.modules[name] = module
                made.append(name)
                source = fill(replaced[mod.name], pkg, consts) if mod.name in (replaced or {}) else \
                    render(mod, pkg, consts, mutate.get(mod.name, frozenset()))
                try:
                    exec(compile(source, f"<{mod.name}>", "exec"), module.__dict__)  # noqa: S102 - our templates
                except Exception as e:  # a mutant that cannot even import fails every test
                    return [{"error": type(e).__name__}] * len(exprs)
                ns[mod.name] = module
            out: list[dict[str, Any]] = []
            for expr in exprs:
                try:
                    out.append({"ok": encode(eval(expr, {"__builtins__": {}}, dict(ns)))})  # noqa: S307
                except Exception as e:
                    out.append({"error": type(e).__name__})
            return out
        finally:
            for name in made:
                sys.modules.pop(name, None)


# ---- tasks ----------------------------------------------------------------------------------------------------------

@dataclass
class Generated:
    """One task: the workspace, the prompt, the tests and the reference's tool calls."""

    kind: str  # "bug", "feature" or "refactor"
    pkg: str
    files: dict[str, str]  # the workspace: path -> text
    instruction: str
    modules: list[str]  # the package's modules, imported by the verifier
    visible: list[list[Any]]  # [expression, expected result] pairs, also written as tests/test_*.py
    hidden: list[list[Any]]  # the same, run only by the verifier
    solution: list[dict[str, Any]]  # the reference's tool calls: {"tool": name, "arguments": {...}}
    faults: list[str]  # "module:kind" of each seeded fault, "module.function" of the missing feature, or
    # "module.old->new" of the rename


class Redraw(Exception):
    """This draw of sites or tests does not make a sound task: draw again (from the same rng)."""


def _path(pkg: str, module: str) -> str:
    return f"{pkg}/{module}.py"


def _candidates(module: Module, rng: random.Random, consts: dict[str, int], per: int) -> dict[str, list[str]]:
    """Per function: its edge cases, then up to `per` distinct random calls."""
    out: dict[str, list[str]] = {}
    for func, gen in module.tests.items():
        exprs = [f"{module.name}.{func}({a})" for a in module.edges.get(func, ())]
        for _ in range(per * 3):
            if len(exprs) >= per + len(module.edges.get(func, ())):
                break
            e = f"{module.name}.{func}({gen(rng, consts)})"
            if e not in exprs:
                exprs.append(e)
        out[func] = exprs
    return out


def _test_file(pkg: str, module: str, tests: list[list[Any]], shown: dict[str, str]) -> str:
    cls = "".join(p.capitalize() for p in module.split("_")) + "Test"
    lines = ["import unittest", "", f"from {pkg} import {module}", "", "", f"class {cls}(unittest.TestCase):"]
    seen: dict[str, int] = {}
    for expr, _ in tests:
        func = expr.split("(", 1)[0].split(".", 1)[1]
        seen[func] = seen.get(func, 0) + 1
        lines += [f"    def test_{func}_{seen[func]}(self):",
                  f"        self.assertEqual({expr}, {shown[expr]}, {expr!r})", ""]
    return "\n".join(lines).rstrip() + "\n"


def _plain(value: Any) -> Any:
    """The Python value of an `encode`d one (for writing it as a literal)."""
    if value is None:
        return None
    tag, x = value
    if tag in ("int", "str", "bool"):
        return x
    if tag == "float":
        return float(x)
    if tag == "list":
        return [_plain(v) for v in x]
    if tag == "tuple":
        return tuple(_plain(v) for v in x)
    return {_plain(k): _plain(v) for k, v in x}


def build(rng: random.Random, level: int) -> Generated:
    """A task at `level` (1-5), a function of `rng` alone."""
    make = {3: _feature, 5: _refactor}.get(level, _bug)
    for _ in range(200):
        try:
            return make(rng, level)
        except Redraw:
            continue
    raise RuntimeError(f"repo generator: no sound task at level {level} in 200 draws")  # a template bug


def _layout(rng: random.Random, level: int, stack: Stack) -> tuple[list[Module], list[Module]]:
    """(the stack's modules the task uses, distractor modules from other stacks)."""
    if level == 1:
        return list(stack.modules[:rng.randint(1, 2)]), []
    others = [s for s in STACKS if s is not stack]
    rng.shuffle(others)
    if level >= 4:  # whole stacks: a distractor module imports its own stack's leaves
        return list(stack.modules), [m for s in others[:rng.randint(1, 2)] for m in s.modules]
    return list(stack.modules), [others[0].modules[0]] if rng.random() < 0.5 else []  # a leaf imports nothing


def _consts(rng: random.Random) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in STACKS:
        out.update(s.consts(rng))
    return out


def _pick_tests(pool: dict[str, list[str]], results: dict[str, dict[str, Any]], count: int, rng: random.Random,
                taken: set[str], prefer: Callable[[str], bool] = lambda e: False) -> list[str]:
    """Up to `count` expressions of each function, those `prefer` likes first, none in `taken`."""
    out: list[str] = []
    for exprs in pool.values():
        usable = [e for e in exprs if e not in taken and "ok" in results[e]]
        rng.shuffle(usable)
        usable.sort(key=lambda e: not prefer(e))
        out += usable[:count]
    return out


def _bug(rng: random.Random, level: int) -> Generated:
    pkg = rng.choice(PACKAGES)
    stack = rng.choice(STACKS)
    consts = _consts(rng)
    used, distract = _layout(rng, level, stack)
    symptom = used[-1]
    every = [s for m in used for s in sites(m)]
    if level == 1:
        choices = [[s] for s in every if s.kind in ("op", "off")]
    elif level == 2:
        choices = [[s] for s in every if s.module != symptom.name and s.kind != "case"]
    else:
        choices = [[c, s] for c in every if c.kind == "case" for s in every if s.kind != "case" and s.module != c.module]
    if not choices:
        raise Redraw
    faults = rng.choice(choices)
    mutate: dict[str, frozenset[int]] = {}
    for s in faults:
        mutate[s.module] = mutate.get(s.module, frozenset()) | {s.index}

    pools = {m.name: _candidates(m, rng, consts, 8) for m in used + distract}
    exprs = [e for p in pools.values() for es in p.values() for e in es]
    modules = used + distract
    correct = dict(zip(exprs, evaluate(modules, consts, {}, exprs), strict=True))
    broken = dict(zip(exprs, evaluate(modules, consts, mutate, exprs), strict=True))
    alone = [dict(zip(exprs, evaluate(modules, consts, {s.module: frozenset({s.index})}, exprs), strict=True))
             for s in faults]

    def fails(results: dict[str, dict[str, Any]]) -> Callable[[str], bool]:
        return lambda e: results[e] != correct[e]

    visible = _pick_tests(pools[symptom.name], correct, 2, rng, set(), fails(broken))[:6]
    if not any(fails(broken)(e) for e in visible):
        raise Redraw  # the visible tests must show the bug
    taken = set(visible)
    hidden: list[str] = []
    for results in alone:  # each fault alone is caught by hidden tests: fixing one of two is not enough
        caught = [e for e in exprs if e not in taken and "ok" in correct[e] and fails(results)(e)]
        if not caught:
            raise Redraw
        rng.shuffle(caught)
        hidden += [e for e in caught[:2] if e not in hidden]
    taken |= set(hidden)
    for m in used:
        hidden += _pick_tests(pools[m.name], correct, 2, rng, taken)
    for m in distract:
        hidden += _pick_tests(pools[m.name], correct, 1, rng, taken)

    files = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n'}
    for m in modules:
        files[_path(pkg, m.name)] = render(m, pkg, consts, mutate.get(m.name, frozenset()))
    if level == 4:  # a stale copy of a broken module that nothing imports: fixing it fixes nothing
        old = next(s.module for s in faults if s.kind != "case")
        files[_path(pkg, f"{old}_old")] = (f'"""Deprecated: the old {old} module, kept for old callers; the package does '
                                           f'not import it."""\n\n' + files[_path(pkg, old)].split('"""', 2)[2].lstrip("\n"))
    test_path = f"tests/test_{symptom.name}.py"
    shown = {e: repr(_plain(correct[e]["ok"])) for e in visible}
    files[test_path] = _test_file(pkg, symptom.name, [[e, None] for e in visible], shown)

    how = "a bug" if len(faults) == 1 else "two bugs, in different places"
    instruction = (f"The Python package `{pkg}` in /workspace (its modules under {pkg}/, its tests under tests/) has "
                   f"{how}: tests in {test_path} fail. Find the cause in the package's code and fix it, so that the "
                   "package does what its docstrings say. Hidden tests of the same documented behaviour are run "
                   "as well, on every module, so fix the cause rather than the symptom, and leave the tests as they "
                   "are. Run the visible tests with run_tests; call submit when you are done.")

    solution: list[dict[str, Any]] = []
    reads = [symptom.name] if level == 1 else [m.name for m in reversed(used)] if level == 4 else \
        [symptom.name, *(s.module for s in faults if s.module != symptom.name)]
    for name in dict.fromkeys(reads):
        solution.append({"tool": "read", "arguments": {"path": _path(pkg, name)}})
    for s in faults:
        solution.append({"tool": "patch", "arguments": _fix(files, pkg, used, consts, mutate, s)})
    solution += [{"tool": "run_tests", "arguments": {}}, {"tool": "submit", "arguments": {}}]
    return _finish(Generated("bug", pkg, files, instruction, [m.name for m in modules],
                             [[e, correct[e]["ok"]] for e in visible], [[e, correct[e]["ok"]] for e in hidden],
                             solution, [f"{s.module}:{s.kind}" for s in faults]))


def _fix(files: dict[str, str], pkg: str, used: list[Module], consts: dict[str, int],
         mutate: dict[str, frozenset[int]], site: Site) -> dict[str, str]:
    """The reference's patch of one fault: the lines around the wrong text, made right; as much context as
    makes the search text unique in the file."""
    module = next(m for m in used if m.name == site.module)
    marked = render(module, pkg, consts, mutate[site.module], mark=True).split("\n")
    plain = files[_path(pkg, site.module)]
    first = next(i for i, ln in enumerate(marked) if "\0" in ln)
    last = max(i for i, ln in enumerate(marked) if "\0" in ln)
    for lo in range(first, -1, -1):  # one fault per module: these marks are this site's
        block = "\n".join(marked[lo:last + 1])
        search = block.replace("\0", "")
        if search.strip() and plain.count(search) == 1:
            return {"path": _path(pkg, site.module), "search": search,
                    "replace": block.replace(f"\0{fill(site.wrong, pkg, consts)}\0", fill(site.correct, pkg, consts))}
    raise Redraw


def _feature(rng: random.Random, level: int) -> Generated:
    pkg = rng.choice(PACKAGES)
    stack = rng.choice(STACKS)
    consts = _consts(rng)
    used, distract = _layout(rng, level, stack)
    top = used[-1]
    func = rng.choice(top.features)
    modules = used + distract
    pools = {m.name: _candidates(m, rng, consts, 8) for m in modules}
    exprs = [e for p in pools.values() for es in p.values() for e in es]
    correct = dict(zip(exprs, evaluate(modules, consts, {}, exprs), strict=True))
    edges = {f"{top.name}.{func}({a})" for a in top.edges.get(func, ())}
    own = [e for e in pools[top.name][func] if "ok" in correct[e]]
    plain_cases = [e for e in own if e not in edges]
    if len(plain_cases) < 5:
        raise Redraw
    rng.shuffle(plain_cases)
    visible = plain_cases[:2] + _pick_tests({k: v for k, v in pools[top.name].items() if k != func}, correct, 1, rng,
                                            set())
    hidden = [e for e in own if e not in visible][:6]
    taken = set(visible) | set(hidden)
    for m in used:
        hidden += _pick_tests({k: v for k, v in pools[m.name].items() if k != func}, correct, 2, rng, taken)
    for m in distract:
        hidden += _pick_tests(pools[m.name], correct, 1, rng, taken)

    files = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n'}
    for m in modules:
        files[_path(pkg, m.name)] = render(m, pkg, consts)
    full = files[_path(pkg, top.name)]
    files[_path(pkg, top.name)], raise_line, body = stub(full, func)
    start, end = function_span(full, func)
    head = full.split("\n")[start:end]
    doc_at = next(i for i, ln in enumerate(head) if ln.rstrip().endswith('"""') and i > 0)
    signature = "\n".join(head[:doc_at + 1])
    test_path = f"tests/test_{top.name}.py"
    shown = {e: repr(_plain(correct[e]["ok"])) for e in visible}
    files[test_path] = _test_file(pkg, top.name, [[e, None] for e in visible], shown)
    examples = " and ".join(f"`{e} == {shown[e]}`" for e in visible[:2])
    instruction = (f"The Python package `{pkg}` in /workspace (its modules under {pkg}/, its tests under tests/) lacks "
                   f"a function: `{func}` in {_path(pkg, top.name)} only raises NotImplementedError. Write it to do "
                   f"what its docstring says:\n\n{signature}\n\nFor example, {examples}. The visible tests in "
                   f"{test_path} check a few cases; hidden tests check the whole specification, edge cases included, "
                   "and the rest of the package. Run the visible tests with run_tests; call submit when you are done.")
    solution = [{"tool": "read", "arguments": {"path": _path(pkg, top.name)}},
                {"tool": "patch", "arguments": {"path": _path(pkg, top.name), "search": raise_line, "replace": body}},
                {"tool": "run_tests", "arguments": {}}, {"tool": "submit", "arguments": {}}]
    return _finish(Generated("feature", pkg, files, instruction, [m.name for m in modules],
                             [[e, correct[e]["ok"]] for e in visible], [[e, correct[e]["ok"]] for e in hidden],
                             solution, [f"{top.name}.{func}"]))


RENAME_PREFIXES = ("calc_", "compute_", "get_", "find_")


def _refactor(rng: random.Random, level: int) -> Generated:
    """Rename a function that another module imports, everywhere, keeping behaviour; the old name must go."""
    pkg = rng.choice(PACKAGES)
    stack = rng.choice(STACKS)
    consts = _consts(rng)
    used, distract = _layout(rng, level, stack)
    modules = used + distract
    sources = {m.name: render(m, "$pkg", consts) for m in modules}  # `$pkg` kept, as `evaluate` takes them

    def mentions(name: str, text: str) -> bool:
        return re.search(rf"\b{name}\b", text) is not None

    choices = [(m, f) for m in used[:-1] for f in m.tests
               if any(mentions(f, sources[o.name]) for o in used if o is not m)  # another module imports it
               and not any(mentions(f, sources[d.name]) for d in distract)
               and sum(f"def {f}(" in src for src in sources.values()) == 1]
    if not choices:
        raise Redraw
    home, old = rng.choice(choices)
    new = rng.choice(RENAME_PREFIXES) + old
    if any(mentions(new, src) for src in sources.values()):
        raise Redraw
    renamed = {n: re.sub(rf"\b{old}\b", new, src) for n, src in sources.items()}
    touched = [m.name for m in modules if renamed[m.name] != sources[m.name]]

    pools = {m.name: _candidates(m, rng, consts, 8) for m in modules}
    before = [e for p in pools.values() for es in p.values() for e in es]
    after = [e.replace(f"{home.name}.{old}(", f"{home.name}.{new}(") for e in before]
    correct = evaluate(modules, consts, {}, before)
    if evaluate(modules, consts, {}, after, replaced=renamed) != correct:
        raise Redraw  # the rename changed what some call returns (a string that held the name)
    results = dict(zip(after, correct, strict=True))
    own = {new: [e for e in after if e.startswith(f"{home.name}.{new}(")]}
    visible = _pick_tests(own, results, 2, rng, set()) + \
        _pick_tests({k: v for k, v in _by_function(after, home.name).items() if k != new}, results, 1, rng, set())[:1]
    taken = set(visible)
    hidden = [e for e in own[new] if e not in taken and "ok" in results[e]][:4]
    taken |= set(hidden)
    for m in modules:
        hidden += _pick_tests(_by_function(after, m.name), results, 2 if m in used else 1, rng, taken)
    gone = [[f"{old!r} in {n}.__dict__", encode(False)] for n in touched]  # no alias left behind

    files = {f"{pkg}/__init__.py": f'"""The {pkg} package."""\n'}
    for m in modules:
        files[_path(pkg, m.name)] = sources[m.name].replace("$pkg", pkg)
    test_path = f"tests/test_{home.name}.py"
    shown = {e: repr(_plain(results[e]["ok"])) for e in visible}
    files[test_path] = _test_file(pkg, home.name, [[e, None] for e in visible], shown)
    instruction = (f"Refactor the Python package `{pkg}` in /workspace (its modules under {pkg}/, its tests under "
                   f"tests/): rename the function `{old}` of {_path(pkg, home.name)} to `{new}` everywhere it is "
                   "defined, imported, called or mentioned, without changing what any function does. Leave no alias "
                   f"behind: no module may still have a `{old}`. {test_path} already uses the new name. Hidden tests "
                   "check every module's behaviour and that the old name is gone. Run the visible tests with "
                   "run_tests; call submit when you are done.")
    diff = "".join("".join(difflib.unified_diff(files[_path(pkg, n)].splitlines(True),
                                                renamed[n].replace("$pkg", pkg).splitlines(True),
                                                f"a/{_path(pkg, n)}", f"b/{_path(pkg, n)}", n=2)) for n in touched)
    solution = [*({"tool": "read", "arguments": {"path": _path(pkg, n)}} for n in touched),
                {"tool": "apply_diff", "arguments": {"diff": diff}},
                {"tool": "run_tests", "arguments": {}}, {"tool": "submit", "arguments": {}}]
    return _finish(Generated("refactor", pkg, files, instruction, [m.name for m in modules],
                             [[e, results[e]["ok"]] for e in visible],
                             [[e, results[e]["ok"]] for e in hidden] + gone, solution, [f"{home.name}.{old}->{new}"]))


def _by_function(exprs: list[str], module: str) -> dict[str, list[str]]:
    """The expressions calling `module`'s functions, by function."""
    out: dict[str, list[str]] = {}
    for e in exprs:
        if e.startswith(f"{module}."):
            out.setdefault(e[len(module) + 1:].split("(", 1)[0], []).append(e)
    return out


def _finish(g: Generated) -> Generated:
    """Refuse a draw whose hidden test stands, by coincidence, in a file or the prompt the policy reads."""
    seen = "\n".join([g.instruction, *g.files.values()])
    if any(e in seen for e, _ in g.hidden):
        raise Redraw
    return g
