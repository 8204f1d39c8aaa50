"""A model someone else trained, brought in from the GGUF file a Python package ships."""

import json

import pytest
from typer.testing import CliRunner

from assay.cli import app
from assay.core.chat_format import chat_format
from assay.core.errors import CheckpointError
from assay.core.gguf_import import load_gguf, packaged_gguf
from assay.core.modeling import load_model
from assay.core.tokenizer import stop_token_ids


def test_import_writes_a_plain_hugging_face_directory(smollm2_dir):
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config  # dequantized: an ordinary float checkpoint
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    model, tok = load_model(smollm2_dir)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    fmt = chat_format(tok)  # the model's own ChatML template, read like any other
    assert fmt.turn_end == "<|im_end|>"
    assert stop_token_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "SmolLM" in text  # its default system prompt, kept


def test_the_imported_weights_are_the_gguf_weights(smollm2_dir):
    model, _ = load_model(smollm2_dir)
    direct, _ = load_gguf(packaged_gguf("smollm2"))
    for (name, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items(), strict=True):
        assert a.equal(b), name


def test_bad_sources_get_one_line_naming_the_problem_and_the_fix(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_gguf(not_gguf)
    with pytest.raises(CheckpointError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(CheckpointError, match="no packaged model named 'gpt5'"):
        load_gguf("gpt5")
    truncated = tmp_path / "truncated.gguf"
    with packaged_gguf("smollm2").open("rb") as f:
        truncated.write_bytes(f.read(1 << 20))  # the header and part of the metadata: a download cut short
    with pytest.raises(CheckpointError, match="could not be read as a model") as e:
        load_gguf(truncated)
    assert "\n" not in str(e.value)


def test_cli_import_and_a_gguf_model_path(tmp_path):
    result = CliRunner().invoke(app, ["model", "import", str(tmp_path / "nothing.gguf"), str(tmp_path / "out")])
    assert result.exit_code != 0 and not (tmp_path / "out").exists()
    model, tok = load_model(packaged_gguf("smollm2"))  # model.path may name the file itself
    assert model.config.model_type == "llama" and chat_format(tok).turn_end == "<|im_end|>"


def test_a_packaged_model_is_evaluated_by_name_and_identified_by_its_gguf(tmp_path):
    import hashlib
    from pathlib import Path

    from assay.core.errors import AssayError
    from assay.eval.record import policy_identity

    identity = policy_identity(Path("smollm2"))
    assert identity == {"kind": "gguf", "path": "smollm2",
                        "weights_sha256": hashlib.sha256(packaged_gguf("smollm2").read_bytes()).hexdigest()}
    with pytest.raises(AssayError, match="holds no \\*.safetensors weights.*a .gguf file or a packaged model"):
        policy_identity(tmp_path)
