"""Multi-process DINO training on torch.distributed (NCCL on GPUs, gloo on CPUs).

``N`` processes on a node, one per GPU (or N CPU processes), on one node or
several::

    dino-opt train --nproc N [--config my.yaml] [key=value ...]
    dino-opt train --nnodes M --node-rank R --master-addr HOST0 --master-port P --nproc N ...

through :func:`launch_distributed_training`, whose launcher
(:func:`~dino_opt.distributed.agent.run_agent`, torch's elastic agent with a
c10d rendezvous) restarts every process from the last checkpoint when one
fails; or through torchrun (``torchrun --nproc_per_node=N -m dino_opt.train``)
or SLURM (``srun`` sets ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``;
``MASTER_ADDR``/``MASTER_PORT`` must point at the first node).
The training job (:class:`~dino_opt.job.CheckpointedDINOTrainer`) then
wraps the student in DistributedDataParallel (the teacher is an EMA of it and
needs no gradients), shards the loader by rank, all-reduces the loss center
asynchronously (:class:`~dino_opt.ops.DINOLoss`) and the logged metrics in one
bucketed call, and lets rank 0 write checkpoints between barriers; every rank
resumes from the same checkpoint.

The process-group helpers themselves (:func:`~dino_opt.runtime.init_distributed`,
:func:`~dino_opt.runtime.all_reduce_metrics`, ...) live in :mod:`dino_opt.runtime`.
Here: the lesson's API, :class:`DistributedDINOTrainer` (process group, DDP
model, sharded loader, metric reduction, rank-0 checkpoint) and
:func:`launch_distributed_training`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import atomic_write, fsync_dir
from ..config import Config, apply_overrides, load_config
from ..data import MultiCropLoader
from ..job import CheckpointedDINOTrainer
from ..observe import RunFolder
from ..runtime import (
    all_reduce_metrics,
    barrier,
    init_distributed,
    wrap_student,
)
from ..tune import resolve_hardware
from .agent import exit_no_restart, run_agent

__all__ = ["DistributedDINOTrainer", "launch_distributed_training"]


class DistributedDINOTrainer:
    """The lesson's distributed trainer, on torch.distributed.

    ``DistributedDINOTrainer(rank, world_size, config, master_addr,
    master_port)`` joins the process group (NCCL with one GPU per rank, gloo on
    CPUs); with ``rank``/``world_size`` None it takes them from torchrun or
    SLURM. ``setup_distributed_model(model)`` wraps a model in
    DistributedDataParallel; ``setup_distributed_dataloader(source)`` gives a
    :class:`~dino_opt.data.MultiCropLoader` over this rank's shard (per-GPU
    batch ``config['data']['batch_size']``, or the lesson's
    ``config['training']['batch_size']`` divided by the world size);
    ``all_reduce_metrics`` averages a dict in one collective;
    ``save_checkpoint`` writes on rank 0 atomically, then all ranks meet at a
    barrier; ``cleanup()`` leaves the group.
    """

    def __init__(
        self,
        rank: int | None = None,
        world_size: int | None = None,
        config: dict | None = None,
        master_addr: str | None = None,
        master_port: str | int | None = None,
        backend: str | None = None,
        device: str = "auto",
    ):
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither (torchrun/SLURM)")
        if rank is not None:
            if not 0 <= rank < world_size:
                raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
            os.environ.setdefault("LOCAL_RANK", str(rank))
        if master_addr is not None:
            os.environ["MASTER_ADDR"] = str(master_addr)
        if master_port is not None:
            os.environ["MASTER_PORT"] = str(master_port)
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "12355")
        self.info = init_distributed(device, backend)
        self.rank, self.world_size = self.info.rank, self.info.world_size
        self.device = self.info.device
        self.config = dict(config or {})

    def setup_distributed_model(self, model: nn.Module) -> nn.Module:
        return wrap_student(model.to(self.device), self.device)

    def _batch_size(self) -> int:
        data = self.config.get("data") or {}
        if "batch_size" in data:
            return int(data["batch_size"])
        training = self.config.get("training") or {}
        if "batch_size" in training:  # the lesson's global batch
            total = int(training["batch_size"])
            if total % self.world_size:
                raise ValueError(
                    f"training.batch_size={total} is not divisible by the world size "
                    f"{self.world_size}"
                )
            return total // self.world_size
        raise ValueError("config needs data.batch_size (per GPU) or training.batch_size (global)")

    def setup_distributed_dataloader(self, source, **loader_kwargs):
        data = self.config.get("data") or {}
        training = self.config.get("training") or {}
        loader_kwargs.setdefault(
            "num_threads", data.get("num_workers", training.get("num_workers"))
        )
        return MultiCropLoader(
            source, self._batch_size(), rank=self.rank, world_size=self.world_size, **loader_kwargs
        )

    def all_reduce_metrics(self, metrics: dict) -> dict[str, float]:
        return all_reduce_metrics(metrics, self.device if self.device.type == "cuda" else None)

    def save_checkpoint(self, checkpoint_data: dict, filepath: str | os.PathLike) -> None:
        if self.rank == 0:
            path = Path(filepath)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, lambda f: torch.save(checkpoint_data, f))
            fsync_dir(path.parent)
        barrier()

    def cleanup(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _train_entry(config: Config, output_dir) -> dict:
    """One worker's job. Its error is printed in one line (the launcher's
    own line only names the rank and its exit status); bad input (a
    ValueError: a config or a checkpoint this run cannot use) ends it through
    :func:`~dino_opt.distributed.agent.exit_no_restart`, since a restart
    would fail the same way."""
    rank = os.environ.get("RANK", "0")
    quiet = rank != "0"  # one progress bar, rank 0's
    try:
        return CheckpointedDINOTrainer(config, output_dir=output_dir, quiet=quiet).train()
    except ValueError as e:
        exit_no_restart(f"dino-opt: rank {rank}: {e}")
    except Exception as e:
        print(f"dino-opt: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise


# The signals torch's launcher takes over in the process that calls it.
_LAUNCHER_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


@contextlib.contextmanager
def _signal_handlers_kept():
    """This process's handlers of the launcher's signals, put back after it:
    the launcher installs its own and leaves them there (a notebook's kernel
    then cannot be interrupted)."""
    kept = {}
    if threading.current_thread() is threading.main_thread():
        kept = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def launch_distributed_training(
    config_path: str | os.PathLike | dict | Config | None,
    num_gpus: int,
    master_addr: str = "localhost",
    master_port: str | int | None = None,
    *,
    overrides: Iterable[str] = (),
    output_dir: str | os.PathLike | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    verbose: bool = False,
) -> dict:
    """Trains with ``num_gpus`` processes on this node through torch's
    elastic agent (:func:`~dino_opt.distributed.agent.run_agent`): a failed
    worker (a signal, a non-zero exit, the hang watchdog) stops and restarts
    every worker, which resume from the newest complete checkpoint, at most
    ``distributed.max_restarts`` times; then
    :class:`~dino_opt.distributed.agent.WorkerFailedError` (or
    :class:`~dino_opt.runtime.TrainingHungError` for a hang) says in one line
    which rank failed, how, after which step, and the last checkpoint.
    Without CUDA the processes run on the CPU with gloo. Returns rank 0's
    report (read from the run folder on the other nodes).

    ``nnodes`` > 1: this is node ``node_rank`` of ``nnodes``, each started
    the same way; they meet at ``master_addr:master_port`` (node 0 hosts the
    rendezvous, torch's c10d), and the run folder (``output_dir`` or
    ``logging.output_dir``, required) must be one they all see. One node:
    ``master_port`` None is a free port. ``verbose``: torch's launcher logs
    (a failed worker's traceback among them).

    ``config_path``: a YAML path, a dict of sections, a
    :class:`~dino_opt.config.Config` or None (the defaults). It is read and
    its hardware preset resolved here, once; the processes receive the
    resolved config."""
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an int >= 1, got {num_gpus!r}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in [0, nnodes={nnodes}), got {node_rank}")
    if isinstance(config_path, Config):
        cfg = apply_overrides(config_path, overrides)
    else:
        cfg = load_config(config_path, overrides)
    cfg, _ = resolve_hardware(cfg)
    device = cfg.hardware.device
    on_gpu = device != "cpu" and torch.cuda.is_available()
    if on_gpu and num_gpus > torch.cuda.device_count():
        raise ValueError(
            f"num_gpus={num_gpus} but this node has {torch.cuda.device_count()} GPUs "
            "(hardware.device=cpu runs the processes on the CPU with gloo)"
        )
    out = output_dir or cfg.logging.output_dir
    if nnodes > 1 and (out is None or master_port is None):
        raise ValueError(
            "several nodes need the run folder (--output-dir, on storage every node sees at "
            "the same path) and the rendezvous port (--master-port)"
        )
    out = out or time.strftime("runs/%Y%m%d-%H%M%S")  # one run folder for all ranks and attempts
    folder = RunFolder(out)
    with _signal_handlers_kept():
        results = run_agent(
            _train_entry,
            (cfg, str(out)),
            folder=folder,
            nproc=num_gpus,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=int(master_port or 0),
            max_restarts=cfg.distributed.max_restarts,
            verbose=verbose,
        )
    if 0 in results:
        return results[0]
    return json.loads(folder.report.read_text())
