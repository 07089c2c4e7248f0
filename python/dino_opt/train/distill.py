"""Distillation: a student learns from a large frozen teacher (a released
DINO, DINOv2 or DINOv3 backbone, or a dino_opt run) instead of from its own
EMA; the EMA of the student is kept and is the run's result, as DINOv3
distils its small models.

Two ways to learn (``mode`` of the config's ``recipe.distill``,
:class:`~dino_opt.config.DistillConfig`, which the losses read as it is):

- ``features`` (any teacher, any student): the student's class token and
  patch tokens, through a projector of its own (:class:`FeatureProjector`,
  trained with it), are pulled towards the frozen teacher's normalised
  tokens of the same global crops by a cosine and a smooth-L1 term
  (:class:`FeatureDistillLoss`). The teacher's patch grid is averaged onto
  the student's when it is a whole multiple of it (a ViT-S/16 teacher on a
  ResNet's stride-32 map); other grids are an error in one line. With
  ``local_weight`` > 0 the student also sees the local crops, and each local
  crop's projected class token is pulled by the same terms towards the
  teacher's class tokens of its image's global crops (DINO's
  local-to-global view; the teacher never sees a local crop).
- ``heads`` (a teacher trained with DINO heads, a ViT student): DINOv2's
  step (DINO, iBOT and KoLeo losses; centering or Sinkhorn-Knopp) with the
  targets made by the frozen teacher's heads instead of the EMA teacher's
  (:class:`HeadsDistillTrainer`); the student's patch grid must equal the
  teacher's, since the iBOT targets are the teacher's tokens at the
  student's masked positions.

The teacher sees the global crops resized by ``teacher_scale`` (DINOv3's
``teacher_to_student_resolution_scale``), in inference mode and the step's
autocast, once per batch. It is held by the loss outside its state dict
(:class:`FrozenTeacher`): checkpoints do not carry it, a resumed run opens
its file again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import DistillConfig
from ..models import Tokens, backbone_tokens, pool_to_grid, running_stats_kept
from ..ops import unwrap
from ..runtime import StudentGroups, is_distributed
from .dinov2 import DINOv2Loss, DINOv2Terms, DINOv2Trainer
from .trainer import MemoryOptimizedDINOTrainer, StepTerms

__all__ = [
    "FeatureDistillLoss",
    "FeatureDistillTerms",
    "FeatureDistillTrainer",
    "FeatureDistillWrapper",
    "FeatureProjector",
    "FrozenTeacher",
    "HeadsDistillLoss",
    "HeadsDistillTerms",
    "HeadsDistillTrainer",
    "LocalViews",
    "StudentBank",
    "TokenWhitener",
    "teacher_side",
]


def teacher_side(side: int, scale: float, patch: int) -> int:
    """The teacher's input side for a student crop of ``side`` pixels:
    ``side * scale``, which must be a whole number of the teacher's
    ``patch`` (ValueError naming the sizes otherwise)."""
    out = round(side * scale)
    if abs(out - side * scale) > 1e-6 or out % patch or out < patch:
        raise ValueError(
            f"recipe.distill.teacher_scale={scale:g} makes the teacher's input {side * scale:g} px "
            f"from {side} px crops, not a multiple of its patch ({patch}); choose a scale with "
            f"{side} * scale a multiple of {patch}"
        )
    return out


class FrozenTeacher:
    """The frozen teacher network, held outside any module's state dict:
    ``network`` (a backbone for ``features``; backbone and heads for
    ``heads``), its ``patch_size`` and the input ``scale``. :meth:`inputs`
    resizes the student's crops for it (bicubic, anti-aliased when shrinking);
    :meth:`tokens` runs it. Students on their own groups of ranks
    (:meth:`split_over`): each rank runs it on its share of the batch."""

    def __init__(self, network: nn.Module, patch_size: int, scale: float = 1.0):
        self.network = network.requires_grad_(False).eval()
        self.patch_size = int(patch_size)
        self.scale = float(scale)
        self.groups: StudentGroups | None = None

    def split_over(self, groups: StudentGroups) -> None:
        """From now on each forward runs on this rank's 1/S of the batch,
        the peers' outputs gathered (:class:`~dino_opt.runtime.StudentGroups`)."""
        self.groups = groups

    def tokens(self, images: torch.Tensor) -> Tokens:
        """The teacher's :class:`~dino_opt.models.Tokens` of ``images`` (at
        its side already: :meth:`inputs`); split over the peers when
        :meth:`split_over` was called, whole on every one of them."""
        g = self.groups
        if g is None:
            return backbone_tokens(self.network, images)
        t = backbone_tokens(self.network, g.take(images))
        return Tokens(g.join(t.cls), g.join(t.patches), t.grid)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> FrozenTeacher:
        """The network moved to ``device`` (and cast to ``dtype`` when given)."""
        self.network.to(device=device, dtype=dtype)
        return self

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` [B, 3, S, S] at the teacher's side (:func:`teacher_side`)."""
        side = teacher_side(images.shape[-1], self.scale, self.patch_size)
        if side == images.shape[-1]:
            return images
        shrink = side < images.shape[-1]
        return F.interpolate(
            images, size=(side, side), mode="bicubic", align_corners=False, antialias=shrink
        )


def _projector(width: int, out: int, hidden: int) -> nn.Module:
    if hidden <= 0:
        return nn.Linear(width, out)
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, out))


class FeatureProjector(nn.Module):
    """The student's projectors onto the teacher's feature width: ``cls``
    and ``patch``, each a linear layer (``hidden`` > 0: Linear, GELU, Linear)."""

    def __init__(self, width: int, teacher_width: int, hidden: int = 0):
        super().__init__()
        self.cls = _projector(width, teacher_width, hidden)
        self.patch = _projector(width, teacher_width, hidden)

    def forward(self, tokens: Tokens) -> Tokens:
        return Tokens(self.cls(tokens.cls), self.patch(tokens.patches), tokens.grid)


class LocalViews(NamedTuple):
    """A student's output with local crops: the projected ``tokens`` of the
    global crops and the projected class tokens of the local crops
    (``local_cls`` [n_local, B, D])."""

    tokens: Tokens
    local_cls: torch.Tensor

    @staticmethod
    def global_tokens(out) -> Tokens:
        """The global crops' tokens of a student's output, with or without
        local crops."""
        return out.tokens if isinstance(out, LocalViews) else out


class FeatureDistillWrapper(nn.Module):
    """A student backbone and its :class:`FeatureProjector` (``head``):
    ``forward(images)`` gives the projected :class:`~dino_opt.models.Tokens`
    of a batch of images; ``forward(images, local)`` also the projected
    class tokens of the local crops ``local`` (a list of [B, 3, s, s]
    batches, one per local crop; :class:`LocalViews`). One call, through
    ``forward``, so DDP's hooks run once per step. The local crops' pass
    leaves BatchNorm's running statistics as the global crops' left them
    (what the EMA copies and the evaluation reads, at the global size)."""

    def __init__(self, backbone: nn.Module, head: FeatureProjector):
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: torch.Tensor, local: Sequence[torch.Tensor] | None = None):
        tokens = self.head(backbone_tokens(self.backbone, images))
        if not local:
            return tokens
        # the running statistics describe the global crops, the size it is evaluated at
        with running_stats_kept(self.backbone):
            cls = backbone_tokens(self.backbone, torch.cat(list(local))).cls
        return LocalViews(tokens, self.head.cls(cls).unflatten(0, (len(local), -1)))


def _standardized(tokens: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``tokens`` [..., D] with each channel's mean 0 and variance 1 over all
    the tokens of the batch (in float32)."""
    tokens = tokens.float()
    var, mean = torch.var_mean(tokens.reshape(-1, tokens.shape[-1]), dim=0, correction=0)
    return (tokens - mean) * torch.rsqrt(var + eps)


class TokenWhitener(nn.Module):
    """Whitens a frozen teacher's tokens [..., D] (ZCA): ``(x - mean) @ W``,
    ``W = V diag((lambda + floor * lambda_max) ** -1/2) V^T`` from the
    eigenvalues ``lambda`` and vectors ``V`` of the running covariance. The
    running mean and covariance (float64 buffers, in the loss's state dict)
    pool every token seen, over all ranks when distributed: exactly while
    fewer than ``1 / (1 - momentum)`` batches were seen, then as a mixture
    that gives this batch ``1 - momentum``. Each batch's covariance is taken
    around its mean (no cancellation in float32). ``floor`` (relative to
    the largest eigenvalue) keeps the smallest directions from being blown
    up as large as the largest. A teacher whose tokens lie mostly in a few
    directions has the rest (where its classes may differ) weighed equally
    by the cosine; the whitened tokens are float32, made outside autocast.
    ``W`` is recomputed for every batch while the statistics are pooled
    exactly, then every ``refresh`` batches (an eigendecomposition makes a
    GPU wait for its host); it is kept with the statistics."""

    def __init__(self, dim: int, floor: float, momentum: float = 0.99, refresh: int = 10):
        super().__init__()
        if not 0 < floor <= 1:
            raise ValueError(f"TokenWhitener: floor must be in (0, 1], got {floor}")
        self.floor, self.momentum, self.refresh = float(floor), float(momentum), int(refresh)
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("cov", torch.zeros(dim, dim, dtype=torch.float64))
        self.register_buffer("batches", torch.zeros((), dtype=torch.int64))
        self.register_buffer("w", torch.eye(dim))
        self._seen: int | None = None  # ``batches`` on the host (read once: no sync per step)

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._seen = None

    @staticmethod
    def _summed(t: torch.Tensor) -> torch.Tensor:
        if is_distributed():
            dist.all_reduce(t)
        return t

    @torch.no_grad()
    def update(self, tokens: torch.Tensor) -> None:
        """Fold the tokens [..., D] of this batch (all ranks') into the
        running mean and covariance."""
        x = tokens.reshape(-1, tokens.shape[-1]).float()
        # the count filled on the device: a tensor built from a host list would make a GPU wait
        sums = self._summed(torch.cat([x.sum(0), x.new_full((1,), len(x))]))
        n, mean = sums[-1], sums[:-1] / sums[-1]
        centred = x - mean
        cov = self._summed(centred.T @ centred).double() / n
        if self._seen is None:
            self._seen = int(self.batches)
        m = min(self.momentum, self._seen / (self._seen + 1))
        shift = self.mean - mean.double()
        self.cov.mul_(m).add_(cov, alpha=1 - m).add_(torch.outer(shift, shift), alpha=m * (1 - m))
        self.mean.mul_(m).add_(mean.double(), alpha=1 - m)
        self.batches += 1
        self._seen += 1

    def matrix(self) -> torch.Tensor:
        """``W`` [D, D] (float32) of the statistics so far."""
        values, vectors = torch.linalg.eigh(self.cov.float())
        values = values.clamp_min(0)
        scale = (values + self.floor * values.max().clamp_min(1e-12)).rsqrt()
        return (vectors * scale) @ vectors.T

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` whitened (float32, same shape), after folding them in."""
        self.update(tokens)
        seen = self._seen
        if seen * (1 - self.momentum) <= 1 or (seen - 1) % self.refresh == 0:
            self.w.copy_(self.matrix())
        with torch.autocast(tokens.device.type, enabled=False):
            return (tokens.float() - self.mean.float()) @ self.w


def _cosine(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return (1 - F.cosine_similarity(student, teacher, dim=-1)).mean()


class FeatureDistillLoss(nn.Module):
    """The ``features`` loss: for the class tokens and the patch tokens,
    ``cosine_weight * mean(1 - cos) + smooth_l1_weight * smooth_l1``
    between the student's projected tokens and the teacher's, weighted by
    ``cls_weight`` and ``patch_weight``; a student's :class:`LocalViews`
    add the same two terms between each local crop's class token and the
    teacher's class token of each global crop of its image, averaged over
    those pairs, weighted by ``local_weight``. The teacher
    (:class:`FrozenTeacher`) is attached with :meth:`attach_teacher`;
    ``options``: the config's ``recipe.distill``."""

    def __init__(self, options: DistillConfig):
        super().__init__()
        self.options = options
        self.frozen: FrozenTeacher | None = None
        self.whiteners = None
        if options.whiten > 0:
            if options.teacher_dim is None:
                raise ValueError(
                    "FeatureDistillLoss: whiten needs the teacher's width "
                    "(recipe.distill.teacher_dim)"
                )
            self.whiteners = nn.ModuleDict(
                {
                    part: TokenWhitener(options.teacher_dim, options.whiten)
                    for part in ("cls", "patch")
                }
            )

    def attach_teacher(self, teacher: FrozenTeacher) -> None:
        self.frozen = teacher

    @torch.no_grad()
    def teacher_tokens(self, images: torch.Tensor, grid):
        """The frozen teacher's tokens of ``images`` (resized for it, one
        forward), its patches averaged onto the student's ``grid``; with a
        dict of grids (the students of a :class:`StudentBank`), a dict of
        tokens, one per student, from that one forward."""
        if self.frozen is None:
            raise RuntimeError("FeatureDistillLoss: no teacher attached (attach_teacher)")
        t = self.frozen.tokens(self.frozen.inputs(images))
        if self.whiteners is not None:  # before pooling: whitening is affine, pooling an average
            t = Tokens(self.whiteners["cls"](t.cls), self.whiteners["patch"](t.patches), t.grid)
        if isinstance(grid, dict):
            return {
                name: Tokens(t.cls, pool_to_grid(t.patches, t.grid, g), g)
                for name, g in grid.items()
            }
        return Tokens(t.cls, pool_to_grid(t.patches, t.grid, grid), grid)

    def forward(self, student, teacher) -> tuple[torch.Tensor, dict]:
        """The loss of one student's tokens against the teacher's; for the
        dicts of a :class:`StudentBank`, the sum of each student's loss (its
        own gradients: the students share no parameter), the parts named
        ``<part>_<student>`` beside each student's own, under its name (the
        metrics: ``loss_<student>``)."""
        if not isinstance(student, dict):
            return self._one(student, teacher)
        total, parts = 0.0, {}
        for name, tokens in student.items():
            loss, own = self._one(tokens, teacher[name])
            total = total + loss
            parts[name] = loss.detach()
            parts.update({f"{k}_{name}": v for k, v in own.items()})
        return total, parts

    def _one(self, student, teacher: Tokens) -> tuple[torch.Tensor, dict]:
        local = student.local_cls if isinstance(student, LocalViews) else None
        student = LocalViews.global_tokens(student)
        if self.options.standardize:
            teacher = Tokens(
                _standardized(teacher.cls), _standardized(teacher.patches), teacher.grid
            )
        pairs = {"cls": (student.cls, teacher.cls), "patch": (student.patches, teacher.patches)}
        if local is not None:  # each local crop against each global crop of its image
            t_cls = teacher.cls.unflatten(0, (-1, local.shape[1]))  # [n_global, B, D]
            shape = (local.shape[0], *t_cls.shape)
            pairs["local"] = (local.unsqueeze(1).expand(shape), t_cls.unsqueeze(0).expand(shape))
        o = self.options
        weights = {"cls": o.cls_weight, "patch": o.patch_weight, "local": o.local_weight}
        total, parts = 0.0, {}
        for name, (s, t) in pairs.items():
            s, t = s.float(), t.float()
            parts[f"distill_{name}_cosine"] = _cosine(s, t)
            parts[f"distill_{name}_smooth_l1"] = F.smooth_l1_loss(s, t)
            term = o.cosine_weight * parts[f"distill_{name}_cosine"]
            term = term + o.smooth_l1_weight * parts[f"distill_{name}_smooth_l1"]
            total = total + weights[name] * term
        return total, {k: v.detach() for k, v in parts.items()}


