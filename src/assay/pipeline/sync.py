"""The synchronous reference pipeline: sample tasks, roll out, verify, train, sync weights, repeat.

Every random choice is a function of the config seed, the step and checkpointed state, so a
resumed run continues exactly as if it had never stopped."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from assay.core.checkpoint import latest_checkpoint, load_training_state, save_checkpoint, set_rng_state
from assay.core.config import Config, dump_config
from assay.core.modeling import apply_threads, load_model, place, save_model, use_template
from assay.core.paths import envqa_store
from assay.core.storage import MetricsLogger, TrajectoryWriter, atomic_write
from assay.core.types import Task, Trajectory
from assay.envs.qa.enforce import mark_unchecked, record_stores, require_checked
from assay.envs.registry import env_spec
from assay.envs.rewards import check_rewards
from assay.eval.evaluate import evaluate
from assay.mixer.mixer import DomainMixer
from assay.mixer.stats import DomainStats
from assay.pipeline.monitor import LoopholeWatch, log_training
from assay.pipeline.policy import Given, build_policy, domain_envs
from assay.pipeline.ranks import Ranks, make_ranks
from assay.pipeline.rollout import Rollout, ThreadRollout
from assay.pipeline.ui import RunView
from assay.rollout.base import RolloutBackend, require_backend
from assay.rollout.factory import make_backend
from assay.rollout.weights import copy_weights
from assay.train.advantages import filter_zero_variance, paying_domains
from assay.train.lora import with_lora
from assay.train.trainer import GRPOTrainer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class SyncPipeline:
    _backend: RolloutBackend  # the rollout's backend, which evaluations share (make_rollout)

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False, given: Given | None = None) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.given = given = given or Given()
        given.check(cfg)
        self.envs = domain_envs(cfg, given.envs)
        self.domains = {d.name: d for d in cfg.domains}
        # before any model is built: an environment with no passing QA record trains only if allowed
        self.unchecked = require_checked(self.envs, cfg.allow_unchecked, record_stores([cfg.eval.qa_store]),
                                         {d.name: d.env_args for d in cfg.domains})
        check_rewards(cfg.domains)
        self.start_step = 0
        self.resumed: dict[str, Any] | None = None  # the checkpoint's trainer.pt, when resuming
        if resume:
            ckpt = latest_checkpoint(run_dir)
            blob, state = load_training_state(ckpt)
            self.model, self.tokenizer = load_model(ckpt, cfg.model)
        elif given.policy is not None:
            model, self.tokenizer = given.policy
            self.model = place(model, cfg.model)
            use_template(self.tokenizer, cfg.model.chat_template_kwargs)  # as load_model does
        else:
            self.model, self.tokenizer = build_policy(cfg, self.envs)
        self.threads = apply_threads(cfg.threads, self.model)
        # the policy as a plain Hugging Face model, what rollouts run and checkpoints hold; with LoRA
        # the trainer's model is a peft wrapper of a copy, and this one gets the adapters folded in;
        # sharded, the trainer shards a copy, and this one gets the whole weights the trainer gathers
        self.plain = self.model
        if cfg.train.lora.rank:
            self.model = with_lora(copy.deepcopy(self.plain), cfg.train.lora)
        elif cfg.train.sharding == "fsdp":
            self.model = copy.deepcopy(self.plain)
        # the config in effect (a resume may override), with the thread count resolved: `threads: 0`
        # measures, and a resume must not measure again (another count rounds floats differently)
        self.cfg = cfg = cfg.model_copy(update={"threads": self.threads})
        atomic_write(run_dir / "config.yaml", dump_config(cfg))
        ref = self._reference_policy() if cfg.train.loss.kl_coef > 0 else None
        self.ranks: Ranks | None = make_ranks(cfg, self.model, ref, run_dir) if cfg.train.distributed else None
        try:  # the ranks are processes and a process group: a failure from here on must not leave them
            self.trainer = GRPOTrainer(self.model, cfg.train, ref_model=ref, temperature=cfg.rollout.temperature,
                                       data_parallel=self.ranks is not None)
            self.mixer = DomainMixer(cfg.domains, cfg.mixer, self.envs, seed=cfg.seed)
            if resume:  # with LoRA trainer.pt holds the trainer's model (frozen base and adapters), for exactness
                trainer_state = {**blob["trainer"], "model": blob["trainer"].get("model") or self.plain.state_dict()}
                if self.ranks:  # first: sharded, loading is a collective that rank 0's load joins
                    self.ranks.load_state_dict(trainer_state)
                self.trainer.load_state_dict(trainer_state)
                self.mixer.load_state_dict(state["mixer"])
                set_rng_state(blob["rng"])
                self.start_step = state["step"]
                self.resumed = blob
            self.rollout: Rollout = self.make_rollout()
            self.rollout.update_weights([], version=self.start_step)
        except BaseException:
            self.close_ranks()
            raise
        self.qa_store = Path(cfg.eval.qa_store) if cfg.eval.qa_store else envqa_store()  # where `env show` reads
        self.watch = LoopholeWatch(cfg.eval.loophole_margin)

    def _reference_policy(self) -> PreTrainedModel:
        """The KL anchor is the policy the run started from; kept on disk so a resume finds it."""
        path = self.run_dir / "reference_policy"
        if not (path / "config.json").is_file():
            save_model(self.plain, self.tokenizer, path)
        ref, _ = load_model(path, self.cfg.model)
        ref.requires_grad_(False)
        return ref.eval()

    def collect_batch(self, step: int, tasks: list[Task] | None = None
                      ) -> tuple[list[Trajectory], list[Trajectory], int]:
        """(every trajectory sampled, those kept for training, groups dropped for zero variance), from
        `tasks` (default: drawn now). Dynamic sampling refills dropped groups with fresh tasks
        (`refill_tasks`), a bounded number of times, from the domains where refills pay
        (`paying_domains`)."""
        want = self.cfg.train.groups_per_step
        everything = self.rollout.rollout(tasks if tasks is not None else self.mixer.sample(want), step, 0)
        if not self.cfg.train.dynamic_sampling:
            return everything, everything, 0
        kept, dropped = filter_zero_variance(everything)
        for attempt in range(1, self.cfg.train.max_refill_rounds + 1):
            missing = want - len({t.group_id for t in kept})
            if missing <= 0:
                break
            tasks = self.refill_tasks(missing, step, paying_domains(everything, kept, self.cfg.train.refill_min_yield))
            if not tasks:  # no domain pays
                break
            more = self.rollout.rollout(tasks, step, attempt)
            everything += more
            more_kept, more_dropped = filter_zero_variance(more)
            kept += more_kept
            dropped += more_dropped
        return everything, kept, dropped

    def refill_tasks(self, n: int, step: int, domains: set[str] | None = None) -> list[Task]:
        """Tasks to replace `n` dropped groups of step `step`, from `domains` (None: any): here the
        mixer's next draw."""
        return self.mixer.sample(n, domains)

    def run(self, view: RunView | None = None) -> None:
        cfg = self.cfg
        writer = TrajectoryWriter(self.run_dir / "trajectories", self.start_step)
        metrics = self.open_metrics(writer.attempt)
        try:
            for step in range(self.start_step + 1, cfg.train.steps + 1):
                t0, c0 = time.time(), time.perf_counter()
                everything, kept, dropped = self.collect_batch(step)
                t1, c1 = time.time(), time.perf_counter()
                mark_unchecked(everything, self.unchecked)
                writer.write(everything, step)
                stats = self.mixer.update(everything)
                train_metrics = self.train_step(kept, step - 1)
                self.rollout.update_weights(self.trainer.named_weights(), version=step)
                # what each worker did when (start: wall clock, duration: monotonic): the report's timeline
                busy = {"rollout_start_s": t0, "rollout_s": c1 - c0, "train_start_s": t1,
                        "train_s": time.perf_counter() - c1}
                self.monitor(step, everything, stats, metrics, view)
                rollout = {f"rollout/{k}": v for k, v in self.rollout.take_stats().items()}  # the engine's counters
                record = {**train_metrics, "groups_dropped": dropped, "sampled": len(everything),
                          **stats.metrics(), **rollout, **busy}
                self.end_step(step, record, stats, train_metrics, metrics, view)
        finally:
            metrics.close()
            self.close_ranks()
            self.close_rollout()

    def train_step(self, batch: list[Trajectory], version: int) -> dict[str, float]:
        """One trainer step; with `train.ranks` > 1 every rank takes it together."""
        if self.ranks:
            self.ranks.step(batch, version)
        return self.trainer.step(batch, version=version)

    def close_rollout(self, wait_s: float = 0) -> None:
        """Stop the rollout (a backend's engine and process group, a worker process, Ray actors; a rollout
        in flight is waited for up to `wait_s`), and the verifier processes this process started, if any."""
        from assay.envs.verifiers import close_shared_verifiers

        close_shared_verifiers(self.envs)
        self.rollout.close(wait_s=wait_s)

    def close_ranks(self) -> None:
        """Stop the other ranks and leave the process group, whose gloo threads must end here rather than in
        the interpreter's teardown (see `leave_process_group`). Sharded, rank 0's trainer holds DTensors whose
        mesh keeps the group alive: the trainer goes first, and `self.model` is the plain policy again."""
        if self.ranks:
            if self.cfg.train.sharding == "fsdp":
                del self.trainer
                self.model = self.plain
            self.ranks.close()
            self.ranks = None

    def open_metrics(self, attempt: int) -> MetricsLogger:
        """The run's metrics log; every attempt after the first (a resume, a restart) first marks the
        step it starts from, so that readers drop the earlier records of the steps it runs again."""
        metrics = MetricsLogger(self.run_dir, self.cfg.loggers, self.cfg.name, self.cfg.model_dump(mode="json"))
        for domain, env in self.unchecked.items():  # in the run's log as well as its config and trajectories
            metrics.log(self.start_step, {"qa_unchecked": f"domain {domain}: {env} runs without a passing QA "
                                                          "record (allow_unchecked)"}, kind="warning")
        if attempt:
            metrics.log(self.start_step, {"attempt": attempt, "resumed_from": self.start_step}, kind="resume")
        return metrics

    def end_step(self, step: int, record: dict[str, Any], stats: DomainStats, train_metrics: dict[str, float],
                 metrics: MetricsLogger, view: RunView | None) -> None:
        """Log the step and its warnings, checkpoint on schedule, show progress."""
        metrics.log(step, record)
        for warning in stats.warnings:
            metrics.log(step, {"seesaw": warning}, kind="warning")
            if view:
                view.warn(f"step {step}: {warning}")
        if step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.steps:
            self.save(step)
        if view:
            view.advance(step, _headline(stats, train_metrics), domain_rows(stats, train_metrics))

    def monitor(self, step: int, trajs: list[Trajectory], stats: DomainStats, metrics: MetricsLogger,
                view: RunView | None) -> None:
        """Log training's pass rates to the QA store; every `eval.every` steps evaluate on the evaluation
        partition and flag a domain whose training reward climbs while its held-out pass rate does not."""
        cfg = self.cfg
        log_training(self.qa_store, cfg.name, step, trajs, {n: env_spec(e) for n, e in self.envs.items()})
        self.watch.observe({name: d.pass_rate for name, d in stats.domains.items()})
        every = cfg.watch_every
        if not every or step % every:
            return
        started = time.perf_counter()
        results = evaluate(self.eval_backend(), self.tokenizer, self.envs, self.domains, cfg.eval.watch_tasks,
                           cfg.eval.watch_n, cfg.eval.seed, cfg.eval.temperature, ks=(1,),
                           allow_unchecked=cfg.allow_unchecked, stores=record_stores([cfg.eval.qa_store]))
        held = {name: (r.pass_at[1].value, r.pass_at[1].se) for name, r in results.items() if 1 in r.pass_at}
        metrics.log(step, {**{f"heldout/{name}/pass@1": v for name, (v, _) in held.items()},
                           "heldout/seconds": time.perf_counter() - started}, kind="eval")
        for warning in self.watch.evaluated(held):
            metrics.log(step, {"loophole": warning}, kind="warning")
            if view:
                view.warn(f"step {step}: {warning}")

    def make_rollout(self) -> Rollout:
        """Where rollouts run: here on this thread, on the trainer's own weights (a weight sync is a version
        bump; with LoRA a copy of the folded weights, sharded a copy of the gathered ones)."""
        self._backend = self.make_backend(self.plain)
        return ThreadRollout(self.cfg, self._backend, self.tokenizer, self.envs)

    def make_backend(self, model: PreTrainedModel) -> RolloutBackend:
        """The configured backend around `model`, or the one the caller's factory makes."""
        if self.given.backend is not None:
            return require_backend(self.given.backend(model, self.tokenizer), "the backend factory given to the pipeline")
        return make_backend(self.cfg.rollout, model, self.tokenizer)

    def policy_model(self) -> PreTrainedModel:
        """The current policy as a plain Hugging Face model (with LoRA, the adapters folded in now)."""
        if self.plain is not self.model:
            copy_weights(self.plain, self.trainer.named_weights())
        return self.plain

    def eval_backend(self) -> RolloutBackend:
        """The backend evaluations run on: the rollout's own (it runs the trainer's current weights)."""
        return self._backend

    def save(self, step: int) -> Path:
        return self._save(step)

    def trainer_state(self) -> dict[str, Any]:
        """The trainer's state for a checkpoint; sharded, every rank gathers it (rank 0 receives it)."""
        if self.ranks and self.cfg.train.sharding == "fsdp":
            self.ranks.gather()
        return self.trainer.state_dict()

    def _save(self, step: int, buffer: dict[int, Any] | None = None) -> Path:
        trainer = self.trainer_state()
        if not self.cfg.train.lora.rank:  # the weights go to model.safetensors once; with LoRA it holds the folded ones
            trainer = {k: v for k, v in trainer.items() if k != "model"}
        return save_checkpoint(self.run_dir / "checkpoints", step, self.policy_model(), self.tokenizer, trainer,
                               {"mixer": self.mixer.state_dict()}, keep=self.cfg.train.keep_checkpoints,
                               buffer=buffer)


def domain_rows(stats: DomainStats, train_metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per-domain figures for the live table: the mixer's step stats plus the trainer's."""
    rows = {}
    for name, d in stats.domains.items():
        row = {k: v for k, v in vars(d).items() if v is not None and not isinstance(v, dict)}
        for key in ("entropy", "kl_ref", "mismatch"):
            if f"{key}/{name}" in train_metrics:
                row[key] = train_metrics[f"{key}/{name}"]
        rows[name] = row
    return rows


def _headline(stats: DomainStats, train_metrics: dict[str, float]) -> str:
    rates = [d.pass_rate for d in stats.domains.values() if d.pass_rate is not None]
    mean = sum(rates) / len(rates) if rates else 0.0
    return f"pass {mean:.2f}  loss {train_metrics.get('loss', 0.0):+.4f}"

