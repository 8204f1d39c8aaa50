"""docs/configuration.md is what the config models render, and it documents every key exactly once."""

import re
from collections import Counter
from pathlib import Path
from typing import get_args, get_origin

import pytest
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from assay.core.config import Config
from assay.core.config_reference import REGENERATE, render, undocumented

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key a YAML config can set, walked here apart from the generator's own walk."""
    keys = []
    for name, field in model.model_fields.items():
        ann, args = field.annotation, get_args(field.annotation)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _leaf_keys(ann, f"{prefix}{name}.")
        elif get_origin(ann) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            keys += _leaf_keys(args[0], f"{prefix}{name}[].")
        else:
            keys.append(prefix + name)
    return keys


def _documented_keys(markdown: str) -> Counter[str]:
    return Counter(re.findall(r"^\| `([^`]+)` \|", markdown, flags=re.MULTILINE))


def test_checked_in_reference_is_current() -> None:
    if DOC.read_text() != render():
        pytest.fail(f"docs/configuration.md is out of step with the config models; regenerate it: {REGENERATE}")
    assert REGENERATE in DOC.read_text().splitlines()[0]


def test_every_field_has_a_description() -> None:
    assert undocumented(Config) == [], "give these fields Field(description=...) in src/assay/core/config.py"


def test_a_field_without_a_description_is_found_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Inner(BaseModel):
        ok: int = Field(1, description="documented")
        bare: int = 2

    class Outer(BaseModel):
        items: list[Inner] = Field(default_factory=list, description="a list section")
        blank: str = Field("x", description="  ")

    assert undocumented(Outer) == ["items[].bare", "blank"]
    monkeypatch.setattr("assay.core.config_reference.Config", Outer)
    with pytest.raises(ValueError, match=r"items\[\]\.bare, blank"):
        render()


def test_reference_lists_every_key_exactly_once() -> None:
    documented = _documented_keys(DOC.read_text())
    expected = _leaf_keys(Config)
    assert len(expected) == len(set(expected))
    assert sorted(k for k, n in documented.items() if n > 1) == []
    assert set(documented) == set(expected)
    # keys the hand-written README table once missed or repeated
    assert {"sft.max_level", "sft.micro_batch_tokens", "eval.every", "allow_unchecked",
            "domains[].rewards[].fn"} <= set(documented)


def test_defaults_and_constraints_are_the_models() -> None:
    rows = {m[0]: m[1:] for m in re.findall(r"^\| `([^`]+)` \| (.*?) \| (.*?) \| (.*?) \|", render(), re.MULTILINE)}
    assert rows["train.lr"] == ("float", "`0.0003`", "> 0")
    assert rows["domains[].difficulty.acceptance"] == ("float", "`0.8`", "> 0, ≤ 1")
    assert rows["domains[].name"] == ("str", "required", "")
    assert rows["rollout.backend"] == ("str", "`engine`", "")  # a registered backend name, checked on load
    assert rows["rollout.gemm"] == ("`auto`, `onednn` or `torch`", "`auto`", "")
    assert rows["sft.max_level"] == ("int or none", "none", "≥ 1")
    assert rows["train.betas"] == ("[float, float]", "`[0.9, 0.99]`", "")


def test_cli_writes_the_reference(tmp_path: Path) -> None:
    from assay.cli import app

    out = tmp_path / "configuration.md"
    result = CliRunner().invoke(app, ["config", "reference", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == render()
    printed = CliRunner().invoke(app, ["config", "reference"])
    assert printed.exit_code == 0 and printed.output == render()
