"""Several processes of the job: the launcher, which restarts them, and the lesson's trainer."""

from .agent import WorkerFailedError, run_agent
from .launch import DistributedDINOTrainer, launch_distributed_training

__all__ = [
    "DistributedDINOTrainer",
    "WorkerFailedError",
    "launch_distributed_training",
    "run_agent",
]
