"""The `assay` command line. Every user error is one line on stderr and a non-zero exit."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from assay.core.config import DomainConfig, EvalConfig
from assay.core.errors import AssayError
from assay.core.paths import describe, envqa_store, evals_dir

if TYPE_CHECKING:  # imported lazily at run time: the CLI starts fast
    from assay.agent.approvals import ApprovalPolicy
    from assay.core.types import Task
    from assay.envs.base import Environment
    from assay.eval.endpoint import Endpoint

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Assay: RL post-training of LLM agents on verifiable rewards.")
console = Console()
_EVAL, _DOMAIN = EvalConfig(), DomainConfig(name="-", env="-")  # `assay eval` defaults are the config's
sandbox_app = typer.Typer(invoke_without_command=True, help="The sandbox model-written code runs in: alone, what "
                                                                "enforces each limit here; `run`, a command in it.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: ratios measured side by side in one run.")
env_app = typer.Typer(no_args_is_help=True, help="Environments: list, show, and the QA gate.")
model_app = typer.Typer(no_args_is_help=True, help="Bring a pretrained model in as a Hugging Face directory.")
config_app = typer.Typer(no_args_is_help=True, help="The run configuration's reference, from its models.")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(bench_app, name="bench")
app.add_typer(env_app, name="env")
app.add_typer(model_app, name="model")
app.add_typer(config_app, name="config")


@app.callback()
def _global(unsafe_no_sandbox: Annotated[bool, typer.Option(
        "--unsafe-no-sandbox", help="run model-written code WITHOUT isolation where the sandbox cannot start")] = False,
            per_process_limits: Annotated[bool, typer.Option(
        "--per-process-limits", help="where no cgroup can cap a sandbox's whole process tree, cap memory and "
                                     "processes per process (rlimits) instead of refusing")] = False) -> None:
    if unsafe_no_sandbox:
        from assay.sandbox import allow_unsafe_sandbox

        allow_unsafe_sandbox()
    if per_process_limits:
        from assay.sandbox import allow_per_process_limits

        allow_per_process_limits()

Overrides = Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides, e.g. train.steps=5")]


@app.command()
def train(config: Annotated[Path | None, typer.Argument(help="YAML config")] = None,
          overrides: Overrides = None,
          resume: Annotated[Path | None, typer.Option(help="resume runs/NAME from its last checkpoint")] = None,
          supervise: Annotated[int, typer.Option(help="restart a training process that dies, from its last "
                                                      "checkpoint, at most this many times (0: off)")] = 0,
          allow_unchecked: Annotated[list[str] | None, typer.Option(
              help="train this environment (NAME, NAME@VERSION or domain) without a passing QA record; recorded "
                   "in the run's config and on its trajectories; repeat for several")] = None,
          quiet: bool = False) -> None:
    """RL-train a policy on the config's domains."""
    from assay.core.config import load_config, load_recorded_config
    from assay.core.storage import lock_run_dir, prepare_run_dir, release_run_dir

    overrides = list(overrides or [])
    if config is not None and "=" in str(config) and not config.exists():  # an override, not a file
        overrides.insert(0, str(config))
        config = None
    allow = list(allow_unchecked or [])
    if supervise < 0:
        raise AssayError(f"--supervise takes the number of restarts allowed (0: off), got {supervise}")
    if supervise:
        from assay.pipeline.supervise import supervise as run_supervised
        from assay.sandbox import unsafe_allowed

        if resume is not None:
            run_dir = resume
        elif config is None:
            raise AssayError("assay train needs a CONFIG file or --resume runs/NAME")
        else:
            cfg = load_config(config, overrides)  # bad input is reported here, before any child starts
            run_dir = Path(cfg.run_dir) / cfg.name
        first = [*([str(config)] if config else []), *overrides, *(["--resume", str(resume)] if resume else []),
                 *(["--quiet"] if quiet else []), *(a for name in allow for a in ("--allow-unchecked", name))]
        code = run_supervised(first, run_dir, supervise, ["--unsafe-no-sandbox"] if unsafe_allowed() else [],
                              log=console.print)
        raise typer.Exit(code)
    if resume is not None:
        cfg = load_config(config, overrides) if config else load_recorded_config(resume / "config.yaml", overrides)
        run_dir = resume
        lock_run_dir(run_dir)  # a run continued twice at once would interleave its records
    elif config is None:
        raise AssayError("assay train needs a CONFIG file or --resume runs/NAME")
    else:
        cfg = load_config(config, overrides)
        run_dir = prepare_run_dir(cfg.run_dir, cfg.name, existing="refuse")
    from assay.pipeline.async_pipeline import make_pipeline  # torch and the rest: after bad input is told
    from assay.pipeline.ui import RunView

    # added to the config's own list: the run's config.yaml then keeps every override
    cfg.allow_unchecked = list(dict.fromkeys([*cfg.allow_unchecked, *allow]))
    try:
        pipeline = make_pipeline(cfg, run_dir, resume=resume is not None)
        with RunView("train", cfg.train.steps, quiet=quiet, console=console) as view:
            view.advance(pipeline.start_step)
            pipeline.run(view)
    finally:
        release_run_dir(run_dir)
    console.print(f"run directory: {run_dir}")


@app.command()
def sft(config: Annotated[Path, typer.Argument(help="YAML config")], overrides: Overrides = None,
        quiet: bool = False) -> None:
    """Supervised cold start on the environments' reference solutions."""
    from assay.core.config import load_config
    from assay.core.storage import prepare_run_dir, release_run_dir
    from assay.pipeline.sft import run_sft
    from assay.pipeline.ui import RunView

    cfg = load_config(config, overrides or [])
    run_dir = prepare_run_dir(cfg.run_dir, cfg.name, existing="refuse")
    try:
        with RunView("sft", cfg.sft.steps, quiet=quiet, console=console) as view:
            out = run_sft(cfg, run_dir, view)
    finally:
        release_run_dir(run_dir)
    console.print(f"policy saved to {out} (use it with model.path={out})")


