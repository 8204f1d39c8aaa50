"""The QA gate: every built-in environment passes it, and each deliberately broken environment is
caught by the gate that exists for its flaw, with the failing task's seed."""

import json
import os
import random

import pytest
from broken_envs import (
    AcceptsAlternatives,
    AcceptsAnyNumberOfTheRightParity,
    AcceptsAnything,
    AcceptsAnyTicketsAnswer,
    AnswerAsPattern,
    AnswerContainedInExpected,
    CachesPassingReplies,
    ChecksInTheWorkspace,
    ClosesTheTicketItsReportNames,
    ConfirmsAnEmptyList,
    DebugFlag,
    DeclaresNoSecrets,
    ExamplesAreTheTests,
    FailsUnderLoad,
    ForgivesRepeatedFailures,
    GradesTheNamedProblem,
    HiddenTestsInTheWorkspace,
    JudgesTheProblemItsHeaderNames,
    LeaksTheAnswer,
    NanWithinTolerance,
    NegativeIndex,
    Nondeterministic,
    PassesRightAfterAPass,
    RarelyFlaky,
    RegradesTheLastSubmit,
    RoutesAnswersByTheirProblem,
    RunsTheWorkspaceTests,
    SharedScratchpad,
    SolutionAfterGivingUp,
    SortedTestInputs,
    TrustsTheTestSummary,
    TrustsTheTranscript,
    UnlimitedChecks,
    WorkedExample,
)

from assay.envs import get_env
from assay.envs.qa import QAConfig, run_gate
from assay.envs.qa.gate import ALPHA, GATE_VERSION, binomial_tail, cpu_contention, flake_runs
from assay.envs.qa.store import VersionNotBumped, check_version, diff, latest, previous_version, save
from assay.envs.qa.strategies import RANDOM_ANSWER_TOLERANCE
from assay.envs.registry import env_hash, env_parts, env_spec
from assay.sandbox import isolation_problem, open_sandbox

# Tests of other gates size the flake runs down (5 idle and 5 loaded): the flake tests use the default.
SMALL = QAConfig(tasks_per_level=3, repeats=2, cheat_tasks_per_level=1, noisy_samples=4, flake_rate=0.5)
TINY = QAConfig(tasks_per_level=2, repeats=1, cheat_tasks_per_level=2, noisy_samples=1, flake_rate=0.5)


def failed_gates(report):
    return {f.gate for f in report.failures}


@pytest.mark.parametrize("name", ["arith", "toolcalc", "codegen", "terminal"])
def test_builtin_environments_pass_the_gate(name):
    report = run_gate(get_env(name), SMALL)
    assert not report.failures, [f.line() for f in report.failures]
    assert all(s["reference"] == 1.0 for s in report.levels.values())
    # a 5000-digit answer is a wrong answer, not a verifier error that training would drop
    assert not any("infrastructure failure, not a reward" in w for w in report.warnings), report.warnings
    if isolation_problem() is not None and report.kind != "answer":  # hostile programs never run unisolated
        assert report.skipped and not report.cheaters and not report.passed
        pytest.skip(f"the namespace sandbox cannot run on this host: {isolation_problem()}")
    assert report.passed and report.cheaters  # and those that may pass by chance did so within chance
    assert all(c["passed"] == 0 for c in report.cheaters.values() if c["tolerance"] == 0)


def test_jsonl_passes_the_gate(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i} squared?", "answer": str(i * i)})
                              for i in range(3, 40)))
    report = run_gate(get_env("jsonl", path=str(data), matcher="numeric"), SMALL)
    assert report.passed, [f.line() for f in report.failures]


def test_a_verifier_that_accepts_anything_fails_the_null_gate():
    report = run_gate(AcceptsAnything(), SMALL)
    assert "null" in failed_gates(report)
    assert any("empty answer" in f.reason and f.seed >= 0 for f in report.failures)


def test_a_verifier_that_accepts_half_of_all_answers_fails_on_other_tasks_answers():
    report = run_gate(AcceptsAnyNumberOfTheRightParity(), SMALL)
    assert any(f.gate == "null" and "another task's answer passed" in f.reason for f in report.failures)
    assert not any("empty answer" in f.reason for f in report.failures)  # only other tasks' answers pass


def test_one_coincidence_among_few_tasks_is_chance_not_a_failure():
    assert binomial_tail(1, 3, RANDOM_ANSWER_TOLERANCE) > ALPHA  # 1 of 3: a third, but chance allows it
    assert binomial_tail(12, 24, RANDOM_ANSWER_TOLERANCE) < ALPHA


