import json
import random

import pytest
from mixer_fakes import CountingEnv, task_of, traj

from assay.core.config import DifficultyRange, DomainConfig, MixerConfig
from assay.core.errors import AssayError, CheckpointError
from assay.core.types import SANDBOX_ERROR
from assay.mixer.mixer import DomainMixer, apply_floor
from assay.mixer.stats import DomainStep, seesaw_warnings


def domain(name: str, weight: float = 1.0, lo: int = 1, hi: int = 3, start: int = 1, acceptance: float = 0.8,
           **kw) -> DomainConfig:
    return DomainConfig(name=name, env=name, weight=weight, **kw,
                        difficulty=DifficultyRange(min=lo, max=hi, start=start, acceptance=acceptance))


def mixer(domains: list[DomainConfig], seed: int = 0, window: int | None = None, **cfg) -> DomainMixer:
    if window is not None:  # every domain's curriculum window
        domains = [d.model_copy(update={"difficulty": d.difficulty.model_copy(update={"window": window})})
                   for d in domains]
    envs = {d.name: CountingEnv(d.name) for d in domains}
    return DomainMixer(domains, MixerConfig(**cfg), envs, seed)


def test_static_ratios_and_exact_counts():
    m = mixer([domain("a", 3), domain("b", 1), domain("c", 1)], strategy="static")
    assert m.ratios == {"a": 0.6, "b": 0.2, "c": 0.2}
    tasks = m.sample(10)
    assert sorted(t.domain for t in tasks) == ["a"] * 6 + ["b"] * 2 + ["c"] * 2
    # each task is regenerated exactly from its stored seed at the curriculum's level
    for t in tasks:
        again = m.envs[t.domain].generate(random.Random(t.seed), 1)
        assert (again.task_id, t.difficulty) == (t.task_id, 1)
    assert len({t.seed for t in tasks}) == 10


def test_a_draw_can_be_limited_to_some_domains_by_their_ratios():
    m = mixer([domain("a", 3), domain("b", 1), domain("c", 1)], strategy="static")
    assert sorted(t.domain for t in m.sample(8, {"b", "c"})) == ["b"] * 4 + ["c"] * 4
    assert sorted(t.domain for t in m.sample(4, {"a"})) == ["a"] * 4
    assert m.sample(5, set()) == [] and m.ratios == {"a": 0.6, "b": 0.2, "c": 0.2}


def test_sampling_is_deterministic_by_seed():
    ds = [domain("a"), domain("b", 2)]
    ids = [[t.task_id for t in mixer(ds, seed=s).sample(7)] for s in (5, 5, 6)]
    assert ids[0] == ids[1] != ids[2]


def test_update_stats_by_hand_and_infra_errors_excluded():
    m = mixer([domain("a"), domain("b")], strategy="static", window=8)
    t = task_of("a")
    trajs = [
        traj(t, True, mask=(0, 1, 1), finish="stop", tool_errors=0),
        traj(t, False, mask=(0, 0, 1, 1, 1), finish="length", tool_errors=1),
        traj(t, True, mask=(1, 1, 1, 1), finish="context", tool_errors=2),
        traj(t, False, status=SANDBOX_ERROR, mask=(1,) * 9, finish="length", tool_errors=7),
    ]
    stats = m.update(trajs)
    a = stats.domains["a"]
    assert a == DomainStep(
        n=4,
        infra_errors=1,
        reward_mean=2 / 3,
        pass_rate=2 / 3,
        completion_len=3.0,
        truncation_rate=2 / 3,
        tool_errors=1.0,
        difficulty=1,
        ratio=0.5,
        signal_share=1.0,  # one group, rewards 1, 0, 1
        degraded_calls=0.0,  # malformed_rate and retry_success_rate None: no tool-call turns, no retries
        fallback_calls=0.0,
        peak_context=0.0, compactions=0.0, memory_calls=0.0,
    )
    assert stats.domains["b"].n == 0 and stats.domains["b"].pass_rate is None
    assert m.curricula["a"].window == [True, False, True]  # the infra failure never reaches the curriculum
    metrics = stats.metrics()
    assert metrics["domain/a/pass_rate"] == 2 / 3 and "domain/b/pass_rate" not in metrics
    assert metrics["domain/b/ratio"] == 0.5


