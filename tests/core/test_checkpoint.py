"""Checkpoints hold tensors and plain data only, and resuming unpickles nothing else."""

import os
import pickle
import random
from pathlib import Path

import pytest
import torch
from test_storage import make_traj

from assay.core.checkpoint import load_trainer_file, load_training_state, save_checkpoint, set_rng_state
from assay.core.errors import CheckpointError
from assay.pipeline.async_pipeline import batch_from_plain, batch_plain


class _Payload:
    """Unpickling it creates a directory: the stand-in for code a hostile trainer.pt would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


class _Saver:
    """Stands in for a model and a tokenizer: save_pretrained writes what check_checkpoint looks for."""

    def save_pretrained(self, path: Path, **_: object) -> None:
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"")


def _optimizer_state() -> dict:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(3)).sum().backward()
    opt.step()
    return {"optimizer": opt.state_dict(), "steps": 1}


def test_a_checkpoint_round_trips_through_weights_only_loading(tmp_path):
    a, b = make_traj(0), make_traj(1)
    b.env_hash = ""  # the trajectory's and its task's hashes are kept apart
    batch = (2, [a, b], [b], 1, {"rollout_s": 0.5})
    random.seed(7)
    path = save_checkpoint(tmp_path / "checkpoints", 3, _Saver(), _Saver(), _optimizer_state(), {"mixer": {"x": 1}},
                           buffer={4: batch_plain(batch)})
    expected = random.random()
    blob, state = load_training_state(path)  # weights_only=True
    assert state == {"step": 3, "mixer": {"x": 1}} and blob["trainer"]["steps"] == 1
    assert blob["trainer"]["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)
    set_rng_state(blob["rng"])
    assert random.random() == expected
    version, everything, kept, dropped, stats = batch_from_plain(blob["buffer"][4])
    assert (version, everything, kept, dropped, stats) == batch
    assert kept[0] is everything[1]  # kept trajectories stay the same objects as in the whole batch


def test_a_trainer_file_carrying_code_is_refused_and_the_code_never_runs(tmp_path):
    marker = tmp_path / "ran"
    path = save_checkpoint(tmp_path / "checkpoints", 1, _Saver(), _Saver(), {"steps": 1}, {"mixer": {}})
    torch.save({"trainer": {"steps": 1}, "rng": None, "buffer": _Payload(marker)}, path / "trainer.pt")
    with pytest.raises(CheckpointError, match=r"trainer\.pt holds pickled Python objects \(posix\.mkdir\).*refuses.*resume from"
                                              r" a checkpoint this version of Assay wrote") as e:
        load_training_state(path)
    assert str(path / "trainer.pt") in str(e.value)
    assert not marker.exists(), "loading the checkpoint ran the code it carried"
    # the file really does carry code: a plain unpickler runs it
    with pytest.raises(CheckpointError):
        load_trainer_file((path / "trainer.pt").open("rb"))
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.is_dir()


def test_a_damaged_trainer_file_is_reported_as_corrupt(tmp_path):
    path = save_checkpoint(tmp_path / "checkpoints", 1, _Saver(), _Saver(), {"steps": 1}, {"mixer": {}})
    (path / "trainer.pt").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=r"is corrupt \(UnpicklingError: damaged: not a pickle of tensors and "
                                              r"plain data\); resume from an earlier step$"):
        load_training_state(path)