def test_a_prompt_that_leaks_the_answer_fails_the_leak_gate():
    report = run_gate(LeaksTheAnswer(), SMALL)
    assert "no leak" in failed_gates(report)
    leaks = [f.reason for f in report.failures if f.gate == "no leak"]
    assert any("Answer:" in r for r in leaks)  # the whole answer line, and its bare value too:
    assert all("Answer:" in r or "the answer's bare value stands in 100% of prompts" in r for r in leaks), leaks
    assert failed_gates(report) <= {"no leak", "cheaters"}  # copying the last value from the prompt now works too


def test_a_code_fence_the_prompt_asks_for_is_format_and_the_code_in_it_stays_secret():
    from assay.envs.qa.gate import leaked, secrets

    env = get_env("codegen")
    task = env.generate(random.Random(0), 1)
    prompt = task.prompt[0].content
    assert "```python" in prompt  # the prompt states the answer's format
    hidden = secrets(env, task)
    assert hidden == [line.strip() for line in task.payload["code"].splitlines()]  # the code, not its fence
    assert not leaked(hidden, prompt) and leaked(hidden, prompt + "\n" + task.payload["code"])


def test_a_nondeterministic_verifier_fails_determinism():
    report = run_gate(Nondeterministic(), QAConfig(tasks_per_level=4, repeats=3, cheat_tasks_per_level=0,
                                                   noisy_samples=2, flake_rate=0.5))
    assert {"determinism", "reference"} <= failed_gates(report)


def test_grading_an_edited_test_file_is_caught_by_the_cheaters(isolated):
    report = run_gate(RunsTheWorkspaceTests(), QAConfig(tasks_per_level=1, repeats=1, cheat_tasks_per_level=1,
                                                        noisy_samples=1, flake_rate=0.5))
    caught = {f.reason for f in report.failures if f.gate == "cheaters"}
    assert any("shadow the tests" in r for r in caught), caught
    assert any("sys.exit(0)" in r for r in caught), caught


def test_the_store_locks_a_passed_version_and_diffs_against_the_previous_one(tmp_path):
    env = get_env("arith")
    report = run_gate(env, SMALL)
    save(tmp_path, report)
    check_version(tmp_path, env_spec(env), env_hash(env), env_parts(env))  # unchanged: fine
    parts = {**env_parts(env), "code assay.envs.builtin.arith": "0" * 12}
    with pytest.raises(VersionNotBumped, match="code assay.envs.builtin.arith.*bump its version"):
        check_version(tmp_path, env_spec(env), "f" * 12, parts)
    moved = tmp_path / "arith@0"
    (tmp_path / "arith@4").rename(moved)
    assert previous_version(tmp_path, "arith", "4")["env"] == "arith@4"
    assert diff(previous_version(tmp_path, "arith", "4"), report) == ["same results as arith@4"]


def test_a_record_from_an_older_gate_is_no_pass_and_locks_only_the_parts_it_hashed(tmp_path):
    env = get_env("arith")
    spec, parts = env_spec(env), env_parts(env)
    old = {"env": spec, "hash": "0" * 12, "passed": True, "gates": {},
           "parts": {k: v for k, v in parts.items() if k != "class"}}  # an older gate, before the class part
    (tmp_path / spec).mkdir()
    (tmp_path / spec / "20260101T000000_000000.json").write_text(json.dumps(old))
    assert latest(tmp_path, spec)["passed"] and latest(tmp_path, spec, passed_only=True) is None
    check_version(tmp_path, spec, env_hash(env), parts)  # the same content: re-check under the same version
    changed = {**parts, "code assay.envs.builtin.arith": "0" * 12}
    with pytest.raises(VersionNotBumped, match="code assay.envs.builtin.arith"):  # changed content: bump
        check_version(tmp_path, spec, "f" * 12, changed)
    report = run_gate(env, SMALL)
    assert report.gate_version == GATE_VERSION
    save(tmp_path, report)
    assert latest(tmp_path, spec, passed_only=True)["gate_version"] == GATE_VERSION
    with pytest.raises(VersionNotBumped, match="class"):  # a current record locks every part
        check_version(tmp_path, spec, "f" * 12, {**parts, "class": "0" * 12})


# -- issue 14: what the gate used to let through --------------------------------------------------------


def test_secrets_a_terminal_start_leaves_in_the_workspace_are_found(isolated):
    env = ChecksInTheWorkspace(timeout_s=2.0)  # the cheater that hangs costs 2 s, not 5
    env.difficulties = (1,)  # its level-1 tasks: a repair task (hidden tests) and a find task (a path)
    report = run_gate(env, TINY)
    leaks = [f.reason for f in report.failures if f.gate == "no leak"]
    assert any("in the file .expected after start" in r for r in leaks), leaks
    assert any("in the file tests/.hidden.json after start" in r for r in leaks), leaks
    assert any("the cheater 'read every file' is shown the hidden" in r for r in leaks), leaks
    caught = [f.reason for f in report.failures if f.gate == "cheaters"]
    assert any("'use hidden files'" in r for r in caught), caught  # `.expected` copied to answer.txt


