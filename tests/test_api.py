"""The top-level API: every advertised noun imports, and `import assay` alone loads no model code."""

import subprocess
import sys

import assay


def test_every_exported_name_resolves():
    assert sorted(assay.__all__) == sorted(assay._EXPORTS)  # the static list type checkers read, and the lazy one
    for name in assay.__all__:
        assert getattr(assay, name) is not None, name


def test_the_type_checking_block_imports_every_export():
    """The names a type checker sees are the ones `import assay` resolves at run time."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(assay.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {(node.module, a.name) for node in block.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert seen == {(module, name) for name, module in assay._EXPORTS.items()}


def test_importing_assay_loads_no_torch():
    code = ("import sys, assay; from assay import Task, register, task_id, Limits, EnvHooks, register_backend; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_framework_stamps_identity_after_generate():
    import random

    from assay import Message, Task, generate_task, task_id

    class Bare:  # an environment that leaves env and env_hash empty
        name, version, category, difficulties, tools = "bare", "1", "text", (1,), ()

        def generate(self, rng, difficulty):
            word = rng.choice("abc")
            return Task(env="", task_id=task_id("bare@1", difficulty, word), difficulty=difficulty,
                        prompt=[Message("user", word)])

    task = generate_task(Bare(), random.Random(0), 1)
    assert task.env == "bare@1" and len(task.env_hash) == 12


def test_a_task_without_id_or_at_another_difficulty_is_refused_by_name():
    import random

    import pytest

    from assay import Message, Task, generate_task
    from assay.core.errors import AssayError

    class Sloppy:
        name, version, category, difficulties, tools = "sloppy", "1", "text", (1, 2), ()

        def __init__(self, task_id, level):
            self.task_id, self.level = task_id, level

        def generate(self, rng, difficulty):
            return Task(env="", task_id=self.task_id, difficulty=self.level,
                        prompt=[Message("user", "hi")])

    with pytest.raises(AssayError, match="without a task_id"):
        generate_task(Sloppy("", 1), random.Random(0), 1)
    with pytest.raises(AssayError, match="honour the difficulty"):
        generate_task(Sloppy("s-1", 1), random.Random(0), 2)


def test_the_readme_trains_a_users_model_on_a_users_environment(tmp_path, monkeypatch):
    """The README's Python example, run as written, with a small HF model saved here as the user's."""
    import json
    import re
    import sys
    import types
    from pathlib import Path

    import torch

    from assay.core.config import ModelConfig
    from assay.core.modeling import build_model, save_model
    from assay.core.tokenizer import train_tokenizer

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    env_code = re.search(r"\*\*Writing one\.\*\*.*?```python\n(.*?)```", readme, re.DOTALL).group(1)
    example = re.search(r"\*\*From Python, on your own model\.\*\*.*?```python\n(.*?)```", readme, re.DOTALL).group(1)
    module = types.ModuleType("reverse_env")
    exec(compile(env_code, "README.md", "exec"), module.__dict__)
    monkeypatch.setitem(sys.modules, "reverse_env", module)
    torch.manual_seed(0)
    tok = train_tokenizer([f"<|im_start|>user\nReverse the letters of {w}.<|im_end|>\n" for w in ("abc", "hgf", "dd")],
                          300)
    save_model(build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                       intermediate_size=64), tok), tok, tmp_path / "user-model")
    example = (example.replace("path/to/your-hf-chat-model", str(tmp_path / "user-model"))
               .replace('"run_dir": "runs"', f'"run_dir": "{tmp_path / "runs"}"').replace('"steps": 20', '"steps": 2'))
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README.md", "exec"), {})
    lines = (tmp_path / "runs" / "reverse" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if json.loads(line)["kind"] == "train"]
    assert steps == [1, 2]


def test_objects_stand_in_for_names_an_unregistered_env_a_policy_and_a_backend(tmp_path):
    """run_training takes an environment object, a (model, tokenizer) pair and a backend factory."""
    import json
    import random

    import pyarrow.parquet as pq
    import pytest
    import torch

    from assay import Message, Reward, Task, task_id
    from assay.core.config import ModelConfig
    from assay.core.errors import ConfigError
    from assay.core.modeling import build_model
    from assay.core.storage import trajectory_shards
    from assay.core.tokenizer import train_tokenizer
    from assay.envs.qa.enforce import UncheckedEnvironment
    from assay.rollout.hf import HFBackend

    class Echo:  # never registered: reachable only as the object given for its domain
        name, version, category, difficulties, tools = "echo-unregistered", "1", "text", (1, 2, 3, 4), ()
        drawn = 0

        def generate(self, rng: random.Random, difficulty: int) -> Task:
            Echo.drawn += 1
            word = rng.choice(["ab", "cd", "ef"])
            return Task(env="", task_id=task_id("echo-unregistered@1", difficulty, word), difficulty=difficulty,
                        prompt=[Message("user", f"Say {word}.")], payload={"word": word})

        def reference_solution(self, task):
            return [Message("assistant", f"Answer: {task.payload['word']}")]

        def start(self, task, sandbox):
            return EchoEpisode(task)

    class EchoEpisode:
        def __init__(self, task):
            self.task = task

        def step(self, call):
            raise AssertionError("no tools")

        def verify(self, final):
            ok = final[-1].content.strip() == f"Answer: {self.task.payload['word']}"
            return Reward(float(ok), ok)

    torch.manual_seed(0)
    tok = train_tokenizer([f"<|im_start|>user\nSay {w}.<|im_end|>\nAnswer: {w}" for w in ("ab", "cd", "ef")], 300)
    model = build_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                    intermediate_size=64), tok)
    made = []

    def backend(m, t):
        made.append(m)
        return HFBackend(m, t)

    config = {"name": "objects", "run_dir": str(tmp_path), "threads": 1,
              "domains": [{"name": "echo", "env": "not-in-the-registry", "group_size": 2, "max_new_tokens": 4}],
              "train": {"steps": 2, "groups_per_step": 2}}
    with pytest.raises(UncheckedEnvironment, match=r"echo-unregistered@1 .*no passing record of QA gate v\d+: "
                                                   r"check it with `assay env check echo-unregistered@1`"):
        assay.run_training({**config, "name": "refused"}, envs={"echo": Echo()}, policy=(model, tok))
    assert Echo.drawn == 0 and made == []  # refused before anything ran
    config["allow_unchecked"] = ["echo-unregistered"]  # never checked: the run says so, everywhere
    run_dir = assay.run_training(config, envs={"echo": Echo()}, policy=(model, tok), backend=backend)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["kind"] == "train"] == [1, 2]
    assert any("echo-unregistered@1" in x.get("qa_unchecked", "") for x in lines if x["kind"] == "warning")
    assert "- echo-unregistered" in (run_dir / "config.yaml").read_text()
    rows = [r for s in trajectory_shards(run_dir / "trajectories") for r in pq.read_table(s).to_pylist()]
    assert rows and all(json.loads(r["reward_info"])["qa_unchecked"].startswith("echo-unregistered@1 ") for r in rows)
    assert Echo.drawn >= 4 and made == [model]  # the given policy's own tensors, under the given backend
    with pytest.raises(ConfigError, match="no domain for"):
        assay.run_training({**config, "name": "objects2"}, envs={"other": Echo()}, policy=(model, tok))
    with pytest.raises(ConfigError, match="stay in this process"):
        assay.run_training({**config, "name": "objects3", "pipeline": {"mode": "async", "workers": "process"}},
                           envs={"echo": Echo()})
