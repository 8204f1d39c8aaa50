import pytest
import torch
from transformers import AutoModelForCausalLM

from assay.core.config import ModelConfig
from assay.core.errors import AssayError, CheckpointError
from assay.core.modeling import build_model, choose_threads, load_model, save_model, set_threads
from assay.core.tokenizer import train_tokenizer

torch.set_num_threads(1)

CFG = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, max_position=256)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([f"<|im_start|>user\nWhat is {i}+{i}?<|im_end|>\n" for i in range(100)], 300)


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return build_model(CFG, tok)


def test_build_model_shapes_and_param_count(tok, model):
    v, h, i = len(tok), 64, 128
    kv = 2 * (64 // 4)  # kv heads x head dim
    per_layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # qkv (bias), o, mlp, 2 norms
    assert sum(p.numel() for p in model.parameters()) == v * h + 2 * per_layer + h  # tied lm_head counted once
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.vocab_size == v
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in model.generation_config.eos_token_id


def test_build_llama(tok):
    m = build_model(CFG.model_copy(update={"arch": "llama"}), tok)
    assert m.config.model_type == "llama"
    assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, len(tok))


def test_save_load_round_trip_identical_logits(tok, model, tmp_path):
    save_model(model, tok, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    x = torch.tensor([tok.encode("What is 3+4?", add_special_tokens=False)])
    with torch.no_grad():
        want = model(x).logits
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
        assert torch.equal(hf(x).logits, want)
        back, back_tok = load_model(tmp_path / "m")
        assert torch.equal(back(x).logits, want)
    assert back.dtype == torch.float32
    assert back_tok.encode("What is 3+4?", add_special_tokens=False) == x[0].tolist()


def test_load_model_errors(tok, model, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path / "empty")
    save_model(model, tok, tmp_path / "bad")
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="could not be loaded"):
        load_model(tmp_path / "bad")
    (tmp_path / "bad" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        load_model(tmp_path / "bad")


def test_choose_threads_measures_and_restores(model):
    torch.set_num_threads(1)
    grads_before = [p.grad for p in model.parameters()]
    assert choose_threads(model, batch=2, seq_len=16, reps=1) in (1, 2)
    assert torch.get_num_threads() == 1
    assert [p.grad for p in model.parameters()] == grads_before  # no .grad was written


def test_set_threads():
    set_threads(1)
    assert torch.get_num_threads() == 1
    with pytest.raises(AssayError):
        set_threads(0)


def test_device_dtype_and_attention_are_applied_on_load(tok, model, tmp_path):
    from assay.core.modeling import place

    save_model(model, tok, tmp_path / "m")
    cfg = ModelConfig(dtype="bfloat16", attn_implementation="eager")
    loaded, _ = load_model(tmp_path / "m", cfg)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.config._attn_implementation == "eager"
    built = place(build_model(ModelConfig(dtype="float16", num_layers=1), tok), ModelConfig(dtype="float16"))
    assert {p.dtype for p in built.parameters()} == {torch.float16}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_missing_device_is_refused_with_the_fix(tok, tmp_path):
    from assay.core.modeling import device_of

    with pytest.raises(AssayError, match="model.device: cpu"):
        device_of(ModelConfig(device="cuda"))
    with pytest.raises(AssayError, match="not a device"):
        device_of(ModelConfig(device="gpu0"))


def test_the_engine_generates_from_a_bfloat16_policy(tok):
    from assay.rollout.base import GenRequest, SamplingParams
    from assay.rollout.engine.engine import Engine, EngineConfig

    m = build_model(ModelConfig(num_layers=1), tok).to(torch.bfloat16).eval()
    engine = Engine(m, tok, EngineConfig(kv_cache_bytes=8 * 2**20))
    prompt = tok("hello world")["input_ids"]
    [[res]] = engine.generate([GenRequest(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[]))])
    assert len(res.token_ids) == 6 and all(isinstance(x, float) for x in res.logprobs)
    with torch.no_grad():  # greedy from the same bf16 weights: the first token is the logits' argmax
        first = int(m(torch.tensor([prompt])).logits[0, -1].float().argmax())
    assert res.token_ids[0] == first
