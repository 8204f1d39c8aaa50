"""Context handling in the agent loop (domain key agent): compaction, the memory tool, plan_execute; and the
trainer scoring every turn on exactly the context the engine was prompted with."""

import re
from dataclasses import replace

import pytest
import torch
from context_fakes import FILES, PromptPolicy, ShelfEpisode, call, read, shelf_task

from assay.agent.loop import run_episodes
from assay.core.config import AgentConfig, LossConfig, ModelConfig, TrainConfig
from assay.core.errors import AssayError
from assay.core.modeling import build_model
from assay.core.storage import trajectory_from_row, trajectory_row
from assay.core.types import Message, ToolSpec, Trajectory
from assay.rollout.base import SamplingParams
from assay.train.trainer import GRPOTrainer

PARAMS = SamplingParams(max_tokens=96)  # room for a plan call with this tokenizer
ELIDE = AgentConfig(compaction="elide_observations", keep_last=1)
ANSWER = Message("assistant", "Answer: 7+7")


def last_tool_output(prompt: str) -> str:
    return re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", prompt, re.S)[-1]


def play(tok, decide, agent: AgentConfig, max_context: int, max_turns: int = 12, model=None, secret="7+7"
         ) -> tuple[Trajectory, PromptPolicy, ShelfEpisode]:
    task = shelf_task(secret)
    ep = ShelfEpisode(task)
    policy = PromptPolicy(tok, decide, model)
    [traj] = run_episodes(policy, [(task, ep)], tok, PARAMS, max_turns=max_turns, max_context=max_context,
                          agent=agent)
    return traj, policy, ep


def reader(n: int):
    """Reads f1 .. fn, one a turn, then answers."""
    return lambda prompt, i: read(f"f{i + 1}") if i < n else ANSWER


def test_a_history_that_overflows_the_window_completes_with_compaction_and_ends_without(tok):
    off, _, _ = play(tok, reader(6), AgentConfig(), max_context=700)
    assert (off.finish_reason, off.passed, off.compactions, off.segment_starts) == ("context", False, 0, [])
    on, policy, ep = play(tok, reader(6), ELIDE, max_context=700)
    assert (on.finish_reason, on.passed) == ("stop", True) and ep.reads == [f"f{i}" for i in range(1, 7)]
    assert on.compactions >= 1 and len(on.segment_starts) == on.compactions
    # react: only a compaction starts a segment, and the first turn prompted with it comes after the turns before it
    mask = on.loss_mask
    sampled_before = [sum(1 for i in range(s) if mask[i] and (i == 0 or not mask[i - 1])) for s in on.segment_starts]
    assert on.compacted_turns == [k + 1 for k in sampled_before]
    assert on.peak_context < 700 and max(len(r.prompt_ids) for r in policy.requests) < 700
    assert off.peak_context > max(len(r.prompt_ids) for r in policy.requests[:2])
    last = policy.prompts[-1]
    assert "[read output elided: " in last and FILES["f6"] in last  # the newest result kept whole
    assert [m.content for m in on.messages if m.role == "tool"] == [FILES[f"f{i}"] for i in range(1, 7)]  # verified on
    back = trajectory_from_row(trajectory_row(on, 0))  # the run directory keeps the segments
    assert (back.segment_starts, back.peak_context, back.compactions, back.compacted_turns) == (
        on.segment_starts, on.peak_context, on.compactions, on.compacted_turns)


def test_drop_turns_sheds_whole_turns_and_a_misnamed_rule_fails_before_generating(tok):
    on, policy, _ = play(tok, reader(6), AgentConfig(compaction="drop_turns", keep_last=1), max_context=700)
    assert on.passed and on.compactions >= 1 and "elided" not in policy.prompts[-1]
    assert policy.prompts[-1].count("<|im_start|>tool") < 6
    with pytest.raises(AssayError, match="agent.compaction: 'summarize' is no compaction rule; the known ones are "
                                         "none, drop_turns, elide_observations"):
        play(tok, reader(1), AgentConfig(compaction="summarize"), max_context=700)


