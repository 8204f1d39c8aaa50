"""Assay against TRL's GRPOTrainer on one workload, side by side in one invocation.

From the same SFT policy, on the same codegen training tasks and rewards (Assay's own verifier, called
from TRL's reward function, on identical prompt tokens: checked before anything trains), with the same
group size, prompts per step, completion length, temperature, learning rate, clip range, optimizer and
token-level loss, both train for the same number of steps. Then every checkpoint of both is evaluated on
the same held-out codegen suite (Assay's evaluation partition), outside the timed training, and the
script prints each one's wall-clock, its final held-out pass@1 and the wall-clock at which each first
reached TRL's final pass rate.

TRL is this script's own dependency, not Assay's (install it beside Assay in an environment of its own):
    python -m venv .venv-trl && .venv-trl/bin/pip install -e . -c constraints.txt trl==1.16.0
    .venv-trl/bin/python bench/trl_grpo.py runs/quickstart/sft/policy --steps 60

On the packaged SmolLM2-135M-Instruct (RL alone on codegen, where the model as it came passes some tasks),
with LoRA in both (peft's LoraConfig on the same modules) and Assay's selective log-probs:
    .venv-trl/bin/python bench/trl_grpo.py smollm2 --lora-rank 16 --lr 3e-4 --max-tokens 128 --temperature 1.0 \
        --steps 6 --prompts 4 --every 3 --eval-tasks 64 --eval-n 4 --runs trl,assay

Arms too large to train side by side run in invocations of their own (`--runs trl`, `--runs assay-levels`,
the same seed), compared afterwards with `--compare trl/report.json assay/report.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import assay
from assay.agent.render import prompt_ids
from assay.core.config import DomainConfig, LoraConfig, RolloutConfig
from assay.core.modeling import load_model
from assay.core.types import Message
from assay.envs.episode import close_episode, start_episode
from assay.envs.registry import get_env
from assay.envs.split import draw_task
from assay.eval.evaluate import evaluate
from assay.rollout.factory import make_backend
from assay.train.lora import peft_config

VERIFIERS = RolloutConfig().verifiers

DOMAIN = "codegen"


def tasks_for(steps: int, prompts: int, seed: int) -> list:
    """Training tasks, levels 1-4 in equal parts (the quickstart's uniform schedule), prompts per step x steps."""
    env, rng = get_env(DOMAIN), random.Random(seed)
    return [draw_task(env, rng, 1 + i % 4, "train") for i in range(steps * prompts)]


def lora(a: argparse.Namespace) -> dict[str, Any]:
    """Both trainers' LoRA setting (rank 0: full fine-tuning)."""
    return {"rank": a.lora_rank, "alpha": 2.0 * max(a.lora_rank, 1)}


def run_trl(policy: Path, tasks: list, a: argparse.Namespace, out: Path) -> tuple[float, dict[int, tuple[float, Path]]]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok = load_model(policy)
    env = get_env(DOMAIN)
    rows = [{"prompt": [{"role": m.role, "content": m.content} for m in t.prompt], "index": i}
            for i, t in enumerate(tasks)]
    for row, t in zip(rows[:16], tasks, strict=False):  # TRL renders the same prompt tokens Assay's rollout does
        theirs = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
        if list(theirs) != prompt_ids(tok, t):
            raise SystemExit("TRL's prompt tokens differ from Assay's; the comparison would not be like for like")

    reward_s = [0.0]  # TRL's time in the reward (verification), printed beside its wall-clock

    def reward(prompts: list, completions: list, index: list[int], **_: Any) -> list[float]:
        t0 = time.perf_counter()
        # On as many threads as Assay's rollout.verifiers, so TRL's batch is graded in shared sandboxed runs too.
        with ThreadPoolExecutor(VERIFIERS) as pool:
            scores = list(pool.map(lambda ci: verify(tasks[ci[1]], ci[0][0]["content"]), zip(completions, index,
                                                                                              strict=True)))
        reward_s[0] += time.perf_counter() - t0
        return scores

    def verify(task: Any, completion: str) -> float:  # on a warm pooled sandbox, as Assay's rollout verifies
        episode = start_episode(env, task)
        try:
            return episode.verify([Message("assistant", completion)]).score
        finally:
            close_episode(episode)

    saved: dict[int, tuple[float, Path]] = {}  # step -> (wall-clock since the start, checkpoint)
    paused = [0.0]

    class Checkpoints(TrainerCallback):  # the policy every `every` steps; saving it is not timed
        def on_step_end(self, args, state, control, **kw):
            if state.global_step % a.every == 0:
                t0 = time.perf_counter()
                d = out / f"trl-{state.global_step}"
                m = kw["model"]
                # adapters folded into a copy: a plain checkpoint, as Assay's are
                (copy.deepcopy(m).merge_and_unload() if hasattr(m, "peft_config") else m).save_pretrained(d)
                tok.save_pretrained(d)
                saved[state.global_step] = (t0 - start - paused[0], d)
                paused[0] += time.perf_counter() - t0

    peft = peft_config(LoraConfig(**lora(a))) if a.lora_rank else None  # the adapters Assay's run injects
    cfg = GRPOConfig(output_dir=str(out / "trl"), num_generations=a.group, per_device_train_batch_size=a.prompts * a.group,
                     max_completion_length=a.max_tokens, temperature=a.temperature, learning_rate=a.lr,
                     epsilon=0.2, epsilon_high=0.28, beta=0.0, num_iterations=1, scale_rewards="none",
                     loss_type="dapo", max_steps=a.steps, lr_scheduler_type="constant", warmup_steps=0,
                     adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, shuffle_dataset=False,
                     logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=a.bf16, seed=a.seed,
                     top_k=0, top_p=1.0,
                     # TRL's default recomputes activations in the backward; Assay's trainer keeps them
                     # (train.activation_checkpointing: false), and at this size memory binds neither
                     gradient_checkpointing=a.trl_checkpointing)
    start = time.perf_counter()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Checkpoints()], peft_config=peft)
    trainer.train()
    wall = time.perf_counter() - start - paused[0]
    print(f"TRL: {wall:.1f} s, of which {reward_s[0]:.1f} s in the reward (verification)")
    return wall, saved


