"""The quickstart recipe's keys: SFT capped at a level, and a run recording the thread count it resolved."""

import yaml

from assay.core.config import load_config
from assay.pipeline.policy import domain_envs
from assay.pipeline.sft import sft_tasks
from assay.pipeline.sync import SyncPipeline


def test_sft_max_level_caps_the_sft_data(tiny_config):
    cfg = load_config(tiny_config(name="cap"), ["sft.examples_per_domain=40"])
    envs = domain_envs(cfg)
    full = sft_tasks(cfg, envs)
    assert {t.difficulty for t in full["arith"]} == {1, 2, 3, 4}
    capped = sft_tasks(load_config(tiny_config(name="cap"), ["sft.examples_per_domain=40", "sft.max_level=2"]), envs)
    for name, tasks in capped.items():
        assert len(tasks) == 40
        assert {t.difficulty for t in tasks} <= {1, 2}, name
    assert {t.difficulty for t in capped["arith"]} == {1, 2}


def test_a_run_records_the_thread_count_it_resolved(tiny_config, tmp_path):
    cfg = load_config(tiny_config(name="threads"), ["threads=0"])
    run = tmp_path / "runs" / "threads"
    run.mkdir(parents=True)
    pipeline = SyncPipeline(cfg, run)
    stored = yaml.safe_load((run / "config.yaml").read_text())["threads"]
    assert stored == pipeline.threads >= 1  # a resume reads this count instead of measuring again
    assert pipeline.cfg.threads == stored and cfg.threads == 0  # the caller's config is left as it was
