"""The shipped environments; importing this package registers them."""

from assay.envs.builtin.arith import ArithEnv
from assay.envs.builtin.codegen import CodegenEnv
from assay.envs.builtin.jsonl import JsonlEnv
from assay.envs.builtin.repo import RepoEnv
from assay.envs.builtin.terminal import TerminalEnv
from assay.envs.builtin.toolcalc import ToolcalcEnv

__all__ = ["ArithEnv", "CodegenEnv", "JsonlEnv", "RepoEnv", "TerminalEnv", "ToolcalcEnv"]