def test_results_from_another_level_do_not_count():
    m = mixer([domain("a")], window=8)
    m.update([traj(task_of("a", difficulty=2), True), traj(task_of("a", difficulty=1), False)])
    assert m.curricula["a"].window == [False]


def test_curriculum_promotes_through_update_and_sample_follows():
    m = mixer([domain("a", acceptance=0.75)], window=4)
    tasks = m.sample(4)
    assert {t.difficulty for t in tasks} == {1}
    m.update([traj(t, True) for t in tasks])
    assert m.curricula["a"].level == 2
    assert {t.difficulty for t in m.sample(3)} == {2}


def test_unknown_domain_and_bad_config_raise():
    m = mixer([domain("a")])
    with pytest.raises(AssayError, match="unknown domain 'zzz'"):
        m.update([traj(task_of("zzz"), True)])
    with pytest.raises(AssayError, match="no environment"):
        DomainMixer([domain("a")], MixerConfig(), {}, 0)
    with pytest.raises(AssayError, match="lacks"):
        DomainMixer([domain("a", hi=5)], MixerConfig(), {"a": CountingEnv("a")}, 0)
    with pytest.raises(CheckpointError, match="domains"):
        mixer([domain("b")]).load_state_dict(m.state_dict())


def test_apply_floor_by_hand():
    out = apply_floor({"a": 0.7, "b": 0.25, "c": 0.05}, 0.1)
    assert out["c"] == 0.1
    assert out["a"] == pytest.approx(0.9 * 0.7 / 0.95, abs=1e-15)
    assert out["b"] == pytest.approx(0.9 * 0.25 / 0.95, abs=1e-15)
    # two below the floor: the second is only found after the first was lifted
    out = apply_floor({"a": 0.91, "b": 0.08, "c": 0.01}, 0.1)
    assert out == pytest.approx({"a": 0.8, "b": 0.1, "c": 0.1}, abs=1e-15)
    assert apply_floor({"a": 1.0, "b": 0.0}, 0.9) == {"a": 0.5, "b": 0.5}  # floor capped at 1/n


def run_updates(m: DomainMixer, rates: dict[str, list[float]], level: dict[str, int] | None = None) -> None:
    """One update per index: domain d gets 8 trajectories of which rates[d][i]·8 pass."""
    for i in range(len(next(iter(rates.values())))):
        batch = []
        for d, rs in rates.items():
            k = round(rs[i] * 8)
            t = task_of(d, difficulty=(level or {}).get(d, 1))
            batch += [traj(t, j < k) for j in range(8)]
        m.update(batch)


def test_adaptive_moves_towards_progress_away_from_saturated_and_keeps_floor():
    ds = [domain("prog"), domain("sat", lo=1, hi=1), domain("stuck")]
    m = mixer(ds, strategy="adaptive", floor=0.15, progress_window=2, smoothing=0.5, window=1000)
    start = dict(m.ratios)
    assert start == pytest.approx({"prog": 1 / 3, "sat": 1 / 3, "stuck": 1 / 3})
    run_updates(m, {"prog": [0.0, 0.25, 0.5, 0.75], "sat": [1.0] * 4, "stuck": [0.0] * 4})
    # prog: |mean(.5,.75) - mean(0,.25)| + p(1-p) at p=.625; sat and stuck: 0
    assert m.scores() == pytest.approx({"prog": 0.5 + 0.625 * 0.375, "sat": 0.0, "stuck": 0.0})
    assert m.ratios["prog"] > 0.6 > start["prog"]
    assert m.ratios["sat"] < start["sat"] and m.ratios["stuck"] < start["stuck"]
    assert min(m.ratios.values()) >= 0.15 - 1e-12
    assert sum(m.ratios.values()) == pytest.approx(1.0, abs=1e-12)
    counts = [t.domain for t in m.sample(20)]
    assert counts.count("prog") >= 12 and counts.count("sat") >= 3 and counts.count("stuck") >= 3