def test_hidden_tests_a_code_start_leaves_in_the_workspace_are_found(isolated):
    env = HiddenTestsInTheWorkspace(timeout_s=1.5)
    env.difficulties = (1,)
    report = run_gate(env, QAConfig(tasks_per_level=1, repeats=1, cheat_tasks_per_level=1, noisy_samples=1,
                                    flake_rate=0.5))
    assert any("in the file .hidden_tests.json after start" in f.reason for f in report.failures
               if f.gate == "no leak"), [f.line() for f in report.failures]
    assert any("'read hidden answers'" in f.reason for f in report.failures if f.gate == "cheaters")


def test_a_terminal_environment_without_secrets_is_warned(isolated):
    env = DeclaresNoSecrets()
    env.difficulties = (1,)
    report = run_gate(env, QAConfig(tasks_per_level=1, repeats=1, cheat_tasks_per_level=0, noisy_samples=1,
                                    flake_rate=0.5))
    assert any(w.startswith("declares no secrets(task)") for w in report.warnings)
    assert report.to_json()["warnings"] == report.warnings
    assert not any(w.startswith("declares no secrets") for w in run_gate(get_env("arith"), SMALL).warnings)


def test_a_bare_answer_value_in_the_prompt_fails_the_leak_gate():
    report = run_gate(WorkedExample(), SMALL)
    leak = [f.reason for f in report.failures if f.gate == "no leak"]
    assert len(leak) == 1 and "the answer's bare value stands in 100% of prompts" in leak[0], leak
    assert report.leaks["p"] < 1e-3 and report.leaks["another answer in prompt"] < 0.3
    copied = [f.reason for f in report.failures if f.gate == "cheaters"]
    assert any("'copy value 3 from the start'" in r for r in copied), copied  # "Worked example: a+b=ANSWER"
    plain = run_gate(get_env("arith"), SMALL)
    assert plain.leaks["p"] > 0.1 and all(c["passed"] <= 2 for c in plain.cheaters.values())


def test_the_flake_runs_are_sized_by_rate_and_power():
    assert flake_runs(0.05, 0.95) == 59
    for rate, power in ((0.05, 0.95), (0.1, 0.99), (0.01, 0.9)):
        n = flake_runs(rate, power)
        assert 1 - (1 - rate) ** n >= power > 1 - (1 - rate) ** (n - 1)


def test_a_verifier_that_fails_one_run_in_ten_is_caught():
    report = run_gate(RarelyFlaky(), QAConfig(tasks_per_level=2, repeats=2, cheat_tasks_per_level=0,
                                              noisy_samples=1))
    f = report.flakiness
    assert (f["runs needed"], f["idle runs"], f["loaded runs"]) == (59, 59, 59)
    assert f["idle failed"] > 0 and f["loaded failed"] > 0
    reasons = [x.reason for x in report.failures if x.gate == "reference"]
    assert any("runs idle (59 runs see a 5% flake rate with probability 0.95)" in r for r in reasons), reasons


def test_a_verifier_that_fails_under_load_is_caught():
    env = FailsUnderLoad()
    env.difficulties = (1,)
    report = run_gate(env, QAConfig(tasks_per_level=2, repeats=1, cheat_tasks_per_level=0, noisy_samples=1))
    assert report.flakiness["loaded failed"] > 0  # idle too, when other work already loads this machine
    assert any("CPUs kept busy" in f.reason for f in report.failures if f.gate == "reference")


def test_cpu_contention_keeps_every_cpu_busy_and_stops():
    with cpu_contention() as busy:
        spinning = _spinners()
        assert busy == len(os.sched_getaffinity(0)) == len(spinning)
        assert sorted(c for p in spinning for c in os.sched_getaffinity(p)) == sorted(os.sched_getaffinity(0))
        assert all(_state(p) == "R" for p in spinning)  # running (one pinned to each CPU), not waiting
    assert not any(os.path.exists(f"/proc/{p}") for p in spinning)


