"""Multi-process DINO training on torch.distributed (NCCL on GPUs, gloo on CPUs).

Two ways to start ``N`` processes, one per GPU (or N CPU processes)::

    torchrun --nproc_per_node=N -m dino_opt.train [--config my.yaml] [key=value ...]
    dino-opt train --nproc N [--config my.yaml] [key=value ...]

and, on several nodes, torchrun's rendezvous (``--nnodes``, ``--node_rank``,
``--rdzv_endpoint``) or SLURM (``srun`` sets ``SLURM_PROCID``/``SLURM_NTASKS``/
``SLURM_LOCALID``; ``MASTER_ADDR``/``MASTER_PORT`` must point at the first node).
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

import os
import signal
import socket
import threading
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..checkpoint import atomic_write, fsync_dir
from ..config import Config, apply_overrides, load_config
from ..data import MultiCropLoader
from ..job import CheckpointedDINOTrainer
from ..runtime import (
    EXIT_HANG,
    TrainingHungError,
    all_reduce_metrics,
    barrier,
    init_distributed,
    wrap_student,
)
from ..tune import resolve_hardware

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _train_entry(config: Config, output_dir) -> dict:
    quiet = os.environ.get("RANK", "0") != "0"  # one progress bar, rank 0's
    return CheckpointedDINOTrainer(config, output_dir=output_dir, quiet=quiet).train()


# The signals torchrun's launcher takes over in the process that calls it.
_LAUNCHER_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def launch_distributed_training(
    config_path: str | os.PathLike | dict | Config | None,
    num_gpus: int,
    master_addr: str = "localhost",
    master_port: str | int | None = None,
    *,
    overrides: Iterable[str] = (),
    output_dir: str | os.PathLike | None = None,
) -> dict:
    """Trains with ``num_gpus`` processes on this node through torchrun's
    launcher (``torch.distributed.launcher``: failures of one rank stop the
    others and are raised here; :class:`~dino_opt.runtime.TrainingHungError`
    when the hang watchdog ended them). Without CUDA the processes run on the CPU
    with gloo. Returns rank 0's report. ``master_port`` None: a free port.

    ``config_path``: a YAML path, a dict of sections, a
    :class:`~dino_opt.config.Config` or None (the defaults). It is read and
    its hardware preset resolved here, once; the processes receive the
    resolved config."""
    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an int >= 1, got {num_gpus!r}")
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
    port = int(master_port) if master_port is not None else _free_port()
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_gpus,
        rdzv_backend="static",
        rdzv_endpoint=f"{master_addr}:{port}",
        rdzv_configs={"rank": 0},
        run_id=f"dino_opt_{os.getpid()}",
        max_restarts=0,
        monitor_interval=0.5,
    )
    # The launcher installs its own handlers for these signals in this process
    # and leaves them there (a notebook's kernel then cannot be interrupted).
    kept = {}
    if threading.current_thread() is threading.main_thread():
        kept = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        results = elastic_launch(launch, _train_entry)(cfg, output_dir)
    except ChildFailedError as e:
        if EXIT_HANG in {f.exitcode for f in e.failures.values()}:
            raise TrainingHungError(
                f"the hang watchdog ended the run (distributed.hang_timeout_s="
                f"{cfg.distributed.hang_timeout_s:g}); its diagnosis is above and in "
                f"{os.path.join(output_dir or '<run folder>', 'hang.json')}; run the same "
                "command again to resume from the last checkpoint"
            ) from None
        raise
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    return results[0]