@app.command(name="eval")
def eval_(target: Annotated[Path, typer.Argument(help="a policy directory, a .gguf file or a packaged model "
                                                        "(smollm2), or a suite YAML (then --policy)")],
          env: Annotated[list[str] | None, typer.Option(help="environment NAME or NAME@VERSION; repeat for "
                                                        "several (without a suite)")] = None,
          policy: Annotated[list[Path] | None, typer.Option(help="policy directory to run a suite on; repeat "
                                                            "to compare several")] = None,
          endpoint: Annotated[str | None, typer.Option(help="an OpenAI-compatible endpoint to evaluate, e.g. "
                                                       "http://127.0.0.1:8000/v1 (with --model)")] = None,
          model: Annotated[str | None, typer.Option(help="the endpoint's model name")] = None,
          api_key_env: Annotated[str | None, typer.Option(help="the environment variable holding the endpoint's "
                                                          "API key (default: OPENAI_API_KEY, if set); the key "
                                                          "is never printed or recorded")] = None,
          n: Annotated[int, typer.Option(help="samples per task (a suite sets its own)")] = _EVAL.n,
          tasks: Annotated[int, typer.Option(help="tasks per environment")] = _EVAL.tasks_per_domain,
          difficulty: Annotated[list[int] | None, typer.Option(help="levels to cover (default: all)")] = None,
          temperature: float = _EVAL.temperature, seed: int = _EVAL.seed,
          max_new_tokens: int = _DOMAIN.max_new_tokens, max_turns: int = _EVAL.max_turns,
          tool_retries: Annotated[int, typer.Option(help="retries of a malformed tool-call turn, as the domain key "
                                                    "(--env; a suite sets its own): evaluate as you trained")] = 0,
          repair_tool_calls: Annotated[bool, typer.Option(help="repair tool calls that do not parse, as the domain "
                                                          "key (--env; a suite sets its own)")] = False,
          backend: Annotated[str, typer.Option(help="rollout backend: engine, hf, vllm or a registered one")] = "engine",
          kv_cache_mb: Annotated[int, typer.Option(help="the engine's KV cache in MiB; 0: room for every episode "
                                                   "at once, up to a quarter of the free memory")] = 0,
          weights: Annotated[str, typer.Option(help="the engine's weights: float32, int8 (what `assay serve "
                                               "--profile fast` runs), bf16 or auto (rollout.weights)")] = "float32",
          run: Annotated[Path | None, typer.Option(help="runs/NAME that trained the policy: check that no "
                                                   "evaluation task is in its RL trajectories or SFT data")] = None,
          out: Annotated[Path | None, typer.Option(help=f"record directory (default: {describe('evals')}/<time>)")] = None,
          price_prompt: Annotated[float, typer.Option(help="cost per million prompt tokens")] = 0.0,
          price_completion: Annotated[float, typer.Option(help="cost per million completion tokens")] = 0.0,
          html: Annotated[bool, typer.Option(help="also write report.html beside each record")] = False,
          repeats: Annotated[int, typer.Option(help="evaluate the same tasks this many times with sampling seeds "
                                               "seed, seed+1, …: run-to-run variance")] = 1,
          allow_unchecked: Annotated[list[str] | None, typer.Option(
              help="evaluate this environment (NAME or NAME@VERSION) without a passing QA record; recorded in the "
                   "record and on its trajectories")] = None,
          critical_tools: Annotated[str | None, typer.Option(
              help="tools whose calls wait for a person's approval, comma-separated (e.g. bash,write); a denial or "
                   "no decision in time is an error result the policy sees, and the call does not run")] = None,
          allow_tools: Annotated[str | None, typer.Option(
              help="the deployment's tool allowlist, comma-separated: a call to any other tool is refused without "
                   "asking anyone (default: every tool a task offers)")] = None,
          approvals: Annotated[str | None, typer.Option(
              help="where a person decides on critical calls: cli (a prompt on this terminal; the default), "
                   "file:DIR (a file queue) or webhook:URL")] = None,
          approval_timeout: Annotated[float | None, typer.Option(
              help="seconds a critical call waits for a decision before it is denied (default 60)")] = None,
          audit_log: Annotated[Path | None, typer.Option(
              help="the JSONL file every approval decision is appended to (default: the record directory's "
                   "approvals.jsonl)")] = None) -> None:
    """pass@k, pass^k and the rest on the evaluation partition, or on a pinned suite; writes a record."""
    import time
    from dataclasses import replace

    from assay.core.config import DifficultyRange, DomainConfig
    from assay.core.errors import ConfigError
    from assay.envs.registry import get_env
    from assay.eval.endpoint import Endpoint
    from assay.eval.evaluate import eval_tasks
    from assay.eval.run import evaluate_plan, make_plan, suite_plan
    from assay.eval.suite import load_suite
    from assay.rollout.factory import backend_names

    if backend not in backend_names():
        raise ConfigError(f"--backend {backend!r} is no rollout backend; the known ones are {', '.join(backend_names())}")
    if kv_cache_mb < 0:
        raise ConfigError(f"--kv-cache-mb must be 0 (sized to the evaluation) or a number of MiB, got {kv_cache_mb}")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    if (endpoint is None) != (model is None):
        raise ConfigError("an endpoint needs both --endpoint URL and --model NAME")
    if api_key_env is not None and endpoint is None:
        raise ConfigError("--api-key-env names the key of an endpoint: pass it with --endpoint URL --model NAME")
    remote = [Endpoint(endpoint, model, api_key_env)] if endpoint is not None and model is not None else []
    for e in remote:
        e.api_key()  # a named variable that is unset fails here, before anything runs
    out = out or evals_dir() / time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    approval = _approval_policy(critical_tools, allow_tools, approvals, approval_timeout, audit_log, out)
    settings: dict[str, Any] = {"backend": backend, "seed": seed, "weights": weights}
    if target.suffix in (".yaml", ".yml"):
        if not policy and not remote:
            load_suite(target)  # a missing or malformed suite is named first
            raise ConfigError(f"a suite runs on policies: assay eval {target} --policy DIR [--policy DIR ...] "
                              "or --endpoint URL --model NAME")
        plan = suite_plan(target, settings, allow_unchecked or ())
        policies: list[Path | Endpoint] = [*(policy or []), *remote]
    else:
        if not env:
            raise ConfigError("assay eval POLICY needs --env NAME (repeat for several), or pass a suite YAML")
        envs = {spec: get_env(spec) for spec in env}
        domains = {}
        for spec, e in envs.items():
            levels = sorted(difficulty or e.difficulties)
            domains[spec] = DomainConfig(name=spec, env=spec, max_new_tokens=max_new_tokens, max_turns=max_turns,
                                         tool_retries=tool_retries, repair_tool_calls=repair_tool_calls,
                                         difficulty=DifficultyRange(min=levels[0], max=levels[-1], start=levels[0]))
        task_list = [t for spec, e in envs.items() for t in eval_tasks(e, spec, tasks, seed, domains[spec].difficulty
                                                                       .levels(e.difficulties))]
        settings |= {"n": n, "tasks": tasks, "difficulty": difficulty, "max_new_tokens": max_new_tokens,
                     "max_turns": max_turns, "tool_retries": tool_retries, "repair_tool_calls": repair_tool_calls}
        plan = make_plan(envs, domains, task_list, n, temperature, settings, allow_unchecked or ())
        policies = [target, *(policy or []), *remote]
    gated = None
    if approval is not None:
        from assay.agent.approvals import check_critical_offered, open_approvals

        check_critical_offered(approval, {tool.name for t in plan.tasks for tool in t.tools})
        plan = replace(plan, settings={**plan.settings, "approvals": approval.describe()})
        gated = open_approvals(approval)  # the channel is checked here, before any policy loads
    records = []
    for i, p in enumerate(policies):
        where = out / f"{i}_{p.name if isinstance(p, Path) else 'endpoint'}" if len(policies) > 1 else out
        runs = [evaluate_plan(p, plan, seed + r, where / f"repeat_{r}" if repeats > 1 else where,
                                kv_cache_mb=kv_cache_mb, run=run, prices=(price_prompt, price_completion), html=html,
                                approvals=gated) for r in range(repeats)]
        if repeats > 1:
            from assay.eval.record import read_record
            from assay.eval.tables import repeats_table

            console.print(repeats_table([read_record(r) for r in runs]))
        records.append(runs[0])
    if len(records) > 1:
        from assay.eval.record import compare, read_record
        from assay.eval.tables import comparison_table

        first = read_record(records[0])
        for other in records[1:]:
            console.print(f"A = {records[0].parent}, B = {other.parent}")
            console.print(comparison_table(compare(first, read_record(other)), None))


