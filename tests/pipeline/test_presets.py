"""Every shipped preset is a valid config whose environments exist, and an unknown one names the known ones."""

import pytest

from assay.core.errors import ConfigError
from assay.pipeline.policy import domain_envs
from assay.pipeline.quickstart import default_config, presets


@pytest.mark.parametrize("preset", presets())
def test_each_preset_builds_and_its_environments_exist(preset):
    cfg = default_config(preset=preset)
    envs = domain_envs(cfg)
    assert sorted(envs) == sorted(d.name for d in cfg.domains) and cfg.train.steps > 0


def test_the_rl_alone_arm_of_the_policies_bench_is_the_preset_without_sft():
    assert default_config(preset="smollm2_sft").sft.steps > 0
    assert default_config(["sft.steps=0"], preset="smollm2_sft").sft.steps == 0


def test_an_unknown_preset_names_the_shipped_ones():
    with pytest.raises(ConfigError, match="smollm2_sft"):
        default_config(preset="smollm3")
