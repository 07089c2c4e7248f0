"""Several processes of the job: the launcher and the lesson's DDP trainer."""

from .launch import DistributedDINOTrainer, launch_distributed_training

__all__ = ["DistributedDINOTrainer", "launch_distributed_training"]
