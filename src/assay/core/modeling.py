"""The policy model: a small Qwen2/Llama causal LM built from a config, saved and loaded in HF layout."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from assay.core.atomic import atomic_dir
from assay.core.attention import implementation
from assay.core.chat_format import chat_format, set_template_kwargs, template_kwargs
from assay.core.config import ModelConfig
from assay.core.errors import AssayError, CheckpointError
from assay.core.gguf_import import PACKAGED
from assay.core.tokenizer import stop_token_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_of(cfg: ModelConfig) -> torch.device:
    """`model.device`, checked against what this machine has."""
    try:
        device = torch.device(cfg.device)
    except RuntimeError as e:
        raise AssayError(f"model.device {cfg.device!r} is not a device torch knows ({e}); use cpu or cuda[:N]") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise AssayError(f"model.device {cfg.device!r}: this machine has no CUDA device torch can use; set "
                         "model.device: cpu")
    if device.type not in ("cpu", "cuda"):
        raise AssayError(f"model.device {cfg.device!r}: only cpu and cuda are supported")
    return device


def place(model: PreTrainedModel, cfg: ModelConfig) -> PreTrainedModel:
    """The model on `model.device` in `model.dtype`."""
    return model.to(device=device_of(cfg), dtype=DTYPES[cfg.dtype])


def build_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialized causal LM sized by `cfg`; the vocabulary is the tokenizer's (embeddings tied)."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise AssayError("the tokenizer has no eos/pad token; train it with assay.core.tokenizer.train_tokenizer")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = Qwen2Config(**common) if cfg.arch == "qwen2" else LlamaConfig(**common)
    config._attn_implementation = implementation(cfg.attn_implementation)
    model_cls = Qwen2ForCausalLM if cfg.arch == "qwen2" else LlamaForCausalLM
    model = model_cls(config)
    # Only the special ids live here: a chat turn ends at <|im_end|>. Sampling settings are passed
    # explicitly on every generate call (rollout.hf), since an unset top_k falls back to transformers' 50.
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=stop_token_ids(tokenizer), bos_token_id=None
    )
    return model


TEMPLATE_KWARGS_FILE = "chat_template_kwargs.json"  # model.chat_template_kwargs the policy was trained with


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str | Path) -> None:
    """Weights (safetensors), config and tokenizer in Hugging Face layout: loadable by `from_pretrained`."""
    with atomic_dir(Path(directory)) as d:
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)
        if kwargs := template_kwargs(tokenizer):  # so that a bare `assay eval --policy DIR` renders as training did
            (d / TEMPLATE_KWARGS_FILE).write_text(json.dumps(kwargs, indent=1))


def load_model(
    path: str | Path, cfg: ModelConfig | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from a local Hugging Face directory, a .gguf file or a packaged model's name (never the network), placed by `cfg`'s
    device, dtype and attention implementation (default: float32 on the CPU, auto); its tokenizer renders its chat
    template with `cfg.chat_template_kwargs`, or where none are given those the directory was saved with."""
    cfg = cfg or ModelConfig()
    device = device_of(cfg)
    d = Path(path)
    if d.suffix == ".gguf" or (not d.exists() and str(path) in PACKAGED):
        # read and dequantized on every load: `assay model import` once is faster where a model loads often
        from assay.core.gguf_import import load_gguf

        model, tokenizer = load_gguf(d)
        model = model.to(device=device, dtype=DTYPES[cfg.dtype])
        model.set_attn_implementation(implementation(cfg.attn_implementation))
        use_template(tokenizer, cfg.chat_template_kwargs)
        return model, tokenizer
    if not d.is_dir():
        raise CheckpointError(f"model directory {str(d)!r} not found; pass a directory written by save_model")
    for need in ("config.json", "tokenizer_config.json"):
        if not (d / need).is_file():
            raise CheckpointError(f"model directory {str(d)!r} has no {need}; it is not a saved model + tokenizer")
    if not any(d.glob("*.safetensors")) and not any(d.glob("*.bin")):
        raise CheckpointError(f"model directory {str(d)!r} has no weights (*.safetensors)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(d, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            d, local_files_only=True, dtype=DTYPES[cfg.dtype],
            attn_implementation=implementation(cfg.attn_implementation),
        ).to(device)
    except Exception as e:  # transformers raises OSError, ValueError, safetensors errors...: all mean corrupt
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"model directory {str(d)!r} could not be loaded ({msg}); re-save it") from e
    saved = d / TEMPLATE_KWARGS_FILE
    use_template(tokenizer, cfg.chat_template_kwargs or (json.loads(saved.read_text()) if saved.is_file() else {}))
    return model, tokenizer


