"""A run's place among several processes (torch.distributed, started by
torchrun, SLURM or ``dino-opt train --nproc``) and the collectives it needs: a
bucketed metric all-reduce, object gather and broadcast, DistributedDataParallel."""

from __future__ import annotations

import contextlib
import inspect
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .device import resolve_device, with_index
from .sharding import FSDPModule, fsdp_no_sync

__all__ = [
    "DistInfo",
    "all_reduce_metrics",
    "barrier",
    "broadcast_object",
    "gather_objects",
    "init_distributed",
    "is_distributed",
    "launched_world",
    "no_sync",
    "rank",
    "world_size",
    "wrap_student",
]


# ---------------------------------------------------------------- processes


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
    device: str = "auto",
    backend: str | None = None,
    timeout_s: float | None = None,
    *,
    group_alone: bool = False,
) -> DistInfo:
    """Joins the process group the launcher describes (torchrun or SLURM
    variables; see :func:`launched_world`), once; a single process stays
    alone, or with ``group_alone`` forms a group of one (what sharding with
    FSDP needs). ``device`` 'auto' is ``cuda:LOCAL_RANK`` when CUDA is
    available, else the CPU; ``backend`` defaults to NCCL on CUDA and gloo on
    the CPU. ``timeout_s``: how long a collective may wait before it fails
    (NCCL's asynchronous error handling is switched on, unless the
    environment chooses otherwise)."""

    placed = launched_world()
    if placed is None or placed[1] == 1:
        dev = with_index(resolve_device(device))
        if group_alone and not dist.is_initialized():
            dist.init_process_group(
                backend or ("nccl" if dev.type == "cuda" else "gloo"),
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                **({"device_id": dev} if dev.type == "cuda" else {}),
            )
        return DistInfo(0, 1, 0, dev, dist.is_initialized())
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
        if use_cuda and backend in (None, "nccl"):
            # a failed or timed-out NCCL collective aborts the communicator
            # and raises, instead of blocking the process
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
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
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if (is_distributed() and dist.get_backend() == "nccl")
            else torch.device("cpu")
        )
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


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` (picklable) on every rank; alone, ``obj``."""
    if not is_distributed():
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def wrap_student(
    student: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None
) -> nn.Module:
    """The student in DistributedDataParallel when distributed (over
    ``group``'s ranks when given, else all of them), else unchanged.
    BatchNorm layers: synchronised across those ranks on GPUs
    (SyncBatchNorm); on CPUs, where SyncBatchNorm does not run, each rank
    normalises by its own batch and the running statistics are rank 0's,
    broadcast before each forward."""
    if not is_distributed():
        return student
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in student.modules())
    if has_bn and device.type == "cuda":
        student = nn.SyncBatchNorm.convert_sync_batchnorm(student, process_group=group)
    ids = [device.index] if device.type == "cuda" else None
    # Buffers broadcast before each forward only for unsynchronised BatchNorm
    # (otherwise DINO's buffers are synchronised statistics or constants);
    # torch 2.13 renamed the switch.
    params = inspect.signature(DistributedDataParallel).parameters
    switch = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    broadcast = {switch: has_bn and device.type != "cuda"}
    return DistributedDataParallel(student, device_ids=ids, process_group=group, **broadcast)


def no_sync(module: nn.Module, skip: bool):
    """When ``skip``: ``module.no_sync()`` for DDP, :func:`fsdp_no_sync` for
    a sharded module; the backward passes of a step but its last accumulate
    gradients without reducing them."""
    if skip and isinstance(module, FSDPModule):
        return fsdp_no_sync(module)
    if skip and hasattr(module, "no_sync"):
        return module.no_sync()
    return contextlib.nullcontext()
