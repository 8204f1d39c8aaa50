"""The golden-suite gate on a canary's promotion: `assay serve STABLE --canary CANDIDATE --golden SUITE.yaml`.

Two evaluation records of one pinned suite, one of each served policy, become a verdict when the deployment
starts. Given the suite file, serve writes them itself (`evaluate_golden`: `assay eval SUITE.yaml --policy
STABLE --policy CANDIDATE`'s own functions, with the served weights setting), reusing records of the same suite
file, settings and weights; given `--golden DIR`, it reads those `assay eval ... --out DIR` wrote. Records are
tied to the served versions by the sha256 of their weights files, not by path or by order, so a record of
another checkpoint, or the two swapped, cannot vouch for a version.

The test. Per environment, and over all the suite's tasks, the paired pass@1 difference d = candidate -
stable is taken task by task (`assay eval compare`'s pairing) with a bootstrap interval that resamples tasks.
The m intervals (each environment and all tasks; all tasks alone for a one-environment suite) each have
one-sided level alpha/m (Bonferroni), so they hold together with probability >= 1 - alpha:
- fail: some interval lies entirely below 0 (the candidate is significantly worse there). A candidate at
  least as good as the stable version everywhere fails with probability <= alpha. The deployment rolls back.
- underpowered: not failed, but the suite cannot detect a loss of `margin`: the minimum detectable effect
  over all tasks (80% power, 5% two-sided; the figure `assay eval compare` prints) exceeds it, or the suite
  has fewer than ln(alpha) / ln(1 - margin) tasks (identical results have a standard error of 0 at any size,
  yet a candidate that loses a `margin` share of tasks shows no loss on fewer tasks with probability >
  alpha). Blocks promotion; the gate names the tasks a suite needs.
- pass: powered, and the all-tasks interval lies above -margin (non-inferior: a candidate worse by more
  than `margin` passes with probability <= alpha). Promotion still waits for the live test.
- inconclusive: powered and not significantly worse, yet a loss of `margin` is not ruled out. Blocks
  promotion.
Bootstrap intervals on a few tasks cover a little less than their level; the power floor keeps suites from
being that small."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from assay.core.errors import AssayError
from assay.core.paths import evals_dir
from assay.eval.passk import bootstrap_mean, minimum_detectable_effect, pass_at_k
from assay.eval.record import RECORD, policy_identity, read_record

log = logging.getLogger("assay.serve.golden")

Verdict = Literal["pass", "fail", "underpowered", "inconclusive"]
ALL = "all tasks"  # the row over every task of the suite
ROUNDS = 10_000  # bootstrap resamples: enough for the tails of alpha/m
SAME_SETTINGS = ("suite", "suite_sha256", "n", "temperature", "weights")  # what both evaluations must share
HOW = "assay eval SUITE.yaml --policy STABLE --policy CANDIDATE --out DIR"
SUITE_SUFFIXES = (".yaml", ".yml")  # a --golden path naming a suite file, not records


@dataclass(frozen=True)
class Row:
    """One environment's (or all tasks') paired pass@1 difference, candidate - stable."""

    env: str
    tasks: int
    stable: float  # mean pass@1
    candidate: float
    diff: float
    low: float  # the interval at one-sided level alpha/m each side
    high: float


@dataclass(frozen=True)
class Gate:
    verdict: Verdict
    reason: str  # one sentence: why
    suite: str
    margin: float  # the pass@1 loss a promotion tolerates
    alpha: float
    tasks: int  # paired tasks in all
    mde: float  # over all tasks
    tasks_needed: int  # for this margin, when underpowered; else 0
    rows: tuple[Row, ...]  # each environment, then all tasks
    stable_record: str
    candidate_record: str

    @property
    def allows_promotion(self) -> bool:
        return self.verdict == "pass"

    def summary(self) -> dict[str, Any]:
        return asdict(self)


def _pass1(entry: dict[str, Any]) -> float:
    passes = entry["passes"]
    return pass_at_k(len(passes), sum(passes), 1)


def paired_pass1(stable: dict[str, Any], candidate: dict[str, Any], where: tuple[str, str] = ("stable", "candidate")
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per environment, (stable, candidate) pass@1 of each task in the same order. Refuses records that are not
    evaluations of one pinned suite: its name and file, samples, temperature, weights, every environment's
    version and hash, and the same tasks."""
    a, b = where
    for record, path in ((stable, a), (candidate, b)):
        if "suite_sha256" not in record.get("settings", {}):
            raise AssayError(f"{path} is not an evaluation of a pinned suite (assay eval POLICY --env ... wrote it); "
                             f"the golden gate pairs two policies on one suite: {HOW}")
    for key in SAME_SETTINGS:
        x, y = stable["settings"].get(key), candidate["settings"].get(key)
        if x != y:
            raise AssayError(f"the golden records differ in {key} ({x!r} in {a}, {y!r} in {b}): they are not of one "
                             f"suite run the same way; evaluate both policies in one run: {HOW}")
    ea, eb = stable["environments"], candidate["environments"]
    if set(ea) != set(eb):
        raise AssayError(f"the golden records hold other environments ({sorted(ea)} in {a}, {sorted(eb)} in {b}); "
                         f"evaluate both policies in one run: {HOW}")
    out = {}
    for name in ea:
        if ea[name] != eb[name]:
            raise AssayError(f"environment {name} differs between the golden records ({ea[name]['spec']} hash "
                             f"{ea[name]['hash']} in {a}, {eb[name]['spec']} hash {eb[name]['hash']} in {b}); "
                             f"evaluate both policies on the same environments: {HOW}")
        try:
            ta, tb = stable["domains"][name]["per_task"], candidate["domains"][name]["per_task"]
        except KeyError:
            raise AssayError(f"environment {name} has no per-task results in {a} or {b}; re-run the evaluation: "
                             f"{HOW}") from None
        if set(ta) != set(tb):
            only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
            raise AssayError(f"environment {name}: the golden records hold other tasks ({len(only_a)} only in {a}, "
                             f"{len(only_b)} only in {b}, e.g. {(only_a + only_b)[0]!r}); a task whose every sample "
                             f"failed on infrastructure is left out of its record: re-run the evaluation: {HOW}")
        if not ta:
            raise AssayError(f"environment {name}: no task of the golden records ran; re-run the evaluation: {HOW}")
        order = sorted(ta)
        out[name] = (np.array([_pass1(ta[t]) for t in order]), np.array([_pass1(tb[t]) for t in order]))
    return out


