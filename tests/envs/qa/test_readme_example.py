"""The README's smallest environment is complete: it registers and passes the QA gate."""

import re
import types
from pathlib import Path

from assay.envs.qa import QAConfig, run_gate


def test_the_readme_environment_passes_the_gate():
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    code = re.search(r"\*\*Writing one\.\*\*.*?```python\n(.*?)```", readme, re.DOTALL).group(1)
    module = types.ModuleType("reverse_env")
    exec(compile(code, "README.md", "exec"), module.__dict__)
    report = run_gate(module.ReverseEnv(), QAConfig(tasks_per_level=4))
    assert report.passed, [f.line() for f in report.failures]
