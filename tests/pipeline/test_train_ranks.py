"""Data-parallel training in the pipeline: two trainer ranks (gloo, this machine) take the steps of one
process, up to float rounding, and end every step with identical weights."""

import pytest
import torch
from safetensors.torch import load_file

from assay.core.config import load_config
from assay.pipeline.async_pipeline import make_pipeline
from assay.pipeline.train_ranks import weights_digest

RUN = ["train.steps=3", "train.checkpoint_every=3", "train.max_refill_rounds=0", "train.lr=1e-2"]


def _run_recording_digests(pipeline) -> list[tuple[str, list[str]]]:
    """Run it; after every step, rank 0's weights digest beside every other rank's."""
    real, digests = pipeline.train_step, []

    def step(batch, version):
        out = real(batch, version)
        digests.append((weights_digest(pipeline.trainer.model), pipeline.ranks.digests()))
        return out

    pipeline.train_step = step
    pipeline.run()
    return digests


def test_two_trainer_ranks_step_as_one_process_and_stay_identical(tiny_config, tmp_path):
    one = make_pipeline(load_config(tiny_config(name="one"), RUN), tmp_path / "one")
    start = {k: v.clone() for k, v in one.model.state_dict().items()}
    one.run()
    two = make_pipeline(load_config(tiny_config(name="two"), [*RUN, "train.ranks=2"]), tmp_path / "two")
    digests = _run_recording_digests(two)
    assert len(digests) == 3 and all([mine] == others for mine, others in digests)  # rank 1 = rank 0, every step
    assert two.ranks is None and not torch.distributed.is_initialized()  # closed with the run
    a, b = (load_file(tmp_path / n / "checkpoints" / "step_3" / "model.safetensors") for n in ("one", "two"))
    # equal up to float rounding (the all-reduce sums in another order), which Adam's normalization amplifies
    # where a gradient is near zero: within a hundredth of one step's update (lr 1e-2)
    assert all(torch.allclose(a[k], b[k], atol=1e-4) for k in a)
    assert any(not torch.allclose(start[k], a[k], atol=1e-3) for k in a)  # the steps moved the weights


def test_a_run_with_two_ranks_resumes_exactly_and_each_rank_gets_its_own_optimizer_state(tiny_config, tmp_path):
    on = ["train.max_refill_rounds=0", "train.lr=1e-2", "train.ranks=2", "train.checkpoint_every=3"]
    make_pipeline(load_config(tiny_config(name="straight"), on), tmp_path / "straight").run()
    make_pipeline(load_config(tiny_config(name="half"), [*on, "train.steps=3"]), tmp_path / "half").run()
    resumed = make_pipeline(load_config(tmp_path / "half" / "config.yaml", ["train.steps=6"]), tmp_path / "half",
                            resume=True)
    digests = _run_recording_digests(resumed)
    assert len(digests) == 3 and all([mine] == others for mine, others in digests)
    a, b = (load_file(tmp_path / n / "checkpoints" / "step_6" / "model.safetensors") for n in ("straight", "half"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # shared optimizer moments would have stepped twice


@pytest.mark.slow  # minutes of Ray actors: `make test-slow` (CI runs it)
def test_trainer_ranks_as_ray_actors_step_as_spawned_ranks_do(tiny_config, tmp_path):
    pytest.importorskip("ray")
    on = [*RUN, "train.ranks=2"]
    make_pipeline(load_config(tiny_config(name="spawned"), on), tmp_path / "spawned").run()
    actors = make_pipeline(load_config(tiny_config(name="actors"),
                                       [*on, "train.rank_workers=ray", "pipeline.ray.num_cpus=2"]), tmp_path / "actors")
    digests = _run_recording_digests(actors)
    assert len(digests) == 3 and all([mine] == others for mine, others in digests)
    import ray

    assert actors.ranks is None and not ray.is_initialized() and not torch.distributed.is_initialized()
    a, b = (load_file(tmp_path / n / "checkpoints" / "step_3" / "model.safetensors") for n in ("spawned", "actors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same steps, to the bit
