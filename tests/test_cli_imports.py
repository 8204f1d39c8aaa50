"""The command line answers help, listings and one-line errors without importing the heavy libraries (torch,
transformers): a newcomer's first commands answer at once. Imports, not seconds, are asserted."""

import subprocess
import sys

import pytest

PROBE = """
import sys
sys.argv = ["assay", *sys.argv[1:]]
from assay.cli import main
try:
    main()
except SystemExit:
    pass
print("HEAVY", sorted(m for m in ("torch", "transformers") if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize("args", [["--help"], ["train", "missing.yaml"], ["env", "list"]])
def test_light_commands_import_no_model_library(args, tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert "HEAVY []" in out.stderr, out.stderr[-2000:]