def _spinners() -> list[int]:
    """This process's children that run the gate's spin loop."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                spins = b"getppid" in fh.read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and spins:
            found.append(pid)
    return found


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_calibration_can_measure_a_real_policy(tmp_path):
    from assay.cli import _policy_rates
    from assay.core.config import ModelConfig
    from assay.core.modeling import build_model, save_model
    from assay.core.tokenizer import train_tokenizer

    env = get_env("arith")
    tok = train_tokenizer([env.generate(random.Random(i), 1).prompt[-1].content for i in range(50)], 300)
    save_model(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                                       max_position=256), tok), tok, tmp_path / "policy")
    report = run_gate(env, QAConfig(tasks_per_level=2, cheat_tasks_per_level=0, noisy_samples=4, flake_rate=0.5),
                      _policy_rates(tmp_path / "policy", env))
    # an untrained policy solves nothing, whereas the noisy reference solves most easy tasks
    assert [s["calibration pass rate"] for s in report.levels.values()] == [0.0] * 4
    assert report.levels[1]["noisy"] > 0


def test_the_gates_reference_sandbox_has_the_environments_limits(isolated, monkeypatch):
    """The sandbox the gate searches is opened with the environment's `sandbox_limits`, not defaults."""
    from assay.envs.qa import gate

    opened = []

    def spy(limits):
        opened.append(limits)
        return open_sandbox(limits)

    monkeypatch.setattr(gate, "open_sandbox", spy)
    env = get_env("codegen", timeout_s=1.5, memory_mb=300)
    task = env.generate(random.Random(0), 1)
    gate._searched_reference(env, task, QAConfig(), lambda g, r: None, gate.secrets(env, task))
    assert opened == [env.sandbox_limits]


class _UndeclaredCode(RunsTheWorkspaceTests):
    """Runs code (declares sandbox_limits) but leaves qa_kind undeclared."""

    name = "broken-undeclared-code"
    qa_kind = None


class _CodeDeclaredAnswer(RunsTheWorkspaceTests):
    name = "broken-code-declared-answer"
    qa_kind = "answer"


def test_an_environment_that_runs_code_is_checked_as_code_whatever_it_declares(isolated):
    """An undeclared kind is inferred from what the environment does (and said); a declared kind that
    contradicts it fails: the code cheaters never silently give way to the answer cheaters."""
    from assay.envs.qa.strategies import does_kind, kind_of

    tiny = QAConfig(tasks_per_level=1, repeats=1, cheat_tasks_per_level=1, noisy_samples=1, flake_rate=0.5)
    undeclared = run_gate(_UndeclaredCode(), tiny)
    assert undeclared.kind == "code" and any("'shadow the tests'" in f.reason for f in undeclared.failures)
    assert any(w.startswith("declares no qa_kind: checked as 'code' because it declares sandbox_limits")
               for w in undeclared.warnings), undeclared.warnings
    lying = run_gate(_CodeDeclaredAnswer(), tiny)
    assert any(f.gate == "cheaters" and "declares qa_kind 'answer' but it declares sandbox_limits" in f.reason
               for f in lying.failures), [f.line() for f in lying.failures]
    assert lying.kind == "code" and any("'sys.exit(0)'" in f.reason for f in lying.failures)
    plain = get_env("arith")
    assert kind_of(plain) == "answer" and does_kind(plain)[0] == "answer"
    assert does_kind(get_env("terminal"))[0] == "terminal"


def test_a_reference_that_answers_with_code_makes_an_undeclared_environment_a_code_one():
    from assay.envs.qa.strategies import does_kind

    env = get_env("codegen")
    task = env.generate(random.Random(0), 1)
    del env.sandbox_limits  # only the answer's code block is left to tell
    assert does_kind(env, task) == ("code", "its reference answers with a code block")


def test_every_chance_test_has_its_stated_power_at_small_task_counts():
    """At 2 tasks a level another task's answer had 2 tries a level, and could never fail (5 are needed at
    ALPHA); the gate raises the count itself, says so, and then catches a verifier that accepts half of
    all answers."""
    from assay.envs.qa.gate import chance_tries

    assert chance_tries(RANDOM_ANSWER_TOLERANCE, 0.75, 0.95) == 17 and chance_tries(0.0, 0.75, 0.95) == 3
    report = run_gate(AcceptsAnyNumberOfTheRightParity(), TINY)
    assert any(w.startswith("tasks per level raised from 2 to 5") for w in report.warnings), report.warnings
    assert report.power["tasks per level"] == 5 and all(s["random answer tries"] >= 17 for s in report.levels.values())
    assert any(f.gate == "null" and "another task's answer passed" in f.reason for f in report.failures)


def test_each_workspace_cheater_is_tried_as_often_as_its_own_chance_test_needs():
    """A sandbox costs: on code and terminal environments a cheater that may not pass at all gets 3 tries, one
    with a 20% tolerance 17, and one that knows another task tries each task with several others of the level."""
    from assay.envs.qa.gate import GateReport, Tries, _sized
    from assay.envs.qa.strategies import cheaters_for

    cheaters, report = cheaters_for(get_env("terminal")), GateReport("x@1", "h", {}, "terminal", {})
    tasks, plan = _sized(report, QAConfig(tasks_per_level=1, cheat_tasks_per_level=1), cheaters, 1)
    assert tasks == 5 and plan["another task's solve, naming it"] == Tries(5, 4) and plan["exit 0"] == Tries(3)
    assert plan["no work, after another task was solved"] == Tries(3, 1)
    tasks, plan = _sized(report, QAConfig(), cheaters, 4)  # the defaults: 8 tasks a level, cheaters on 2
    assert tasks == 8 and plan["another task's solve, naming it"] == Tries(5) and plan["exit 0"] == Tries(2)


