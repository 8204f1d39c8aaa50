"""Domain mixer and per-domain difficulty curriculum."""

from assay.mixer.curriculum import Curriculum
from assay.mixer.mixer import DomainMixer, apply_floor
from assay.mixer.stats import DomainStats, DomainStep, seesaw_warnings

__all__ = ["Curriculum", "DomainMixer", "DomainStats", "DomainStep", "apply_floor", "seesaw_warnings"]
