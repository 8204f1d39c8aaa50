"""The top-level API: every advertised noun imports, and `import assay` alone loads no model code."""

import subprocess
import sys

import assay


def test_every_exported_name_resolves():
    for name in assay.__all__:
        assert getattr(assay, name) is not None, name


def test_importing_assay_loads_no_torch():
    code = "import sys, assay; from assay import Task, register, task_id; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_framework_stamps_identity_after_generate():
    import random

    from assay import Message, Task, generate_task, task_id

    class Bare:  # an environment that leaves env and env_hash empty
        name, version, domain, difficulties, tools = "bare", "1", "text", (1,), ()

        def generate(self, rng, difficulty):
            word = rng.choice("abc")
            return Task(env="", task_id=task_id("bare@1", difficulty, word), domain="text", difficulty=difficulty,
                        prompt=[Message("user", word)])

    task = generate_task(Bare(), random.Random(0), 1)
    assert task.env == "bare@1" and len(task.env_hash) == 12


def test_a_task_without_id_or_at_another_difficulty_is_refused_by_name():
    import random

    import pytest

    from assay import Message, Task, generate_task
    from assay.core.errors import AssayError

    class Sloppy:
        name, version, domain, difficulties, tools = "sloppy", "1", "text", (1, 2), ()

        def __init__(self, task_id, level):
            self.task_id, self.level = task_id, level

        def generate(self, rng, difficulty):
            return Task(env="", task_id=self.task_id, domain="text", difficulty=self.level,
                        prompt=[Message("user", "hi")])

    with pytest.raises(AssayError, match="without a task_id"):
        generate_task(Sloppy("", 1), random.Random(0), 1)
    with pytest.raises(AssayError, match="honour the difficulty"):
        generate_task(Sloppy("s-1", 1), random.Random(0), 2)
