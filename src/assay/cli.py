"""The `assay` command line. Every user error is one line on stderr and a non-zero exit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from assay.core.errors import AssayError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Assay: RL post-training of LLM agents on verifiable rewards.")
console = Console()

Overrides = Annotated[list[str] | None, typer.Argument(help="key.sub=value overrides, e.g. train.steps=5")]


def _threads(cfg_threads: int, model: object | None = None) -> None:
    from assay.core.modeling import choose_threads, set_threads

    set_threads(cfg_threads or (choose_threads(model) if model is not None else 1))


@app.command()
def train(config: Annotated[Path | None, typer.Argument(help="YAML config")] = None,
          overrides: Overrides = None,
          resume: Annotated[Path | None, typer.Option(help="resume runs/NAME from its last checkpoint")] = None,
          quiet: bool = False) -> None:
    """RL-train a policy on the config's domains."""
    from assay.core.config import load_config
    from assay.core.storage import prepare_run_dir
    from assay.pipeline.sync import SyncPipeline
    from assay.pipeline.ui import RunView

    overrides = list(overrides or [])
    if config is not None and "=" in str(config) and not config.exists():  # an override, not a file
        overrides.insert(0, str(config))
        config = None
    if resume is not None:
        cfg = load_config(config or resume / "config.yaml", overrides)
        run_dir = resume
    elif config is None:
        raise AssayError("assay train needs a CONFIG file or --resume runs/NAME")
    else:
        cfg = load_config(config, overrides)
        run_dir = prepare_run_dir(cfg.run_dir, cfg.name)
    pipeline = SyncPipeline(cfg, run_dir, resume=resume is not None)
    _threads(cfg.threads, pipeline.model)
    with RunView("train", cfg.train.steps, quiet=quiet, console=console) as view:
        view.advance(pipeline.start_step)
        pipeline.run(view)
    console.print(f"run directory: {run_dir}")


@app.command()
def sft(config: Annotated[Path, typer.Argument(help="YAML config")], overrides: Overrides = None,
        quiet: bool = False) -> None:
    """Supervised cold start on the environments' reference solutions."""
    from assay.core.config import load_config
    from assay.core.storage import prepare_run_dir
    from assay.pipeline.sft import run_sft
    from assay.pipeline.ui import RunView

    cfg = load_config(config, overrides or [])
    _threads(cfg.threads)
    run_dir = prepare_run_dir(cfg.run_dir, cfg.name)
    with RunView("sft", cfg.sft.steps, quiet=quiet, console=console) as view:
        out = run_sft(cfg, run_dir, view)
    console.print(f"policy saved to {out} (use it with model.path={out})")


@app.command(name="eval")
def eval_(checkpoint: Annotated[Path, typer.Argument(help="a policy directory in Hugging Face layout")],
          env: Annotated[list[str], typer.Option(help="environment name[@version]; repeat for several")],
          n: Annotated[int, typer.Option(help="samples per task")] = 8,
          tasks: Annotated[int, typer.Option(help="tasks per environment")] = 64,
          difficulty: Annotated[list[int] | None, typer.Option(help="levels to cover (default: all)")] = None,
          temperature: float = 1.0, seed: int = 1_000_003, max_new_tokens: int = 64, max_turns: int = 4) -> None:
    """pass@1 and pass@k with 95% confidence intervals on held-out tasks."""
    from rich.table import Table

    from assay.core.config import DifficultyRange, DomainConfig
    from assay.core.modeling import load_model
    from assay.envs.registry import get_env
    from assay.eval.evaluate import evaluate
    from assay.rollout.hf import HFBackend

    envs = {spec: get_env(spec) for spec in env}
    domains = {}
    for spec, e in envs.items():
        levels = sorted(difficulty or e.difficulties)
        domains[spec] = DomainConfig(name=spec, env=spec, max_new_tokens=max_new_tokens, max_turns=max_turns,
                                     difficulty=DifficultyRange(min=levels[0], max=levels[-1], start=levels[0]))
    model, tokenizer = load_model(checkpoint)
    _threads(0, model)
    ks = sorted({1, *(k for k in (2, 4, 8, 16) if k <= n)})
    results = evaluate(HFBackend(model, tokenizer), tokenizer, envs, domains, tasks, n, seed, temperature, ks)
    table = Table(title=f"{checkpoint}: {tasks} tasks × {n} samples, 95% bootstrap CIs")
    table.add_column("environment")
    for k in ks:
        table.add_column(f"pass@{k}", justify="right")
    table.add_column("by difficulty (pass rate)")
    table.add_column("infra errors", justify="right")
    for name, r in results.items():
        levels = " ".join(f"{d}:{p:.2f}" for d, p in r.by_difficulty.items())
        table.add_row(name, *(str(r.pass_at[k]) if k in r.pass_at else "-" for k in ks), levels, str(r.infra_errors))
    console.print(table)


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="runs/NAME")]) -> None:
    """Write runs/NAME/report.html with per-domain curves."""
    from assay.eval.report import write_report

    console.print(f"wrote {write_report(run_dir)}")


@app.command()
def quickstart(overrides: Overrides = None,
               print_config: Annotated[bool, typer.Option(help="print the embedded config and exit")] = False) -> None:
    """The main job on the embedded default config: SFT, evaluate, multi-domain RL, evaluate again."""
    from assay.pipeline.quickstart import default_config, default_config_text, run_quickstart

    if print_config:
        print(default_config_text())
        return
    cfg = default_config(overrides or [])
    _threads(cfg.threads)
    run_quickstart(cfg, console)


def main() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress bars say what is happening
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
