"""LoRA through peft: only the adapters train, the engine and checkpoints see the adapters folded into
plain weights, and a LoRA run resumes exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from assay.core.config import LoraConfig, load_config
from assay.core.errors import ConfigError
from assay.pipeline.async_pipeline import make_pipeline

pytest.importorskip("peft")

LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lr=1e-2", "train.max_refill_rounds=0"]


@pytest.mark.parametrize("extra", [[], ["train.selective_logprobs=true", "pipeline.mode=async"],
                                   ["pipeline.mode=async", "pipeline.workers=process", "train.ranks=2"]],
                         ids=["sync", "async-selective", "process-worker-two-ranks"])
def test_only_the_adapters_train_and_the_engine_runs_them_folded_in(tiny_config, tmp_path, extra):
    cfg = load_config(tiny_config(name="lora"), [*LORA, "train.steps=3", *extra])
    pipeline = make_pipeline(cfg, tmp_path / "lora")
    base = {n: t.clone() for n, t in pipeline.plain.state_dict().items()}
    trainable = {n for n, p in pipeline.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    pipeline.run()
    folded = dict(pipeline.trainer.named_weights())
    assert folded.keys() == base.keys()  # the plain model's names
    changed = {n for n in base if not torch.equal(base[n], folded[n])}
    assert changed and all(n.endswith("_proj.weight") for n in changed)  # the adapted projections only
    if not extra:  # sync: the engine runs the plain model, which the loop's weight sync left folded
        engine_weights = pipeline.plain.state_dict()
        assert all(torch.equal(engine_weights[n], folded[n]) for n in folded)
    # the folded plain model computes what the peft model computes
    pipeline.policy_model()
    ids = torch.tensor([[5, 17, 42, 8, 99, 3]])
    with torch.no_grad():
        assert torch.allclose(pipeline.model(input_ids=ids).logits, pipeline.plain(input_ids=ids).logits, atol=1e-5)
    saved = load_file(tmp_path / "lora" / "checkpoints" / "step_3" / "model.safetensors")
    assert all(torch.equal(saved[n], folded[n]) for n in saved)  # a checkpoint in plain Hugging Face layout


def test_a_lora_run_resumes_exactly(tiny_config, tmp_path):
    straight = make_pipeline(load_config(tiny_config(name="straight"), LORA), tmp_path / "straight")
    straight.run()
    half = make_pipeline(load_config(tiny_config(name="half"), [*LORA, "train.steps=3"]), tmp_path / "half")
    half.run()
    resumed = make_pipeline(load_config(tmp_path / "half" / "config.yaml", ["train.steps=6"]), tmp_path / "half",
                            resume=True)
    resumed.run()
    a, b = (load_file(tmp_path / n / "checkpoints" / "step_6" / "model.safetensors") for n in ("straight", "half"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = [json.loads(x) for x in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "train" and r["step"] == 6 and not r["skipped"] for r in records)


def test_unknown_target_modules_are_refused_with_the_model_s_linear_layers(tiny_config, tmp_path):
    cfg = load_config(tiny_config(name="bad"), ["train.lora.rank=4", "train.lora.target_modules=[qkv]"])
    with pytest.raises(ConfigError, match=r"no module named \['qkv'\].*q_proj"):
        make_pipeline(cfg, tmp_path / "bad")
    dotted = load_config(tiny_config(name="dotted"), ["train.lora.rank=4", "train.lora.target_modules=[self_attn.q_proj]"])
    assert make_pipeline(dotted, tmp_path / "dotted").model.peft_config  # a dotted suffix names the module too
    tied = load_config(tiny_config(name="tied"), ["train.lora.rank=4", "train.lora.target_modules=[q_proj,lm_head]"])
    with pytest.raises(ConfigError, match="ties its output head"):
        make_pipeline(tied, tmp_path / "tied")
    assert LoraConfig().rank == 0  # off by default
