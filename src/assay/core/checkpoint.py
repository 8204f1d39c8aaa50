"""Checkpoints: `checkpoints/step_N/` holds the policy in Hugging Face layout (safetensors +
tokenizer), `trainer.pt` (optimizer, step, RNG states, batches sampled ahead) and `state.json` (mixer, curriculum).
A checkpoint is written into a temp directory and swapped into place, so it is whole or absent.

`trainer.pt` holds tensors and plain data only (dicts, lists, tuples, str, numbers), and is read with
`torch.load(weights_only=True)`: a run directory is data, and resuming from one must not run code that
a pickle in it could carry."""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from assay.core.atomic import atomic_dir
from assay.core.errors import CheckpointError

REQUIRED = ("config.json", "model.safetensors", "trainer.pt", "state.json")


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(state["torch"])


def save_checkpoint(ckpt_root: Path, step: int, model: Any, tokenizer: Any, trainer_state: dict[str, Any],
                    state: dict[str, Any], keep: int = 2, buffer: Any = None) -> Path:
    """`buffer`: what was sampled ahead of this step and not yet trained (the asynchronous pipeline's), as
    plain data; `trainer_state` and `buffer` must load with `weights_only=True` (see `load_trainer_file`)."""
    final = ckpt_root / f"step_{step}"
    with atomic_dir(final) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save({"trainer": trainer_state, "rng": rng_state(), "buffer": buffer}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
    for old in sorted(list_checkpoints(ckpt_root))[:-keep]:
        shutil.rmtree(ckpt_root / f"step_{old}", ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path) -> list[int]:
    if not ckpt_root.is_dir():
        return []
    return sorted(int(p.name.split("_")[1]) for p in ckpt_root.glob("step_*") if p.name.split("_")[1].isdigit())


def latest_checkpoint(run_dir: Path) -> Path:
    steps = list_checkpoints(run_dir / "checkpoints")
    if not steps:
        raise CheckpointError(f"no checkpoint in {run_dir / 'checkpoints'}; "
                              f"a run can resume only after its first checkpoint (train.checkpoint_every)")
    return run_dir / "checkpoints" / f"step_{steps[-1]}"


def check_checkpoint(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} not found; pass a directory like runs/NAME/checkpoints/step_N")
    missing = [f for f in REQUIRED if not (path / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete (missing {', '.join(missing)}); "
                              f"resume from an earlier step or retrain")


def load_trainer_file(file: Path | Any) -> Any:
    """`torch.load` that unpickles only tensors and plain data: a pickled object, which could run code
    as it loads, is refused with a CheckpointError (nothing of it runs). `file`: a path or a byte stream."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        refused = re.search(r"GLOBAL ([\w.]+)", str(e))  # an object it would import; otherwise a damaged file
        if not refused:  # torch's message spans lines about its defaults: the error is one line
            raise pickle.UnpicklingError("damaged: not a pickle of tensors and plain data") from None
        name = file if isinstance(file, Path) else "the trainer state"
        raise CheckpointError(f"{name} holds pickled Python objects ({refused[1]}), not only tensors and plain "
                              "data; Assay refuses to load it since unpickling them could run code: resume from a "
                              "checkpoint this version of Assay wrote (or retrain), and never resume from a run "
                              "directory you do not trust") from None


def load_training_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trainer.pt contents, state.json contents); the caller loads weights with from_pretrained."""
    check_checkpoint(path)
    try:
        blob = load_trainer_file(path / "trainer.pt")
        state = json.loads((path / "state.json").read_text())
    except CheckpointError:
        raise
    except Exception as e:  # any decoding failure means the files are damaged
        raise CheckpointError(f"checkpoint {path} is corrupt ({type(e).__name__}: {' '.join(str(e).split())}); "
                              f"resume from an earlier step") from None
    return blob, state