def golden_gate(stable: dict[str, Any], candidate: dict[str, Any], margin: float, alpha: float,
                where: tuple[str, str] = ("stable", "candidate")) -> Gate:
    """The gate's verdict on two evaluation records (read_record) of one pinned suite (see the module doc)."""
    if not 0 < margin < 1:
        raise AssayError(f"--golden-margin {margin}: a pass@1 difference in (0, 1), e.g. 0.1")
    if not 0 < alpha < 1:
        raise AssayError(f"--alpha {alpha}: an error rate between 0 and 1, e.g. 0.05")
    per_env = paired_pass1(stable, candidate, where)
    families = dict(per_env)
    if len(per_env) > 1:
        families[ALL] = (np.concatenate([s for s, _ in per_env.values()]),
                         np.concatenate([c for _, c in per_env.values()]))
    level = 1 - 2 * alpha / len(families)
    rows, se = [], 0.0
    for name, (s, c) in families.items():
        est = bootstrap_mean(c - s, ROUNDS, 0, level)
        rows.append(Row(name, len(s), float(s.mean()), float(c.mean()), est.value, est.low, est.high))
        se = est.se  # the last: all tasks
    overall = rows[-1]
    n, mde = overall.tasks, minimum_detectable_effect(se)
    floor = math.ceil(math.log(alpha) / math.log(1 - margin))
    needed = max(floor, math.ceil(n * (mde / margin) ** 2)) if mde > margin or n < floor else 0
    worse = [r for r in rows if r.high < 0]
    if worse:
        verdict: Verdict = "fail"
        reason = "significantly worse on " + "; ".join(
            f"{r.env} (pass@1 {r.stable:.3f} -> {r.candidate:.3f}, difference in [{r.low:.3f}, {r.high:.3f}])"
            for r in worse)
    elif needed:
        verdict = "underpowered"
        reason = (f"the suite's {n} tasks detect a pass@1 loss of {mde:.3f} with 80% power, not one of {margin:g}: "
                  f"about {needed} tasks are needed (more samples per task also help)" if mde > margin else
                  f"the suite's {n} tasks are too few to rule out a pass@1 loss of {margin:g} even with no task "
                  f"differing: about {needed} tasks are needed")
    elif overall.low > -margin:
        verdict = "pass"
        reason = (f"no environment significantly worse; pass@1 difference over {n} tasks {overall.diff:+.3f} in "
                  f"[{overall.low:.3f}, {overall.high:.3f}], above -{margin:g}")
    else:
        verdict = "inconclusive"
        reason = (f"not significantly worse, but the pass@1 difference over {n} tasks, {overall.diff:+.3f} in "
                  f"[{overall.low:.3f}, {overall.high:.3f}], does not rule out a loss of {margin:g}")
    return Gate(verdict, reason, stable["settings"]["suite"], margin, alpha, n, mde, needed, tuple(rows), *where)


