"""The agent layer: the multi-turn loop, tool-call parsing and validation, and the token layout SFT shares."""

from assay.agent.loop import run_episodes
from assay.agent.parse import parse_assistant
from assay.agent.render import sft_example
from assay.envs.tools import validate_call

__all__ = ["parse_assistant", "run_episodes", "sft_example", "validate_call"]