def test_saturated_domain_scores_less_than_same_rate_below_max():
    ds = [domain("top", lo=1, hi=1, acceptance=0.8), domain("mid", acceptance=0.95)]
    m = mixer(ds, strategy="adaptive", progress_window=2, window=1000)
    run_updates(m, {"top": [0.875] * 3, "mid": [0.875] * 3})
    assert m.scores() == {"top": 0.875 * 0.125 * 0.1, "mid": 0.875 * 0.125}
    assert m.ratios["mid"] > m.ratios["top"]


def test_weight_scales_adaptive_and_zero_weight_is_off():
    ds = [domain("a", 2), domain("b", 1), domain("off", 0)]
    m = mixer(ds, strategy="adaptive", floor=0.1, smoothing=1.0)
    assert m.ratios == pytest.approx({"a": 2 / 3, "b": 1 / 3, "off": 0.0})
    run_updates(m, {"a": [0.5], "b": [0.5], "off": [0.5]})  # equal scores: the weights decide
    assert m.ratios == pytest.approx({"a": 2 / 3, "b": 1 / 3, "off": 0.0})
    assert all(t.domain != "off" for t in m.sample(30))


def test_seesaw_warning_names_both_domains():
    m = mixer([domain("a"), domain("b"), domain("c")], progress_window=2, seesaw_margin=0.15, window=1000)
    run_updates(m, {"a": [0.75, 0.75, 0.25], "b": [0.25, 0.25, 0.75], "c": [0.5] * 3})
    assert m.seesaw() == []  # not yet a full 2 x window span
    stats = m.update(
        [traj(task_of("a"), j < 2) for j in range(8)]
        + [traj(task_of("b"), j < 6) for j in range(8)]
        + [traj(task_of("c"), j < 4) for j in range(8)]
    )
    assert len(stats.warnings) == 1
    assert "a pass rate fell by 0.50" in stats.warnings[0] and "b rose by 0.50" in stats.warnings[0]


def test_seesaw_ignores_drop_after_promotion_and_small_moves():
    hist = {"a": [(0.9, 1), (0.9, 1), (0.3, 2), (0.3, 2)], "b": [(0.2, 1), (0.2, 1), (0.8, 1), (0.8, 1)]}
    assert seesaw_warnings(hist, window=2, margin=0.15) == []
    hist["a"] = [(0.9, 2), (0.9, 2), (0.3, 2), (0.3, 2)]
    assert len(seesaw_warnings(hist, window=2, margin=0.15)) == 1
    assert seesaw_warnings(hist, window=2, margin=0.7) == []


def simulate(m: DomainMixer, steps: int) -> list:
    """Sample, fake outcomes that depend only on each task's seed and level, update."""
    log = []
    for _ in range(steps):
        tasks = m.sample(6)
        batch = []
        for t in tasks:
            p = {"a": 0.9, "b": 0.5, "c": 0.2}[t.domain] / t.difficulty
            rng = random.Random(t.seed)
            batch += [traj(t, rng.random() < p, group=str(t.seed)) for _ in range(4)]
        stats = m.update(batch)
        log.append(([(t.task_id, t.seed, t.difficulty) for t in tasks], stats))
    return log


def test_exact_resume_through_json():
    ds = [domain("a"), domain("b", 2), domain("c")]
    cfg = dict(strategy="adaptive", floor=0.1, progress_window=2, window=4, smoothing=0.5)
    straight = mixer(ds, seed=16, **cfg)  # a seed whose run moves two curricula
    full = simulate(straight, 6)
    first = mixer(ds, seed=16, **cfg)
    head = simulate(first, 3)
    resumed = mixer(ds, seed=999, **cfg)  # a different seed: everything must come from the state
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = simulate(resumed, 3)
    assert head + tail == full
    assert resumed.state_dict() == straight.state_dict()
    assert any(c.level > 1 for c in straight.curricula.values())  # the run did move the curriculum


def test_signal_share_counts_groups_whose_rewards_vary():
    m = mixer([domain("a")], strategy="static", window=8)
    t = task_of("a")
    trajs = [traj(t, True, group="g1"), traj(t, False, group="g1"),  # varies
             traj(t, True, group="g2"), traj(t, True, group="g2"),  # all pass: no signal
             traj(t, False, group="g3"), traj(t, False, group="g3")]  # all fail: no signal
    assert m.update(trajs).domains["a"].signal_share == 1 / 3
    assert m.update([]).domains["a"].signal_share is None
