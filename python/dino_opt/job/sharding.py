"""How the job spreads its networks over the ranks (``distributed.strategy``)
and what that changes in its state: with ``ddp`` every rank holds the whole
student (in DistributedDataParallel), teacher and optimizer, and rank 0 saves
them in one file; with ``fsdp`` each rank holds its shards (FSDP2), saves them
itself into a sharded checkpoint and loads them back at any world size.
Either way a run resumes at another world size: the loader's position is
carried over in images seen (:func:`resharded_loader_state`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..checkpoint import load_shards
from ..config import Config
from ..runtime import is_sharded, resolve_precision, shard_model, wrap_student

__all__ = [
    "full_teacher_backbone",
    "load_full_state",
    "load_sharded_state",
    "optimizer_state_by_position",
    "resharded_loader_state",
    "sharded_state",
    "spread",
]

#: The parts of the state a sharded checkpoint keeps as shards.
SHARDED_KEYS = ("student", "teacher", "optimizer")


def spread(cfg: Config, student: nn.Module, teacher: nn.Module, device: torch.device):
    """(student as trained, teacher) after ``distributed.strategy``: DDP
    around the student when there are several ranks, or both networks
    sharded with FSDP2 in place (parameters in the precision's dtype while
    gathered, gradients reduced in float32)."""
    if cfg.distributed.strategy == "ddp":
        return wrap_student(student, device), teacher
    dtype = resolve_precision(cfg.hardware.precision, device)
    reshard = cfg.distributed.reshard_after_forward
    shard_model(student, dtype, reshard_after_forward=reshard)
    # The teacher runs forward only: nothing to keep its gathered parameters for.
    shard_model(teacher, dtype, reshard_after_forward=True)
    return student, teacher


def sharded_state(student: nn.Module, teacher: nn.Module, optimizer) -> dict:
    """This rank's shards of the student, the teacher and (once it has any:
    asking for it earlier would initialise it) the optimizer's state."""
    shards = {"student": get_model_state_dict(student), "teacher": get_model_state_dict(teacher)}
    if optimizer.state:
        shards["optimizer"] = get_optimizer_state_dict(student, optimizer)
    return shards


def load_sharded_state(
    folder: str | Path, keys: list[str], student: nn.Module, teacher: nn.Module, optimizer
) -> None:
    """Collective: the shards of ``folder`` (those of ``keys``) loaded into
    the sharded networks and optimizer, whatever world size wrote them."""
    shards = {"student": get_model_state_dict(student), "teacher": get_model_state_dict(teacher)}
    if "optimizer" in keys:
        shards["optimizer"] = get_optimizer_state_dict(student, optimizer)
    load_shards(folder, shards)
    set_model_state_dict(student, shards["student"])
    set_model_state_dict(teacher, shards["teacher"])
    if "optimizer" in keys:
        set_optimizer_state_dict(student, optimizer, shards["optimizer"])


def _names_by_position(student: nn.Module, optimizer) -> list[str]:
    """The parameter names in the order of the optimizer's groups (the
    positions that key torch's own optimizer state dicts)."""
    names = {id(p): n for n, p in student.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state_by_name(state: dict, student: nn.Module, optimizer) -> dict:
    """torch's optimizer state dict (keyed by position) keyed by parameter
    name instead, as full state dicts of torch.distributed.checkpoint are."""
    names = _names_by_position(student, optimizer)
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: s for i, s in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_position(state: dict, student: nn.Module, optimizer) -> dict:
    """An optimizer state for ``optimizer.load_state_dict``: torch's own
    (keyed by position) as it is, one keyed by parameter name (a sharded
    checkpoint's, read whole) keyed by position."""
    if not any(isinstance(n, str) for g in state["param_groups"] for n in g["params"]):
        return state
    position = {n: i for i, n in enumerate(_names_by_position(student, optimizer))}
    groups = [{**g, "params": [position[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {position[n]: s for n, s in state["state"].items()}, "param_groups": groups}


def load_full_state(state: dict, student: nn.Module, teacher: nn.Module, optimizer) -> None:
    """A whole state (a ddp checkpoint, read by every rank) into the sharded
    networks and optimizer: each rank keeps its shards of it."""
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(student, state["student"], options=full)
    set_model_state_dict(teacher, state["teacher"], options=full)
    if state["optimizer"]["state"]:
        by_name = _optimizer_state_by_name(state["optimizer"], student, optimizer)
        set_optimizer_state_dict(student, optimizer, by_name, options=full)


def full_teacher_backbone(teacher: nn.Module, template: nn.Module, lead: bool) -> nn.Module | None:
    """Collective for a sharded teacher: its whole backbone on rank 0 (a
    copy of ``template``'s, the unsharded network of the same architecture,
    holding the teacher's weights; None elsewhere). An unsharded teacher's
    backbone is returned as it is."""
    if not is_sharded(teacher):
        return teacher.backbone
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(teacher, options=options)
    if not lead:
        return None
    whole = copy.deepcopy(template)
    whole.load_state_dict(weights)
    return whole.backbone


def resharded_loader_state(states: list[dict], rank: int, world: int) -> dict:
    """This rank's loader state from the per-rank states of a run with
    another number of ranks: the same epoch, resumed after the images the
    old ranks had seen together, rounded down to whole batches of the new
    world (so at most one global batch of images is seen again)."""
    old = states[0]
    seen = int(old["next_batch"]) * int(old["batch_size"]) * len(states)
    per_batch = int(old["batch_size"]) * world
    return {**old, "rank": rank, "world_size": world, "next_batch": seen // per_batch}