def _approval_policy(critical: str | None, allow: str | None, channel: str | None, timeout_s: float | None,
                     audit: Path | None, out: Path) -> ApprovalPolicy | None:
    """`assay eval`'s approval options as a policy (its audit log by default in the record directory `out`);
    None when they set nothing."""
    from assay.agent.approvals import ApprovalPolicy, tool_names

    critical_names, allowed = tool_names(critical) or frozenset(), tool_names(allow)
    if not critical_names and (channel is not None or timeout_s is not None):
        raise AssayError("--approvals and --approval-timeout say how critical calls are approved; name the "
                         "critical tools with --critical-tools a,b")
    if critical is not None and not critical_names:
        raise AssayError("--critical-tools names no tool; give them comma-separated, e.g. --critical-tools bash,write")
    if not critical_names and allowed is None:
        if audit is not None:
            raise AssayError("--audit-log records approval decisions; it needs --critical-tools or --allow-tools")
        return None
    return ApprovalPolicy(audit or out / "approvals.jsonl", critical_names, allowed, 60.0 if timeout_s is None else timeout_s, channel or "cli")


@app.command(name="eval-pin", hidden=True)  # spelled `assay eval pin SUITE.yaml` (see main)
def eval_pin(suite: Annotated[Path, typer.Argument(help="a suite YAML")]) -> None:
    """Write each entry's current environment hash into the suite."""
    from assay.eval.suite import pin

    changes = pin(suite)
    console.print("\n".join(changes) if changes else f"{suite}: every entry already pinned at its current hash")


@app.command(name="eval-compare", hidden=True)  # spelled `assay eval compare A B` (see main)
def eval_compare(a: Annotated[Path, typer.Argument(help="record A (a directory assay eval wrote)")],
                 b: Annotated[Path, typer.Argument(help="record B")],
                 effect: Annotated[float | None, typer.Option(help="the pass@1 difference you care about: warn "
                                                              "when the suite is too small to detect it")] = None) -> None:
    """Paired differences of two evaluation records, task by task, with CIs and verdicts."""
    from assay.eval.record import compare, read_record
    from assay.eval.tables import comparison_table

    ra, rb = read_record(a), read_record(b)
    for name in sorted(set(ra["environments"]) & set(rb["environments"])):
        ea, eb = ra["environments"][name], rb["environments"][name]
        if ea != eb:
            console.print(f"[yellow]warning:[/] {name} differs between the records ({ea['spec']} {ea['hash']} vs "
                          f"{eb['spec']} {eb['hash']}): tasks are paired by id, but the environment changed")
    rows = compare(ra, rb)
    if not rows:
        raise AssayError(f"{a} and {b} share no environment to compare")
    console.print(comparison_table(rows, effect))


