"""`assay eval --run` refuses to call an evaluation held out when the run trained on its tasks."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from assay.core.config import dump_config
from assay.core.errors import AssayError
from assay.envs import get_env
from assay.pipeline.overlap import check_overlap
from assay.pipeline.quickstart import default_config
from assay.pipeline.sft import sft_tasks


def _sft_run(root, name="sft"):
    cfg = default_config(["sft.examples_per_domain=30"])
    run = root / name
    (run / "policy").mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(cfg))
    return run, sft_tasks(cfg, {d.name: get_env(d.env) for d in cfg.domains})


def test_tasks_in_sft_data_or_trajectories_are_found(tmp_path):
    sft_run, sft = _sft_run(tmp_path)
    rl_cfg = default_config([f"model.path={sft_run / 'policy'}"])
    rl_run = tmp_path / "rl"
    (rl_run / "trajectories").mkdir(parents=True)
    (rl_run / "config.yaml").write_text(dump_config(rl_cfg))
    pq.write_table(pa.table({"task_id": ["rl-task-a", "rl-task-b"]}), rl_run / "trajectories" / "step_000000_a0.parquet")

    clean = check_overlap(rl_run, ["never-trained-1", "never-trained-2"])
    assert clean.held_out and clean.evaluated == 2
    assert set(clean.trained) == {"rl trajectories", "sft SFT data"}  # the starting policy's run is followed

    leaked = check_overlap(rl_run, ["rl-task-a", sft["arith"][0].task_id, sft["codegen"][3].task_id, "fresh"])
    assert not leaked.held_out and leaked.contaminated == 3
    assert leaked.shared == {"rl trajectories": 1, "sft SFT data": 2}
    assert leaked.describe().startswith("NOT held out: 3 of 4 evaluation tasks")


def test_a_directory_that_is_not_a_run_is_named(tmp_path):
    with pytest.raises(AssayError, match="not a run directory"):
        check_overlap(tmp_path, ["x"])
