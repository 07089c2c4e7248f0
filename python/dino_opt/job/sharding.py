"""How the job spreads its networks over the ranks (``distributed.strategy``)
and what that changes in its state: with ``ddp`` every rank holds the whole
student (in DistributedDataParallel), teacher and optimizer, and rank 0 saves
them in one file; with ``fsdp`` each rank holds its shards (FSDP2), saves them
itself into a sharded checkpoint and loads them back at any world size. The
frozen copies of the teacher's backbone a recipe's loss keeps (the dinov3
recipe's Gram teacher) follow the teacher: whole on every rank with ``ddp``,
sharded as the teacher's backbone with ``fsdp``, their shards saved with the
networks' (the loss's other state, small, with the rest). Either way a run
resumes at another world size: the loader's position is carried over in
images seen (:func:`resharded_loader_state`)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
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
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..checkpoint import load_shards
from ..config import Config
from ..runtime import (
    StudentGroups,
    is_sharded,
    resolve_precision,
    shard_frozen_backbone,
    shard_model,
    wrap_student,
)

__all__ = [
    "full_teacher",
    "load_full_state",
    "load_loss_state",
    "load_sharded_state",
    "load_whole_state",
    "optimizer_state_by_position",
    "resharded_loader_state",
    "sharded_state",
    "split_shards",
    "spread",
]

#: The parts of the state a sharded checkpoint keeps as shards.
SHARDED_KEYS = ("student", "teacher", "optimizer")
#: The part of it that holds the shards of the loss's frozen networks, when it has any.
LOSS_KEY = "loss"


def spread(
    cfg: Config,
    student: nn.Module,
    teacher: nn.Module,
    device: torch.device,
    frozen: Sequence[nn.Module] = (),
    external: nn.Module | None = None,
    groups: StudentGroups | None = None,
):
    """(student as trained, teacher) after ``distributed.strategy``: DDP
    around the student when there are several ranks (with ``groups``, over
    its student's group; none when that is one rank), or both networks
    sharded with FSDP2 in place (parameters in the precision's dtype while
    gathered, gradients reduced in float32). ``frozen``: copies of the
    teacher's backbone that the loss keeps (made by
    :func:`~dino_opt.train.attach_frozen_copies` from the unsharded
    teacher), left whole with ddp, sharded as the teacher's backbone with
    fsdp. ``external``: a distillation's frozen teacher (a backbone, or a
    network with a ``backbone``), whole on every rank with ddp; with fsdp
    its backbone is sharded block by block (its heads stay whole), so that
    a teacher too large for one device is spread over the ranks."""
    if groups is not None:
        return _spread_groups(cfg, student, teacher, device, external, groups)
    if cfg.distributed.strategy == "ddp":
        return wrap_student(student, device), teacher
    dtype = resolve_precision(cfg.hardware.precision, device)
    reshard = cfg.distributed.reshard_after_forward
    shard_model(student, dtype, reshard_after_forward=reshard)
    # The teacher runs forward only: nothing to keep its gathered parameters for.
    shard_model(teacher, dtype, reshard_after_forward=True)
    for network in frozen:
        shard_frozen_backbone(network, dtype)
    if external is not None:
        shard_frozen_backbone(getattr(external, "backbone", external), dtype)
    return student, teacher


def _spread_groups(
    cfg: Config,
    student: nn.Module,
    teacher: nn.Module,
    device: torch.device,
    external: nn.Module | None,
    groups: StudentGroups,
):
    """:func:`spread` with each student on its own group of ranks: DDP over
    the group, or the student and its EMA sharded over it (fsdp; the
    frozen teacher's backbone over every rank, which all run its forward
    at once); nothing of the student's when the group is one rank."""
    if cfg.distributed.strategy == "ddp":
        return (wrap_student(student, device, groups.group) if groups.group else student), teacher
    dtype = resolve_precision(cfg.hardware.precision, device)
    if groups.group is not None:
        mesh = DeviceMesh.from_group(groups.group, device.type)
        reshard = cfg.distributed.reshard_after_forward
        shard_model(student, dtype, reshard_after_forward=reshard, mesh=mesh)
        shard_model(teacher, dtype, reshard_after_forward=True, mesh=mesh)
    if external is not None:
        shard_frozen_backbone(getattr(external, "backbone", external), dtype)
    return student, teacher


def _loss_shards(loss_state: dict) -> dict:
    """The sharded (``DTensor``) entries of a loss's state dict: the weights
    of its sharded frozen networks."""
    return {k: v for k, v in loss_state.items() if isinstance(v, DTensor)}


