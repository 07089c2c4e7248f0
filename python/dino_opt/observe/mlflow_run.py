"""A run's MLflow run (``logging.mlflow: true``): the resolved config as
parameters, every metrics row and evaluation as metrics by step, pictures
as images, and at the end the run folder's figures, reports and pictures
(and the exported weights the job hands over) as artifacts.

The tracking URI is ``logging.mlflow_tracking_uri``, else MLflow's own
``MLFLOW_TRACKING_URI``, else a local file store beside the run folder
(``<run>/../mlruns``, one store for the runs of a folder: ``mlflow ui
--backend-store-uri runs/mlruns``). MLflow keeps its file store in
maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; a file store chosen
here sets that switch for this process. The run's id is kept in the run
folder, so a resumed run continues its MLflow run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from ..config import Config
from .runfiles import RunFolder

__all__ = ["MlflowRun", "flat_params", "tracking_uri"]

# MLflow takes at most 100 parameters and 1000 metrics in one call.
_PARAMS_PER_CALL = 100
_METRICS_PER_CALL = 1000


def tracking_uri(cfg: Config, folder: RunFolder) -> str:
    """Where the run is tracked (see the module docstring)."""
    given = cfg.logging.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if given:
        return given
    return (folder.root.resolve().parent / "mlruns").as_uri()


def _is_file_store(uri: str) -> bool:
    """A ``file:`` URI or a plain path (not a server, a database or Databricks)."""
    return urlparse(uri).scheme in ("", "file")


def flat_params(cfg: Config) -> dict[str, str]:
    """The resolved config as ``section.key`` -> its value as text (lists as JSON)."""
    out = {}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            out[f"{section}.{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def _numbers(row: dict, prefix: str = "") -> dict[str, float]:
    return {
        f"{prefix}{k}": float(v)
        for k, v in row.items()
        if k not in ("step", "epoch") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class MlflowRun:
    """The MLflow run of one training run (rank 0 only). Raises ImportError
    in one line when the ``mlflow`` extra is not installed."""

    def __init__(self, cfg: Config, folder: RunFolder, metadata: dict) -> None:
        try:
            import mlflow  # optional dependency: the `mlflow` extra
            from mlflow.entities import Metric, Param
        except ImportError as e:
            raise ImportError(
                "logging.mlflow=true needs the mlflow package: pip install 'dino_opt[mlflow]'"
            ) from e
        self._metric, self._param = Metric, Param
        uri = tracking_uri(cfg, folder)
        if _is_file_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self._folder = folder
        self.run_id = self._start(cfg, folder, metadata)

    def _start(self, cfg: Config, folder: RunFolder, metadata: dict) -> str:
        """The run's id: the one kept in the run folder (resumed), else a new run's."""
        kept = folder.mlflow_id.read_text().strip() if folder.mlflow_id.exists() else None
        if kept:
            self.client.update_run(kept, status="RUNNING")
            return kept
        name = cfg.logging.mlflow_experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(name)
        )
        tags = {f"dino_opt.{k}": str(v) for k, v in metadata.items()}
        run = self.client.create_run(experiment_id, run_name=folder.root.name, tags=tags)
        run_id = run.info.run_id
        params = [self._param(k, v) for k, v in flat_params(cfg).items()]
        for i in range(0, len(params), _PARAMS_PER_CALL):
            self.client.log_batch(run_id, params=params[i : i + _PARAMS_PER_CALL])
        folder.mlflow_id.write_text(run_id + "\n")
        return run_id

    def metrics(self, values: dict[str, float], step: int) -> None:
        """Numbers at ``step`` (a metrics row's, or an evaluation's)."""
        stamp = int(1000 * time.time())
        found = [self._metric(k, v, stamp, step) for k, v in values.items()]
        for i in range(0, len(found), _METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=found[i : i + _METRICS_PER_CALL])

    def row(self, row: dict, prefix: str = "") -> None:
        """A metrics row's numbers (``step`` and ``epoch`` keys aside)."""
        values = _numbers(row, prefix)
        if values:
            self.metrics(values, int(row["step"]))

    def image(self, tag: str, picture, step: int) -> None:
        """A picture (uint8 ``(H, W, 3)`` array) as ``images/<tag>_step<N>.png``."""
        self.client.log_image(self.run_id, picture, artifact_file=f"images/{tag}_step{step}.png")

    def artifacts(self, paths: Iterable[Path], where: str | None = None) -> None:
        """Files and folders that exist among ``paths``, under ``where``."""
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), where or path.name)
            elif path.is_file():
                self.client.log_artifact(self.run_id, str(path), where)

    def close(self, report: dict | None) -> None:
        """A finished run (``report``): its report's numbers as metrics, the
        run folder's figures, reports and pictures as artifacts, status
        FINISHED; else (stopped, or failed) KILLED, to be resumed."""
        if report is not None:
            f = self._folder
            self.metrics(_numbers(report, "report/"), int(report.get("steps", 0)))
            self.artifacts([f.config, f.report, f.metrics, f.evaluation, f.profile])
            self.artifacts([f.training_curves, f.tsne("trained"), f.tsne("random_init")], "figures")
            self.artifacts([f.pictures])
        self.client.set_terminated(self.run_id, "FINISHED" if report is not None else "KILLED")