def run_assay(policy: Path, a: argparse.Namespace, out: Path, name: str
              ) -> tuple[float, dict[int, tuple[float, Path]]]:
    """`assay train` on the same settings; its tasks come from its own mixer, drawn from the same distribution.
    `assay-dynamic` refills zero-variance groups; `assay-async` samples a step ahead on a process of its own."""
    dynamic = name == "assay-dynamic"
    pipeline = {"mode": "async", "max_staleness": 1, "workers": "process"} if name == "assay-async" else {}
    # `assay-levels`: the stratified schedule deals every step's groups across levels 1-4 in equal parts, as
    # TRL's task list does (with --prompts 4, one group a level); the others draw each group's level at random
    schedule = "stratified" if name == "assay-levels" else "uniform"
    config = {
        "name": name, "run_dir": str(out), "seed": a.seed, "threads": a.threads,
        "model": {"path": str(policy)},
        "domains": [{"name": DOMAIN, "env": DOMAIN, "group_size": a.group, "max_new_tokens": a.max_tokens,
                     "difficulty": {"min": 1, "max": 4, "schedule": schedule}}],
        "rollout": {"temperature": a.temperature, "weights": "bf16" if a.bf16 else "float32"},
        "pipeline": {"online": True, **pipeline},
        "train": {"steps": a.assay_steps, "groups_per_step": a.prompts, "lr": a.lr, "betas": [0.9, 0.99],
                  "dynamic_sampling": dynamic, "checkpoint_every": a.every, "keep_checkpoints": a.assay_steps,
                  "loss": {"eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0, "std_normalize": False,
                           "aggregation": "token", "decoupled": a.bf16},
                  "bf16": a.bf16,
                  "lora": lora(a),
                  "selective_logprobs": a.lora_rank > 0},
        "eval": {"every": 0},
    }
    t0, epoch = time.perf_counter(), time.time()
    run = assay.run_training(config)
    wall = time.perf_counter() - t0
    ended = {r["step"]: r["time"] - epoch for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if r.get("kind") == "train"}  # when each step's record was written
    return wall, {int(p.name.split("_")[-1]): (ended[int(p.name.split("_")[-1])], p)
                  for p in (run / "checkpoints").glob("step_*")}


def held_out(policy_dir: Path, a: argparse.Namespace) -> dict[str, float]:
    """Held-out codegen pass@1 (value and 95% interval) of a policy directory."""
    model, tok = load_model(policy_dir)
    dom = DomainConfig(name=DOMAIN, env=DOMAIN, group_size=a.group, max_new_tokens=a.max_tokens)
    res = evaluate(make_backend(RolloutConfig(), model, tok), tok, {DOMAIN: get_env(DOMAIN)}, {DOMAIN: dom},
                   a.eval_tasks, a.eval_n, seed=1000003, temperature=1.0)
    est = res[DOMAIN].pass_at[1]
    return {"value": est.value, "low": est.low, "high": est.high}


def curve_text(curve: dict) -> str:
    """step:pass@1@seconds of each checkpoint, in step order (keys are ints in memory, strings in a report)."""
    return " ".join(f"{s}:{curve[s]['pass_at_1']['value']:.3f}@{curve[s]['at_s']:.0f}s" for s in sorted(curve, key=int))


def reach(curve: dict, target: float) -> str | None:
    """The first checkpoint (step, as the report's key) at or above `target`, or None."""
    return next((s for s in sorted(curve, key=int) if curve[s]["pass_at_1"]["value"] >= target), None)