class StudentBank(nn.Module):
    """Several students of one teacher trained in one run: ``members``, each
    a :class:`FeatureDistillWrapper` under its name (its backbone's).
    ``forward(images)`` gives each one's projected tokens, as a dict; the
    teacher's forward serves them all (:meth:`FeatureDistillLoss.teacher_tokens`).
    ``backbone`` is the first student's (what a run evaluates and exports
    by default)."""

    def __init__(self, members: dict[str, nn.Module]):
        super().__init__()
        if len(members) < 2:
            raise ValueError(f"StudentBank: give two students or more, not {len(members)}")
        self.members = nn.ModuleDict(members)

    @property
    def backbone(self) -> nn.Module:
        return next(iter(self.members.values())).backbone

    def forward(self, images: torch.Tensor, local: Sequence[torch.Tensor] | None = None) -> dict:
        return {name: member(images, local) for name, member in self.members.items()}


def _grids(student):
    if isinstance(student, dict):
        return {name: LocalViews.global_tokens(out).grid for name, out in student.items()}
    return LocalViews.global_tokens(student).grid


class FeatureDistillTerms(StepTerms):
    """The ``features`` terms of the one step: the student's projected tokens
    of the global crops and the frozen teacher's tokens of the same crops
    (one forward, pooled onto the student's grid), :class:`FeatureDistillLoss`.
    The local crops go through the student (in the same call) only when the
    loss's ``local_weight`` is above 0. A :class:`StudentBank` trains its
    students from the one teacher forward, each clipped to its own gradient
    norm. Nothing is masked: ``masks`` are not used."""

    def inputs(self, trainer, crops, masks):
        glob = torch.cat(trainer.to_device(crops[: trainer.n_global]))
        local = None
        if trainer.loss_fn.options.local_weight > 0:
            local = trainer.to_device(crops[trainer.n_global :])
        return glob, local

    def student(self, trainer, inputs, views):
        glob, local = inputs
        student = trainer.model.student(glob, local)
        return student, trainer.loss_fn.teacher_tokens(glob, _grids(student))

    def loss(self, trainer, out, targets, inputs, views, last):
        return trainer.loss_fn(*out)

    def clip_groups(self, trainer, params):
        bank = unwrap(trainer.model.student)
        if not isinstance(bank, StudentBank):
            return [params]
        ids = {id(p) for p in params}
        return [
            [p for p in member.parameters() if id(p) in ids] for member in bank.members.values()
        ]


