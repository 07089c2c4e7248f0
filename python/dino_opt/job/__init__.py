"""The training job of dino-opt train: set-up, resume, steps, health, hangs, the finish."""

from .hang import injected_hang, report_hang, start_watchdog
from .job import CheckpointedDINOTrainer, run_training
from .parts import PROFILE_PHASES, ResumeError

__all__ = [
    "CheckpointedDINOTrainer",
    "PROFILE_PHASES",
    "ResumeError",
    "injected_hang",
    "report_hang",
    "run_training",
    "start_watchdog",
]
