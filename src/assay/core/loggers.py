"""Metrics sinks: where a run's scalars go besides metrics.jsonl (which is always written: it is the
record the rest of Assay reads). The config's `loggers` names them.

A sink is a factory `(RunInfo) -> MetricsSink`, registered with `@metrics_sink(NAME)`. The built-ins
(tensorboard, wandb, mlflow) register on import; third-party sinks are found through the
`assay.loggers` entry-point group, each entry point naming a factory (a class taking a RunInfo).
A sink whose package is missing is refused when the config is validated, with the extra to install."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from assay.core.atomic import atomic_write
from assay.core.errors import AssayError
from assay.core.registry import Registry, qualname

ENTRY_POINT_GROUP = "assay.loggers"


@dataclass(frozen=True)
class RunInfo:
    """What a sink may know about the run: where its directory is, its name, its resolved config."""
    run_dir: Path
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class MetricsSink(Protocol):
    def log(self, step: int, kind: str, metrics: Mapping[str, float]) -> None:
        """The numeric metrics (never none) of one record (`kind`: train, eval, sft, resume...) at `step`. A step may
        come again after a resume: the steps after the checkpoint are run again."""

    def close(self) -> None: ...


SinkFactory = Callable[[RunInfo], MetricsSink]
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class SinkSpec:
    name: str
    factory: SinkFactory
    requires: tuple[str, ...] = ()  # modules the sink imports, checked before the run starts
    install: str = ""  # how to get them, for the error

    def missing(self) -> list[str]:
        return [m for m in self.requires if importlib.util.find_spec(m) is None]


def _adopt(registry: Registry[SinkSpec], ep: EntryPoint, factory: object) -> None:
    """A plugin need not use the decorator: its entry point names the factory (the built-ins are declared
    too, and are the same objects)."""
    if not callable(factory):
        raise registry.plugin_error(ep, "must name a sink factory (a class taking a RunInfo)")
    if registry.origin(ep.name) != qualname(factory):
        registry.add(ep.name, SinkSpec(ep.name, factory), qualname(factory))


sinks: Registry[SinkSpec] = Registry("logger", "loggers", ENTRY_POINT_GROUP, _adopt)


def metrics_sink(name: str, *, requires: Sequence[str] = (), install: str = "") -> Callable[[F], F]:
    """Decorator: make the factory (a class taking a RunInfo) selectable as `loggers: [NAME]`."""
    sinks.check_name(name)

    def register(factory: F) -> F:
        sinks.add(name, SinkSpec(name, factory, tuple(requires), install), qualname(factory))
        return factory
    return register


def known_sinks() -> list[str]:
    sinks.load_all()
    return sorted(sinks.entries())


def sink_spec(name: str) -> SinkSpec:
    """The sink `name`; every plugin is loaded first (as the config's check lists them all)."""
    sinks.load_all()
    return sinks.get(name)


def check_loggers(names: list[str]) -> list[str]:
    """The config's `loggers`, each known and installed (a pydantic validator: errors are ValueErrors)."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"repeated loggers: {', '.join(repeated)}")
    for name in names:
        try:
            spec = sink_spec(name)
        except AssayError as e:
            raise ValueError(str(e)) from None
        missing = spec.missing()
        if missing:
            hint = f"; install it with {spec.install}" if spec.install else ""
            raise ValueError(f"logger {name!r} needs {', '.join(missing)}, which is not installed{hint}")
    return names


def open_sinks(names: Sequence[str], run: RunInfo) -> list[MetricsSink]:
    """Each named sink, opened for `run`; if one fails to open, those already open are closed."""
    sinks: list[MetricsSink] = []
    try:
        for name in names:
            spec = sink_spec(name)
            try:
                sinks.append(spec.factory(run))
            except ImportError as e:  # a logger given here, not through a checked config
                hint = f"; install it with {spec.install}" if spec.install else ""
                raise AssayError(f"logger {name!r}: {e}{hint}") from e
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the opening is the one to see
            close_sinks(sinks)
        raise
    return sinks


def close_sinks(sinks: Sequence[MetricsSink]) -> None:
    """Close every sink even if one fails; the first failure is raised after."""
    error: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as e:
            error = error or e
    if error is not None:
        raise error


def _stored_id(run: RunInfo, sink: str, new: Callable[[], str]) -> str:
    """The sink's run id for this run directory: the one an earlier attempt stored, else a new one,
    stored now, so a resumed run (same directory) continues the same remote run."""
    path = run.run_dir / "loggers" / f"{sink}.id"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = new()
    store_id(run, sink, run_id)
    return run_id


def store_id(run: RunInfo, sink: str, run_id: str) -> None:
    (run.run_dir / "loggers").mkdir(parents=True, exist_ok=True)
    atomic_write(run.run_dir / "loggers" / f"{sink}.id", run_id)


@metrics_sink("tensorboard", requires=("tensorboard",), install="pip install tensorboard")
class TensorBoardSink:
    """Scalars under RUN/tb, tagged KIND/KEY."""

    def __init__(self, run: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import, only when logging

        self._writer = SummaryWriter(log_dir=str(run.run_dir / "tb"))

    def log(self, step: int, kind: str, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(f"{kind}/{key}", value, step)

    def close(self) -> None:
        self._writer.close()


@metrics_sink("wandb", requires=("wandb",), install="pip install 'assay[wandb]'")
class WandbSink:
    """A Weights & Biases run named after the Assay run, with its config; files under RUN/wandb.
    WANDB_MODE (offline, disabled), WANDB_PROJECT (default "assay") and the other WANDB_ variables
    apply as wandb reads them. Keys are KIND/KEY against a `step` axis of their own: wandb's built-in
    step only increases, and a resumed run logs its re-run steps again."""

    def __init__(self, run: RunInfo) -> None:
        import wandb

        run_id = _stored_id(run, "wandb", lambda: secrets.token_hex(6))  # wandb's own generator is private
        # console off: wandb would otherwise wrap stdout, under the run's live progress display
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "assay"), name=run.name, id=run_id,
                               resume="allow", config=dict(run.config), dir=str(run.run_dir),
                               settings=wandb.Settings(console="off"))
        self._run.define_metric("*", step_metric="step")

    def log(self, step: int, kind: str, metrics: Mapping[str, float]) -> None:
        self._run.log({**{f"{kind}/{k}": v for k, v in metrics.items()}, "step": step})

    def close(self) -> None:
        self._run.finish()


_MLFLOW_KEY = re.compile(r"[^/\w.\- :]")  # the characters MLflow refuses in a metric name (pass@1's @)


def mlflow_key(kind: str, key: str) -> str:
    return _MLFLOW_KEY.sub("_", f"{kind}/{key}")


@metrics_sink("mlflow", requires=("mlflow",), install="pip install 'assay[mlflow]'")
class MlflowSink:
    """One MLflow run per Assay run, in experiment MLFLOW_EXPERIMENT_NAME (default "assay"), at
    MLFLOW_TRACKING_URI, else a file store under RUN/mlruns; the config is its config.json artifact.
    Keys are KIND/KEY with the characters MLflow refuses replaced by _ (pass@1 -> pass_1)."""

    def __init__(self, run: RunInfo) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run.run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 refuses its file store (in maintenance) unless asked; a database store would need
            # SQLAlchemy and a migration on first use, for what a local run directory records fine
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "assay")
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)

        def new() -> str:
            created = client.create_run(experiment_id, run_name=run.name)
            client.log_dict(created.info.run_id, dict(run.config), "config.json")
            return created.info.run_id

        self.run_id = _stored_id(run, "mlflow", new)
        try:
            client.update_run(self.run_id, status="RUNNING")
        except MlflowException:  # the stored run is not at this tracking URI: start one there
            self.run_id = new()
            store_id(run, "mlflow", self.run_id)

    def log(self, step: int, kind: str, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(kind, k), float(v), now, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
