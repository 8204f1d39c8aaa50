"""Every built-in environment has passed the current gate (GATE_VERSION) under its current version
(a record in the QA store shipped in the package, src/assay/envs/qa/records/), and has not changed since: editing one means bumping
its version and running `assay env check` again; changing the gate means running it again."""

import pytest

from assay.envs import env_hash, env_parts, get_env
from assay.envs.qa.enforce import PACKAGED_RECORDS
from assay.envs.qa.gate import GATE_VERSION
from assay.envs.qa.store import check_version, latest

STORE = PACKAGED_RECORDS


@pytest.mark.parametrize("name", ["arith", "codegen", "repo", "terminal", "toolcalc"])
def test_builtin_versions_are_checked_and_unchanged(name):
    env = get_env(name)
    spec = f"{env.name}@{env.version}"
    record = latest(STORE, spec, passed_only=True)
    assert record is not None, (f"{spec} has no record of passing gate v{GATE_VERSION}: run `assay env check {name} "
                                f"--store {STORE}` and commit it")
    check_version(STORE, spec, env_hash(env), env_parts(env))
