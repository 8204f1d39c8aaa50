import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from assay.core.config import ModelConfig
from assay.core.errors import AssayError, CheckpointError
from assay.core.modeling import (
    build_model,
    cgroup_cpu_limit,
    choose_threads,
    load_model,
    save_model,
    set_threads,
    thread_candidates,
    usable_cores,
)
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


def test_choose_threads_tries_powers_of_two_up_to_the_cores_and_stops_once_slower(model, monkeypatch):
    import types

    import assay.core.modeling as modeling

    tried: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", tried.append)
    # each count's timing: a start then an end; 1 thread 8 s, 2: 4 s, 4: 2 s, 8: 3 s (slower: the search stops)
    clock = iter([0.0, 8.0, 0.0, 4.0, 0.0, 2.0, 0.0, 3.0])
    monkeypatch.setattr(modeling, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    assert choose_threads(model, batch=1, seq_len=4, reps=1, cores=32) == 4
    assert tried[:-1] == [1, 2, 4, 8]  # not 16 or 32; then the previous count is restored


def test_thread_candidates():
    assert thread_candidates(1) == [1]
    assert thread_candidates(2) == [1, 2]
    assert thread_candidates(6) == [1, 2, 4, 6]
    assert thread_candidates(64) == [1, 2, 4, 8, 16, 32, 64]


def _cgroups(tmp_path, proc: str, files: dict[str, str]) -> tuple:
    root = tmp_path / "sys"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self_cgroup").write_text(proc)
    return root, tmp_path / "self_cgroup"


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    root, me = _cgroups(tmp_path, "0::/jobs/one\n", {
        "cgroup.controllers": "cpu memory", "jobs/cpu.max": "250000 100000", "jobs/one/cpu.max": "max 100000"})
    assert cgroup_cpu_limit(root, me) == 2.5  # the parent's limit holds under an unlimited child
    (root / "jobs" / "one" / "cpu.max").write_text("50000 100000")
    assert cgroup_cpu_limit(root, me) == 0.5
    (root / "jobs" / "cpu.max").write_text("max 100000")
    (root / "jobs" / "one" / "cpu.max").write_text("max 100000")
    assert cgroup_cpu_limit(root, me) is None


def test_cgroup_v1_quota_and_a_hybrid_host(tmp_path):
    # v1 controllers with the unified hierarchy beside them (as on the development machine)
    root, me = _cgroups(tmp_path, "4:memory:/x\n2:cpu,cpuacct:/job\n0::/\n", {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "300000", "cpu,cpuacct/job/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "unified/cgroup.controllers": ""})
    assert cgroup_cpu_limit(root, me) == 3.0
    (root / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us").write_text("-1")
    assert cgroup_cpu_limit(root, me) is None
    assert cgroup_cpu_limit(root, tmp_path / "missing") is None  # not Linux, or no /proc


def test_a_container_sees_its_cgroup_as_the_root(tmp_path):
    root, me = _cgroups(tmp_path, "0::/kubepods/pod1/abc\n", {"cgroup.controllers": "cpu", "cpu.max": "150000 100000"})
    assert cgroup_cpu_limit(root, me) == 1.5  # the path is the host's and does not exist here


def test_usable_cores_is_the_affinity_capped_by_the_quota(monkeypatch):
    import assay.core.modeling as modeling

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(modeling, "cgroup_cpu_limit", lambda: 2.5)
    assert usable_cores() == 3  # a fractional core still runs a thread
    monkeypatch.setattr(modeling, "cgroup_cpu_limit", lambda: None)
    assert usable_cores() == 8
    monkeypatch.setattr(modeling, "cgroup_cpu_limit", lambda: 64.0)
    assert usable_cores() == 8


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
