"""Multi-process DINO training on torch.distributed (NCCL on GPUs, gloo on CPUs).

Two ways to start ``N`` processes, one per GPU (or N CPU processes)::

    torchrun --nproc_per_node=N -m dino_opt.train [--config my.yaml] [key=value ...]
    dino-opt train --nproc N [--config my.yaml] [key=value ...]

and, on several nodes, torchrun's rendezvous (``--nnodes``, ``--node_rank``,
``--rdzv_endpoint``) or SLURM (``srun`` sets ``SLURM_PROCID``/``SLURM_NTASKS``/
``SLURM_LOCALID``; ``MASTER_ADDR``/``MASTER_PORT`` must point at the first node).
The training job (:class:`~dino_opt.checkpoint.CheckpointedDINOTrainer`) then
wraps the student in DistributedDataParallel (the teacher is an EMA of it and
needs no gradients), shards the loader by rank, all-reduces the loss center
asynchronously (:class:`~dino_opt.loss.DINOLoss`) and the logged metrics in one
bucketed call, and lets rank 0 write checkpoints between barriers; every rank
resumes from the same checkpoint.

Also the lesson's API: :class:`DistributedDINOTrainer` (process group, DDP
model, sharded loader, metric reduction, rank-0 checkpoint) and
:func:`launch_distributed_training`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistInfo",
    "DistributedDINOTrainer",
    "all_reduce_metrics",
    "barrier",
    "init_distributed",
    "is_distributed",
    "launch_distributed_training",
    "rank",
    "world_size",
]


@dataclass(frozen=True)
class DistInfo:
    """This process's place: ``rank`` of ``world_size``, ``local_rank`` on its
    node, and its ``device``; ``initialized`` when a process group is up."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    initialized: bool


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def launched_world() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from torchrun's variables (RANK,
    WORLD_SIZE, LOCAL_RANK) or SLURM's (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID); None when the process was not started as one of several."""
    world = _env_int("WORLD_SIZE")
    if world is not None:
        r = _env_int("RANK")
        if r is None:
            raise ValueError("WORLD_SIZE is set but RANK is not (start the job with torchrun)")
        return r, world, _env_int("LOCAL_RANK") or 0
    world = _env_int("SLURM_NTASKS")
    if world is not None and world > 1:
        return _env_int("SLURM_PROCID") or 0, world, _env_int("SLURM_LOCALID") or 0
    return None


def init_distributed(
    device: str = "auto", backend: str | None = None, timeout_s: float | None = None
) -> DistInfo:
    """Joins the process group the launcher describes (torchrun or SLURM
    variables; see :func:`launched_world`), once; a single process stays
    alone. ``device`` 'auto' is ``cuda:LOCAL_RANK`` when CUDA is available,
    else the CPU; ``backend`` defaults to NCCL on CUDA and gloo on the CPU."""
    from datetime import timedelta

    placed = launched_world()
    if placed is None or placed[1] == 1:
        from .trainer import resolve_device

        return DistInfo(0, 1, 0, resolve_device(device), dist.is_initialized())
    r, world, local = placed
    if device == "auto":
        use_cuda = torch.cuda.is_available()
    else:
        use_cuda = torch.device(device).type == "cuda"
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {local} has no GPU: this node has {torch.cuda.device_count()}; "
                "start at most that many processes per node"
            )
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise ValueError(
                    f"{name} is not set: torchrun sets it; under SLURM export MASTER_ADDR (the "
                    "first node's host name) and MASTER_PORT before srun"
                )
        kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        dist.init_process_group(
            backend or ("nccl" if use_cuda else "gloo"),
            rank=r,
            world_size=world,
            **({"device_id": dev} if use_cuda else {}),
            **kwargs,
        )
    return DistInfo(r, world, local, dev, True)


def all_reduce_metrics(metrics: dict[str, float | torch.Tensor], device=None) -> dict[str, float]:
    """The mean over ranks of each metric, in one all-reduce of one tensor
    (the lesson reduces each metric on its own: one collective and one host
    sync per key). Non-numeric values are left out. Alone: the values as floats."""
    keys = [k for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))]
    if not keys:
        return {}
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if (
            is_distributed() and dist.get_backend() == "nccl"
        ) else torch.device("cpu")  # fmt: skip
    values = torch.stack(
        [torch.as_tensor(metrics[k], dtype=torch.float64).to(device).reshape(()) for k in keys]
    )
    if is_distributed():
        dist.all_reduce(values)
        values /= dist.get_world_size()
    return dict(zip(keys, values.tolist(), strict=True))


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def wrap_student(student: nn.Module, device: torch.device) -> nn.Module:
    """The student in DistributedDataParallel when distributed (BatchNorm
    layers synchronised across ranks), else unchanged."""
    if not is_distributed():
        return student
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in student.modules()):
        student = nn.SyncBatchNorm.convert_sync_batchnorm(student)
    ids = [device.index] if device.type == "cuda" else None
    # No buffer broadcast before each forward (DINO's buffers are synchronised
    # BatchNorm statistics or constants); torch 2.13 renamed the switch.
    params = inspect.signature(DistributedDataParallel).parameters
    no_sync_buffers = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in params
        else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(student, device_ids=ids, **no_sync_buffers)


def no_sync(module: nn.Module, skip: bool):
    """``module.no_sync()`` when ``skip`` and the module is DDP: the backward
    passes of a step but its last accumulate gradients without all-reducing."""
    if skip and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()


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
        from .data import MultiCropLoader

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
            from .checkpoint import _atomic_write, _fsync_dir

            path = Path(filepath)
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, lambda f: torch.save(checkpoint_data, f))
            _fsync_dir(path.parent)
        barrier()

    def cleanup(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _train_entry(config, overrides, output_dir) -> dict:
    from .checkpoint import CheckpointedDINOTrainer

    quiet = os.environ.get("RANK", "0") != "0"  # one progress bar, rank 0's
    return CheckpointedDINOTrainer(
        config, overrides=overrides, output_dir=output_dir, quiet=quiet
    ).train()


# The signals torchrun's launcher takes over in the process that calls it.
_LAUNCHER_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    if hasattr(signal, name)
)


def launch_distributed_training(
    config_path: str | os.PathLike | dict | None,
    num_gpus: int,
    master_addr: str = "localhost",
    master_port: str | int | None = None,
    *,
    overrides: Iterable[str] = (),
    output_dir: str | os.PathLike | None = None,
) -> dict:
    """Trains with ``num_gpus`` processes on this node through torchrun's
    launcher (``torch.distributed.launcher``: failures of one rank stop the
    others and are raised here). Without CUDA the processes run on the CPU
    with gloo. Returns rank 0's report. ``master_port`` None: a free port."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not isinstance(num_gpus, int) or isinstance(num_gpus, bool) or num_gpus < 1:
        raise ValueError(f"num_gpus must be an int >= 1, got {num_gpus!r}")
    from .config import load_config

    device = load_config(config_path, overrides).hardware.device  # checks the config, too
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
    cfg = str(config_path) if isinstance(config_path, (str, os.PathLike)) else config_path
    # The launcher installs its own handlers for these signals in this process
    # and leaves them there (a notebook's kernel then cannot be interrupted).
    kept = {}
    if threading.current_thread() is threading.main_thread():
        kept = {sig: signal.getsignal(sig) for sig in _LAUNCHER_SIGNALS}
    try:
        results = elastic_launch(launch, _train_entry)(cfg, list(overrides), output_dir)
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    return results[0]
