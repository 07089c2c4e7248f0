"""The first weights of a distillation's students
(``recipe.distill.students_init_from``, one file or ``none`` per student of
``recipe.distill.students``; the first student, ``model.backbone``, starts
from ``model.init_from``).

A built-in backbone reads any format ``model.init_from`` reads
(:func:`~dino_opt.weights.load_backbone`). A network of the user's own
(``timm:``, ``torchvision:``, ``package.module:function``) reads its own
state dict (safetensors or a torch file, ``module.`` prefixes stripped),
as ``net.load_state_dict`` would, except that a classifier the student has
not (timm's and torchvision's ``fc``, ``head``, ``classifier``) is left out.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ...config import Config
from ...models import ExternalBackbone
from ...ops import unwrap
from ...train import StudentBank
from .backbone import load_backbone
from .reading import read_state_dict

__all__ = ["load_student_start", "start_students", "student_starts"]

# The top-level names of the classifiers that timm and torchvision models
# have and a student built without one has not.
_CLASSIFIERS = ("fc", "head", "classifier", "last_linear")


def _load_own(path: str | os.PathLike, backbone: ExternalBackbone) -> list[str]:
    state = {k.removeprefix("module."): v for k, v in read_state_dict(path).items()}
    if state and all(k.startswith("net.") for k in state):  # a dino_opt student's backbone
        state = {k.removeprefix("net."): v for k, v in state.items()}
    try:
        with torch.no_grad():
            result = backbone.net.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that do not fit: one line naming the file
        raise ValueError(
            f"{path} does not fit {backbone.name}: {' '.join(str(e).split())}"
        ) from None
    left_out = [k for k in result.unexpected_keys if k.split(".")[0] in _CLASSIFIERS]
    unexpected = [k for k in result.unexpected_keys if k not in left_out]
    if result.missing_keys or unexpected:
        raise ValueError(
            f"{path} does not fit {backbone.name}: missing {len(result.missing_keys)} key(s) "
            f"{result.missing_keys[:4]}, unexpected {len(unexpected)} {unexpected[:4]}"
        )
    note = f"{backbone.name} from {path}"
    return [note + (f" (its classifier left out: {len(left_out)} tensors)" if left_out else "")]


def load_student_start(path: str | os.PathLike, backbone: nn.Module) -> list[str]:
    """Loads the weights at ``path`` into a student's ``backbone`` (see the
    module docstring); returns notes on what was loaded. ValueError naming
    the file and what does not fit."""
    if isinstance(backbone, ExternalBackbone):
        return _load_own(path, backbone)
    return load_backbone(path, backbone)


def student_starts(cfg: Config) -> list[str | None]:
    """The weights each student of ``cfg`` starts from, in the order of
    ``cfg.student_names``: ``model.init_from`` for the first,
    ``recipe.distill.students_init_from`` for the others; None for one
    from random initialisation (``none``, or no starts given)."""
    others = cfg.recipe.distill.students_init_from or [None] * (len(cfg.student_names) - 1)
    return [
        cfg.model.init_from,
        *(None if s is None or str(s).lower() == "none" else s for s in others),
    ]


def _members(cfg: Config, student: nn.Module, ema: nn.Module, index: int | None):
    """(start, student member, its EMA) of each student of ``cfg`` this
    process holds that has a start of its own (the first student's,
    ``model.init_from``, is loaded with the whole network): every one of a
    :class:`~dino_opt.train.StudentBank`, or the one student ``index`` of
    a process of a group of ranks."""
    starts = [None, *student_starts(cfg)[1:]]
    bank, bank_ema = unwrap(student), unwrap(ema)
    if isinstance(bank, StudentBank):
        held = [
            (s, bank.members[k], bank_ema.members[k])
            for s, k in zip(starts, cfg.student_keys, strict=True)
        ]
    else:
        held = [(starts[index], bank, bank_ema)] if index is not None else []
    return [(s, m, e) for s, m, e in held if s is not None]


def start_students(
    cfg: Config, student: nn.Module, ema: nn.Module, index: int | None = None
) -> list[str]:
    """A fresh distillation's students (and their EMAs) from
    ``recipe.distill.students_init_from`` (``index``: the student of this
    process on a group of ranks, None with all of them in one process);
    returns notes on what was loaded."""
    notes = []
    if not cfg.recipe.distill.students_init_from:
        return notes
    for path, member, member_ema in _members(cfg, student, ema, index):
        try:
            notes += load_student_start(path, member.backbone)
        except (OSError, ValueError) as e:
            raise ValueError(f"recipe.distill.students_init_from: {e}") from e
        member_ema.backbone.load_state_dict(member.backbone.state_dict())
    return notes
