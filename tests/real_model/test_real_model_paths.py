"""The engine, the trainer and LoRA on a model trained elsewhere: SmolLM2-135M-Instruct's real weights."""

import pytest
import torch

from assay.core.modeling import load_model
from assay.rollout.base import GenRequest, SamplingParams
from assay.rollout.engine import Engine, EngineConfig
from assay.rollout.hf import HFBackend


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    model, tok = load_model(smollm2_dir)
    return model.eval(), tok


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def test_engine_greedy_is_transformers_greedy_token_for_token(smol):
    model, tok = smol
    prompts = [chat(tok, "What is 37 + 48? Answer with the number only."),
               chat(tok, "Write a Python function f(x) that returns x plus 3.")]
    params = SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
    hf = HFBackend(model, tok)
    expected = [hf.generate([GenRequest(p, params)])[0][0].token_ids for p in prompts]
    engine = Engine(model, tok, EngineConfig(kv_cache_bytes=64 * 2**20, warm_up=False))
    got = [r[0].token_ids for r in engine.generate([GenRequest(p, params) for p in prompts])]
    assert got == expected
    assert all(len(t) > 8 for t in got)  # it answers in its own words, not at once with a stop token


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_lora_rl_with_selective_logprobs_trains_the_real_model(smollm2_dir, tmp_path, mode):
    """Two RL steps of the real model in each pipeline mode: the adapters train, the engine samples the
    folded weights, and a checkpoint in plain Hugging Face layout comes out."""
    import json

    import yaml

    from assay.core.config import load_config
    from assay.pipeline.async_pipeline import make_pipeline

    records = tmp_path / "no_e.jsonl"  # an instruct model passes this about half the time: a signal from step 1
    records.write_text("\n".join(json.dumps({"prompt": f"Say one short word without the letter e ({i}).",
                                             "answer": "[^e]*", "reference": "ok"}) for i in range(4)))
    config = {"name": "smol", "seed": 0, "threads": 1, "run_dir": str(tmp_path), "allow_unchecked": ["no_e"],
              "model": {"path": str(smollm2_dir)},
              "domains": [{"name": "no_e", "env": "jsonl", "group_size": 4, "max_new_tokens": 6,
                           "env_args": {"path": str(records), "matcher": "regex"}}],
              "rollout": {"kv_cache_mb": 64, "warm_up": False},
              "pipeline": {"mode": mode},
              "train": {"steps": 2, "groups_per_step": 2, "micro_batch": 4, "max_refill_rounds": 3, "lr": 1e-3,
                        "selective_logprobs": True, "lora": {"rank": 4, "alpha": 8}, "checkpoint_every": 2}}
    (tmp_path / "smol.yaml").write_text(yaml.safe_dump(config))
    pipeline = make_pipeline(load_config(tmp_path / "smol.yaml"), tmp_path / "smol")
    base = {n: t.clone() for n, t in pipeline.plain.state_dict().items()}
    pipeline.run()
    folded = dict(pipeline.trainer.named_weights())
    changed = {n for n in base if not torch.equal(base[n], folded[n])}
    assert changed and all(n.endswith("_proj.weight") for n in changed)
    steps = [json.loads(x) for x in (tmp_path / "smol" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in steps if r.get("kind") == "train" and not r.get("skipped")]
    assert trained and all(torch.isfinite(torch.tensor(r["loss"])) for r in trained)
    assert (tmp_path / "smol" / "checkpoints" / "step_2" / "model.safetensors").is_file()


def test_smollm2_is_shown_the_tools_its_template_drops(smol):
    """SmolLM2's template prints no `tools=`: the prompt carries Assay's block, the schema and the call syntax
    that the agent loop parses (Hermes, the style its template falls back to)."""
    import random

    from assay.agent.render import prompt_ids
    from assay.core.chat_format import CALL_EXAMPLE, chat_format
    from assay.envs.registry import get_env

    _, tok = smol
    fmt = chat_format(tok)
    assert not fmt.renders_tools and fmt.tool_calls == "hermes"
    task = get_env("toolcalc").generate(random.Random(0), 2)
    text = tok.decode(prompt_ids(tok, task))
    assert '"name": "lookup"' in text and CALL_EXAMPLE["hermes"] in text
    assert text.index("Use the lookup tool") < text.index("You can call these tools") < text.index("<|im_start|>user")
