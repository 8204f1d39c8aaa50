"""End to end through the CLI: the run directory's contents, exact resume, and bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from assay.core.storage import read_metrics, trajectory_shards


def assay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=600)


def test_train_writes_a_complete_run_directory(tiny_config, tmp_path):
    out = assay("train", tiny_config(name="e2e"), "train.steps=3", "--quiet")
    assert out.returncode == 0, out.stderr
    run = tmp_path / "runs" / "e2e"
    assert "domains" in (run / "config.yaml").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    for key in ("skipped", "tokens", "domain/arith/pass_rate", "domain/agent/difficulty", "domain/agent/ratio",
                "domain/arith/truncation_rate"):
        assert any(key in r for r in train), key
    assert all("rollout/weight_update_s" in r and r["rollout/prefix_hit_rate"] > 0 for r in train)  # groups share prompts
    assert list((run / "tb").iterdir())
    df = pd.read_parquet(run / "trajectories")
    assert len(df) >= 3 * 2 * 2 and set(df["domain"]) <= {"arith", "agent", "no_e"}
    assert {"token_ids", "loss_mask", "logprobs", "reward", "status", "env_hash"} <= set(df.columns)
    ckpt = run / "checkpoints" / "step_3"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    AutoTokenizer.from_pretrained(ckpt)
    assert model.config.num_hidden_layers == 1
    report = assay("report", str(run))
    assert report.returncode == 0, report.stderr
    page = (run / "report.html").read_text()
    assert "data:image/png;base64" in page
    assert "<h2>Timeline</h2>" in page and "rollout busy" in page and "trainer busy" in page
    # sync: each step's rollout begins after the previous step's training ended
    assert all(b["rollout_start_s"] >= a["train_start_s"] + a["train_s"] - 1e-3 for a, b in zip(train, train[1:], strict=False))
    assert f"Training trajectories ({len(df)})" in page and page.count("<details class=traj>") == len(df)


def test_resume_is_exact(tiny_config, tmp_path):
    straight = assay("train", tiny_config(name="straight"), "--quiet")
    assert straight.returncode == 0, straight.stderr
    half = assay("train", tiny_config(name="half"), "train.steps=3", "--quiet")
    assert half.returncode == 0, half.stderr
    resumed = assay("train", "--resume", str(tmp_path / "runs" / "half"), "train.steps=6", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    a = tmp_path / "runs" / "straight" / "checkpoints" / "step_6"
    b = tmp_path / "runs" / "half" / "checkpoints" / "step_6"
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    assert json.loads((a / "state.json").read_text()) == json.loads((b / "state.json").read_text())
    records = [json.loads(x) for x in (tmp_path / "runs" / "half" / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in records if r["kind"] == "train" and r["skipped"] == 0]
    assert {2, 3, 5, 6} & set(trained), "the policy must really change on both sides of the resume"
    # the trajectories of both attempts are all kept
    assert set(pd.read_parquet(tmp_path / "runs" / "half" / "trajectories")["step"]) == set(range(1, 7))


ASYNC_PROCESS = ("pipeline.mode=async", "pipeline.max_staleness=1", "pipeline.workers=process")


@pytest.mark.parametrize("mode", [(), pytest.param(ASYNC_PROCESS, marks=pytest.mark.slow)], ids=["sync", "async-process"])
def test_a_run_killed_between_checkpoints_resumes_with_nothing_lost_or_trained_twice(tiny_config, tmp_path, mode):
    """In async mode the checkpoint holds the batch sampled ahead of it, so the resume is exact there too."""
    straight = assay("train", tiny_config(name="straight"), *mode, "--quiet")
    assert straight.returncode == 0, straight.stderr
    run = tmp_path / "runs" / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "train", tiny_config(name="killed"), *mode, "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not any(r["kind"] == "train" and r["step"] == 4 for r in _records(run)):  # past the step-3 checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "checkpoints" / "step_6").exists(), "killed too late: the run had finished"
    resumed = assay("train", "--resume", str(run), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    a, b = (load_file(tmp_path / "runs" / n / "checkpoints" / "step_6" / "model.safetensors") for n in ("straight", "killed"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the steps run again were trained once, as in the straight run
    steps = [r["step"] for r in read_metrics(run) if r["kind"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]
    on_disk = pd.concat(pd.read_parquet(s) for s in trajectory_shards(run / "trajectories", superseded=True))
    live = pd.concat(pd.read_parquet(s) for s in trajectory_shards(run / "trajectories"))
    assert sorted(set(live["step"])) == [1, 2, 3, 4, 5, 6] and len(on_disk) > len(live)  # step 4 was written twice
    reference = pd.read_parquet(tmp_path / "runs" / "straight" / "trajectories")
    key = ["step", "group_id", "reward"]
    assert sorted(map(tuple, live[key].values)) == sorted(map(tuple, reference[key].values))  # each group once


def test_a_supervised_run_restarts_its_killed_trainer_and_completes(tiny_config, tmp_path):
    straight = assay("train", tiny_config(name="straight"), "--quiet")
    assert straight.returncode == 0, straight.stderr
    run = tmp_path / "runs" / "supervised"
    supervisor = subprocess.Popen([sys.executable, "-m", "assay.cli", "train", tiny_config(name="supervised"),
                                   "--supervise", "2", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
    deadline = time.monotonic() + 300
    while not any(r["kind"] == "train" and r["step"] == 4 for r in _records(run)):
        assert supervisor.poll() is None and time.monotonic() < deadline, supervisor.communicate()
        time.sleep(0.01)
    trainer, = _children(supervisor.pid)
    os.kill(trainer, signal.SIGKILL)
    out, err = supervisor.communicate(timeout=600)
    assert supervisor.returncode == 0, err
    assert "died (killed by SIGKILL); restart 1 of 2, from its last checkpoint" in " ".join(out.split())
    a, b = (load_file(tmp_path / "runs" / n / "checkpoints" / "step_6" / "model.safetensors")
            for n in ("straight", "supervised"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = read_metrics(run)
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["attempt"] for r in records if r["kind"] == "resume"] == [1]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.is_file() else []


def test_bad_input_is_one_line_and_nonzero(tiny_config, tmp_path):
    corrupt = tmp_path / "runs" / "corrupt"
    step = corrupt / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    (corrupt / "config.yaml").write_text(Path(tiny_config(name="corrupt")).read_text())
    for name in ("config.json", "model.safetensors", "trainer.pt", "state.json"):
        (step / name).write_bytes(b"\x00garbage")
    cases = [
        ("train", "--resume", str(corrupt)),
        ("eval", str(step), "--env", "arith"),
        ("train", tiny_config(name="x"), "train.stepz=3"),
        ("train", tiny_config(name="y", domains=[{"name": "q", "env": "nosuchenv"}])),
        ("train", str(tmp_path / "missing.yaml")),
        ("train", "--resume", str(tmp_path / "runs" / "never")),
        ("eval", str(tmp_path / "no-checkpoint"), "--env", "arith"),
        ("train", tiny_config(name="corrupt")),  # a fresh run where one with a checkpoint lives: never mixed
    ]
    with ThreadPoolExecutor(4) as pool:  # each case is a fresh interpreter importing torch: run them side by side
        outs = list(pool.map(lambda args: assay(*args), cases))
    for args, out in zip(cases, outs, strict=True):
        assert out.returncode != 0, args
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, out.stderr)
    blocker = Path(tmp_path / "blocker")
    blocker.write_text("")
    out = assay("train", tiny_config(name="z", run_dir=str(blocker)))
    assert out.returncode != 0 and "not writable" in out.stderr