@app.command()
def serve(policy: Annotated[Path, typer.Argument(help="a policy: runs/NAME (its latest checkpoint), a checkpoint or "
                                                       "Hugging Face directory, a .gguf file, or smollm2")],
          profile: Annotated[str, typer.Option(help="how the policy is run: standard, or fast (int8 weights, "
                                               "speculative decoding, latency first)")] = "standard",
          host: Annotated[str, typer.Option(help="address to listen on; the loopback unless you open it")] = "127.0.0.1",
          port: Annotated[int, typer.Option(help="port to listen on; 0: any free one (logged)")] = 8000,
          max_queue: Annotated[int, typer.Option(help="requests that may wait for the batch; more are answered "
                                                 "429")] = 64,
          max_batch: Annotated[int | None, typer.Option(help="sequences the engine runs at once (default: the "
                                                        "profile's)")] = None,
          threads: Annotated[int, typer.Option(help="torch threads (0: the count measured fastest here)")] = 0,
          served_model_name: Annotated[str | None, typer.Option(
              help="the name clients pass as `model` (default: the policy argument as given)")] = None,
          api_key_env: Annotated[str | None, typer.Option(help="the environment variable holding the API key "
                                                          "clients must send as a Bearer token; never printed")] = None,
          log: Annotated[str | None, typer.Option(help="log every completed request (trajectory schema, Parquet) to "
                                                  "this directory or fsspec URL (s3://...); durable per request")] = None,
          canary: Annotated[Path | None, typer.Option(help="a candidate policy served to --share of sessions, rolled "
                                                      "back automatically on a significant success-rate loss")] = None,
          share: Annotated[float, typer.Option(help="the canary's share of sessions")] = 0.1,
          alpha: Annotated[float, typer.Option(help="the canary test's error rates (false rollback, false "
                                               "promotion)")] = 0.05,
          margin: Annotated[float, typer.Option(help="the success-rate loss a promotion tolerates")] = 0.1,
          latency_slo: Annotated[float | None, typer.Option(help="seconds a request may take: the canary is also rolled "
                                                          "back when significantly more of its requests exceed it")
                                 ] = None,
          cost_budget: Annotated[int | None, typer.Option(help="tokens (prompt and completion) a request may use: the "
                                                        "canary is also rolled back when significantly more of its "
                                                        "requests exceed it")] = None,
          verify_suite: Annotated[Path | None, typer.Option(
              help="a pinned suite: a chat request whose metadata names one of its single-turn tasks ({\"assay_task\": "
                   "ID}) and sends that task's prompt is graded by the task's verifier, its verdict fed to the canary's "
                   "test like client feedback")] = None,
          deployment: Annotated[Path | None, typer.Option(help="a JSON file kept with the deployment's versions, "
                                                          "hashes, pointer and decisions")] = None,
          golden: Annotated[list[Path] | None, typer.Option(
              help="a pinned suite (SUITE.yaml), on which both policies are evaluated before serving (records in "
                   f"{describe('evals/golden')}, reused for the same suite, settings and weights), or their records "
                   "(the --out DIR of assay eval SUITE.yaml --policy STABLE --policy CANDIDATE, or the two record "
                   "directories): the candidate is rolled back at once if significantly worse on it, and promoted "
                   "only if it passes")] = None,
          golden_margin: Annotated[float | None, typer.Option(help="the suite's pass@1 loss a promotion tolerates "
                                                              "(default: --margin)")] = None
          ) -> None:
    """An OpenAI-compatible API (chat completions, completions, models; /health, /metrics) on Assay's engine."""
    from assay.serve import require_installed

    require_installed()
    from assay.serve.canary import CanaryConfig
    from assay.serve.profile import get_profile
    from assay.serve.server import ServeOptions
    from assay.serve.server import serve as run_server

    if threads < 0:
        raise AssayError(f"--threads {threads}: give a positive count, or 0 for the count measured fastest here")
    run_server(policy, get_profile(profile), ServeOptions(
        host, port, max_queue, max_batch, api_key_env, model_id=served_model_name, threads=threads, log=log,
        canary=canary, deployment_record=deployment,
        canary_config=CanaryConfig(share, alpha, margin, latency_slo_s=latency_slo, cost_budget_tokens=cost_budget)
        if canary is not None else None,
        golden=tuple(golden or ()), golden_margin=golden_margin, verify_suite=verify_suite))


@app.command()
def replay(log: Annotated[str, typer.Argument(help="a session log: the directory or fsspec URL of assay serve --log")],
           policy: Annotated[Path, typer.Option(help="the policy to replay on: runs/NAME, a checkpoint or Hugging Face "
                                                     "directory, a .gguf file, or smollm2")],
           show: Annotated[int, typer.Option(help="differing choices to print")] = 20) -> None:
    """Re-run the logged sessions on a policy (same prompts and sampling) and print where outcomes differ."""
    from assay.core.modeling import apply_threads, load_model
    from assay.serve.replay import format_report
    from assay.serve.replay import replay as run_replay
    from assay.serve.server import policy_dir
    from assay.serve.session_log import read_sessions

    sessions = read_sessions(log)
    model, tokenizer = load_model(policy_dir(policy))
    apply_threads(0, model)
    console.print(format_report(run_replay(sessions, model, tokenizer), show), markup=False, highlight=False)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="runs/NAME")]) -> None:
    """Write runs/NAME/report.html with per-domain curves."""
    from assay.eval.report import write_report

    console.print(f"wrote {write_report(run_dir)}")


@app.command()
def scale(run_dir: Annotated[Path, typer.Argument(help="runs/NAME of a run with pipeline.workers: ray")],
          rollout_workers: Annotated[int | None, typer.Option(help="rollout actors from the next rollout on")] = None,
          verifier_workers: Annotated[int | None, typer.Option(help="verifier actors from the next rollout on "
                                                                    "(0: the rollout actors verify)")] = None) -> None:
    """Change a running run's number of rollout or verifier workers (Ray actors) without restarting its trainer."""
    from assay.pipeline.ray_workers import request_scale

    if rollout_workers is None and verifier_workers is None:
        raise AssayError("assay scale: give --rollout-workers N, --verifier-workers N, or both")
    for n, verifiers, what in ((rollout_workers, False, "rollout"), (verifier_workers, True, "verifier")):
        if n is not None:
            request_scale(run_dir, n, verifiers=verifiers)
            console.print(f"{run_dir}: {n} {what} worker(s) from its next rollout on")


@app.command()
def quickstart(overrides: Overrides = None,
               preset: Annotated[str, typer.Option(help="a config shipped with Assay: quickstart (the embedded "
                                                   "default), smollm2 (RL on SmolLM2-135M-Instruct) or smollm2_sft "
                                                   "(SFT on clean demonstrations, then RL)")] = "quickstart",
               print_config: Annotated[bool, typer.Option(help="print the preset's config and exit")] = False) -> None:
    """The main job on the embedded default config: SFT, evaluate, multi-domain RL, evaluate again."""
    from assay.pipeline.quickstart import default_config, default_config_text, run_quickstart

    if print_config:
        print(default_config_text(preset))
        return
    cfg = default_config(overrides or [], preset)
    run_quickstart(cfg, console)


@sandbox_app.callback()
def sandbox_status(ctx: typer.Context) -> None:
    """Alone: which sandbox this host gives, and what enforces each limit (cgroup v1 or v2, rlimit per process,
    namespace, seccomp); exit 1 where it refuses."""
    if ctx.invoked_subcommand is not None:
        return
    from assay.sandbox.cli_support import sandbox_report

    text, ok = sandbox_report()
    print(text)
    raise typer.Exit(0 if ok else 1)


