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


def test_sft_label_noise_gives_a_share_of_tasks_another_tasks_response(tiny_config):
    from assay.pipeline.sft import demonstrations

    cfg = load_config(tiny_config(name="noise"), ["sft.examples_per_domain=400", "sft.label_noise=0.3"])
    envs = domain_envs(cfg)
    pairs = demonstrations(cfg, envs)
    clean = demonstrations(load_config(tiny_config(name="noise"), ["sft.examples_per_domain=400"]), envs)
    assert [t.task_id for t, _ in pairs] == [t.task_id for t, _ in clean]  # the same prompts either way
    for name, env in envs.items():
        if name == "no_e":
            continue  # every reference there is the same "ok"
        mine = [(t, r) for t, r in pairs if t.env == f"{env.name}@{env.version}"]
        swapped = sum(r != env.reference_solution(t) for t, r in mine)
        assert len(mine) == 400 and 0.2 < swapped / len(mine) < 0.4, name
    by_env = {f"{e.name}@{e.version}": e for e in envs.values()}
    assert all(r == by_env[t.env].reference_solution(t) for t, r in clean)


def test_shaped_rewards_reach_training_and_are_logged_per_term(tiny_config, tmp_path):
    import json

    cfg = load_config(tiny_config(name="shaped"), ["train.steps=1", "train.max_refill_rounds=0"])
    from assay.core.config import RewardTerm

    terms = [RewardTerm(fn="verifier"), RewardTerm(fn="length", weight=0.2)]
    domains = [d.model_copy(update={"rewards": terms})
               if d.name == "arith" else d for d in cfg.domains]
    cfg = cfg.model_copy(update={"domains": domains})
    run = tmp_path / "runs" / "shaped"
    run.mkdir(parents=True)
    SyncPipeline(cfg, run).run()
    [record] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "train"]
    assert record["domain/arith/term_length"] < 0 and "domain/arith/term_verifier" in record
    assert not any(k.startswith("domain/no_e/term_") for k in record)
    from assay.eval.report import write_report

    assert 'alt="reward term length"' in write_report(run).read_text()
