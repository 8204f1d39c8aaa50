"""`assay bench cluster`: the event model gives the answers known in closed form on fixed durations, the
fit reads a run directory, and bad input is refused with the fix named."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from assay.bench.cluster import run_cluster_bench
from assay.bench.cluster_fit import Episode, Fit, Group, StepRecord, fit_run
from assay.bench.cluster_model import (
    Shape,
    calibrate,
    plan_steps,
    run_schedule,
    simulate_round,
    simulate_worker,
    verify_pool,
)
from assay.core.errors import AssayError
from assay.core.storage import TrajectoryWriter
from assay.core.types import Message, Task, Trajectory


def fixed_fit(rollout_s: float, train_s: float, groups_per_step: int = 2, verify_s: float = 0.0) -> Fit:
    """Every episode one turn of 100 tokens at 1/100 of `rollout_s` per iteration, nothing else costing time:
    a round takes exactly `rollout_s`, a train step `train_s`."""
    group = Group(prompt=0, episodes=(Episode(1, 100, 0, 0.0, verify_s),) * 2)
    step = StepRecord(rounds=(1.0,), round_groups=((group,) * groups_per_step,), tokens=100.0, rollout_s=rollout_s,
                      generate_s=rollout_s, iterations=100, computed=200, train_s=train_s, weight_sync_s=0.0,
                      driver_s=0.0)
    return Fit(run=Path("synthetic"), steps=[step], groups=[group], groups_per_step=groups_per_step, group_size=2,
               threads=1, max_seqs=256, rollout_workers=1, verifiers=4, iteration_s=rollout_s / 100, token_s=0.0, engine_r2=1.0,
               train_fixed_s=0.0, train_token_s=train_s / 100, train_r2=0.0, train_linear=False)


def shape(**kw) -> Shape:
    return Shape(**{"workers": 1, "verifiers": 4, "ranks": 1, "groups_per_step": 2, **kw})


def test_sync_step_is_rollout_plus_train_and_the_idle_shares_add_up():
    fit, sh = fixed_fit(1.0, 2.0), shape()
    result = run_schedule(plan_steps(fit, sh, 10, seed=0), sh, None)
    assert result.wall_s == pytest.approx(10 * 3.0)
    # one worker, always decoding while it rolls out: what the trainer does not use, the rollout does
    assert result.busy["rollout"] == pytest.approx(1 / 3) and result.busy["trainer"] == pytest.approx(2 / 3)
    assert result.idle("rollout") + result.idle("trainer") == pytest.approx(1.0)
    assert result.steps_per_hour == pytest.approx(3600 / 3.0)


@pytest.mark.parametrize(("rollout_s", "train_s"), [(1.0, 2.0), (2.0, 1.0)])
def test_async_overlaps_to_the_slower_side_after_the_first_rollout(rollout_s, train_s):
    fit, sh = fixed_fit(rollout_s, train_s), shape()
    steps = 20
    plans = plan_steps(fit, sh, steps, seed=0)
    for k in (1, 2):
        wall = run_schedule(plans, sh, k).wall_s
        # the slower side sets the pace; a train step waits for the draw of the step k ahead, so the
        # first one follows k rollouts and the last k follow the last rollout
        assert wall == pytest.approx(max(k * rollout_s + steps * train_s, steps * rollout_s + k * train_s))
        assert wall / steps == pytest.approx(max(rollout_s, train_s), rel=0.1)
    assert run_schedule(plans, sh, 0).wall_s == pytest.approx(run_schedule(plans, sh, None).wall_s)


def test_colocated_lanes_sharing_their_cores_gain_nothing_from_async():
    fit = fixed_fit(1.0, 2.0)
    sh = shape(cores=2, rollout_demand=2, train_demand=2)  # both lanes want both cores: half speed together
    assert sh.overlap_speed() == (0.5, 0.5)
    plans = plan_steps(fit, sh, 10, seed=0)
    assert run_schedule(plans, sh, 1).wall_s == pytest.approx(run_schedule(plans, sh, None).wall_s)
    roomy = shape(cores=4, rollout_demand=2, train_demand=2)
    assert run_schedule(plans, roomy, 1).wall_s == pytest.approx(1.0 + 10 * 2.0)
    # a rollout with verifier processes (demand 3) beside a one-thread trainer on 2 cores: the rollout keeps
    # 1.5 of the 2 cores it had alone, the trainer 0.5 of its 1
    assert shape(cores=2, rollout_demand=3, train_demand=1).overlap_speed() == pytest.approx((0.75, 0.5))


def test_engine_shares_its_iterations_over_running_sequences():
    a, b = 0.01, 0.001
    short, long = Episode(1, 10, 0, 0.0, 0.5), Episode(1, 20, 0, 0.0, 0.25)
    done, busy, last = simulate_worker([Group(prompt=0, episodes=(short, long))], a, b, max_seqs=8)
    t1 = 10 * (a + 2 * b)  # both decode for 10 iterations, then the long one alone for 10 more
    assert [d for d, _ in done] == pytest.approx([t1, t1 + 10 * (a + b)])
    assert busy == pytest.approx(last) and [v for _, v in done] == [0.5, 0.25]
    # one sequence at a time: each waits for the one before it
    done, _, _ = simulate_worker([Group(prompt=0, episodes=(short, long))], a, b, max_seqs=1)
    assert [d for d, _ in done] == pytest.approx([10 * (a + b), 30 * (a + b)])
    # a group's prompt is prefilled once, stalling the engine for its tokens
    done, _, _ = simulate_worker([Group(prompt=100, episodes=(short,))], a, b, max_seqs=8)
    assert done[0][0] == pytest.approx(100 * b + 10 * (a + b))


def test_a_multi_turn_episode_leaves_the_engine_for_its_tool_calls():
    a = 0.01
    ep = Episode(turns=3, tokens=30, observed=0, tool_s=1.0, verify_s=0.0)  # 10 tokens a turn, 0.5 s a tool gap
    done, busy, _ = simulate_worker([Group(prompt=0, episodes=(ep,))], a, 0.0, max_seqs=8)
    assert done[0][0] == pytest.approx(3 * 10 * a + 2 * 0.5)
    assert busy == pytest.approx(3 * 10 * a)  # nothing decodes while the tool runs


def test_verifier_pool_and_the_long_tail_floor():
    end, busy = verify_pool([(0.0, 1.0)] * 4, slots=2)
    assert (end, busy) == (2.0, 4.0)
    # spreading a round over more workers than groups leaves the longest episode as the floor
    fit = fixed_fit(1.0, 1.0, groups_per_step=8)
    one, many = simulate_round(list(fit.steps[0].round_groups[0]), shape(workers=1), fit), \
        simulate_round(list(fit.steps[0].round_groups[0]), shape(workers=64), fit)
    assert one.seconds == pytest.approx(1.0) and many.seconds == pytest.approx(1.0)
    assert many.worker_busy_s == pytest.approx(8.0) and one.worker_busy_s == pytest.approx(1.0)
    slow = simulate_round(list(fixed_fit(1.0, 1.0, 8, verify_s=1.0).steps[0].round_groups[0]), shape(verifiers=1),
                          fixed_fit(1.0, 1.0, 8, verify_s=1.0))
    assert slow.seconds == pytest.approx(1.0 + 16 * 1.0)  # 16 episodes queue for one verifier after the batch ends


def test_ranks_divide_the_trainer_and_plans_are_a_function_of_the_seed():
    fit = fixed_fit(1.0, 4.0)
    one = plan_steps(fit, shape(ranks=1), 3, seed=0)[0]
    four = plan_steps(fit, shape(ranks=4, allreduce_s=0.5), 3, seed=0)[0]
    assert one.train_s == pytest.approx(4.0) and four.train_s == pytest.approx(1.0 + 2 * 3 / 4 * 0.5)
    varied = Fit(**{**vars(fit), "groups": [Group(0, (Episode(1, n, 0, 0.0, 0.0),) * 2) for n in (10, 50, 200)]})
    sh = shape(workers=2, groups_per_step=4)
    assert plan_steps(varied, sh, 5, seed=3) == plan_steps(varied, sh, 5, seed=3)
    assert plan_steps(varied, sh, 5, seed=3) != plan_steps(varied, sh, 5, seed=4)


def _write_run(root: Path, steps: int = 4, mode: str = "sync") -> Path:
    """A run directory as sync.py leaves it: config, metrics with the timings, one trajectory shard a step."""
    run = root / "run"
    run.mkdir()
    cfg = {"threads": 2, "model": {"path": str(root / "none")}, "pipeline": {"mode": mode},
           "rollout": {"max_seqs": 64, "verifiers": 3}, "train": {"groups_per_step": 2, "max_refill_rounds": 1},
           "domains": [{"name": "d", "group_size": 2}]}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    writer = TrajectoryWriter(run / "trajectories")
    lines, t = [], 1000.0
    for s in range(1, steps + 1):
        trajs = []
        for rnd, groups in ((0, 2), (1, 1)):  # the batch, then one refilled group
            for g in range(groups):
                task = Task(env="d@1", task_id=f"t{s}{rnd}{g}", difficulty=1, prompt=[Message("user", "q")])
                for _ in range(2):
                    trajs.append(Trajectory(task=task, messages=[], token_ids=[1] * (5 + 10 * s), prompt_len=5,
                                            loss_mask=[0] * 5 + [1] * (10 * s), logprobs=[0.0] * (5 + 10 * s),
                                            turns=1, timings={"generate_s": 0.1, "tool_s": 0.0, "verify_s": 0.02},
                                            group_id=f"s{s}a{rnd}/{g}:t"))
        writer.write(trajs, s)
        it, comp = 10.0 * s, 40.0 * s + 7 * s * s
        rollout_s, train_s = 0.5 + 0.1 * s, 0.2 + 0.01 * s
        t += rollout_s + train_s + 0.05
        lines.append({"step": s, "kind": "train", "time": t, "tokens": 40.0 * s, "rollout_s": rollout_s,
                      "train_s": train_s, "rollout/generate_s": 0.002 * it + 0.0001 * comp, "rollout/steps": it,
                      "rollout/computed_tokens": comp, "rollout/weight_update_s": 0.01,
                      "rollout_start_s": t - rollout_s - train_s - 0.05})
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return run


def test_fit_reads_a_run_directory(tmp_path):
    fit = fit_run(_write_run(tmp_path))
    assert len(fit.steps) == 4 and len(fit.groups) == 12 and fit.group_size == 2 and fit.max_seqs == 64 and fit.verifiers == 3
    assert fit.steps[0].rounds == (1.0, 0.5) and len(fit.steps[0].round_groups[1]) == 1
    assert fit.iteration_s == pytest.approx(0.002) and fit.token_s == pytest.approx(0.0001)
    assert fit.steps[1].train_s == pytest.approx(0.22 - 0.01)  # sync.py times the weight sync inside train_s
    assert fit.steps[1].driver_s == pytest.approx(0.05) and fit.steps[0].driver_s == pytest.approx(0.05)
    assert fit.train_linear and fit.train_token_s == pytest.approx(0.01 / 40)
    assert fit.verify_load == pytest.approx(sum(6 * 0.02 for _ in range(4)) / sum(0.5 + 0.1 * s for s in range(1, 5)))
    assert {e.tokens for g in fit.groups for e in g.episodes} == {10, 20, 30, 40}
    assert all(e.verify_s == 0.02 for g in fit.groups for e in g.episodes)
    assert calibrate(fit).round_residual_s != 0.0  # the synthetic rollout_s is not what the engine law gives


def test_bad_input_is_refused_with_the_fix(tmp_path):
    run = _write_run(tmp_path)
    args = dict(workers="8", groups_per_step=4, verifiers_per_worker=1, workers_per_rank=1, max_staleness=1,
                steps=2, seed=0, link_gbps=100.0, against=[], cores=0, seeds=1)
    assert "rollout workers" in run_cluster_bench(run, **args)
    with pytest.raises(AssayError, match="--workers takes positive"):
        run_cluster_bench(run, **{**args, "workers": "8,0"})
    with pytest.raises(AssayError, match="--groups-per-step must be at least 1"):
        run_cluster_bench(run, **{**args, "groups_per_step": 0})
    for f in (run / "trajectories").glob("*.parquet"):
        f.unlink()
    with pytest.raises(AssayError, match="no trajectories.*RL run"):
        run_cluster_bench(run, **args)
    (run / "metrics.jsonl").unlink()
    with pytest.raises(AssayError, match="metrics.jsonl not found"):
        run_cluster_bench(run, **args)
    other = tmp_path / "async"
    other.mkdir()
    with pytest.raises(AssayError, match="fit from a synchronous run"):
        run_cluster_bench(_write_run(other, mode="async"), **args)


def test_cli_names_the_error_and_exits_non_zero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "assay.cli", "bench", "cluster", str(tmp_path), "--workers", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--workers takes positive" in proc.stderr
