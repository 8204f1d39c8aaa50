import threading
import time

import pytest
import torch
from agent_fakes import FakeEpisode, OnlineScripted, ScriptedBackend, calc_task, reference, turn

from assay.agent.loop import run_episodes
from assay.agent.render import assistant_ids, prompt_ids, sft_example
from assay.core.config import ModelConfig
from assay.core.modeling import build_model
from assay.core.types import OK, SANDBOX_ERROR, VERIFIER_ERROR, Message, Observation, Reward, ToolCall
from assay.rollout.base import SamplingParams
from assay.rollout.hf import HFBackend

PARAMS = SamplingParams(max_tokens=64)


def script_of(tok, task, messages):
    return {tuple(prompt_ids(tok, task)): [turn(tok, m) for m in messages if m.role == "assistant"]}


def test_loop_replays_reference_token_exact_like_sft(tok):
    task = calc_task(12, 30)
    ref = reference(task)
    backend = ScriptedBackend(script_of(tok, task, ref), version=4)
    ep = FakeEpisode(task)
    [traj] = run_episodes(backend, [(task, ep)], tok, PARAMS, max_turns=4, max_context=512)

    ids, mask = sft_example(tok, task, ref)
    assert traj.token_ids == ids and traj.loss_mask == mask
    # hand-checked positions: prompt | turn 1 (sampled) | tool output | turn 2 (sampled)
    p, a1 = len(prompt_ids(tok, task)), len(assistant_ids(tok, ref[0]))
    a2 = len(assistant_ids(tok, ref[2]))
    o = len(ids) - p - a1 - a2
    assert traj.prompt_len == p
    assert mask == [0] * p + [1] * a1 + [0] * o + [1] * a2
    assert traj.logprobs == [0.0] * p + [-0.01 * (i + 1) for i in range(a1)] + [0.0] * o + [
        -0.01 * (i + 1) for i in range(a2)
    ]
    assert tok.decode(ids[p + a1 : p + a1 + o], skip_special_tokens=False) == (
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )
    assert traj.completion_tokens == a1 + a2

    assert traj.messages == task.prompt + ref
    assert ep.calls == [ToolCall("calc", {"expression": "12+30"})]
    assert ep.verified == traj.messages
    assert (traj.reward, traj.passed, traj.reward_info) == (1.0, True, {"answer": "Answer: 42"})
    assert (traj.turns, traj.tool_errors, traj.finish_reason, traj.status) == (2, 0, "stop", OK)
    assert traj.env_hash == "hash-fakecalc-1" and traj.policy_version == 4
    assert set(traj.timings) == {"generate_s", "tool_s", "verify_s"}
    # the second request continued the first token for token: never re-tokenized
    assert backend.requests[1].prompt_ids == ids[: p + a1 + o]
    assert backend.requests[0].params.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]


def test_all_active_episodes_share_one_generate_call_per_turn(tok):
    tasks = [calc_task(1, 1), calc_task(2, 2), calc_task(3, 3)]
    call = lambda t: Message("assistant", "", [ToolCall("calc", {"expression": t.task_id})])  # noqa: E731
    scripts = {}
    for k, t in enumerate(tasks):  # episode k makes k tool calls, then answers
        turns = [call(t)] * k + [Message("assistant", f"Answer: {t.payload['answer']}")]
        scripts.update(script_of(tok, t, turns))
    backend = ScriptedBackend(scripts)
    trajs = run_episodes(backend, [(t, FakeEpisode(t)) for t in tasks], tok, PARAMS, max_turns=5, max_context=512)
    assert backend.batches == [3, 2, 1]
    assert [t.turns for t in trajs] == [1, 2, 3]
    assert all(t.passed for t in trajs)
    assert [t.task.task_id for t in trajs] == ["1+1", "2+2", "3+3"]


