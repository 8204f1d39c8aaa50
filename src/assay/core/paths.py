"""Assay's home: where what belongs to no run directory lives, so that a command run from any directory
writes and finds the same records. `$ASSAY_HOME` when set, else `~/.assay`; under it

- `envqa/`: the QA store, where `assay env check` writes its records and training and evaluation look
  for passing ones (after the stores a run names, before the packaged ones);
- `evals/`: `assay eval`'s record directories, when no `--out` is given.

A run's own files stay in its run directory (`runs/NAME`), as before."""

from __future__ import annotations

import os
from pathlib import Path

from assay.core.errors import ConfigError

HOME_ENV = "ASSAY_HOME"
DEFAULT_HOME = "~/.assay"


def home() -> Path:
    """`$ASSAY_HOME`, else `~/.assay` (not created here: whatever writes under it does)."""
    value = os.environ.get(HOME_ENV, "").strip()
    path = Path(value or DEFAULT_HOME).expanduser()
    if not path.is_absolute():  # a relative home would move with the working directory, as before
        raise ConfigError(f"{HOME_ENV}={value!r} is a relative path, so records would land wherever a command "
                          f"runs; set it to an absolute one (e.g. {HOME_ENV}=$PWD/{value}) or unset it for "
                          f"{DEFAULT_HOME}")
    return path


def envqa_store() -> Path:
    """The QA store `assay env check` writes by default, and enforcement searches."""
    return home() / "envqa"


def evals_dir() -> Path:
    """Where `assay eval` puts a record directory with no `--out`."""
    return home() / "evals"


def describe(sub: str) -> str:
    """For help texts: the real default path of `sub` under the home, or how it is formed when
    ASSAY_HOME is not usable (help must still print)."""
    try:
        return str(home() / sub)
    except ConfigError:
        return f"${HOME_ENV}/{sub}"