@pytest.mark.parametrize(("agent", "steps", "max_context"), [
    (ELIDE, 6, 700),
    (AgentConfig(mode="plan_execute"), 2, 900),
    (AgentConfig(mode="plan_execute", compaction="elide_observations", keep_last=1, memory=True), 5, 1100)],
    ids=["compaction", "plan_execute", "both"])
def test_the_trainer_scores_each_turn_on_the_ids_the_engine_was_prompted_with(tok, agent, steps, max_context):
    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                    intermediate_size=128), tok)
    if agent.mode == "plan_execute":
        decide = planner_and_executor([f"read f{i}" for i in range(1, steps + 1)] + ["answer"])
    else:
        decide = reader(steps)
    traj, policy, _ = play(tok, decide, agent, max_context=max_context, model=model)
    traj.group_id = "g"
    assert traj.passed and traj.segment_starts  # the context was re-rendered at least once
    trainer = GRPOTrainer(model, TrainConfig(micro_batch=2, loss=LossConfig(per_domain_normalize=False)))
    samples = trainer.prepare([traj])
    assert len(samples) == len(traj.segment_starts) + 1
    # every turn: prompt + what it generated is the start of one sequence the trainer scores, the generated
    # ids its only mask-1 tokens there, with the engine's logprobs
    for req, res in zip(policy.requests, policy.results, strict=True):
        p, g = list(req.prompt_ids), res.token_ids
        hits = [s.traj for s in samples if s.traj.token_ids[: len(p) + len(g)] == p + g
                and s.traj.loss_mask[len(p): len(p) + len(g)] == [1] * len(g)]
        assert len(hits) == 1, "a turn's prompt and tokens are not a sequence the trainer scores"
        assert hits[0].logprobs[len(p): len(p) + len(g)] == res.logprobs
    # and nothing else is trained on: the mask-1 tokens are exactly the generated ones
    assert sum(sum(s.traj.loss_mask) for s in samples) == sum(len(r.token_ids) for r in policy.results)
    # the trainer's own logprobs of those sequences are the engine's: no mismatch beyond float rounding ...
    # (scored beside a second member of the group with another reward: alone, its advantage is 0 and it is not run)
    def with_a_rival(t: Trajectory) -> list[Trajectory]:
        return [t, replace(t, reward=t.reward - 1.0)]

    exact = trainer.accumulate_gradients(with_a_rival(traj))["mismatch"]
    assert exact < 1e-5
    # ... where scoring the concatenation of the segments would not be
    flat = Trajectory(traj.task, traj.messages, traj.token_ids, traj.loss_mask, traj.logprobs, traj.prompt_len,
                      group_id="g")
    assert trainer.accumulate_gradients(with_a_rival(flat))["mismatch"] > max(1e-3, 100 * exact)


def test_notes_survive_compaction(tok):
    def decide(prompt, i):
        script = [read("f1"), call("note_write", key="start", text=FILES["f1"][:3]),
                  *[read(f"f{k}") for k in range(2, 7)], call("note_read", key="start")]
        return script[i] if i < len(script) else Message("assistant", f"Answer: {last_tool_output(prompt)}")

    traj, policy, _ = play(tok, decide, AgentConfig(memory=True, compaction="elide_observations", keep_last=1),
                           max_context=1300, secret="111")
    assert (traj.finish_reason, traj.passed) == ("stop", True)
    assert traj.compactions >= 1 and (traj.memory_calls, traj.memory_errors) == (2, 0)
    before_read = policy.prompts[-2]
    assert FILES["f1"] not in before_read and "[read output elided: " in before_read  # gone from the context...
    assert last_tool_output(policy.prompts[-1]) == "111"  # ... and back from the notes
    assert "note_write" in policy.prompts[0] and "note_search" in policy.prompts[0]  # offered in the tool list