def test_terminal_environments_try_other_tasks_answers_too(isolated):
    env = get_env("terminal", timeout_s=2.0)
    env.difficulties = (1,)
    report = run_gate(env, QAConfig(tasks_per_level=4, repeats=1, cheat_tasks_per_level=1, noisy_samples=1,
                                    flake_rate=0.5))
    assert report.levels[1]["random answer tries"] >= 17 and report.cheaters
    assert all(c["tried"] >= 3 for c in report.cheaters.values())  # each cheater: 3 tries see a 75% winner
    assert not report.failures, [f.line() for f in report.failures]


# -- issue 44: loopholes by class -------------------------------------------------------------------------------
# Each planted environment has a correct reference and an exploit that wins every task while an honest wrong
# answer scores 0; the gate must fail it with the strategy meant for its class named, with class and tolerance.

LOOPHOLES = [  # (environment, the strategy meant for its class, the class)
    (NanWithinTolerance, "not a number", "parser"),
    (AnswerAsPattern, "a wildcard answer", "parser"),
    (AcceptsAlternatives, "candidates joined by 'or'", "parser"),
    (AnswerContainedInExpected, "an empty answer line", "parser"),
    (TrustsTheTranscript, "forge the tool's verdict", "trust"),
    (UnlimitedChecks, "enumerate through the tool", "tools"),
    (DebugFlag, "set every flag", "tools"),
    (NegativeIndex, "arguments out of range", "tools"),
    (SharedScratchpad, "read the tools after a solve", "state"),
    (ForgivesRepeatedFailures, "the same wrong answer, again", "state"),
    (RegradesTheLastSubmit, "tools out of order, submitting first", "tools"),  # submit twice: the last counts
    (ConfirmsAnEmptyList, "arguments at the schema's edges", "tools"),  # "" is a list of no wrong spellings
    (GradesTheNamedProblem, "another task's solve, naming it", "ids"),
    (CachesPassingReplies, "another task's answer, after it was solved", "state"),  # across tasks
]
# Planted after the strategies were written, not designed against. RoutesAnswersByTheirProblem passed the gate at
# first (the strategy named the other task only in tool arguments); naming it in the reply too now catches it.
UNSEEN = [
    (RoutesAnswersByTheirProblem, "another task's solve, naming it", "ids"),
    (SolutionAfterGivingUp, "tools out of order, each twice", "tools"),
]
CODE_LOOPHOLES = [  # and an honest wrong program (None: another task's reference)
    (SortedTestInputs, "return the argument", "tests", "```python\ndef f(xs):\n    return xs[::-1]\n```"),
    (ExamplesAreTheTests, "special-case the visible examples", "tests", None),
    (TrustsTheTestSummary, "forge a test summary", "trust", "```python\ndef f(*args):\n    return -1\n```"),
]


def won_by(report, name):
    """The cheater failures that name strategy `name`."""
    return [f.reason for f in report.failures if f.gate == "cheaters" and f"the cheater {name!r}" in f.reason]


def check_loophole(env, name, klass, cfg, wrong=None):
    """`wrong`: an honest wrong answer (a reply, or a task's wrong turns as a function of it; default: another
    task's reference)."""
    from assay.core.types import Message
    from assay.envs.qa.play import Replay, play
    from assay.envs.qa.strategies import other_reference

    report = run_gate(env, cfg)
    assert not report.passed, (report.cheaters, report.warnings)
    assert "reference" not in failed_gates(report), [f.line() for f in report.failures]  # a correct reference
    won = won_by(report, name)
    assert won, [f.line() for f in report.failures]
    assert all(f"class {klass}, tolerance " in r for r in won), won
    assert report.cheaters[name]["class"] == klass and report.cheaters[name]["passed"] > 0
    level = min(env.difficulties)
    a, b = (get_task(env, level, i) for i in (0, 1))
    turns = wrong(a) if callable(wrong) else [Message("assistant", wrong)] if wrong else None
    honest = play(env, a, Replay("wrong", turns) if turns else other_reference(env, b))
    assert not honest.reward.passed and honest.reward.score == 0, honest.reward
    return report


def get_task(env, level, i):
    from assay.envs.split import draw_task

    return draw_task(env, random.Random(f"honest/{level}/{i}"), level, "train")


@pytest.mark.parametrize(("env_cls", "name", "klass"), LOOPHOLES, ids=[e[0].__name__ for e in LOOPHOLES])
def test_a_loophole_of_each_class_is_caught_by_its_strategy(env_cls, name, klass):
    check_loophole(env_cls(), name, klass, SMALL)


