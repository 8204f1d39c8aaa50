import pytest

from assay.core.config import build_config, load_config
from assay.core.errors import ConfigError

BASE = {"domains": [{"name": "arith", "env": "arith"}, {"name": "code", "env": "codegen"}]}


def test_defaults_and_overrides():
    cfg = build_config(BASE, ["train.steps=7", "domains.code.group_size=4", "domains.0.weight=2.5",
                              "train.loss.eps_high=0.3", "name=x"])
    assert cfg.train.steps == 7
    domains = {d.name: d for d in cfg.domains}
    assert domains["code"].group_size == 4
    assert domains["arith"].weight == 2.5
    assert cfg.train.loss.eps_high == 0.3
    assert cfg.name == "x"


@pytest.mark.parametrize("override, expected", [
    ("train.stepz=3", "unknown key 'train.stepz'"),
    ("sft.warmup=5", "sft.warmup is now sft.warmup_steps"),
    ("domains.1.acceptance=0.9", "domains.1.acceptance is now domains[].difficulty.acceptance"),
    ("mixer.curriculum_window=8", "mixer.curriculum_window is now domains[].difficulty.window"),
    ("domains.0.difficulty.regression=0.9", "need regression < acceptance"),
    ("train.steps=abc", "train.steps"),
    ("train.steps=-1", "train.steps: Input should be greater than 0"),
    ("mixer.strategy=greedy", "mixer.strategy"),
    ("domains.nope.weight=1", "no list item 'nope'"),
    ("train.steps", "expected key.sub=value"),
    ("domains.0.difficulty.start=9", "need min <= start <= max"),
    ("rollout.verifiers=0", "rollout.verifiers: Input should be greater than or equal to 1"),
    ("domains.0.verify_timeout_s=0", "domains.0.verify_timeout_s: Input should be greater than 0"),
    ("pipeline.max_staleness=-1", "pipeline.max_staleness: Input should be greater than or equal to 0"),
    ("rollout.verifier_processes=-1", "rollout.verifier_processes: Input should be greater than or equal to 0"),
    ("pipeline.ray.verifier_workers=-2", "pipeline.ray.verifier_workers: Input should be greater than or equal to 0"),
    ("pipeline.ray.verifier_resources={CPU: 1}", "verifier_resources: ['CPU'] have keys of their own"),
    ("pipeline.ray.rollout_resources={node_a: 0}", "rollout_resources: every amount must be > 0"),
])
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        build_config(BASE, [override])
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_vllm_in_the_trainers_process_refuses_trainer_ranks():
    with pytest.raises(ConfigError, match="starts its own torch.distributed group"):
        build_config(BASE, ["rollout.backend=vllm", "train.ranks=2"])
    cfg = build_config(BASE, ["rollout.backend=vllm", "train.ranks=2", "pipeline.mode=async", "pipeline.workers=process"])
    assert cfg.rollout.vllm.block_size == 32


def test_missing_domains_and_duplicates():
    with pytest.raises(ConfigError, match="domains is required"):
        build_config({})
    with pytest.raises(ConfigError, match="repeated"):
        build_config({"domains": [{"name": "a", "env": "arith"}, {"name": "a", "env": "arith"}]})


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("domains: [\n  - name: a\n  env: : x")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)


def test_a_recorded_config_of_an_earlier_assay_is_migrated_and_a_written_one_is_not(tmp_path):
    """A run's config.yaml from before the curriculum keys moved still reads (overlap checks and resumes follow
    the chain of runs), with every renamed key where it is now; a config a user writes gets the message."""
    import yaml

    from assay.core.config import dump_config, load_config, load_recorded_config
    from assay.core.errors import ConfigError
    from assay.pipeline.quickstart import default_config

    data = yaml.safe_load(dump_config(default_config([])))
    for d in data["domains"]:
        d["acceptance"] = d["difficulty"].pop("acceptance")
        d["regression"] = d["difficulty"].pop("regression")
        d["difficulty"].pop("window")
    data["mixer"]["curriculum_window"] = 17
    data["sft"]["warmup"] = data["sft"].pop("warmup_steps")
    data["domains"][0]["acceptance"] = 0.61
    old = tmp_path / "config.yaml"
    old.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="is now domains\\[\\].difficulty.acceptance"):
        load_config(old)
    cfg = load_recorded_config(old, ["train.steps=3"])
    assert cfg.domains[0].difficulty.acceptance == 0.61 and cfg.train.steps == 3
    assert {d.difficulty.window for d in cfg.domains} == {17} and "curriculum_window" not in cfg.mixer.model_dump()
    assert cfg.sft.warmup_steps == data["sft"]["warmup"]
