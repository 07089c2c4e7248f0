"""The training job of dino-opt train: set-up, resume, steps, health, hangs, restarts, finish."""

from .hang import HangReporter, injected_hang, start_watchdog
from .job import CheckpointedDINOTrainer, run_training
from .parts import PROFILE_PHASES, ResumeError
from .restarts import (
    describe_exit,
    first_failure,
    injected_kill,
    read_progress,
    read_restarts,
    record_failure,
    stuck_ranks,
)

__all__ = [
    "CheckpointedDINOTrainer",
    "HangReporter",
    "PROFILE_PHASES",
    "ResumeError",
    "describe_exit",
    "first_failure",
    "injected_hang",
    "injected_kill",
    "read_progress",
    "read_restarts",
    "record_failure",
    "run_training",
    "start_watchdog",
    "stuck_ranks",
]