@pytest.mark.parametrize(("env_cls", "name", "klass"), UNSEEN, ids=[e[0].__name__ for e in UNSEEN])
def test_a_loophole_the_strategies_were_not_written_for_is_caught(env_cls, name, klass):
    check_loophole(env_cls(), name, klass, SMALL)


def test_a_workspace_loophole_across_tasks_is_caught_by_its_strategy(isolated):
    """Terminal: a pass granting the next minute's episodes a pass, whatever their task."""
    from assay.core.types import Message, ToolCall
    from assay.envs.qa.play import Replay, play

    env = PassesRightAfterAPass(timeout_s=2.0)
    env.difficulties = (1,)
    cfg = QAConfig(tasks_per_level=4, repeats=1, cheat_tasks_per_level=1, noisy_samples=1, flake_rate=0.5)
    PassesRightAfterAPass.last_pass[0] = float("-inf")
    wrong = Replay("wrong", [Message("assistant", "", [ToolCall("bash", {"command": "true"})]),
                             Message("assistant", "Done.")])
    report = run_gate(env, cfg)
    won = won_by(report, "no work, after another task was solved")
    assert not report.passed and won and all("class state, tolerance " in r for r in won), \
        [f.line() for f in report.failures]
    PassesRightAfterAPass.last_pass[0] = float("-inf")  # an honest wrong episode, with no pass before it
    assert not play(env, get_task(env, 1, 0), wrong).reward.passed


@pytest.mark.parametrize(("env_cls", "name", "klass", "wrong"), CODE_LOOPHOLES,
                         ids=[e[0].__name__ for e in CODE_LOOPHOLES])
def test_a_code_loophole_is_caught_by_its_strategy(isolated, env_cls, name, klass, wrong):
    cfg = QAConfig(tasks_per_level=1, repeats=1, cheat_tasks_per_level=1, noisy_samples=1, flake_rate=0.5)
    report = check_loophole(env_cls(timeout_s=1.5), name, klass, cfg, wrong)
    c = report.cheaters[name]
    if klass == "tests":  # a program doing no work may pass a weak task by chance: it won every try, not one
        assert c["tolerance"] > 0 and c["passed"] == c["tried"] >= 8, c


def _sums_to_one(task):
    """An honest wrong episode on a ticket: its answer file written, with a wrong sum."""
    from assay.core.types import Message, ToolCall

    command = f"mkdir -p answers && echo 1 > {task.payload['path']}"
    return [Message("assistant", "", [ToolCall("bash", {"command": command})]), Message("assistant", "Done.")]


IDS_IN_A_WORKSPACE = [  # code and terminal kinds: (environment, the identifier strategy meant for it, a wrong answer)
    (JudgesTheProblemItsHeaderNames, "another task's solve, naming it", "```python\ndef f(*args):\n    return -1\n```"),
    (ClosesTheTicketItsReportNames, "another task's solve, naming it", _sums_to_one),
    (AcceptsAnyTicketsAnswer, "another task's solve, under this task's ids", _sums_to_one),
]


@pytest.mark.parametrize(("env_cls", "name", "wrong"), IDS_IN_A_WORKSPACE, ids=[e[0].__name__ for e in IDS_IN_A_WORKSPACE])
def test_other_tasks_identifiers_in_a_program_or_a_workspace_are_caught_by_their_strategy_alone(isolated, env_cls,
                                                                                               name, wrong):
    """A judge that runs the tests of the problem a program's header names, a workspace graded against the ticket
    the agent's report names, and one that takes any ticket's answer under this ticket's file name: each wins every
    try of the identifier strategy meant for it (at the 20% tolerance another task's solve has), and nothing else
    catches it: not the plain replay of other tasks' answers, nor any other cheater."""
    cfg = QAConfig(tasks_per_level=1, repeats=1, cheat_tasks_per_level=1, noisy_samples=1, flake_rate=0.5)
    report = check_loophole(env_cls(timeout_s=2.0), name, "ids", cfg, wrong)
    assert failed_gates(report) == {"cheaters"} and [c for c in report.cheaters if won_by(report, c)] == [name], \
        [f.line() for f in report.failures]
    c = report.cheaters[name]
    assert c["tolerance"] == RANDOM_ANSWER_TOLERANCE and c["passed"] == c["tried"] >= 17, c


def test_a_checking_tool_that_believes_the_transcript_is_caught_by_a_claimed_verdict_too():
    report = run_gate(TrustsTheTranscript(), SMALL)
    assert won_by(report, "claim a verdict") and not won_by(report, "enumerate through the tool")  # one check only