def test_parse_errors_and_invalid_calls_are_tool_errors(tok):
    task = calc_task(2, 3)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    broken = tok.encode('<tool_call>{"name":"calc","arguments":{', add_special_tokens=False)  # no </tool_call>
    bad_schema = Message("assistant", "", [ToolCall("calc", {"expression": 5})])
    unknown = Message("assistant", "", [ToolCall("sum", {"a": 2})])
    env_error = Message("assistant", "", [ToolCall("calc", {"expression": "two+3"})])
    answer = Message("assistant", "Answer: 5")
    backend = ScriptedBackend({tuple(prompt_ids(tok, task)): [
        (broken + [im_end], "stop"), turn(tok, bad_schema), turn(tok, unknown), turn(tok, env_error), turn(tok, answer),
    ]})
    ep = FakeEpisode(task)
    [traj] = run_episodes(backend, [(task, ep)], tok, PARAMS, max_turns=6, max_context=1024)
    assert traj.tool_errors == 4 and traj.turns == 5
    assert traj.passed and traj.finish_reason == "stop"
    assert ep.calls == [ToolCall("calc", {"expression": "two+3"})]  # only the valid call reached the episode
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools[0].startswith("error: tool call 1:") and "without a closing" in tools[0]
    assert tools[1] == "error: calc: invalid expression: 5 is not of type 'string'"
    assert tools[2] == "error: unknown tool 'sum'; known tools: calc"
    assert tools[3] == "error: expected a+b"
    assert traj.messages[2] == Message("assistant", '<tool_call>{"name":"calc","arguments":{', [])  # raw text kept


def test_max_turns_stops_and_still_verifies(tok):
    task = calc_task(4, 4)
    call = Message("assistant", "", [ToolCall("calc", {"expression": "4+4"})])
    backend = ScriptedBackend(script_of(tok, task, [call] * 5))
    ep = FakeEpisode(task)
    [traj] = run_episodes(backend, [(task, ep)], tok, PARAMS, max_turns=2, max_context=1024)
    assert (traj.finish_reason, traj.turns, traj.passed, traj.status) == ("max_turns", 2, False, OK)
    assert ep.verified == traj.messages and len(ep.calls) == 2  # the last turn's call ran, its output is recorded
    assert traj.messages[-1] == Message("tool", "8", name="calc")
    assert traj.loss_mask[-1] == 1  # but no tokens follow the last sampled <|im_end|>


def test_time_limit_stops_after_the_turn_that_crosses_it_and_still_verifies(tok):
    task = calc_task(4, 4)
    call = Message("assistant", "", [ToolCall("calc", {"expression": "4+4"})])

    class SlowEpisode(FakeEpisode):
        def step(self, c):
            time.sleep(0.05)
            return super().step(c)

    backend = ScriptedBackend(script_of(tok, task, [call] * 5))
    ep = SlowEpisode(task)
    [traj] = run_episodes(backend, [(task, ep)], tok, PARAMS, max_turns=5, max_context=1024, time_limit_s=0.01)
    assert (traj.finish_reason, traj.turns, traj.passed, traj.status) == ("time_limit", 1, False, OK)
    assert ep.verified == traj.messages and len(ep.calls) == 1
    [unlimited] = run_episodes(ScriptedBackend(script_of(tok, task, [call] * 5)), [(task, FakeEpisode(task))], tok,
                               PARAMS, max_turns=5, max_context=1024, time_limit_s=60)
    assert (unlimited.finish_reason, unlimited.turns) == ("max_turns", 5)
    assert tok.decode(traj.token_ids[-1:], skip_special_tokens=False) == "<|im_end|>"


def test_length_truncation_is_verified_without_acting(tok):
    task = calc_task(1, 2)
    long_text = tok.encode("Answer: 3 because one plus two is three", add_special_tokens=False)
    backend = ScriptedBackend({tuple(prompt_ids(tok, task)): [(long_text, "length")]})
    ep = FakeEpisode(task, reward=Reward(0.5, False, details={"partial": True}))
    [traj] = run_episodes(backend, [(task, ep)], tok, SamplingParams(max_tokens=4), max_turns=3, max_context=1024)
    assert traj.finish_reason == "length" and traj.turns == 1
    assert traj.completion_tokens == 4 and traj.loss_mask[-4:] == [1] * 4
    assert ep.verified is not None and (traj.reward, traj.passed) == (0.5, False)


def test_context_limit(tok):
    task = calc_task(6, 7)
    ref = reference(task)
    p, a1 = len(prompt_ids(tok, task)), len(assistant_ids(tok, ref[0]))
    # room for the first turn but not for the tool output after it
    backend = ScriptedBackend(script_of(tok, task, ref))
    [traj] = run_episodes(backend, [(task, FakeEpisode(task))], tok, PARAMS, max_turns=4, max_context=p + a1 + 3)
    assert traj.finish_reason == "context" and traj.turns == 1 and len(traj.token_ids) == p + a1
    # the turn itself is cut by the context: max_tokens shrinks to the room left
    backend = ScriptedBackend(script_of(tok, task, ref))
    [traj] = run_episodes(backend, [(task, FakeEpisode(task))], tok, PARAMS, max_turns=4, max_context=p + 5)
    assert backend.requests[0].params.max_tokens == 5
    assert traj.finish_reason == "context" and len(traj.token_ids) == p + 5
    # a prompt that does not fit at all never reaches the backend
    backend = ScriptedBackend(script_of(tok, task, ref))
    [traj] = run_episodes(backend, [(task, FakeEpisode(task))], tok, PARAMS, max_turns=4, max_context=p)
    assert traj.finish_reason == "context" and traj.turns == 0 and backend.batches == []


