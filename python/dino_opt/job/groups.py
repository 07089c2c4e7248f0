"""What students on their own groups of ranks (``distributed.student_groups``,
:class:`~dino_opt.runtime.StudentGroups`) change in the job.

Each rank holds one student (its networks and optimizer); a checkpoint is
the same as a run of all the students on every rank writes (a
:class:`~dino_opt.train.StudentBank`'s keys, ``members.<name>.``, and its
optimizer state, each student's positions after the previous students'),
so that ``dino-opt export`` reads it as it is and either layout resumes
the other's. The lead of each group sends its student's state to rank 0,
which joins them (:func:`joined_state`); a resumed rank takes its student's
part of a checkpoint (:func:`own_state`). The loader is sharded over the
ranks of one group: the checkpoint keeps those ranks' positions.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from ..config import Config
from ..runtime import (
    StudentGroups,
    gather_objects,
    is_sharded,
    recv_state,
    send_state,
    student_groups,
)
from .sharding import load_whole_state, optimizer_state_by_position

__all__ = [
    "group_state",
    "joined_state",
    "layout_of",
    "load_group_state",
    "optimizer_sizes",
    "own_state",
    "send_to_lead",
    "whole_networks",
]


def layout_of(cfg: Config, rank: int, world: int) -> StudentGroups | None:
    """The groups of ``cfg``'s students (collective: makes the process
    groups), or None unless ``distributed.student_groups``."""
    if not cfg.distributed.student_groups:
        return None
    return student_groups(len(cfg.student_names), rank, world, cfg.data.batch_size)


def optimizer_sizes(groups: StudentGroups, optimizer) -> list[tuple[int, int]]:
    """Collective: (parameter groups, parameters) of each student's
    optimizer, by student: where its part of a joined state begins."""
    own = (
        groups.index,
        len(optimizer.param_groups),
        sum(len(g["params"]) for g in optimizer.param_groups),
    )
    sizes = {index: (n_groups, n_params) for index, n_groups, n_params in gather_objects(own)}
    return [sizes[i] for i in range(groups.students)]


def whole_networks(student: nn.Module, teacher: nn.Module, optimizer) -> dict:
    """This rank's student, EMA and optimizer states, whole (collective
    within the student's group when it is sharded over it): the optimizer's
    keyed by position, as torch's own."""
    if not is_sharded(student):
        return {
            "student": student.state_dict(),
            "teacher": teacher.state_dict(),
            "optimizer": optimizer.state_dict(),
        }
    full = StateDictOptions(full_state_dict=True)  # on every rank of the group
    out = {
        "student": get_model_state_dict(student, options=full),
        "teacher": get_model_state_dict(teacher, options=full),
        "optimizer": optimizer.state_dict(),
    }
    if optimizer.state:  # asking for it earlier would initialise it
        named = get_optimizer_state_dict(student, optimizer, options=full)
        out["optimizer"] = optimizer_state_by_position(named, student, optimizer)
    return out


def group_state(
    groups: StudentGroups,
    names: list[str],
    sizes: list[tuple[int, int]],
    student: nn.Module,
    teacher: nn.Module,
    optimizer,
) -> dict:
    """Collective: every student's networks and optimizer state joined on
    rank 0 (:func:`joined_state`); ``{}`` elsewhere."""
    states = send_to_lead(groups, whole_networks(student, teacher, optimizer))
    return joined_state(names, states, sizes) if states is not None else {}


def load_group_state(
    state: dict,
    names: list[str],
    groups: StudentGroups,
    sizes: list[tuple[int, int]],
    student: nn.Module,
    teacher: nn.Module,
    optimizer,
) -> None:
    """This rank's student's part of a state of all the students
    (:func:`own_state`) into its networks and optimizer (each rank keeps
    its shards of it when they are sharded)."""
    load_whole_state(
        own_state(state, names, groups, sizes, student, optimizer), student, teacher, optimizer
    )


def _on_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_cpu(v) for v in value]
    return value


def send_to_lead(groups: StudentGroups, networks: dict) -> list[dict] | None:
    """Collective: every group lead's ``networks`` (its student's
    ``student``, ``teacher`` and ``optimizer`` states), on the CPU, by
    student, on rank 0 (None elsewhere). Each other lead sends its own to
    rank 0 alone (a gather would pad every rank's share to the largest), its
    tensors as one buffer (:func:`~dino_opt.runtime.send_state`)."""
    if dist.get_rank() == 0:
        others = [recv_state(groups.lead_rank(i)) for i in range(1, groups.students)]
        return [_on_cpu(networks), *others]
    if groups.lead:
        send_state(networks, 0)
    return None


def joined_state(names: list[str], states: list[dict], sizes: list[tuple[int, int]]) -> dict:
    """One state of all the students from each one's ``states`` (in the
    order of ``names``): its networks' keys under ``members.<name>.``, its
    optimizer's parameters numbered after the previous students'."""
    out = {"student": {}, "teacher": {}}
    per_param, param_groups, offset = {}, [], 0
    for name, state, (_, n_params) in zip(names, states, sizes, strict=True):
        for key in ("student", "teacher"):
            out[key].update({f"members.{name}.{k}": v for k, v in state[key].items()})
        optim = state["optimizer"]
        per_param.update({offset + i: s for i, s in optim["state"].items()})
        param_groups += [
            {**g, "params": [offset + i for i in g["params"]]} for g in optim["param_groups"]
        ]
        offset += n_params
    out["optimizer"] = {"state": per_param, "param_groups": param_groups}
    return out


def _strip(state: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _own_optimizer(
    state: dict, groups: StudentGroups, prefix: str, sizes: list[tuple[int, int]]
) -> dict:
    """Student ``groups.index``'s part of a joined optimizer state: by
    position (its groups and parameters after the previous students'), or
    by name (a sharded run's, read whole: the names under ``prefix``)."""
    named = any(isinstance(n, str) for g in state["param_groups"] for n in g["params"])
    if named:
        own = [
            g
            for g in state["param_groups"]
            if g["params"] and all(n.startswith(prefix) for n in g["params"])
        ]
        return {
            "state": _strip(state["state"], prefix),
            "param_groups": [{**g, "params": [n[len(prefix) :] for n in g["params"]]} for g in own],
        }
    first_group = sum(n for n, _ in sizes[: groups.index])
    offset = sum(n for _, n in sizes[: groups.index])
    n_groups, n_params = sizes[groups.index]
    own = state["param_groups"][first_group : first_group + n_groups]
    return {
        "state": {
            i - offset: s for i, s in state["state"].items() if offset <= i < offset + n_params
        },
        "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in own],
    }


def own_state(
    state: dict,
    names: list[str],
    groups: StudentGroups,
    sizes: list[tuple[int, int]],
    student: nn.Module,
    optimizer,
) -> dict:
    """This rank's student's part of a state of all the students
    (:func:`joined_state`'s, or a run's of every student on every rank):
    ``student``, ``teacher`` and (when the state has one) ``optimizer``,
    ready for their ``load_state_dict``. KeyError naming the student when
    the state has none of it."""
    prefix = f"members.{names[groups.index]}."
    out = {key: _strip(state[key], prefix) for key in ("student", "teacher")}
    if not out["student"]:
        raise KeyError(f"the checkpoint holds no student {names[groups.index]!r}")
    if "optimizer" in state:
        optim = _own_optimizer(state["optimizer"], groups, prefix, sizes)
        out["optimizer"] = optimizer_state_by_position(optim, student, optimizer)
    return out