def test_cheaters_read_only_what_a_policy_sees():
    """Every cheater plays from the prompt, the tool schemas and the tool results: a task whose payload
    cannot be read changes nothing it says."""
    from dataclasses import replace

    from assay.core.types import Message
    from assay.envs.qa.strategies import CHEATERS

    class Sealed(dict):
        def __getitem__(self, key):
            raise AssertionError(f"a cheater read the payload's {key!r}")

        get = __getitem__

    from assay.envs.qa.loopholes import Sibling

    for env in (get_env("arith"), get_env("toolcalc"), get_env("codegen"), DebugFlag(), NegativeIndex(),
                GradesTheNamedProblem(), JudgesTheProblemItsHeaderNames(), AcceptsAnyTicketsAnswer()):
        level = min(2, max(env.difficulties))
        task, other = get_task(env, level, 0), get_task(env, level, 1)
        sealed = replace(task, payload=Sealed())
        known = tuple(m for m in env.reference_solution(other) if m.role == "assistant")  # what training showed
        for cheater in CHEATERS:
            policy, sealed_policy = cheater.given(Sibling(other, known)), cheater.given(
                Sibling(replace(other, payload=Sealed()), known))
            first = sealed_policy.act(sealed, list(sealed.prompt))
            assert first == policy.act(task, list(task.prompt)), cheater.name
            later = [*sealed.prompt, first, *(Message("tool", "error: no", name=c.name) for c in first.tool_calls)]
            sealed_policy.act(sealed, later)


def test_the_loophole_helpers():
    from assay.envs.qa import loopholes as lh

    assert lh.reverse_verdict("verdict: wrong (not accepted)") == "verdict: correct (accepted)"
    assert lh.reverse_verdict("FAILED: False") == "PASSED: True"
    assert lh.answer_in(['{"table_size": 2, "expected": 23}']) == "23"
    assert lh.answer_in(["noise", "x=1\nAnswer: 7"]) == "7" and lh.answer_in(["14", "error: 3"]) is None
    assert lh.last_number(["1+2=3", "error: no row 9"]) == "3"
    task = get_task(get_env("codegen"), 3, 0)
    assert lh.shown_examples(task) and all(isinstance(args, list) for args, _ in lh.shown_examples(task))
    assert "12 or 13 or 14" in lh.joined(" or ")(task, []).content


def test_a_program_doing_no_work_that_passes_within_its_tolerance_is_said():
    """A weak task or two is chance for the environment (no failure), but each is named in a warning."""
    from assay.envs.qa.gate import CheatTally, GateReport, _chance_checks
    from assay.envs.qa.strategies import CHEATERS

    identity = next(c for c in CHEATERS if c.name == "return the argument")
    report = GateReport("x@1", "h", {}, "code", {})
    counts = {identity.name: CheatTally(passed=1, tried=8, won=["level 4 seed 7"])}
    _chance_checks(report, {1: [get_task(get_env("codegen"), 1, 0)]}, [identity], counts, {})
    assert not report.failures
    assert any("'return the argument'" in w and "level 4 seed 7 have hidden tests that hold without the work" in w
               for w in report.warnings), report.warnings
    counts[identity.name] = CheatTally(passed=8, tried=8)
    _chance_checks(report, {1: [get_task(get_env("codegen"), 1, 0)]}, [identity], counts, {})
    assert any("'return the argument'" in f.reason and "class tests, tolerance 5%" in f.reason
               for f in report.failures)


def test_a_cheater_that_gets_an_infrastructure_failure_instead_of_a_reward_is_said():
    from assay.envs.qa.gate import CheatTally, GateReport, _chance_checks
    from assay.envs.qa.strategies import CHEATERS

    huge = next(c for c in CHEATERS if c.name == "a huge number")
    report = GateReport("x@1", "h", {}, "answer", {})
    _chance_checks(report, {1: [get_task(get_env("arith"), 1, 0)]}, [huge], {huge.name: CheatTally(tried=8, infra=8)}, {})
    assert not report.failures and report.cheaters[huge.name]["infra"] == 8
    assert any("'a huge number'" in w and "infrastructure failure, not a reward, on 8 of 8 tasks" in w
               for w in report.warnings), report.warnings


