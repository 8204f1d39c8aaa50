"""Every built-in environment has passed the current gate (GATE_VERSION) under its current version
(a record in the committed QA store, envqa/), and has not changed since: editing one means bumping
its version and running `assay env check` again; changing the gate means running it again."""

from pathlib import Path

import pytest

from assay.envs import env_hash, env_parts, get_env
from assay.envs.qa.gate import GATE_VERSION
from assay.envs.qa.store import check_version, latest

STORE = Path(__file__).parents[3] / "envqa"


@pytest.mark.parametrize("name", ["arith", "codegen", "terminal", "toolcalc"])
def test_builtin_versions_are_checked_and_unchanged(name):
    env = get_env(name)
    spec = f"{env.name}@{env.version}"
    record = latest(STORE, spec, passed_only=True)
    assert record is not None, (f"{spec} has no record of passing gate v{GATE_VERSION}: run `assay env check {name}` "
                                "and commit envqa/")
    check_version(STORE, spec, env_hash(env), env_parts(env))