def find_records(paths: Sequence[Path]) -> list[Path]:
    """Each path a record directory (or its record.json), or a directory of them (a several-policy evaluation)."""
    found = []
    for p in paths:
        if (p / RECORD).is_file() or p.is_file():
            found.append(p)
        elif p.is_dir() and (inside := sorted(d for d in p.iterdir() if (d / RECORD).is_file())):
            found += inside
        else:
            raise AssayError(f"--golden {p}: no evaluation record there (a record.json, or directories holding one, "
                             f"as `{HOW}` writes)")
    return found


def _weights(record: dict[str, Any]) -> str | None:
    return record.get("policy", {}).get("weights_sha256")


def _described(path: Path, record: dict[str, Any]) -> str:
    policy = record.get("policy", {})
    if policy.get("kind") == "endpoint":  # an API's answers are tied to no weights file
        return f"{path}: the endpoint {policy.get('model')} at {policy.get('url')} (no weights hash: it cannot vouch " \
               "for a served checkpoint)"
    return f"{path}: {policy.get('path')} (weights sha256 {str(_weights(record))[:12]})"


def _served_hash(what: str, policy: Path) -> str:
    try:
        return policy_identity(policy)["weights_sha256"]
    except AssayError:
        raise AssayError(f"--golden ties evaluation records to the served policies by their weights' hash, and the "
                         f"{what} policy {policy} holds no *.safetensors; serve a checkpoint directory (assay model "
                         "import turns a .gguf or packaged model into one)") from None


def served_hashes(stable: Path, candidate: Path) -> tuple[str, str]:
    """The sha256 of the stable and the candidate policy's weights files: hashed once per deployment start, since a
    large model's weights take seconds each."""
    return _served_hash("stable", stable), _served_hash("candidate", candidate)


def pick_records(paths: Sequence[Path], stable: Path, candidate: Path, hashes: tuple[str, str] | None = None
                 ) -> tuple[tuple[Path, dict[str, Any]], tuple[Path, dict[str, Any]]]:
    """The record of the stable policy and the record of the candidate among those `paths` hold, matched by the
    sha256 of the weights files each record names and each served policy directory holds (`hashes`, when the
    caller has them)."""
    records = [(p, read_record(p)) for p in find_records(paths)]
    hs, hc = hashes or served_hashes(stable, candidate)
    listing = "; ".join(_described(p, r) for p, r in records)
    if hs == hc:  # the same weights twice: the records in the order given
        same = [pr for pr in records if _weights(pr[1]) == hs]
        if len(same) < 2:
            raise AssayError(f"the stable and candidate policies have the same weights (sha256 {hs[:12]}), and "
                             f"--golden holds {len(same)} record of them, not 2 ({listing})")
        return same[0], same[1]
    picked = []
    for what, policy, h in (("stable", stable, hs), ("candidate", candidate, hc)):
        match = [pr for pr in records if _weights(pr[1]) == h]
        if not match:
            raise AssayError(f"no --golden record evaluated the {what} policy {policy} (weights sha256 {h[:12]}); "
                             f"they evaluated {listing}. Evaluate the served checkpoints: {HOW}")
        if len(match) > 1:
            raise AssayError(f"--golden holds {len(match)} records of the {what} policy {policy} "
                             f"({', '.join(str(p) for p, _ in match)}); pass the two records to use")
        picked.append(match[0])
    return picked[0], picked[1]