@sandbox_app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def sandbox_run(ctx: typer.Context,
                template: Annotated[Path | None, typer.Option(help="directory the workspace starts from")] = None,
                timeout: Annotated[float, typer.Option(help="wall-clock seconds")] = 10.0,
                memory_mb: int = 512) -> None:
    """assay sandbox run [--template DIR] -- CMD ARGS…: run one command in a fresh sandbox."""
    from assay.sandbox import Limits
    from assay.sandbox.cli_support import run_command

    if not ctx.args:
        raise AssayError("assay sandbox run needs a command after --, e.g. assay sandbox run -- ls -la")
    limits = Limits(timeout_s=timeout, cpu_s=max(1, int(timeout)), memory_mb=memory_mb)
    raise typer.Exit(run_command(list(ctx.args), str(template) if template else None, limits))


@model_app.command("import")
def model_import(source: Annotated[str, typer.Argument(help="a .gguf file, or a packaged model: smollm2")],
                 out: Annotated[Path, typer.Argument(help="the Hugging Face directory to write")]) -> None:
    """A GGUF model (dequantized to float32) as safetensors, tokenizer and chat template: a model.path."""
    from assay.core.gguf_import import import_gguf

    console.print(f"wrote {import_gguf(source, out)}")


@config_app.command("reference")
def config_reference(out: Annotated[Path | None, typer.Option(
        help="write the markdown here (docs/configuration.md in the repository) instead of to stdout")] = None) -> None:
    """Every config key (type, default, constraints, meaning) as markdown, from the config models' descriptions."""
    from assay.core.config_reference import render

    text = render()
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        console.print(f"wrote {out}")


@env_app.command("list")
def env_list() -> None:
    """Every registered environment and version."""
    from assay.envs.registry import list_envs

    for name, version in list_envs():
        console.print(f"{name}@{version}")


@env_app.command("show")
def env_show(spec: Annotated[str, typer.Argument(help="NAME or NAME@VERSION")],
             store: Annotated[Path | None, typer.Option(
                 help=f"the QA store (default: {describe('envqa')})")] = None) -> None:
    """Category, tools, difficulty levels, hash and the last QA result of an environment."""
    from assay.envs.qa.gate import GATE_VERSION
    from assay.envs.qa.store import gate_version, latest
    from assay.envs.registry import env_hash, env_parts, env_spec, get_env
    from assay.envs.split import SPACE_DRAWS, estimate_space, eval_share

    store = store or envqa_store()
    env = get_env(spec)
    console.print(f"[bold]{env_spec(env)}[/]  category {env.category}  levels {list(env.difficulties)}  hash {env_hash(env)}")
    for tool in env.tools:
        console.print(f"  tool {tool.name}: {tool.description}")
    for part, h in env_parts(env).items():
        console.print(f"  {part}: {h}")
    console.print(f"  task space per level (evaluation share {eval_share(env):g}; estimated from {SPACE_DRAWS} draws):")
    for level in env.difficulties:
        est = estimate_space(env, level, SPACE_DRAWS)
        size = f"{est.distinct}" if est.distinct == est.size else f"~{est.size:,.0f}" if est.distinct < est.draws \
            else f"> {est.draws} (no repeats)"
        small = f"; too small to split usefully (~{est.eval_size:.0f} evaluation tasks)" if est.too_small else ""
        console.print(f"    level {level}: {size} tasks, {est.eval_distinct} of the {est.distinct} drawn in the "
                      f"evaluation partition{small}")
    from assay.envs.qa.enforce import record_stores

    rec = next((r for r in (latest(s, env_spec(env)) for s in record_stores([store])) if r is not None), None)
    if rec is None:
        console.print("  QA: never checked (run assay env check)")
    else:
        verdict = "passed" if rec["passed"] else "failed"
        stale = "" if gate_version(rec) >= GATE_VERSION else f", older than the current v{GATE_VERSION}: re-check it"
        console.print(f"  QA: {verdict} for hash {rec['hash']} by gate v{gate_version(rec)}{stale}; gates {rec['gates']}")
    from assay.pipeline.monitor import training_summary

    for h, t in training_summary(Path(store), env_spec(env)).items():
        levels = "  ".join(f"{lv}: {p / n:.2f} of {n}" for lv, (p, n) in sorted(t["levels"].items(), key=lambda x: int(x[0])))
        console.print(f"  training (hash {h}, {len(t['runs'])} runs, {t['steps']} steps): pass rate by level {levels}")


@env_app.command("check")
def env_check(spec: Annotated[str | None, typer.Argument(help="NAME or NAME@VERSION")] = None,
              all_: Annotated[bool, typer.Option("--all", help="every registered environment")] = False,
              tasks: Annotated[int, typer.Option(help="tasks per difficulty level")] = 8,
              policy: Annotated[Path | None, typer.Option(help="calibrate with this policy instead of a noisy reference")] = None,
              env_arg: Annotated[list[str] | None, typer.Option(help="KEY=VALUE for the environment's constructor, "
                                                                  "e.g. path=data.jsonl or tasks_dir=my_tasks")] = None,
              store: Annotated[Path | None, typer.Option(
                  help=f"the QA store, one JSON record per run (default: {describe('envqa')})")] = None) -> None:
    """The QA gate: reference, null policies, cheaters, determinism, leaks, calibration."""
    from assay.envs.qa import QAConfig, run_gate
    from assay.envs.qa.render import print_report
    from assay.envs.qa.store import check_version, diff, previous_version, save
    from assay.envs.registry import env_hash, env_parts, env_spec, get_env, list_envs

    if all_ == (spec is not None):
        raise AssayError("assay env check takes one NAME[@VERSION] or --all")
    store = store or envqa_store()  # the store enforcement searches, from any working directory
    args = {}
    for item in env_arg or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise AssayError(f"--env-arg {item!r}: expected KEY=VALUE, e.g. --env-arg path=data.jsonl")
        args[key] = value
    specs = [f"{n}@{v}" for n, v in list_envs()] if all_ else [spec]
    failed = []
    for s in specs:
        try:
            env = get_env(s, **args)
        except AssayError as e:
            console.print(f"[yellow]skipped[/] {s}: {e}")
            continue
        name = env_spec(env)
        check_version(store, name, env_hash(env), env_parts(env))
        rates = _policy_rates(policy, env) if policy else None
        report = run_gate(env, QAConfig(tasks_per_level=tasks), rates)
        save(store, report)
        print_report(console, report, diff(previous_version(store, env.name, str(env.version)), report))
        if not report.passed:
            failed.append(name)
    if failed:
        console.print(f"[red]QA gate failed:[/] {', '.join(failed)}")
        raise typer.Exit(1)


