"""`assay replay`: a log written by the tiny policy, replayed on itself (no deterministic choice differs) and
on an untrained policy (differences found and counted)."""

import openai
from serve_helpers import CALC, MODEL
from typer.testing import CliRunner

from assay.cli import app
from assay.core.modeling import save_model
from assay.serve.replay import format_report, replay
from assay.serve.session_log import read_sessions

TOOLS = [{"type": "function", "function": CALC.to_json()}]


def ask(a: int, b: int) -> list[dict]:
    return [{"role": "system", "content": "Use the calc tool."}, {"role": "user", "content": f"What is {a}+{b}?"}]


def make_log(logged, url: str) -> None:
    server, log = logged(url)
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    for a in (2, 12, 30):
        c.chat.completions.create(model=MODEL, messages=ask(a, 5), tools=TOOLS, temperature=0, max_tokens=30)
    first = c.chat.completions.create(model=MODEL, messages=ask(4, 4), tools=TOOLS, temperature=0, max_tokens=30)
    if first.choices[0].message.tool_calls:  # the conversation goes on with the tool's result, as recorded
        call = first.choices[0].message.tool_calls[0]
        c.chat.completions.create(model=MODEL, tools=TOOLS, temperature=0, max_tokens=20, messages=[
            *ask(4, 4), first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "8"}])
    list(c.chat.completions.create(model=MODEL, messages=ask(7, 1), temperature=0, max_tokens=20, stream=True))
    c.completions.create(model=MODEL, prompt=["What is", "Use the"], max_tokens=8, n=2, temperature=1.0, seed=11)
    c.completions.create(model=MODEL, prompt="What is", max_tokens=8, temperature=1.0)  # unseeded
    log.close()


def test_replay_on_the_logging_policy_reproduces_every_deterministic_choice(logged, policy, tok, tmp_path):
    make_log(logged, str(tmp_path / "log"))
    sessions = read_sessions(str(tmp_path / "log"))
    report = replay(sessions, policy, tok)
    assert report.choices == len(sessions) >= 11 and report.deterministic == report.choices - 1
    assert report.differing(True) == 0, format_report(report)
    assert "0 of" in format_report(report)


def test_replay_on_another_policy_finds_and_counts_the_differences(logged, babbler, tok, tmp_path):
    make_log(logged, str(tmp_path / "log"))
    sessions = read_sessions(str(tmp_path / "log"))
    report = replay(sessions, babbler, tok)
    counts = report.counts(True)
    assert report.differing(True) >= 5 and counts["text"] >= 5, format_report(report)
    assert counts["tool_calls"] >= 1  # the trained policy called calc; the babbler does not
    assert sum(counts.values()) == sum(len(d.kinds) for d in report.differences if d.deterministic)

    save_model(babbler, tok, tmp_path / "babbler")
    out = CliRunner().invoke(app, ["replay", str(tmp_path / "log"), "--policy", str(tmp_path / "babbler"),
                                   "--show", "3"])
    assert out.exit_code == 0, out.output
    assert f"{report.choices} choices replayed" in out.output
    assert f"deterministic: {report.differing(True)} of {report.deterministic} differ" in out.output
    assert "more (--show N)" in out.output and "logged:" in out.output


def test_replay_refuses_what_is_no_served_log(policy, tok):
    import pytest

    from assay.core.errors import AssayError
    from assay.core.types import Message, Task, Trajectory

    t = Trajectory(Task("calc@1", "x", 0, [Message("user", "hi")]), [], [1], [0], [0.0], 1)
    with pytest.raises(AssayError, match="no served request"):
        replay([t], policy, tok)