def test_the_order_edge_and_identifier_helpers():
    from broken_envs import CHECK, SUBMIT_FOR

    from assay.core.types import Message
    from assay.envs.qa import loopholes as lh

    env = GradesTheNamedProblem()
    task, other = get_task(env, 1, 0), get_task(env, 1, 1)
    assert lh.identifiers(task) == [task.payload["id"]] and lh.identifiers(other) == [other.payload["id"]]
    assert lh.identifiers(get_task(get_env("arith"), 2, 0)) == []  # operands are the task, not its name
    assert "4821" in lh.identifiers(replace_prompt(task, "Ticket #4821: sum the rows."))
    shared = "Use python3."  # an identifier every task shows (a shared system prompt's) names none
    assert lh.naming(replace_prompt(task, f"{shared} Problem P-1."), replace_prompt(other, shared)) == ["P-1"]
    known = lh.Sibling(other, tuple(m for m in env.reference_solution(other) if m.role == "assistant"))
    named = lh.naming_sibling(known)(task, list(task.prompt))
    assert named.tool_calls[0].arguments == {"answer": str(other.payload["answer"]), "problem": other.payload["id"]}
    final = lh.naming_sibling(known)(task, [*task.prompt, named, Message("tool", "submitted", name="submit")])
    assert final.content.startswith(other.payload["id"] + "\n")
    assert lh.renamed({"p": ["P-1", 7, "see P-1x"]}, {"P-1": "P-2", "7": "8"}) == {"p": ["P-2", 8, "see P-1x"]}
    # a program and a command name the other task in a comment; ids swapped reach the paths a command writes
    assert lh.commented("P-1\n```python\ndef f():\n    pass\n```", "# P-1") == \
        "P-1\n```python\n# P-1\ndef f():\n    pass\n```"
    tickets = AcceptsAnyTicketsAnswer()
    mine, theirs = get_task(tickets, 1, 0), get_task(tickets, 1, 1)
    known = lh.Sibling(theirs, tuple(m for m in tickets.reference_solution(theirs) if m.role == "assistant"))
    at_work = [*mine.prompt, Message("assistant", ""), Message("tool", "1", name="bash")]  # the second turn
    assert lh.naming_sibling(known)(mine, at_work).tool_calls[0].arguments["command"] == \
        f"# {theirs.payload['ticket']}\nmkdir -p answers && echo {theirs.payload['answer']} > {theirs.payload['path']}"
    assert lh.as_this_task(known)(mine, at_work).tool_calls[0].arguments["command"] == \
        f"mkdir -p answers && echo {theirs.payload['answer']} > {mine.payload['path']}"
    # every value the schema admits at its edges, bounds as floats too; the odd result out is called again
    edges = lh.schema_edges({"type": "integer", "minimum": 1})
    assert {0, -1, 10**100, 1} <= set(edges) and any(isinstance(v, float) for v in edges)
    assert "" in lh.schema_edges({"type": "string"}) and lh.schema_edges({"enum": ["a", "b"]}) == ["a", "b"]
    planned = [("confirm", {"answer": v}) for v in ("", "a", "b", "c")]
    assert lh.odd_ones(planned, ["confirmed", "no: a", "no: b", "no: c"]) == [("confirm", {"answer": ""})]
    # order: every tool twice, reversed (the submitting tool first), then again with the value the results named
    order = lh.in_order(lambda tools: tools[::-1])
    task2 = replace_tools(task, [SUBMIT_FOR, CHECK])
    first = order(task2, list(task2.prompt))
    assert [c.name for c in first.tool_calls] == ["check", "check", "submit", "submit"]
    history = [*task2.prompt, first, *(Message("tool", "wrong: the expected answer was 42", name=c.name)
                                      for c in first.tool_calls)]
    second = order(task2, history)
    assert [(c.name, c.arguments["answer"]) for c in second.tool_calls] == [("submit", "42"), ("check", "42")]


def replace_prompt(task, text):
    from dataclasses import replace

    from assay.core.types import Message

    return replace(task, prompt=[Message("user", text)])


def replace_tools(task, tools):
    from dataclasses import replace

    return replace(task, tools=tools)


def test_a_cheater_that_knows_another_task_is_given_the_next_one_and_skipped_alone():
    """The cheaters that know another task play from the next task of the level; a level of one distinct task
    gives them nothing to know, and they are not counted as tried there."""
    from assay.envs.qa.gate import CheatTally, Tries, _try_cheaters
    from assay.envs.qa.strategies import CHEATERS

    env = CachesPassingReplies()
    knowing = [c for c in CHEATERS if c.needs_sibling and "answer" in c.kinds]
    task, other = get_task(env, 1, 0), get_task(env, 1, 1)
    counts = {c.name: CheatTally() for c in knowing}
    failures = []
    _try_cheaters(env, task, knowing, counts, QAConfig(), lambda g, r: failures.append(r), [], [])
    assert all(t.tried == 0 for t in counts.values()) and not failures
    _try_cheaters(env, task, knowing, counts, QAConfig(), lambda g, r: failures.append(r), [], [other, task])
    assert all(t.tried == 1 for t in counts.values())
    assert counts["another task's answer, after it was solved"].passed == 1  # other's reply, cached as a pass
    third = get_task(env, 1, 2)  # with more others planned, once per other task
    _try_cheaters(env, task, knowing, counts, QAConfig(), lambda g, r: failures.append(r), [], [other, third],
                  {c.name: Tries(1, 2) for c in knowing})
    assert all(t.tried == 3 for t in counts.values())
