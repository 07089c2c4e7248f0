"""The files of a run folder, named in one place.

``dino-opt train`` writes, and ``dino-opt report`` / ``dino-opt knn`` read::

    <run>/config.yaml              the resolved configuration
    <run>/metrics.jsonl            one JSON row per logging step
    <run>/report.json              the run's report (k-NN, time, profile shares)
    <run>/profile.json             time per step phase
    <run>/checkpoints/             checkpoints, their sidecars and index
    <run>/hang.json                written when the hang watchdog ended the run
    <run>/restarts.json            the restarts of the job by its launcher
    <run>/failures/                failures a launcher saw, until the restart claims them
    <run>/progress/rank<R>.json    each rank's last completed step (several processes)
    <run>/tensorboard/             TensorBoard event files
    <run>/wandb_id.txt             the Weights & Biases run id (resumed with the folder)
    <run>/mlflow_id.txt            the MLflow run id (resumed with the folder)
    <run>/export/                  the trained teacher exported for MLflow (logging.mlflow_weights)
    <run>/training_curves.png      the metrics over the steps
    <run>/tsne_trained.png         t-SNE of held-out features, trained teacher
    <run>/tsne_random_init.png     ... and the same network at random initialisation
    <run>/checkpoint_report.json   written by dino-opt report
    <run>/performance_report.json  written by dino-opt report
    <run>/model_evolution.png      written by dino-opt report
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunFolder"]


def _entry(name: str) -> property:
    return property(lambda self: self.root / name, doc=f"``<run>/{name}``")


@dataclass(frozen=True)
class RunFolder:
    """The paths of the files of the run folder ``root``."""

    root: Path

    def __init__(self, root: str | os.PathLike) -> None:
        object.__setattr__(self, "root", Path(root))

    CONFIG = "config.yaml"
    METRICS = "metrics.jsonl"
    REPORT = "report.json"
    PROFILE = "profile.json"
    CHECKPOINTS = "checkpoints"
    TENSORBOARD = "tensorboard"
    WANDB_ID = "wandb_id.txt"
    MLFLOW_ID = "mlflow_id.txt"
    EXPORT = "export"
    TRAINING_CURVES = "training_curves.png"
    CHECKPOINT_REPORT = "checkpoint_report.json"
    PERFORMANCE_REPORT = "performance_report.json"
    MODEL_EVOLUTION = "model_evolution.png"
    HANG = "hang.json"
    RESTARTS = "restarts.json"
    FAILURES = "failures"
    PROGRESS = "progress"
    PICTURES = "pictures"
    EVALUATION = "evaluation.json"
    STUDENTS = "students"

    config = _entry(CONFIG)
    metrics = _entry(METRICS)
    report = _entry(REPORT)
    profile = _entry(PROFILE)
    checkpoints = _entry(CHECKPOINTS)
    tensorboard = _entry(TENSORBOARD)
    wandb_id = _entry(WANDB_ID)
    mlflow_id = _entry(MLFLOW_ID)
    export = _entry(EXPORT)
    training_curves = _entry(TRAINING_CURVES)
    checkpoint_report = _entry(CHECKPOINT_REPORT)
    performance_report = _entry(PERFORMANCE_REPORT)
    model_evolution = _entry(MODEL_EVOLUTION)
    hang = _entry(HANG)
    restarts = _entry(RESTARTS)
    failures = _entry(FAILURES)
    progress = _entry(PROGRESS)
    pictures = _entry(PICTURES)
    evaluation = _entry(EVALUATION)

    def tsne(self, which: str) -> Path:
        """The t-SNE map of the ``which`` teacher ('trained' or 'random_init')."""
        return self.root / f"tsne_{which}.png"

    def student(self, name: str) -> RunFolder:
        """The folder of the evaluation of student ``name`` of a run that
        trains several (``students/<name>/``), made when missing."""
        folder = RunFolder(self.root / self.STUDENTS / name)
        folder.root.mkdir(parents=True, exist_ok=True)
        return folder

    def is_run(self) -> bool:
        """Whether ``root`` looks like a run folder (metrics or checkpoints)."""
        return self.metrics.is_file() or self.checkpoints.is_dir()
