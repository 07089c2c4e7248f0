"""Where a training run reports to: ``metrics.jsonl``, TensorBoard, Weights &
Biases, MLflow (:mod:`~dino_opt.observe.mlflow_run`) and the progress bar,
as one object (:class:`RunLog`) that the training job writes rows to. Only
the first process of a run writes; the others get a :class:`RunLog` that
writes nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from ..config import Config
from ..runtime import compile_totals
from .mlflow_run import MlflowRun
from .runfiles import RunFolder

__all__ = ["RunLog"]


def _start_wandb(cfg: Config, folder: RunFolder, metadata: dict):
    """A Weights & Biases run for this run folder (resumed with it: the id
    is kept in the folder). WANDB_MODE=offline logs without a network."""
    try:
        import wandb  # optional dependency: the `wandb` extra
    except ImportError as e:
        raise ImportError(
            "logging.wandb=true needs the wandb package: pip install 'dino_opt[wandb]'"
        ) from e
    run_id = folder.wandb_id.read_text().strip() if folder.wandb_id.exists() else None
    run = wandb.init(
        project=cfg.logging.wandb_project,
        dir=str(folder.root),
        id=run_id,
        resume="allow",
        name=folder.root.name,
        config={**cfg.to_dict(), "metadata": metadata},
    )
    folder.wandb_id.write_text(run.id + "\n")
    return run


class RunLog:
    """The sinks of one run. ``write(row)`` appends a metrics row to
    ``metrics.jsonl`` (flushed), TensorBoard scalars and W&B;
    ``alerts``/``histogram`` add health alerts and per-image histograms;
    ``advance()`` moves the progress bar (after the run's first step, with
    ``hardware.compile`` on, it says what was compiled and how long that
    took, and writes it as a ``compiled`` event). ``close(report)`` closes them all,
    handing the report to W&B as the run's summary.

    Args:
        cfg: the run's config (``logging`` says which sinks are on).
        folder: the run folder.
        lead: whether this process writes (the first of a run).
        step: the step the run starts from (a resumed run continues its
            TensorBoard curves from there).
        total: the steps of the whole run, for the progress bar.
        metadata: versions and commit, for W&B.
        history: the rows of a resumed run so far, written again first.
        quiet: no progress bar.
    """

    def __init__(
        self,
        cfg: Config,
        folder: RunFolder,
        *,
        lead: bool,
        step: int,
        total: int,
        metadata: dict,
        history: Sequence[dict] = (),
        quiet: bool = False,
    ) -> None:
        log = cfg.logging
        self.lead = lead
        self._file = open(folder.metrics, "w") if lead else None  # closed in close()
        self._tb = None
        if log.tensorboard and lead:
            self._tb = SummaryWriter(str(folder.tensorboard), purge_step=step + 1 if step else None)
        self._wandb = _start_wandb(cfg, folder, metadata) if log.wandb and lead else None
        self._mlflow = MlflowRun(cfg, folder, metadata) if log.mlflow and lead else None
        self._bar = tqdm(
            total=total,
            initial=step,
            unit="batch",
            desc="train",
            disable=quiet or not log.progress or not lead,
        )
        for row in history:  # a resumed run's metrics so far, then its own
            self._write_line(row)
        self._step = step
        self._compiling = cfg.hardware.compile is True
        self._quiet = quiet

    def compiled(self) -> dict:
        """The ``compiled`` event of the graphs and seconds ``torch.compile``
        spent so far (in a process that compiles, the first step's blocks:
        one graph per block's crop sizes and drop-path rate, forward and
        backward), printed and written to the sinks."""
        graphs, seconds = compile_totals()
        row = {
            "step": self._step,
            "event": "compiled",
            "graphs": graphs,
            "seconds": round(seconds, 2),
        }
        if self.lead and not self._quiet:
            tqdm.write(
                f"torch.compile: {graphs} graphs of the ViT blocks (whole, static shapes "
                f"per crop size) in {seconds:.1f} s, during the first step"
            )
        self.event(row)
        return row

    def _write_line(self, row: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")

    def advance(self) -> None:
        """One more batch on the progress bar."""
        self._bar.update()
        self._step += 1
        if self._compiling:
            self._compiling = False
            self.compiled()

    def write(self, row: dict[str, Any]) -> None:
        """One metrics row (``step`` and ``epoch`` keys, numbers and lists)."""
        self._write_line(row)
        if self._file is not None:
            self._file.flush()
        step = row["step"]
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "epoch") and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)
        if self._mlflow is not None:
            self._mlflow.row(row)
        # memory: the GPU allocator's peak on a GPU, else the process's RSS
        mem = row.get("gpu_memory_peak_gb", row.get("host_rss_gb", 0.0))
        self._bar.set_postfix(
            loss=f"{row['loss']:.3f}",
            lr=f"{row['lr']:.2e}",
            ips=f"{row['images_per_second']:.0f}",
            mem=f"{mem:.2f}G",
        )

    def event(self, row: dict[str, Any]) -> None:
        """A row that is not a metrics row (``step``, ``epoch``, ``event`` and
        what it says): in ``metrics.jsonl`` among the rows, and as
        TensorBoard text under ``events``."""
        self._write_line(row)
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.add_text(f"events/{row['event']}", json.dumps(row), row["step"])
        if self._wandb is not None:
            self._wandb.log({f"events/{row['event']}": json.dumps(row)}, step=row["step"])

    def scalars(self, prefix: str, values: dict[str, Any], step: int) -> None:
        """Numbers of an evaluation (``values``), as TensorBoard scalars
        ``<prefix>/<name>`` and in W&B; other values are passed over."""
        numbers = {
            f"{prefix}/{k}": v
            for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self._tb is not None:
            for k, v in numbers.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None and numbers:
            self._wandb.log(numbers, step=step)
        if self._mlflow is not None and numbers:
            self._mlflow.metrics(numbers, step)

    def image(self, tag: str, picture, step: int) -> None:
        """A picture (uint8 ``(height, width, 3)`` array) in TensorBoard and MLflow."""
        if self._tb is not None:
            self._tb.add_image(tag, picture, step, dataformats="HWC")
        if self._mlflow is not None:
            self._mlflow.image(tag, picture, step)

    @property
    def tracks_artifacts(self) -> bool:
        """Whether files handed to :meth:`artifacts` go anywhere (MLflow)."""
        return self._mlflow is not None

    def artifacts(self, paths, where: str | None = None) -> None:
        """Files or folders kept with the run in MLflow, under ``where``."""
        if self._mlflow is not None:
            self._mlflow.artifacts(paths, where)

    def alerts(self, messages: Sequence[str], step: int) -> None:
        """Health alerts, as TensorBoard text."""
        if self._tb is not None:
            for message in messages:
                self._tb.add_text("health/alerts", message, step)

    @property
    def histograms(self) -> bool:
        """Whether histograms have somewhere to go (TensorBoard)."""
        return self._tb is not None

    def histogram(self, name: str, values: torch.Tensor, step: int) -> None:
        if self._tb is not None:
            self._tb.add_histogram(name, values, step)

    def close(self, report: dict | None = None) -> None:
        """Closes every sink; ``report`` (a finished run's) becomes the W&B
        summary, and MLflow's run gets the run folder's figures and reports
        and is marked finished (without one: killed, to be resumed)."""
        self._bar.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            if report is not None:
                self._wandb.summary.update({k: v for k, v in report.items() if k != "profile"})
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            self._mlflow.close(report)
            self._mlflow = None