def _policy_rates(checkpoint: Path, env: Environment) -> Callable[[dict[int, list[Task]]], dict[int, list[float]]]:
    """A policy checkpoint's pass rate on each of the gate's tasks (4 samples each), per level."""
    from dataclasses import replace

    from assay.agent.groups import collect
    from assay.core.config import DifficultyRange, DomainConfig, RolloutConfig
    from assay.core.modeling import load_model
    from assay.rollout.factory import make_backend

    model, tokenizer = load_model(checkpoint)
    backend = make_backend(RolloutConfig(), model, tokenizer)
    levels = list(env.difficulties)
    domain = DomainConfig(name=env.name, env=env.name, max_turns=8,
                          difficulty=DifficultyRange(min=levels[0], max=levels[-1], start=levels[0]))

    def rates(tasks: dict[int, list[Task]]) -> dict[int, list[float]]:
        out = {}
        for level, level_tasks in tasks.items():
            drawn = [replace(t, domain=env.name) for t in level_tasks]
            trajs = collect(backend, tokenizer, {env.name: env}, {env.name: domain}, drawn, samples=4,
                            temperature=1.0, seed=0)
            out[level] = [sum(t.passed for t in trajs[i:i + 4]) / 4 for i in range(0, len(trajs), 4)]
        return out

    return rates


@bench_app.command("sandbox")
def bench_sandbox(seconds: Annotated[float, typer.Option(help="measuring time per row")] = 1.0) -> None:
    """Sandbox latency (p50/p99) and throughput beside a plain subprocess."""
    from assay.bench.sandbox import run_sandbox_bench

    print(run_sandbox_bench(seconds=seconds))


@bench_app.command("verify")
def bench_verify(candidates: Annotated[int, typer.Option(help="codegen candidates per round, half of them wrong")] = 256,
                 threads: Annotated[int, typer.Option(help="verifying threads, as rollout.verifiers")] = 16,
                 rounds: Annotated[int, typer.Option(help="rounds of both modes, alternated")] = 3) -> None:
    """Codegen verification: a sandboxed run per candidate beside candidates graded together."""
    from assay.bench.verify import run_verify_bench

    print(run_verify_bench(candidates, threads, rounds))


@bench_app.command("serve")
def bench_serve(policy: Annotated[Path, typer.Argument(help="a policy, as `assay serve` takes it (e.g. smollm2)")],
                profiles: Annotated[str, typer.Option(help="comma-separated serving profiles")] = "standard,fast",
                concurrency: Annotated[str, typer.Option(help="comma-separated concurrent clients")] = "1,8,32",
                rounds: Annotated[int, typer.Option(help="rounds of every profile and level, alternated")] = 3,
                requests: Annotated[int, typer.Option(
                    help="requests each client sends, one after another (more where a level would otherwise "
                         "leave one of the bench's prompts unsent)")] = 2,
                max_tokens: Annotated[int, typer.Option(help="most tokens per response (greedy)")] = 64,
                threads: Annotated[int, typer.Option(help="torch threads (0: the count measured fastest here)")] = 0,
                vllm_python: Annotated[str | None, typer.Option(
                    help="the python of an environment with vLLM: its OpenAI server becomes one more column "
                         "(default: this python, where vllm imports)")] = None,
                out: Annotated[Path | None, typer.Option(help="also write the rows as JSON here")] = None) -> None:
    """Serving profiles side by side: TTFT, inter-token latency and tokens/s under concurrent streaming clients."""
    import tempfile

    from assay.bench.serve import assay_starter, find_vllm_python, rows_json, run_serve_bench, table, vllm_starter
    from assay.core.modeling import apply_threads, load_model, save_model
    from assay.serve.server import policy_dir

    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError:
        raise AssayError(f"--concurrency {concurrency!r}: give whole numbers separated by commas, e.g. 1,8,32") from None
    python = find_vllm_python(vllm_python)
    model, tokenizer = load_model(policy_dir(policy))
    n_threads = apply_threads(threads, model)
    with tempfile.TemporaryDirectory(prefix="assay-bench-serve-") as tmp:
        weights = Path(tmp) / "model"  # the very weights every column serves, loaded once (a .gguf dequantized once)
        save_model(model, tokenizer, weights)
        del model
        queue = max(levels) + 8
        columns = {name: assay_starter(name, weights, n_threads, queue, Path(tmp) / f"{name}.log")
                   for name in (p.strip() for p in profiles.split(",")) if name}
        if python is not None:
            columns["vllm"] = vllm_starter(python, weights, n_threads, Path(tmp) / "vllm.log")
        rows = run_serve_bench(columns, levels, rounds, requests, max_tokens)
    print(table(rows, None if python else "vLLM: not installed here (the `vllm` extra, or --vllm-python PY): "
                                          "no vLLM column"))
    if out is not None:
        out.write_text(rows_json(rows))


