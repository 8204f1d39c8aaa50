"""`assay serve` as a user runs it: a saved policy, a port the system picks, a key from the environment that
the server's output never shows."""

import os
import signal
import subprocess
import sys

import httpx
import pytest
from serve_helpers import CALC, served_url

from assay.core.errors import AssayError
from assay.core.modeling import save_model
from assay.serve.profile import ServeProfile, get_profile, profile_names, register_profile
from assay.serve.server import policy_dir

KEY = "k3y-that-must-not-leak-4242"


def test_assay_serve_serves_a_saved_policy_on_the_loopback_and_never_shows_its_key(policy, tok, tmp_path):
    save_model(policy, tok, tmp_path / "run" / "policy")  # an SFT run's directory stands for its policy
    env = {**os.environ, "ASSAY_TEST_SERVE_KEY": KEY, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "serve", str(tmp_path / "run"), "--port", "0",
                             "--api-key-env", "ASSAY_TEST_SERVE_KEY", "--max-queue", "4"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        url = served_url(proc, output, 180)
        with httpx.Client(base_url=url, timeout=60) as c:
            c.get("/health").raise_for_status()
            headers = {"Authorization": f"Bearer {KEY}"}
            model = c.get("/v1/models", headers=headers).json()["data"][0]["id"]
            assert model == str(tmp_path / "run")
            assert c.post("/v1/chat/completions", json={"model": model, "messages": []}).status_code == 401
            r = c.post("/v1/chat/completions", headers=headers, json={
                "model": model, "max_tokens": 30, "temperature": 0, "tools": [{"type": "function",
                                                                               "function": CALC.to_json()}],
                "messages": [{"role": "user", "content": "What is 2+3?"}]})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["finish_reason"] in ("tool_calls", "stop", "length")
            bad = c.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}x"},
                         json={"model": model, "prompt": KEY})
            assert bad.status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        output.append(rest)
    log = "".join(output)
    assert proc.returncode == 0, log
    assert "$ASSAY_TEST_SERVE_KEY" in log and "POST /v1/chat/completions" in log  # the access log is on
    assert KEY not in log


def test_profiles_are_found_by_name():
    assert get_profile("standard").name == "standard" and "standard" in profile_names()
    with pytest.raises(AssayError, match="known ones are fast, standard"):
        get_profile("turbo")
    with pytest.raises(AssayError, match="registered already"):
        register_profile(ServeProfile("standard", "again", get_profile("standard").engine, 1))


def test_a_run_directory_stands_for_its_latest_checkpoint(tmp_path):
    for step in (5, 40, 12):
        (tmp_path / "run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
    assert policy_dir(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_40"
    assert policy_dir(tmp_path / "hf") == tmp_path / "hf"


def test_a_missing_serve_extra_is_named_and_make_installs_it(monkeypatch):
    import tomllib
    from pathlib import Path

    import assay.serve as serve_pkg

    monkeypatch.setattr(serve_pkg, "find_spec", lambda name: None if name == "uvicorn" else object())
    with pytest.raises(AssayError, match=r"needs uvicorn: pip install 'assay\[serve\]'"):
        serve_pkg.require_installed()
    root = Path(__file__).parents[2]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["serve"] == ["fastapi==0.165.0", "uvicorn==0.55.0", "prometheus-client==0.26.0"]
    assert ",serve" in (root / "Makefile").read_text()  # make (so CI) installs it: these tests need it