def use_template(tokenizer: PreTrainedTokenizerBase, kwargs: dict[str, Any]) -> None:
    """Bind these chat-template kwargs to the tokenizer (none: keep what it has) and read its layout now,
    so that a template that cannot lay out turns is named here, not deep in a rollout."""
    if kwargs:
        set_template_kwargs(tokenizer, kwargs)
    chat_format(tokenizer)


def set_threads(n: int) -> None:
    if n < 1:
        raise AssayError(f"thread count must be >= 1, got {n}")
    torch.set_num_threads(n)


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (the tightest along its path up to the root), or
    None when there is none: cgroup v2 `cpu.max` ("QUOTA PERIOD" or "max PERIOD"), v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1: none). v2 is mounted at `root` or, on a host
    with both versions, at `root/unified`."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            mounts = [m for m in (root, root / "unified") if (m / "cgroup.controllers").is_file()]
            limits += _quotas(mounts, path, lambda d: _v2_quota(d / "cpu.max"))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            mounts = [root / name for name in dict.fromkeys((controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"))]
            limits += _quotas([m for m in mounts if m.is_dir()], path,
                              lambda d: _v1_quota(d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
    return min(limits, default=None)


def _quotas(mounts: list[Path], path: str, read: Callable[[Path], float | None]) -> list[float]:
    """Each quota set from the cgroup at `path` up to the mount's root (a container sees its own cgroup
    as the root, where the path may not exist)."""
    found = []
    for mount in mounts:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            quota = read(mount.joinpath(*parts[:depth]))
            if quota is not None:
                found.append(quota)
    return found


def _v2_quota(file: Path) -> float | None:
    try:
        quota, period = file.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(quota_file: Path, period_file: Path) -> float | None:
    try:
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota (rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, math.ceil(limit))) if limit is not None else max(1, cores)


def thread_candidates(cores: int) -> list[int]:
    """1, 2, 4, ... up to `cores`, and `cores` itself."""
    counts = [1 << i for i in range(cores.bit_length()) if 1 << i <= cores]
    return counts if counts[-1] == cores else [*counts, cores]


_MEASURE_PARAMS = 4e6  # up to this many parameters the full measuring batch is cheap


def choose_threads(model: PreTrainedModel, batch: int = 8, seq_len: int = 128, reps: int = 3,
                   cores: int | None = None) -> int:
    """Measure forward+backward at 1, 2, 4, ... threads up to the cores this process may use (`usable_cores`:
    affinity and cgroup quota) and return the fastest count.

    On a shared machine small matrices often run much slower on more threads (contention), but that
    depends on the model size and the load, so it is measured, not assumed. The counts are tried in
    increasing order and the search stops at the first that is slower than the best so far (more threads
    rarely win again past it, and each try costs a few steps). The previous thread count is restored;
    gradients are computed with autograd.grad so no `.grad` of the model is touched."""
    before = torch.get_num_threads()
    params = [p for p in model.parameters() if p.requires_grad]
    vocab = model.config.vocab_size
    seq_len = min(seq_len, model.config.max_position_embeddings)
    # the same arithmetic whatever the model's size: a 135M-parameter model measured on the tiny model's
    # 1024 tokens spent minutes choosing; a few seconds of work tell the counts apart as well
    batch = max(1, min(batch, round(batch * _MEASURE_PARAMS / sum(p.numel() for p in model.parameters()))))
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)

    def step() -> None:
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        torch.autograd.grad(loss, params)

    times: dict[int, float] = {}
    try:
        for n in thread_candidates(cores or usable_cores()):
            torch.set_num_threads(n)
            step()  # warm-up
            t0 = time.perf_counter()
            for _ in range(reps):
                step()
            times[n] = time.perf_counter() - t0
            if times[n] > min(times.values()):
                break
    finally:
        torch.set_num_threads(before)
    return min(times, key=lambda n: times[n])


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls beat float32 here: a CUDA device that supports bf16, or a CPU with bf16 dot-product
    instructions, AMX tiles or AVX512-BF16 (oneDNN's bf16 kernels without either ran 10-20x slower than float32;
    docs/architecture.md, Threads)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


def bf16_enabled(setting: bool | Literal["auto"], device: torch.device) -> bool:
    """A `bf16` key's answer on this device: `auto` means where `fast_bf16` finds bf16 matmuls fast."""
    return setting is True or (setting == "auto" and fast_bf16(device))


def apply_threads(requested: int, model: PreTrainedModel) -> int:
    """Use `requested` torch threads, or (0) the count measured fastest for this model here."""
    n = requested or choose_threads(model)
    set_threads(n)
    return n
