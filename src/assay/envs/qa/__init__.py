"""Environment QA: the gate an environment passes before it trains anything, and its store."""

from assay.envs.qa.gate import GATES, GateReport, QAConfig, run_gate
from assay.envs.qa.play import Played, play

__all__ = ["GATES", "GateReport", "Played", "QAConfig", "play", "run_gate"]
