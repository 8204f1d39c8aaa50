"""Assay's home (core/paths.py): records that belong to no run go under $ASSAY_HOME (else ~/.assay), so a
command run from any directory writes and finds the same ones."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from assay.cli import app
from assay.core.errors import ConfigError
from assay.core.paths import envqa_store, evals_dir, home
from assay.envs import get_env
from assay.envs.qa.enforce import UncheckedEnvironment, record_stores, require_checked


def test_the_home_is_assay_home_else_dot_assay_in_the_users_home(monkeypatch, tmp_path):
    monkeypatch.setenv("ASSAY_HOME", str(tmp_path / "h"))
    assert (home(), envqa_store(), evals_dir()) == (tmp_path / "h", tmp_path / "h" / "envqa", tmp_path / "h" / "evals")
    monkeypatch.delenv("ASSAY_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert home() == tmp_path / "user" / ".assay"
    monkeypatch.setenv("ASSAY_HOME", "rel/home")  # would move with the working directory
    with pytest.raises(ConfigError, match="ASSAY_HOME='rel/home' is a relative path"):
        home()


def _jsonl(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(1, 13)))
    return path


def test_env_check_from_one_directory_is_found_by_training_from_another(monkeypatch, tmp_path, assay_home):
    """A user's environment checked once (default store) is found by enforcement run from elsewhere, and
    nothing lands in either working directory."""
    data = _jsonl(tmp_path / "d.jsonl")
    env = get_env("jsonl@4", path=str(data))
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(UncheckedEnvironment):  # no record yet: the packaged ones hold none for it
        require_checked({"qa": env})
    result = CliRunner().invoke(app, ["env", "check", "jsonl@4", "--env-arg", f"path={data}", "--tasks", "2"])
    assert result.exit_code == 0, result.output
    assert len(list((assay_home / "envqa" / "jsonl@4").glob("*.json"))) == 1
    monkeypatch.chdir(there)
    assert require_checked({"qa": env}) == {}  # found, not run unchecked
    assert envqa_store() in record_stores()
    assert not any(here.iterdir()) and not any(there.iterdir())


def test_records_in_the_old_cwd_store_are_named_when_a_check_is_missing(monkeypatch, tmp_path):
    """./envqa is no longer searched; a refusal from a directory holding one says where records go now."""
    env = get_env("jsonl@4", path=str(_jsonl(tmp_path / "d.jsonl")))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envqa" / "jsonl@4").mkdir(parents=True)
    with pytest.raises(UncheckedEnvironment, match=r"envqa holds QA records, which are no longer searched: move them "
                                                   rf"into {envqa_store()}"):
        require_checked({"qa": env})


def test_help_shows_the_real_default_store(assay_home):
    # a fresh process: the help text is made when the CLI is imported, from that process's ASSAY_HOME
    out = subprocess.run([sys.executable, "-m", "assay.cli", "env", "check", "--help"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "COLUMNS": "250"})
    assert f"(default: {assay_home / 'envqa'})" in out.stdout, out.stdout
