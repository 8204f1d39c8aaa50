"""The rollout backend registry: built-ins and a user's backend are built by name, from a decorator in
this process or from the `assay.rollout_backends` entry-point group in any process; an unknown name is
refused with the known ones, in the config and in `make_backend`."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import assay
from assay.core.config import ConfigError, RolloutConfig, build_config
from assay.core.errors import AssayError
from assay.rollout import factory
from assay.rollout.base import RolloutBackend, require_backend
from assay.rollout.factory import backend_names, make_backend, register_backend

SRC = Path(__file__).resolve().parents[2] / "src"

PLUGIN = '''
from assay.rollout.base import RolloutBackend


class Echo(RolloutBackend):
    """Made by the plugin's entry point: remembers what it was built with."""

    def __init__(self, cfg, model, tokenizer):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer

    def generate(self, requests):
        return []

    def update_weights(self, named_tensors, version):
        pass
'''


@pytest.fixture
def scratch(monkeypatch):
    """Registrations and plugins a test makes vanish after it."""
    monkeypatch.setattr(factory, "backends", factory.backends.copy())


def _plugin(monkeypatch, tmp_path, name: str = "echo", value: str = "assay_echo_backend:Echo") -> None:
    (tmp_path / "assay_echo_backend.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint(name, value, factory.ENTRY_POINT_GROUP)
    monkeypatch.setattr(factory, "backends", factory.backends.copy(plugins=[ep]))


def test_the_builtins_are_registered():
    assert {"engine", "hf", "vllm"} <= set(backend_names())


def test_a_registered_backend_is_built_by_make_backend(scratch):
    class Mine(RolloutBackend):
        def __init__(self, cfg, model, tokenizer):
            self.built = (cfg.backend, model, tokenizer)

        def generate(self, requests):
            return []

        def update_weights(self, named_tensors, version):
            pass

    @register_backend("mine")
    def _mine(cfg, model, tokenizer):
        return Mine(cfg, model, tokenizer)

    backend = make_backend(RolloutConfig(backend="mine"), "model", "tokenizer")
    assert isinstance(backend, Mine) and backend.built == ("mine", "model", "tokenizer")
    assert backend.take_stats() == {} and backend.close() is None  # the protocol's defaults
    assert "mine" in backend_names()
    with pytest.raises(AssayError, match="'mine' is registered twice"):
        register_backend("mine")(lambda cfg, model, tokenizer: None)


def test_an_unknown_backend_is_refused_with_the_known_ones(scratch):
    with pytest.raises(ConfigError, match=r"rollout\.backend: .*no rollout backend of that name; known backends: "
                                          r"engine, hf, vllm .*assay\.rollout_backends.*\(got 'vlm'\)"):
        build_config({"domains": [{"name": "a", "env": "arith"}]}, ["rollout.backend=vlm"])
    cfg = RolloutConfig.model_construct(backend="vlm")  # unvalidated: make_backend checks the name itself
    with pytest.raises(AssayError, match="unknown rollout backend 'vlm'; known backends: engine, hf, vllm"):
        make_backend(cfg, None, None)


def test_a_backend_without_the_protocol_is_refused_naming_what_it_lacks(scratch):
    class Bare:  # generate and update_weights only: no take_stats, no close
        def generate(self, requests):
            return []

        def update_weights(self, named_tensors, version):
            pass

    register_backend("bare")(lambda cfg, model, tokenizer: Bare())
    with pytest.raises(AssayError, match="rollout backend 'bare' made a .*Bare, which lacks take_stats, close .*"
                                         "subclass assay.RolloutBackend"):
        make_backend(RolloutConfig(backend="bare"), None, None)
    with pytest.raises(AssayError, match="lacks generate, update_weights, take_stats, close"):
        require_backend(object(), "a test")


def test_an_entry_point_backend_is_found_by_name_and_loaded_only_when_built(scratch, monkeypatch, tmp_path):
    _plugin(monkeypatch, tmp_path)
    sys.modules.pop("assay_echo_backend", None)
    assert "echo" in backend_names() and "assay_echo_backend" not in sys.modules  # listed, not imported
    cfg = build_config({"domains": [{"name": "a", "env": "arith"}], "rollout": {"backend": "echo"}}).rollout
    backend = make_backend(cfg, "model", "tokenizer")
    assert type(backend).__name__ == "Echo" and (backend.model, backend.tokenizer) == ("model", "tokenizer")


def test_a_broken_entry_point_is_named(scratch, monkeypatch, tmp_path):
    _plugin(monkeypatch, tmp_path, "broken", "no_such_module_xyz:Backend")
    with pytest.raises(AssayError, match=r"rollout backend plugin 'broken' \(no_such_module_xyz:Backend\) failed"):
        make_backend(RolloutConfig(backend="broken"), None, None)


def test_an_installed_plugin_is_found_in_a_fresh_process(tmp_path):
    """What a worker process or a Ray actor does: nothing registered it there, the distribution's entry
    point names it."""
    (tmp_path / "assay_echo_backend.py").write_text(PLUGIN)
    dist = tmp_path / "assay_echo_backend-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: assay-echo-backend\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{factory.ENTRY_POINT_GROUP}]\necho = assay_echo_backend:Echo\n")
    code = ("from assay.core.config import RolloutConfig; from assay.rollout.factory import make_backend; "
            "print(type(make_backend(RolloutConfig(backend='echo'), 'm', 't')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": f"{tmp_path}:{SRC}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Echo"


def test_the_backend_protocol_is_exported_from_the_top():
    assert assay.RolloutBackend is RolloutBackend and assay.register_backend is register_backend


def test_the_builtins_build_around_a_model(model, tok):
    from assay.rollout.base import OnlineBackend
    from assay.rollout.engine import Engine
    from assay.rollout.hf import HFBackend

    hf = make_backend(RolloutConfig(backend="hf"), model, tok)
    assert isinstance(hf, HFBackend) and hf.take_stats() == {}
    engine = make_backend(RolloutConfig(kv_cache_mb=4, max_batched_tokens=64, warm_up=False), model, tok)
    assert isinstance(engine, Engine) and isinstance(engine, OnlineBackend)
    engine.close()  # the protocol's default: nothing to release
