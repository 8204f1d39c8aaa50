"""`assay bench policies`: four policies side by side on the same held-out tasks, over seeds: the model as it
came, RL alone, SFT, and SFT then RL.

Each seed runs two quickstarts of one preset: NAME_rl_sS with `sft.steps=0` (RL from the model as it came) and
NAME_sft_sS as the preset says (SFT on the environments' clean reference solutions, then the same RL). Both
evaluate on the evaluation partition's tasks drawn by `eval.seed`, so every column pairs task by task; the
bench refuses two runs whose tasks differ. What it judges is RL against imitation: SFT then RL − SFT, and RL
alone − SFT (paired 95% bootstrap intervals over tasks; the mean over domains resamples tasks in each domain)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from assay.bench.learning import machine, read_summaries, run_seeds, settings_drift
from assay.core.errors import AssayError
from assay.eval.evaluate import DomainEval, paired
from assay.eval.passk import paired_difference_ci, pass_at_k_ci
from assay.pipeline.quickstart import mean_difference

# arm -> the overrides that make it: RL from the model as it came, or the preset's SFT then RL
ARMS: dict[str, list[str]] = {"rl": ["sft.steps=0"], "sft": []}
POLICIES = ("base", "RL alone", "SFT", "SFT → RL")


def policy_evals(rl_alone: dict[str, Any], sft_rl: dict[str, Any]) -> dict[str, dict[str, DomainEval]]:
    """The four policies' evaluations from the two arms' summaries, after checking that they measured the
    same tasks (the base model is the RL-alone run's start, the SFT policy the other run's)."""
    if sft_rl.get("start") != "after SFT":
        raise AssayError("bench policies: the SFT arm ran no SFT (its preset has sft.steps: 0); pass a preset "
                         "with SFT, or sft.steps=N")
    for summary in (rl_alone, sft_rl):
        if "per_task" not in summary:
            raise AssayError("bench policies: a run's summary.json has no per-task passes (written by an older "
                             "Assay); move the run aside so that it is run again")
    sources = {"base": rl_alone["per_task"]["start"], "RL alone": rl_alone["per_task"]["final"],
               "SFT": sft_rl["per_task"]["start"], "SFT → RL": sft_rl["per_task"]["final"]}
    for domain, base in sources["base"].items():
        if sorted(base["task_ids"]) != sorted(sources["SFT"].get(domain, {}).get("task_ids", [])):
            raise AssayError(f"bench policies: the two arms evaluated different {domain} tasks; both must run "
                             "the same preset with the same domains and eval settings")
    return {policy: {d: DomainEval(domain=d, passes=e["passes"], task_ids=e["task_ids"]) for d, e in src.items()}
            for policy, src in sources.items()}


def _ci(e: Any, signed: bool = False) -> str:
    f = "+.3f" if signed else ".3f"
    return f"{e.value:{f}} [{e.low:{f}}, {e.high:{f}}]"


def seed_rows(evals: dict[str, dict[str, DomainEval]]) -> tuple[list[list[str]], bool]:
    """Markdown cells per domain and for the mean over domains; and whether RL beat imitation on this seed:
    SFT then RL above SFT on the mean (interval above zero) with no domain's interval below zero."""
    rows, no_domain_below = [], True
    for d in evals["base"]:
        cells = [d, *(_ci(pass_at_k_ci(evals[p][d].passes, 1)) for p in POLICIES)]
        for a, b in (("SFT → RL", "SFT"), ("RL alone", "SFT")):
            diff = paired_difference_ci(*paired(evals[b][d], evals[a][d]), k=1)
            cells.append(_ci(diff, signed=True))
            no_domain_below &= a != "SFT → RL" or diff.high >= 0
        rows.append(cells)
    means = [sum(pass_at_k_ci(e.passes, 1).value for e in evals[p].values()) / len(evals[p]) for p in POLICIES]
    over_sft = mean_difference(evals["SFT"], evals["SFT → RL"])
    alone = mean_difference(evals["SFT"], evals["RL alone"])
    rows.append(["mean", *(f"{m:.3f}" for m in means),
                 *(f"{x['value']:+.3f} [{x['low']:+.3f}, {x['high']:+.3f}]" for x in (over_sft, alone))])
    return rows, over_sft["low"] > 0 and no_domain_below


def policies_table(pairs: dict[int, tuple[dict[str, Any], dict[str, Any]]], where: str = "") -> str:
    """Markdown: per seed, the four policies' pass@1 per domain and on average, the paired differences, and
    the seed's verdict."""
    head = ["seed", "domain", *POLICIES, "SFT → RL − SFT", "RL alone − SFT"]
    lines = [f"| {' | '.join(head)} |", f"|{'---|' * len(head)}"]
    verdicts = []
    for s in sorted(pairs):
        rows, beat = seed_rows(policy_evals(*pairs[s]))
        lines += [f"| {s} | {' | '.join(cells)} |" for cells in rows]
        verdicts.append(f"seed {s}: {'RL beats imitation' if beat else 'RL does not beat imitation'}")
    out = "\n".join([*lines, "", "; ".join(verdicts)])
    return f"{out}\n\n{where}" if where else out


def run_policies_bench(seeds: int, name: str, run_dir: Path, overrides: Sequence[str], jobs: int, threads: int,
                       log=print, preset: str = "smollm2_sft") -> tuple[str, dict[int, tuple[dict, dict]]]:
    dirs = {arm: run_seeds(list(range(seeds)), f"{name}_{arm}", run_dir, [*overrides, *extra], jobs, threads, log,
                           preset) for arm, extra in ARMS.items()}
    summaries = {arm: read_summaries(d) for arm, d in dirs.items()}
    pairs = {s: (summaries["rl"][s], summaries["sft"][s]) for s in range(seeds)}
    minutes = {arm: ", ".join(f"{summ.get('seconds', {}).get('total', 0) / 60:.1f}" for summ in by_seed.values())
               for arm, by_seed in summaries.items()}
    where = (f"Machine: {machine()}; {jobs} run(s) at a time; minutes per seed: RL alone {minutes['rl']}; "
             f"SFT then RL {minutes['sft']}.")
    drift = [n for arm, extra in ARMS.items() for n in settings_drift(dirs[arm], preset, [*overrides, *extra])]
    for note in drift:
        log(note)
    return policies_table(pairs, where) + "".join(f"\n- {n}" for n in drift) + "\n", pairs