@bench_app.command("rollout")
def bench_rollout(dtype: Annotated[str, typer.Option(help="float32 or bfloat16, the same for every backend")] = "float32",
                  threads: Annotated[int, typer.Option(help="torch threads in every process (0: torch's default)")] = 0,
                  rounds: Annotated[int, typer.Option(help="runs of each backend on each workload, alternated")] = 3,
                  backends: Annotated[str | None, typer.Option(
                      help="comma-separated: hf, engine, engine-torch (on torch.mm), engine-bf16 (bf16 GEMMs), "
                           "vllm-32, vllm-128 (vLLM with KV blocks of 32 or 128 tokens); default: hf and engine, "
                           "with both vLLM rows where vLLM is installed or --vllm-python is given")] = None,
                  vllm_python: Annotated[str | None, typer.Option(
                      help="an interpreter whose environment has vLLM and Assay (vLLM in an environment of its own)"
                  )] = None,
                  quick: Annotated[bool, typer.Option(help="a tiny model and workload: a smoke test, not a measurement")] = False,
                  out: Annotated[Path | None, typer.Option(help="also write the rows as JSON here")] = None,
                  device: Annotated[str, typer.Option(help="cpu or cuda[:N], the same for every backend")] = "cpu"
                  ) -> None:
    """The native engine beside HF generate and vLLM: GRPO groups and multi-turn sessions, a process per run."""
    import json
    from dataclasses import asdict

    from assay.bench.rollout import (
        BACKENDS,
        QUICK_MODEL,
        QUICK_WORKLOADS,
        WORKLOADS,
        ModelShape,
        Settings,
        run_rollout_bench,
        summarize,
        table,
    )
    from assay.bench.serve import find_vllm_python
    from assay.core.errors import ConfigError

    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    with_vllm = find_vllm_python(vllm_python) is not None  # refuses a --vllm-python that is no interpreter
    if backends is None:
        backends = "hf,engine" + (",vllm-32,vllm-128" if with_vllm else "")
    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    if unknown := [b for b in chosen if b not in BACKENDS]:
        raise ConfigError(f"--backends: unknown {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    settings = Settings(model=QUICK_MODEL if quick else ModelShape(), dtype=dtype, device=device, threads=threads,
                        kv_cache_mb=64 if quick else 2048)
    python = {b: vllm_python for b in chosen if b.startswith("vllm") and vllm_python}
    rows = run_rollout_bench(settings, QUICK_WORKLOADS if quick else WORKLOADS, chosen, rounds, python)
    print(table(rows, settings))
    if out is not None:
        out.write_text(json.dumps({"settings": asdict(settings), "summary": summarize(rows),
                                   "rows": [{**vars(r), "tokens_per_s": r.tokens_per_s} for r in rows]}, indent=1))


@bench_app.command("agent")
def bench_agent(policy: Annotated[Path | None, typer.Argument(help="a policy directory (e.g. "
                                                                 "runs/quickstart/sft/policy); not with --scripted")
                                  ] = None,
                overrides: Overrides = None,
                tasks: Annotated[int, typer.Option(help="evaluation tasks per domain")] = 32,
                n: Annotated[int, typer.Option(help="samples per task")] = 8,
                rounds: Annotated[int, typer.Option(help="alternating rounds of both loops")] = 3,
                scripted: Annotated[bool, typer.Option(help="instead: the long-horizon countermeasures off and on "
                                                            "under scripted failures (a wrong early edit, malformed "
                                                            "calls, overflow, drift) on repo tasks, in one table "
                                                            "(assay.bench.countermeasures)")] = False,
                countermeasures: Annotated[bool, typer.Option(help="instead: POLICY's own repo episodes under each "
                                                                    "long-horizon countermeasure (retry, repair, "
                                                                    "fallback, compaction, memory, plan_execute), in "
                                                                    "the --scripted table's columns")] = False,
                per_level: Annotated[int, typer.Option(help="--scripted, --countermeasures: repo tasks per level "
                                                            "(levels 2 and 4)")] = 4,
                failure: Annotated[list[str] | None, typer.Option(help="--scripted: only this failure (repeat it): "
                                                                       "'wrong early edit', 'malformed calls', "
                                                                       "overflow, drift")] = None,
                threads: Annotated[int, typer.Option(help="--countermeasures: torch threads (0: measured)")] = 0,
                ) -> None:
    """The lockstep agent loop beside the online one on the quickstart's domains (or a config's); with
    --scripted, the long-horizon countermeasures against scripted failures, in one table; with
    --countermeasures, a real policy under each of them, in the same table."""
    if scripted and policy is not None:
        raise typer.BadParameter("--scripted runs scripted policies: name no POLICY (or use --countermeasures)")
    if scripted and countermeasures:
        raise typer.BadParameter("--scripted and --countermeasures are two tables: --scripted for scripted policies, "
                                 "--countermeasures POLICY for a real one; pass one of them")
    if countermeasures:
        from assay.bench.countermeasures import run_model_countermeasures
        from assay.bench.countermeasures import table as countermeasures_table

        if policy is None:
            raise typer.BadParameter("--countermeasures: name the policy directory, e.g. "
                                     "assay bench agent runs/NAME/policy --countermeasures")
        print(countermeasures_table(*run_model_countermeasures(policy, per_level=per_level, threads=threads)))
        return
    if scripted:
        from assay.bench.countermeasures import FAILURES, run_countermeasures
        from assay.bench.countermeasures import table as countermeasures_table

        print(countermeasures_table(*run_countermeasures(failure or tuple(FAILURES), per_level=per_level)))
        return
    if policy is None:
        raise typer.BadParameter("assay bench agent POLICY: name a policy directory, or pass --scripted")
    from assay.bench.agent import run_agent_bench, table
    from assay.core.modeling import set_threads
    from assay.pipeline.quickstart import default_config

    cfg = default_config(overrides or [])
    set_threads(cfg.threads or 1)  # tiny policies run fastest on one thread; threads=N overrides
    print(table(run_agent_bench(cfg, policy, tasks, n, rounds)))


@bench_app.command("rollback")
def bench_rollback(tasks: Annotated[int, typer.Option(help="repo evaluation tasks per level")] = 8,
                   seed: Annotated[int, typer.Option(help="which evaluation tasks")] = 0) -> None:
    """Error accumulation on repo: a scripted wrong early edit, then continuing or rolling back (checkpoint tools)."""
    from assay.bench.rollback import run_rollback_bench, table

    print(table(run_rollback_bench(tasks, seed)))


@bench_app.command("pipeline")
def bench_pipeline(policy: Annotated[Path, typer.Argument(help="a policy directory to start RL from")],
                   overrides: Overrides = None,
                   steps: Annotated[int, typer.Option(help="RL steps per run")] = 10,
                   rounds: Annotated[int, typer.Option(help="alternating rounds of every variant")] = 2,
                   variant: Annotated[list[str] | None, typer.Option(help="run only these variants (repeat it); "
                                                                    "the first is the baseline")] = None,
                   held_out: Annotated[int, typer.Option(help="evaluation tasks per domain for each run's final "
                                                              "policy, 4 samples each (0: none)")] = 16) -> None:
    """RL wall time: the synchronous pipeline beside the asynchronous one, the online agent loop and
    the rollout in a worker process; the reward each reached against wall time, and held out."""
    from assay.bench.pipeline import run_pipeline_bench, table

    print(table(run_pipeline_bench(policy, steps, rounds, list(overrides or []), variant, held_out)))


