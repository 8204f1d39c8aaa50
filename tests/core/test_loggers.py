"""The metrics sinks (assay.core.loggers), offline: each one's scalars are read back from its own files
(TensorBoard event files, the wandb offline run's .wandb log, the MLflow file store)."""

import json
import tomllib
from collections import defaultdict
from importlib import import_module
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from assay.core import loggers
from assay.core.config import build_config
from assay.core.errors import ConfigError
from assay.core.storage import MetricsLogger

ROOT = Path(__file__).parents[2]
DOMAINS = [{"name": "arith", "env": "arith"}]
Series = dict[str, list[tuple[int, float]]]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network and nothing outside tmp_path: wandb offline, MLflow at its default (the run's file store)."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


def tensorboard_series(run_dir: Path) -> Series:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(run_file: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a .wandb file: a 7-byte header, then LevelDB-log chunks (checksum, length, type)
    in 32 KiB blocks, a record split over several chunks (first, middle, last) where it must."""
    data, pos, chunks, records = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        size, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_series(run_dir: Path) -> tuple[set[str], Series, dict[str, object]]:
    """Every offline run's id, the scalars against Assay's step, and the config, over all attempts."""
    ids, series, config = set(), defaultdict(list), {}
    for run_file in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(run_file):
            if record.HasField("run"):
                ids.add(record.run.run_id)
                config |= {u.key: json.loads(u.value_json) for u in record.run.config.update}
            if record.HasField("history"):
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                for key, value in row.items():
                    if not key.startswith("_") and key != "step":
                        series[key].append((row["step"], value))
    return ids, dict(series), config


def mlflow_runs(run_dir: Path) -> list[Path]:
    return [p.parent for p in (run_dir / "mlruns").glob("*/*/meta.yaml") if (p.parent / "metrics").is_dir()]


def mlflow_series(mlflow_run: Path) -> Series:
    series: Series = {}
    for path in sorted((mlflow_run / "metrics").rglob("*")):
        if path.is_file():
            rows = [line.split() for line in path.read_text().splitlines()]
            series[path.relative_to(mlflow_run / "metrics").as_posix()] = [(int(s), float(v)) for _, v, s in rows]
    return series


def log_steps(run_dir: Path, sinks: list[str], steps: range, config: dict | None = None) -> None:
    metrics = MetricsLogger(run_dir, sinks, "tiny", config or {"seed": 3})
    for step in steps:
        # values exact in float32, as TensorBoard stores them
        metrics.log(step, {"loss": 2.0 ** -step, "note": "text goes to metrics.jsonl only"})
        metrics.log(step, {"heldout/arith/pass@1": step / 8}, kind="eval")
        metrics.log(step, {"seesaw": "a warning has no scalar"}, kind="warning")
    metrics.close()


def jsonl_series(run_dir: Path) -> Series:
    """What metrics.jsonl, the run's record, says each sink should hold."""
    series = defaultdict(list)
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        for key, value in r.items():
            if key not in ("step", "kind", "time") and isinstance(value, (int, float)):
                series[f"{r['kind']}/{key}"].append((r["step"], value))
    return dict(series)


def test_every_sink_holds_the_scalars_of_metrics_jsonl(tmp_path: Path, offline: None) -> None:
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    log_steps(run_dir, ["tensorboard", "wandb", "mlflow"], range(1, 4))
    expected = jsonl_series(run_dir)
    assert set(expected) == {"train/loss", "eval/heldout/arith/pass@1"} and len(expected["train/loss"]) == 3

    assert tensorboard_series(run_dir) == expected
    ids, series, config = wandb_series(run_dir)
    assert series == expected and config["seed"] == 3
    assert ids == {(run_dir / "loggers" / "wandb.id").read_text()}
    [mlflow_run] = mlflow_runs(run_dir)
    assert mlflow_run.name == (run_dir / "loggers" / "mlflow.id").read_text()
    # MLflow refuses '@' in a name: pass@1 is pass_1 there
    assert mlflow_series(mlflow_run) == {loggers.mlflow_key(*k.split("/", 1)): v for k, v in expected.items()}
    assert "eval/heldout/arith/pass_1" in mlflow_series(mlflow_run)
    assert json.loads((mlflow_run / "artifacts" / "config.json").read_text()) == {"seed": 3}
    assert (mlflow_run / "tags" / "mlflow.runName").read_text() == "tiny"


def test_a_resumed_run_continues_the_same_remote_runs(tmp_path: Path, offline: None) -> None:
    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    log_steps(run_dir, ["wandb", "mlflow"], range(1, 3))
    log_steps(run_dir, ["wandb", "mlflow"], range(2, 4))  # a resume from step 1 runs step 2 again

    ids, series, _ = wandb_series(run_dir)
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2 and len(ids) == 1
    assert [s for s, _ in series["train/loss"]] == [1, 2, 2, 3]  # the re-run step is kept, not dropped
    [mlflow_run] = mlflow_runs(run_dir)
    assert [s for s, _ in mlflow_series(mlflow_run)["train/loss"]] == [1, 2, 2, 3]


def test_the_default_is_tensorboard_and_an_empty_list_writes_metrics_jsonl_alone(tmp_path: Path) -> None:
    assert build_config({"domains": DOMAINS}).loggers == ["tensorboard"]
    cfg = build_config({"domains": DOMAINS, "loggers": []})
    log_steps(tmp_path, cfg.loggers, range(1, 2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_an_unknown_or_repeated_logger_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown logger 'wandbb'; known loggers: mlflow, tensorboard, wandb"):
        build_config({"domains": DOMAINS, "loggers": ["wandbb"]})
    with pytest.raises(ConfigError, match="repeated loggers: mlflow"):
        build_config({"domains": DOMAINS, "loggers": ["mlflow", "mlflow"]})


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_missing_package_is_refused_with_the_extra_to_install(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = loggers.importlib.util.find_spec
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda m, *a: None if m == name else real(m, *a))
    with pytest.raises(ConfigError, match=rf"logger '{name}' needs {name}, which is not installed; "
                                          rf"install it with pip install 'assay\[{name}\]'"):
        build_config({"domains": DOMAINS, "loggers": ["tensorboard", name]})
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert name in extras  # the extra the message names exists
    assert f",{name}" in (ROOT / "Makefile").read_text()  # and make (so CI) installs it: these tests run


class Recorder:
    opened: list["Recorder"] = []

    def __init__(self, run: loggers.RunInfo) -> None:
        self.run, self.records, self.closed = run, [], False
        Recorder.opened.append(self)

    def log(self, step: int, kind: str, metrics: dict[str, float]) -> None:
        self.records.append((step, kind, dict(metrics)))

    def close(self) -> None:
        self.closed = True


def test_a_registered_sink_receives_the_scalars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loggers.known_sinks()  # the built-ins and plugins in, then a registry of this test's own
    monkeypatch.setattr(loggers, "sinks", loggers.sinks.copy())
    monkeypatch.setattr(Recorder, "opened", [])
    loggers.metrics_sink("recorder")(Recorder)
    cfg = build_config({"name": "tiny", "domains": DOMAINS, "loggers": ["recorder"]})

    log_steps(tmp_path, cfg.loggers, range(1, 3), cfg.model_dump(mode="json"))
    [sink] = Recorder.opened
    assert isinstance(sink, loggers.MetricsSink) and sink.closed
    assert sink.run.run_dir == tmp_path and sink.run.name == "tiny" and sink.run.config["loggers"] == ["recorder"]
    assert sink.records == [(1, "train", {"loss": 0.5}), (1, "eval", {"heldout/arith/pass@1": 0.125}),
                            (2, "train", {"loss": 0.25}), (2, "eval", {"heldout/arith/pass@1": 0.25})]
    with pytest.raises(loggers.AssayError, match="registered twice"):
        loggers.metrics_sink("recorder")(type("Other", (Recorder,), {}))


def test_a_sink_that_fails_to_open_closes_those_already_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loggers, "sinks", loggers.sinks.copy())
    monkeypatch.setattr(Recorder, "opened", [])
    loggers.metrics_sink("recorder")(Recorder)

    @loggers.metrics_sink("broken")
    def broken(run: loggers.RunInfo) -> loggers.MetricsSink:
        raise ConnectionError("no server")

    with pytest.raises(ConnectionError):
        MetricsLogger(tmp_path, ["recorder", "broken"])
    assert Recorder.opened[0].closed and not (tmp_path / "metrics.jsonl").exists()


def test_the_entry_points_declare_the_registered_built_ins() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][loggers.ENTRY_POINT_GROUP]
    assert sorted(declared) == ["mlflow", "tensorboard", "wandb"]
    for name, value in declared.items():
        module, attr = value.split(":")
        assert loggers.sink_spec(name).factory is getattr(import_module(module), attr)


def test_a_tiny_sft_run_logs_its_steps_to_each_configured_sink(tmp_path: Path, offline: None) -> None:
    from assay.core.storage import prepare_run_dir
    from assay.pipeline.sft import run_sft

    model = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64,
             "vocab_size": 400, "tokenizer_corpus": 50}
    cfg = build_config({"name": "tiny", "threads": 1, "run_dir": str(tmp_path), "model": model, "domains": DOMAINS,
                        "sft": {"steps": 2, "batch_size": 2, "examples_per_domain": 2},
                        "loggers": ["tensorboard", "wandb", "mlflow"]})
    run_dir = prepare_run_dir(cfg.run_dir, cfg.name)  # as `assay sft` does
    run_sft(cfg, run_dir)

    expected = jsonl_series(run_dir)
    assert sorted(expected) == ["sft/loss", "sft/lr"] and [s for s, _ in expected["sft/loss"]] == [0, 1]
    as_float32 = {k: [(s, float(np.float32(v))) for s, v in vs] for k, vs in expected.items()}
    assert tensorboard_series(run_dir) == as_float32  # TensorBoard stores float32
    ids, series, config = wandb_series(run_dir)
    assert series == expected and len(ids) == 1 and config["loggers"] == ["tensorboard", "wandb", "mlflow"]
    [mlflow_run] = mlflow_runs(run_dir)
    assert mlflow_series(mlflow_run) == expected
    assert json.loads((mlflow_run / "artifacts" / "config.json").read_text())["sft"]["steps"] == 2