def test_infrastructure_failures_are_statuses_not_rewards(tok):
    task = calc_task(1, 1)
    ref = reference(task)
    sandbox_down = FakeEpisode(task, step_obs=Observation("", status=SANDBOX_ERROR))
    bad_verifier = FakeEpisode(task, reward=Reward(1.0, True, status=VERIFIER_ERROR))

    class Raising(FakeEpisode):
        def verify(self, final):
            raise RuntimeError("boom")

    raising = Raising(task)
    [(key, (call, answer))] = script_of(tok, task, ref).items()
    # the three share one prompt, so one script serves them in request order: three calls, then two answers
    backend = ScriptedBackend({key: [call, call, call, answer, answer]})
    items = [(task, sandbox_down), (task, bad_verifier), (task, raising)]
    t1, t2, t3 = run_episodes(backend, items, tok, PARAMS, max_turns=4, max_context=1024)
    assert (t1.status, t1.finish_reason, t1.reward) == (SANDBOX_ERROR, "error", 0.0)
    assert sandbox_down.verified is None
    assert (t2.status, t2.reward, t2.passed) == (VERIFIER_ERROR, 0.0, False)
    assert t3.status == VERIFIER_ERROR and t3.reward_info["error"] == "episode.verify raised RuntimeError: boom"
    assert [e.closed for e in (sandbox_down, bad_verifier, raising)] == [1, 1, 1]  # closed on every path


def test_a_verifier_past_its_timeout_is_an_infrastructure_failure_and_closes_when_it_returns(tok):
    task = calc_task(2, 2)
    release = threading.Event()

    class Hanging(FakeEpisode):
        def verify(self, final):
            release.wait(30)
            return super().verify(final)

    hanging, prompt = Hanging(task), FakeEpisode(task)
    [(key, (call, answer))] = script_of(tok, task, reference(task)).items()
    backend = ScriptedBackend({key: [call, call, answer, answer]})
    t0 = time.perf_counter()
    stuck, fine = run_episodes(backend, [(task, hanging), (task, prompt)], tok, PARAMS, max_turns=4, max_context=1024,
                               verify_timeout_s=0.2)
    assert time.perf_counter() - t0 < 10  # the loop did not wait for the hung verifier
    assert (stuck.status, stuck.reward, stuck.passed) == (VERIFIER_ERROR, 0.0, False)
    assert "verify_timeout_s" in stuck.reward_info["error"]
    assert (fine.status, fine.passed, prompt.closed) == (OK, True, 1)
    assert hanging.closed == 0  # still verifying: its sandbox stays with it ...
    release.set()
    for _ in range(100):
        if hanging.closed:
            break
        time.sleep(0.05)
    assert hanging.closed == 1  # ... and it is closed once, when the verifier returns


def test_hf_backend_trajectories_carry_exact_behaviour_logprobs(tok):
    torch.manual_seed(0)
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    model = build_model(cfg, tok)
    backend = HFBackend(model, tok)
    tasks = [calc_task(1, 2), calc_task(1, 2), calc_task(30, 4)]  # a group of two shares its task
    params = SamplingParams(temperature=0.8, max_tokens=10, seed=0)
    trajs = run_episodes(backend, [(t, FakeEpisode(t)) for t in tasks], tok, params, max_turns=2, max_context=256)
    for t in trajs:
        assert len(t.token_ids) == len(t.loss_mask) == len(t.logprobs)
        assert t.finish_reason in {"stop", "length", "max_turns", "context"} and t.status == OK
        with torch.no_grad():
            logits = model(torch.tensor([t.token_ids])).logits[0, :-1].float() / 0.8
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None]).squeeze(-1)
        m = torch.tensor(t.loss_mask[1:], dtype=torch.bool)
        assert m.any()
        assert torch.allclose(logp[m], torch.tensor(t.logprobs[1:])[m], atol=1e-4)
        assert all(lp == 0.0 for lp, k in zip(t.logprobs, t.loss_mask, strict=True) if k == 0)
    assert trajs[0].token_ids != trajs[1].token_ids  # the group's samples are separate draws