def load_gate(paths: Sequence[Path], stable: Path, candidate: Path, weights: str, margin: float, alpha: float,
              hashes: tuple[str, str] | None = None) -> Gate:
    """The gate of a deployment serving `stable` and `candidate` (policy directories) with the engine's `weights`
    (float32, int8): records found and matched (`pick_records`), then compared (`golden_gate`)."""
    (ps, rs), (pc, rc) = pick_records(paths, stable, candidate, hashes)
    for path, record in ((ps, rs), (pc, rc)):
        evaluated = record.get("settings", {}).get("weights", "float32")
        if evaluated != weights:
            raise AssayError(f"{path} evaluated {evaluated} weights, and this profile serves {weights}: the gate "
                             f"must measure what is served; evaluate with --weights {weights}")
    return golden_gate(rs, rc, margin, alpha, (str(ps), str(pc)))


def golden_suite(paths: Sequence[Path]) -> Path | None:
    """The pinned suite file `--golden` names, if it names one (else it names records)."""
    suites = [p for p in paths if p.suffix in SUITE_SUFFIXES]
    if suites and len(paths) > 1:
        raise AssayError(f"--golden takes one pinned suite file, evaluated when the deployment starts, or evaluation "
                         f"records, not both or several suites ({', '.join(map(str, paths))}); pass one --golden "
                         "SUITE.yaml")
    return suites[0] if suites else None


def golden_dir() -> Path:
    """Where `assay serve --golden SUITE.yaml` keeps its records: a cache keyed by content, shared by deployments."""
    return evals_dir() / "golden"


def _reusable(record: Path, settings: dict[str, Any], weights_sha256: str) -> bool:
    """Whether `record` is an evaluation of these weights with these settings (the suite file's path aside: its
    sha256 is among them)."""
    try:
        found = read_record(record)
    except AssayError:
        return False
    want = json.loads(json.dumps({k: v for k, v in settings.items() if k != "suite_file"}))  # as JSON reads back
    return _weights(found) == weights_sha256 and all(found["settings"].get(k) == v for k, v in want.items())


def evaluate_golden(suite: Path, stable: Path, candidate: Path, weights: str, hashes: tuple[str, str] | None = None
                    ) -> list[Path]:
    """The records of the policy directories `stable` and `candidate` on the pinned `suite`, as `assay eval SUITE
    --policy STABLE --policy CANDIDATE --weights WEIGHTS` writes them: each reused from `golden_dir()` when one of
    the same suite sha256, settings and weights sha256 is there, else evaluated into it. A suite that is missing,
    does not load or no longer matches its pins, or a policy with no weights file to hash, is refused before any
    model loads."""
    from assay.core.config import EvalConfig
    from assay.envs.qa.enforce import UncheckedEnvironment
    from assay.eval.run import evaluate_plan, suite_plan

    seed = EvalConfig().seed  # `assay eval`'s defaults: the records are the command's
    try:
        plan = suite_plan(suite, {"backend": "engine", "seed": seed, "weights": weights})
    except UncheckedEnvironment as e:  # no override here: a promotion gate on an unchecked environment proves nothing
        raise AssayError(f"--golden {suite}: {e.problem}; a golden suite gates promotion on checked "
                         f"environments only: check it with `{e.check}`") from None
    settings = plan.settings
    where = golden_dir() / f"{settings['suite']}-{settings['suite_sha256'][:12]}"
    records = []
    with _locked(where):  # a second deployment starting on the same suite waits, then reuses these records
        for what, policy, sha in zip(("stable", "candidate"), (stable, candidate),
                                     hashes or served_hashes(stable, candidate), strict=True):
            record = where / f"{weights}-{sha[:12]}"
            if _reusable(record, settings, sha):
                log.info("golden suite %s: the %s policy's record %s is reused (same suite sha256, settings and "
                         "weights sha256)", settings["suite"], what, record)
            else:
                shutil.rmtree(record, ignore_errors=True)  # an interrupted evaluation's trajectories, or stale settings
                log.info("golden suite %s: evaluating the %s policy %s (%s weights, %d tasks x %d samples) into %s",
                         settings["suite"], what, policy, weights, len(plan.tasks), plan.n, record)
                evaluate_plan(policy, plan, seed, record)
            records.append(record)
    return records


@contextmanager
def _locked(where: Path) -> Iterator[None]:
    """Hold WHERE/.lock (an exclusive flock, released however this process ends) while the block runs."""
    where.mkdir(parents=True, exist_ok=True)
    with (where / ".lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("golden suite: another process is evaluating into %s; waiting for it", where)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield
