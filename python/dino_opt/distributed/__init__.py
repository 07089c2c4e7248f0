"""Several processes of the job: the launcher, which restarts them, and the lesson's trainer;
embedding on several processes."""

from .agent import WorkerFailedError, run_agent
from .embed import embed_here, embed_on_processes
from .launch import DistributedDINOTrainer, launch_distributed_training

__all__ = [
    "DistributedDINOTrainer",
    "WorkerFailedError",
    "embed_here",
    "embed_on_processes",
    "launch_distributed_training",
    "run_agent",
]