def compare(reports: list[Path]) -> None:
    """Runs of separate invocations (the same seed and settings) against the first report's first run:
    its final held-out pass@1 is the target, and each run's time to the target is the wall-clock at its
    first checkpoint at or above it, on both sides (so the reference may reach it before its final)."""
    runs = [r for path in reports for r in json.loads(path.read_text())["runs"]]
    ref = runs[0]["curve"]
    target = ref[max(ref, key=int)]["pass_at_1"]["value"]
    ref_at = ref[reach(ref, target)]["at_s"]
    print(f"target: {runs[0]['run']}'s final held-out pass@1, {target:.3f}, first reached at {ref_at:.0f} s")
    for r in runs:
        c = r["curve"]
        step = reach(c, target)
        print(f"{r['run']:42s} {curve_text(c)}"
              + (f"  reaches it at step {step}, {c[step]['at_s']:.0f} s, {c[step]['at_s'] / ref_at:.2f} of the "
                 "reference's time" if step else "  never reaches it"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policy", type=Path, nargs="?", help="the SFT policy both start from (e.g. runs/quickstart/sft/policy)")
    p.add_argument("--compare", type=Path, nargs="+", metavar="REPORT",
                   help="train nothing: compare the runs of these report.json files (separate invocations, one seed) "
                        "against the first one's first run, as its target")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=16, help="prompts (GRPO groups) per step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--every", type=int, default=10, help="checkpoint (and evaluate) every this many steps")
    p.add_argument("--eval-tasks", type=int, default=128)
    p.add_argument("--eval-n", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank in both (alpha 2 x rank); "
                                                            "Assay then also computes selective log-probs")
    p.add_argument("--bf16", action="store_true", help="both in bf16 (for a CPU with AMX): TRL's bf16 autocast; "
                   "Assay's bf16 trainer and engine, with the decoupled loss; held-out evaluations stay float32")
    p.add_argument("--assay-steps", type=int, default=None,
                   help="steps of Assay's runs (default: --steps); more, with --every, shows when they reach TRL's "
                        "final pass rate")
    p.add_argument("--trl-checkpointing", action="store_true",
                   help="TRL's default gradient checkpointing (off unless given: the faster TRL where memory allows)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--runs", default="trl,assay,assay-dynamic",
                   help="which to run: trl, assay (dynamic sampling off), assay-dynamic, assay-async, assay-levels "
                        "(one group a level each step, as TRL's task list); TRL's is the target")
    a = p.parse_args()
    if a.compare:
        return compare(a.compare)
    if a.policy is None:
        p.error("a policy is required unless --compare is given")
    a.assay_steps = a.assay_steps or a.steps
    runs = a.runs.split(",")
    torch.set_num_threads(a.threads)
    out = a.out or Path(tempfile.mkdtemp(prefix="assay-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if not a.policy.is_dir():  # a .gguf or a packaged model: dequantized once, so neither clock includes it
        from assay.core.gguf_import import import_gguf

        a.policy = import_gguf(a.policy, out / "policy")
    start = held_out(a.policy, a)
    if "trl" in runs:
        rows.append(("TRL GRPOTrainer", *run_trl(a.policy, tasks_for(a.steps, a.prompts, a.seed), a, out)))
    labels = {"assay": "assay train, dynamic sampling off", "assay-dynamic": "assay train, dynamic sampling on",
              "assay-async": "assay train, async (staleness 1), no refills",
              "assay-levels": "assay train, every level every step"}
    for name, label in labels.items():
        if name in runs:
            rows.append((label, *run_assay(a.policy, a, out, name)))
    report: dict[str, Any] = {"start_pass_at_1": start, "settings": vars(a), "runs": []}
    for label, wall, ckpts in rows:  # evaluated after all training: evaluation is in no run's wall-clock
        curve = {s: {"at_s": at, "pass_at_1": held_out(d, a)} for s, (at, d) in sorted(ckpts.items())}
        report["runs"].append({"run": label, "wall_s": wall, "curve": curve})
    trl_curve = report["runs"][0]["curve"]  # the first run's final pass rate is the target
    target = trl_curve[max(trl_curve)]["pass_at_1"]["value"]
    print(f"held-out {DOMAIN} pass@1 ({a.eval_tasks} tasks x {a.eval_n} samples), SFT start {start['value']:.3f}; "
          f"{report['runs'][0]['run']}'s final {target:.3f}")
    for r in report["runs"]:
        c = r["curve"]
        step = reach(c, target)
        r["reaches_trl_final_at_s"] = None if step is None else c[step]["at_s"]
        last = c[max(c)]["pass_at_1"]
        print(f"{r['run']:42s} {r['wall_s']:7.1f} s  final {last['value']:.3f} [{last['low']:.3f}, {last['high']:.3f}]"
              f"  by step: {curve_text(c)}"
              + (f"  reaches the target at {c[step]['at_s']:.0f} s" if step else "  never reaches it"))
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {out / 'report.json'}")


if __name__ == "__main__":
    main()