class _Broken(RuntimeError):
    pass


class _FailsOnSecondTurn(OnlineScripted):
    """Gives every episode a tool call, then fails, through either loop's entry point."""

    def __init__(self, scripts):
        super().__init__(scripts)
        self.calls = 0
        self.has_unfinished = False

    def generate(self, requests):
        self.calls += 1
        if self.calls > 1:
            raise _Broken("the backend went away")
        return super().generate(requests)


@pytest.mark.parametrize("online", [False, True])
def test_every_episode_is_closed_once_when_the_backend_fails(tok, online):
    from assay.agent.loop import EpisodeJob, run_episodes_online

    tasks = [calc_task(1, 1), calc_task(2, 2)]
    call = lambda t: Message("assistant", "", [ToolCall("calc", {"expression": "1+1"})])  # noqa: E731
    scripts = {}
    for t in tasks:
        scripts.update(script_of(tok, t, [call(t), Message("assistant", "Answer: 2")]))
    backend = _FailsOnSecondTurn(scripts)
    episodes = [FakeEpisode(t) for t in tasks]
    with pytest.raises(_Broken):
        if online:
            run_episodes_online(backend, [EpisodeJob(t, e, PARAMS, 5, 512, i) for i, (t, e) in
                                          enumerate(zip(tasks, episodes, strict=True))], tok)
        else:
            run_episodes(backend, list(zip(tasks, episodes, strict=True)), tok, PARAMS, max_turns=5, max_context=512)
    assert [e.closed for e in episodes] == [1, 1]
    assert all(e.verified is None for e in episodes)


def test_a_finished_episode_is_closed_once(tok):
    t = calc_task(1, 1)
    episode = FakeEpisode(t)
    run_episodes(ScriptedBackend(script_of(tok, t, [Message("assistant", "Answer: 2")])), [(t, episode)], tok,
                 PARAMS, max_turns=5, max_context=512)
    assert episode.closed == 1


class _CalcEnv:
    """Starts FakeEpisodes (recording them), failing on the `fail_at`-th start if asked."""

    def __init__(self, fail_at=None):
        self.started: list[FakeEpisode] = []
        self.fail_at = fail_at

    def start(self, task, sandbox):
        if len(self.started) == self.fail_at:
            raise RuntimeError("the environment could not start an episode")
        self.started.append(FakeEpisode(task))
        return self.started[-1]


def _domains(*names):
    from assay.core.config import DomainConfig

    return {n: DomainConfig(name=n, env="fakecalc", group_size=2, max_new_tokens=64) for n in names}


def test_collect_closes_the_episodes_it_started_when_one_cannot_start(tok):
    from dataclasses import replace

    from assay.agent.groups import collect

    env = _CalcEnv(fail_at=3)
    tasks = [replace(calc_task(i, i), domain="math") for i in range(1, 4)]
    with pytest.raises(RuntimeError, match="could not start"):
        collect(ScriptedBackend({}), tok, {"math": env}, _domains("math"), tasks, samples=2, temperature=1.0)
    assert [e.closed for e in env.started] == [1, 1, 1]


def test_collect_closes_every_domains_episodes_when_the_first_domains_rollout_fails(tok):
    from dataclasses import replace

    from assay.agent.groups import collect

    envs = {"a": _CalcEnv(), "b": _CalcEnv()}
    tasks = [replace(calc_task(1, 1), domain="a"), replace(calc_task(2, 2), domain="b")]
    backend = _FailsOnSecondTurn({})
    backend.calls = 1  # its next generate call fails: domain a's first turn
    with pytest.raises(_Broken):
        collect(backend, tok, envs, _domains("a", "b"), tasks, samples=2, temperature=1.0)
    assert [e.closed for env in envs.values() for e in env.started] == [1, 1, 1, 1]


def test_a_close_that_raises_does_not_keep_the_others_open(tok):
    from assay.envs.episode import close_episodes

    class Stuck(FakeEpisode):
        def close(self):
            super().close()
            raise OSError("the sandbox would not close")

    t = calc_task(1, 1)
    episodes = [Stuck(t), FakeEpisode(t)]
    with pytest.raises(OSError, match="would not close"):
        close_episodes(episodes)
    assert [e.closed for e in episodes] == [1, 1]