class FeatureDistillTrainer(MemoryOptimizedDINOTrainer):
    """The one step (:class:`MemoryOptimizedDINOTrainer`: AMP, accumulation,
    clipping, the optimizer step and the student's EMA) with
    :class:`FeatureDistillTerms`."""

    def __init__(self, model, loss_fn, optimizer, config, device):
        super().__init__(model, loss_fn, optimizer, config, device, terms=FeatureDistillTerms())


class HeadsDistillLoss(DINOv2Loss):
    """:class:`~dino_opt.train.DINOv2Loss` whose targets come from a frozen
    teacher with DINO heads (:meth:`attach_teacher`, a
    :class:`~dino_opt.train.DINOv2Wrapper`), not from the EMA teacher;
    ``distill``: the config's ``recipe.distill``."""

    def __init__(
        self,
        out_dim: int,
        ibot_out_dim: int,
        n_local: int,
        *,
        distill: DistillConfig | None = None,
        **dinov2,
    ) -> None:
        super().__init__(out_dim, ibot_out_dim, n_local, **dinov2)
        self.options = distill or DistillConfig(mode="heads")
        self.frozen: FrozenTeacher | None = None

    def attach_teacher(self, teacher: FrozenTeacher) -> None:
        self.frozen = teacher


class HeadsDistillTerms(DINOv2Terms):
    """DINOv2's terms (:class:`~dino_opt.train.DINOv2Terms`) with the frozen
    teacher's head outputs as targets: its DINO head on the class tokens of
    the global crops, its iBOT head (or DINO's, shared) on the patch tokens
    at the student's masked positions. The grids must match."""

    def teacher_outputs(self, trainer, glob: list[torch.Tensor], info):
        frozen = trainer.loss_fn.frozen
        if frozen is None:
            raise RuntimeError("HeadsDistillLoss: no teacher attached (attach_teacher)")
        images = [frozen.inputs(g) for g in glob]
        student_grid = glob[0].shape[-1] // trainer.model.teacher.backbone.patch_size
        teacher_grid = images[0].shape[-1] // frozen.patch_size
        if student_grid != teacher_grid:
            raise ValueError(
                f"recipe.distill.mode=heads needs the teacher's patch grid ({teacher_grid} x "
                f"{teacher_grid}) equal to the student's ({student_grid} x {student_grid}): its "
                "iBOT targets are the teacher's tokens at the student's masked patches; set "
                "recipe.distill.teacher_scale (or use recipe.distill.mode=features)"
            )
        with trainer.autocast():
            return frozen.network(images, mask_indices=info["mask_indices_list"])


class HeadsDistillTrainer(DINOv2Trainer):
    """The one step with :class:`HeadsDistillTerms`, ``loss_fn`` a
    :class:`HeadsDistillLoss` with its teacher attached."""

    def __init__(self, model, loss_fn, optimizer, config, device):
        super().__init__(model, loss_fn, optimizer, config, device, terms=HeadsDistillTerms())