def test_a_note_over_its_limit_is_an_error_observation_and_the_episode_goes_on(tok):
    script = [call("note_write", key="a", text="x" * 11), call("note_write", key="a", text="y" * 8),
              call("note_write", key="b", text="z" * 8), call("note_read", key="c"),
              call("note_search", query="Y"), ANSWER]
    traj, _, _ = play(tok, lambda p, i: script[i], AgentConfig(memory=True, note_max_chars=10, notes_max_chars=15),
                      max_context=2048)
    assert (traj.finish_reason, traj.passed, traj.status) == ("stop", True, "ok")
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert tools[0] == "error: note 'a' has 11 characters; a note holds at most 10. Nothing was saved: write a " \
                       "shorter note"
    assert tools[1].startswith("saved note 'a' (8 characters; 8 of 15 used)")
    assert tools[2].startswith("error: the notes would hold 16 characters; all notes together hold at most 15.")
    assert tools[3] == "error: no note 'c'; the notes are: a"
    assert tools[4] == "a: yyyyyyyy"
    assert (traj.memory_calls, traj.memory_errors, traj.tool_errors) == (5, 3, 3)


def test_memory_tools_clash_with_an_environments_tool_of_that_name(tok):
    task = shelf_task()
    task.tools = [*task.tools, ToolSpec("note_read", "an environment's own tool", {"type": "object"})]
    with pytest.raises(AssayError, match="already has a tool named note_read"):
        run_episodes(PromptPolicy(tok, reader(0)), [(task, ShelfEpisode(task))], tok, PARAMS, 2, 512,
                     agent=AgentConfig(memory=True))


def planner_and_executor(steps: list[str]):
    """Planner: the steps, current = its planning turn's number. Executor: does the subtask its prompt names."""
    def decide(prompt: str, i: int) -> Message:
        if "You are planning" in prompt:
            return call("plan", steps=steps, current=min(i // 2 + 1, len(steps)))
        sub = re.search(r"Current subtask \((\d+) of \d+\): (.*)\n", prompt)
        assert sub is not None, "an acting turn's prompt names its subtask"
        what = sub.group(2)
        return ANSWER if what == "answer" else read(what.split()[-1])
    return decide


def test_plan_execute_alternates_planning_and_acting_and_the_executor_sees_only_its_subtask(tok):
    steps = ["read f1", "read f2", "answer"]
    traj, policy, ep = play(tok, planner_and_executor(steps), AgentConfig(mode="plan_execute"), max_context=2048,
                            max_turns=3)
    assert (traj.finish_reason, traj.passed) == ("stop", True) and ep.reads == ["f1", "f2"]
    kinds = ["plan" if "You are planning" in p else "act" for p in policy.prompts]
    assert kinds == ["plan", "act"] * 3
    assert (traj.turns, traj.plan_turns) == (6, 3)  # planning turns are outside max_turns (3)
    for k, prompt in enumerate(policy.prompts[1::2], 1):
        assert f"Current subtask ({k} of 3): {steps[k - 1]}" in prompt
        assert "You are planning" not in prompt and "<tool_call>" not in prompt.split("Current subtask")[0]
    assert FILES["f1"] not in policy.prompts[3]  # subtask 2's turn does not carry subtask 1's history
    assert FILES["f1"] in policy.prompts[2] and FILES["f2"] in policy.prompts[4]  # the planner sees the progress
    assert len(traj.segment_starts) == traj.turns - 1  # every turn re-renders its context
    assert [m.name for m in traj.messages if m.role == "tool"] == ["plan", "read", "plan", "read", "plan"]


def test_a_bad_plan_leaves_the_plan_unchanged_and_is_a_tool_error(tok):
    script = [call("plan", steps=["read f1"], current=2), Message("assistant", "Answer: 7+7")]
    traj, policy, _ = play(tok, lambda p, i: script[i], AgentConfig(mode="plan_execute"), max_context=2048)
    assert traj.passed and traj.tool_errors == 1
    assert traj.messages[3].content == ("error: plan: current is 2, but there are 1 steps. The plan is unchanged.")
    assert "No plan yet: work on the task directly." in policy.prompts[1]