@bench_app.command("cluster")
def bench_cluster(run: Annotated[Path, typer.Argument(help="a synchronous RL run's directory (runs/NAME) to take "
                                                           "the measured durations from")],
                  workers: Annotated[str, typer.Option(help="rollout-worker counts, comma-separated")]
                  = "8,16,32,64,128,256,512,1024",
                  groups_per_step: Annotated[int, typer.Option(help="GRPO groups per step (the global batch)")] = 512,
                  verifiers_per_worker: Annotated[int, typer.Option(help="verifier slots per rollout worker")] = 4,
                  workers_per_rank: Annotated[int, typer.Option(help="rollout workers per trainer rank")] = 1,
                  max_staleness: Annotated[int, typer.Option(help="async: versions rollout may run ahead")] = 1,
                  steps: Annotated[int, typer.Option(help="simulated steps per configuration")] = 20,
                  seed: int = 0,
                  link_gbps: Annotated[float, typer.Option(help="trainer ranks' link, for the all-reduce")] = 100.0,
                  against: Annotated[list[Path] | None, typer.Option(
                      help="a real run to compare with the model at this machine's shape (repeat it)")] = None,
                  cores: Annotated[int, typer.Option(help="with --against: cores rollout and trainer share "
                                                          "(0: this machine's)")] = 0,
                  seeds: Annotated[int, typer.Option(help="with --against: simulations per run")] = 20) -> None:
    """Simulated throughput, idle shares and async speed-up at 8 to 1,024 rollout workers, from a real
    run's measured durations; --against checks the model on real runs of this machine."""
    from assay.bench.cluster import run_cluster_bench

    print(run_cluster_bench(run, workers, groups_per_step, verifiers_per_worker, workers_per_rank, max_staleness,
                            steps, seed, link_gbps, list(against or []), cores, seeds))


@bench_app.command("trainer")
def bench_trainer(rounds: Annotated[int, typer.Option(help="fresh processes per variant, alternated")] = 3,
                  seqs: Annotated[int, typer.Option(help="sequences in the batch")] = 8,
                  length: Annotated[int, typer.Option(help="tokens per sequence")] = 384,
                  completion: Annotated[int, typer.Option(help="completion tokens per sequence")] = 96,
                  hidden: Annotated[int, typer.Option(help="hidden size of the 2-layer model")] = 256,
                  threads: Annotated[int, typer.Option(help="torch threads")] = 2) -> None:
    """Trainer step time and peak memory with a 151,936-token vocabulary: full logits beside selective
    log-probs, selective log-probs with LoRA adapters, and that with each group's prompt run once."""
    from assay.bench.trainer import run_trainer_bench

    print(run_trainer_bench(rounds, seqs, length, completion, hidden, threads, log=console.print))


def _seeded_bench(run: Callable[..., tuple[str, Any]], seeds: int, name: str, run_dir: Path,
                  overrides: list[str] | None, jobs: int, threads: int, preset: str, out: Path | None) -> None:
    """A bench over quickstart seeds: its arguments checked, its table printed and, with --out, written."""
    from assay.core.errors import ConfigError

    if seeds < 1 or jobs < 1 or threads < 0:
        raise ConfigError("--seeds and --jobs must be at least 1, --threads at least 0")
    text, _ = run(seeds, name, run_dir, overrides or [], jobs, threads, log=console.print, preset=preset)
    print(text)
    if out is not None:
        out.write_text(text)


@bench_app.command("learning")
def bench_learning(overrides: Overrides = None,
                   seeds: Annotated[int, typer.Option(help="quickstart runs, config seeds 0..N-1")] = 3,
                   jobs: Annotated[int, typer.Option(help="runs side by side (each then on one torch thread)")] = 1,
                   threads: Annotated[int, typer.Option(help="torch threads per run (0: the config's)")] = 0,
                   run_dir: Annotated[Path, typer.Option(help="where the runs go")] = Path("runs"),
                   name: Annotated[str, typer.Option(help="runs are NAME_s0, NAME_s1, …")] = "learning",
                   preset: Annotated[str, typer.Option(
                       help="the config each seed runs: a shipped preset (quickstart, smollm2, smollm2_sft)")] = "quickstart",
                   out: Annotated[Path | None, typer.Option(help="also write the tables (markdown) here")] = None) -> None:
    """The quickstart over several seeds: RL's Δ pass@1 per domain and on average, mean ± sd over seeds."""
    from assay.bench.learning import run_learning_bench

    _seeded_bench(run_learning_bench, seeds, name, run_dir, overrides, jobs, threads, preset, out)


@bench_app.command("policies")
def bench_policies(overrides: Overrides = None,
                   seeds: Annotated[int, typer.Option(help="config seeds 0..N-1, two runs each")] = 3,
                   jobs: Annotated[int, typer.Option(help="runs side by side (each then on one torch thread)")] = 1,
                   threads: Annotated[int, typer.Option(help="torch threads per run (0: the config's)")] = 0,
                   run_dir: Annotated[Path, typer.Option(help="where the runs go")] = Path("runs"),
                   name: Annotated[str, typer.Option(help="runs are NAME_rl_sS (RL alone) and NAME_sft_sS")]
                   = "policies",
                   preset: Annotated[str, typer.Option(help="a config with SFT; its RL-alone arm sets sft.steps=0")]
                   = "smollm2_sft",
                   out: Annotated[Path | None, typer.Option(help="also write the table (markdown) here")] = None) -> None:
    """Four policies on the same held-out tasks: the model as it came, RL alone, SFT, SFT then RL."""
    from assay.bench.policies import run_policies_bench

    _seeded_bench(run_policies_bench, seeds, name, run_dir, overrides, jobs, threads, preset, out)


def main() -> None:
    # our own progress bars say what is happening; set before transformers is imported (it reads this as it
    # loads), so that a command that never loads a model never imports transformers just to silence it
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader draws a bar of its own (plain tqdm)
    if sys.argv[1:2] == ["eval"] and sys.argv[2:3] in (["compare"], ["pin"]):  # `eval` takes a path; these are
        sys.argv[1:3] = [f"eval-{sys.argv[2]}"]                                 # commands of their own
    try:
        app()
    except AssayError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: everything recorded so far is on disk; resume with assay train --resume runs/NAME",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