def split_shards(state: dict) -> dict:
    """Takes out of a sharded run's ``state`` (:meth:`~dino_opt.job.Job.state_dict`)
    what its checkpoint keeps as shards and returns it: the networks and the
    optimizer state (:data:`SHARDED_KEYS`), and under :data:`LOSS_KEY` the
    loss's sharded entries (its frozen networks' weights), when it has any.
    The rest stays (the loss's other state with it) and lists the keys taken
    in ``sharded_keys``."""
    shards = {key: state.pop(key) for key in SHARDED_KEYS if key in state}
    weights = _loss_shards(state.get("loss") or {})
    if weights:
        shards[LOSS_KEY] = weights
        state["loss"] = {k: v for k, v in state["loss"].items() if k not in weights}
    state["sharded_keys"] = list(shards)
    return shards


def sharded_state(student: nn.Module, teacher: nn.Module, optimizer) -> dict:
    """This rank's shards of the student, the teacher and (once it has any:
    asking for it earlier would initialise it) the optimizer's state."""
    shards = {"student": get_model_state_dict(student), "teacher": get_model_state_dict(teacher)}
    if optimizer.state:
        shards["optimizer"] = get_optimizer_state_dict(student, optimizer)
    return shards


def load_sharded_state(
    folder: str | Path,
    keys: list[str],
    student: nn.Module,
    teacher: nn.Module,
    optimizer,
    loss_fn: nn.Module | None = None,
) -> dict:
    """Collective: the shards of ``folder`` (those of ``keys``) loaded into
    the sharded networks and optimizer, whatever world size wrote them.
    Returns the loss's sharded entries read (empty when ``keys`` has none),
    for :func:`load_loss_state` with the loss's other state."""
    shards = {"student": get_model_state_dict(student), "teacher": get_model_state_dict(teacher)}
    if "optimizer" in keys:
        shards["optimizer"] = get_optimizer_state_dict(student, optimizer)
    if LOSS_KEY in keys and loss_fn is not None:
        shards[LOSS_KEY] = _loss_shards(loss_fn.state_dict())
    load_shards(folder, shards)
    set_model_state_dict(student, shards["student"])
    set_model_state_dict(teacher, shards["teacher"])
    if "optimizer" in keys:
        set_optimizer_state_dict(student, optimizer, shards["optimizer"])
    return shards.get(LOSS_KEY, {})


def load_loss_state(loss_fn: nn.Module, state: dict) -> None:
    """The loss's state dict ``state`` into ``loss_fn``. Where ``loss_fn``
    holds a shard (a sharded frozen network's weight) and ``state`` a whole
    tensor (a ddp checkpoint, or a sharded one read whole), this rank keeps
    its piece of it, cut locally (no communication)."""
    current = _loss_shards(loss_fn.state_dict())
    state = {
        k: _piece(v, current[k]) if k in current and not isinstance(v, DTensor) else v
        for k, v in state.items()
    }
    loss_fn.load_state_dict(state)


def _piece(whole: torch.Tensor, like: DTensor) -> DTensor:
    """This rank's piece of ``whole``, placed as ``like``."""
    if tuple(whole.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(whole.shape)} for one of {tuple(like.shape)}")
    whole = whole.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None)


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


def load_whole_state(state: dict, student: nn.Module, teacher: nn.Module, optimizer) -> None:
    """A whole state (``student``, ``teacher`` and, where it holds one, the
    ``optimizer``'s, keyed by position or by parameter name) into the
    networks and optimizer: as they are, or each rank keeping its shards
    of it when they are sharded."""
    if is_sharded(student):
        load_full_state({"optimizer": {"state": {}}, **state}, student, teacher, optimizer)
        return
    student.load_state_dict(state["student"])
    teacher.load_state_dict(state["teacher"])
    if "optimizer" in state:
        by_position = optimizer_state_by_position(state["optimizer"], student, optimizer)
        optimizer.load_state_dict(by_position)


def full_teacher(
    teacher: nn.Module, template: nn.Module, lead: bool, cpu_offload: bool = True
) -> nn.Module | None:
    """Collective for a sharded teacher (over every rank it is sharded
    over): the whole network where ``lead`` (a copy of ``template``, the
    unsharded network of the same architecture, holding the teacher's
    weights; None elsewhere). With ``cpu_offload`` the weights are gathered
    on the CPU of global rank 0 alone, which must be the lead; without it
    on every rank of the teacher's mesh, the lead's copy on the teacher's
    device. An unsharded teacher is returned as it is."""
    if not is_sharded(teacher):
        return teacher
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    weights = get_model_state_dict(teacher, options=options)
    if not lead:
        return None
    whole = copy.deepcopy(template)
    whole.load_state_dict({k: v.cpu() for k, v in weights.items()})
    return whole if cpu_offload else whole.to(next(iter(weights.values())).device)


def resharded_loader_state(states: list[dict], rank: int, world: int) -> dict:
    """This rank's loader state from the per-rank states of a run with
    another number of ranks: the same epoch, resumed after the images the
    old ranks had seen together, rounded down to whole batches of the new
    world (so at most one global batch of images is seen again)."""
    old = states[0]
    seen = int(old["next_batch"]) * int(old["batch_size"]) * len(states)
    per_batch = int(old["batch_size"]) * world
    return {**old, "rank": rank, "world_size": world, "next_batch": seen // per_batch}
