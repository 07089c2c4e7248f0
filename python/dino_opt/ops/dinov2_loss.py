"""The losses of the DINOv2 recipe: drop-ins for facebookresearch/dinov2's
``DINOLoss`` (class token), ``iBOTPatchLoss`` (masked patch tokens) and
``KoLeoLoss``, same constructors, methods and values.

The cross-entropies run in one call of the fused operator
:func:`~dino_opt.ops.library.ibot_loss` (float32 accumulation for half
students, gradient to the student only). The teacher side is dinov2's: a
softmax around a center kept as a buffer, or Sinkhorn-Knopp
(:func:`sinkhorn_knopp`) in float32 whatever the input dtype.

Under torch.distributed (initialised, world size > 1) the Sinkhorn-Knopp sums
and the centers' batch sums are all-reduced; the center's all-reduce is
asynchronous, started by ``update_center`` and waited for when the center is
next needed (``softmax_center_teacher``, ``apply_center_update`` or
``state_dict``), as in dinov2. Without a process group the world is one
process. Where dinov2 assumes the same number of rows on every rank (its
``len(rows) * world_size``), the row counts are all-reduced with the sums
instead, in the same collective: equal shards give dinov2's values, unequal
ones the exact mean over all rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .library import ibot_loss

__all__ = ["DINOLoss", "KoLeoLoss", "iBOTPatchLoss", "sinkhorn_knopp"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_reduce_(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or max) ``tensor`` in place over all ranks when distributed."""
    if _distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor


def _check_dim(where: str, name: str, tensor, ndim: int | None, last: int | None = None) -> None:
    """A ValueError naming ``name`` unless ``tensor`` is a tensor with ``ndim``
    dimensions (any number when None, at least one) and ``last`` columns."""
    is_tensor = isinstance(tensor, torch.Tensor)
    if not is_tensor or (tensor.dim() != ndim if ndim else tensor.dim() == 0):
        shape = tuple(tensor.shape) if is_tensor else type(tensor).__name__
        raise ValueError(f"{where}: {name} must be a {ndim or 'N'}-D tensor, got {shape}")
    if last is not None and tensor.shape[-1] != last:
        raise ValueError(
            f"{where}: {name} has {tensor.shape[-1]} columns in its last dimension, expected "
            f"{last} (shape {tuple(tensor.shape)})"
        )


def _count_tensor(count, device: torch.device) -> torch.Tensor:
    """A rank's sample count as a 0-dim float32 tensor on ``device``."""
    count = torch.as_tensor(count, dtype=torch.float32, device=device)
    if count.numel() != 1:
        raise ValueError(
            f"sinkhorn_knopp: n_masked_patches must be one count, got shape {tuple(count.shape)}"
        )
    return count.reshape(())


@torch.no_grad()
def sinkhorn_knopp(
    teacher_output: torch.Tensor,
    teacher_temp: float,
    n_iterations: int = 3,
    n_masked_patches: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Sinkhorn-Knopp teacher targets, dinov2's algorithm: ``Q = exp(logits /
    teacher_temp)`` normalised to total mass 1, then ``n_iterations`` times
    each prototype's mass (over all ranks' rows) to ``1 / K`` followed by each
    row's to ``1 / B``; the rows are finally scaled to sum to 1.

    ``teacher_output``: [rows, K] of any float dtype; the arithmetic is in
    float32 and the result is float32 [rows, K]. ``B``, the number of samples
    to assign, is ``n_masked_patches`` (this rank's count, an int or a
    one-element tensor, left unchanged) or ``rows``, summed over all ranks.

    The logits are shifted by their maximum over all ranks before the
    exponential, a common factor that the first normalisation removes: the
    same values as dinov2's, without its overflow for logits above about
    ``88 * teacher_temp``. What float32 cannot hold is a spread of the logits
    over all rows beyond about ``87 * teacher_temp`` (a prototype whose every
    entry underflows has no mass to normalise, NaN as in dinov2). Collectives
    when distributed: the maximum, the total mass with ``B`` (one all-reduce),
    and the prototype masses once per iteration.
    """
    _check_dim("sinkhorn_knopp", "teacher_output", teacher_output, 2)
    logits = teacher_output.detach().float() / teacher_temp
    rows, n_prototypes = logits.shape
    top = logits.amax() if rows else logits.new_tensor(float("-inf"))
    q = logits.sub_(_all_reduce_(top, "max")).exp_()
    count = rows if n_masked_patches is None else n_masked_patches
    totals = _all_reduce_(torch.stack([q.sum(), _count_tensor(count, q.device)]))
    q /= totals[0]
    n_samples = totals[1]
    for _ in range(n_iterations):
        q /= _all_reduce_(q.sum(dim=0, keepdim=True)) * n_prototypes  # prototypes: 1 / K each
        q /= q.sum(dim=1, keepdim=True) * n_samples  # rows: 1 / B each
    q *= n_samples  # rows sum to 1: assignments
    return q


def _cross_entropy(student, targets, weights, student_temp: float) -> torch.Tensor:
    """``-sum_n weights[n] * sum_k targets[n % M, k] * log_softmax(student[n] /
    student_temp)_k`` through the fused operator (targets float32, or float64
    for a float64 student)."""
    target_dtype = torch.float64 if student.dtype == torch.float64 else torch.float32
    targets = targets.detach().to(dtype=target_dtype, device=student.device)
    weights = weights.to(dtype=torch.float32, device=student.device)
    return ibot_loss(student, targets, weights, float(student_temp))


class _CenteredLoss(nn.Module):
    """The center buffer and its asynchronous update, shared by both losses:
    ``center <- m * center + (1 - m) * (batch sum over ranks / rows over ranks)``."""

    def __init__(self, center_shape: tuple[int, ...], student_temp, center_momentum) -> None:
        super().__init__()
        if not 0.0 <= center_momentum <= 1.0:
            raise ValueError(
                f"{type(self).__name__}: center_momentum must be in [0, 1], got {center_momentum}"
            )
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.register_buffer("center", torch.zeros(*center_shape))
        self._pending = None  # (batch sum with the row count last, all-reduce handle or None)

    @property
    def out_dim(self) -> int:
        return self.center.shape[-1]

    @property
    def updated(self) -> bool:
        """False while a center update is started and not yet applied (dinov2's flag)."""
        return self._pending is None

    def _start_center_update(self, batch_sum: torch.Tensor, rows: int) -> None:
        # As dinov2 (and dinov3): a second update started before the first is
        # applied replaces it; only the last batch moves the center. Its
        # all-reduce is waited for, so that every rank's collectives stay in order.
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].wait()
        totals = torch.cat([batch_sum.reshape(-1), batch_sum.new_tensor([float(rows)])])
        handle = dist.all_reduce(totals, async_op=True) if _distributed() else None
        self._pending = (totals, handle)

    @torch.no_grad()
    def apply_center_update(self) -> None:
        """Wait for the pending all-reduce, if any, and apply it to ``center``."""
        if self._pending is None:
            return
        totals, handle = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        batch_center = (totals[:-1] / totals[-1]).reshape(self.center.shape)
        m = self.center_momentum
        new = self.center * m + batch_center.to(self.center.device) * (1 - m)
        self.center = new.to(self.center.dtype)

    def _centered_softmax(self, teacher: torch.Tensor, teacher_temp: float) -> torch.Tensor:
        self.apply_center_update()
        self.center = self.center.to(device=teacher.device)
        return F.softmax((teacher.detach() - self.center) / teacher_temp, dim=-1)

    def state_dict(self, *args, **kwargs):
        self.apply_center_update()
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A loaded center replaces the current one: a pending update is dropped.
        if self._pending is not None and self._pending[1] is not None:
            self._pending[1].wait()
        self._pending = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _rows_of(name: str, tensors) -> list[torch.Tensor]:
    """A [V, B, K] tensor or a sequence of [B, K] tensors as a list of the
    latter, all of one shape."""
    if isinstance(tensors, torch.Tensor):
        _check_dim("DINOLoss.forward", name, tensors, 3)
    elif not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise ValueError(f"DINOLoss.forward: {name} must be a non-empty list of [B, K] tensors")
    rows = list(tensors)
    for i, t in enumerate(rows):
        _check_dim("DINOLoss.forward", f"{name}[{i}]", t, 2)
        if t.shape != rows[0].shape:
            raise ValueError(
                f"DINOLoss.forward: {name}[{i}] has shape {tuple(t.shape)}, {name}[0] has "
                f"{tuple(rows[0].shape)}"
            )
    return rows


class DINOLoss(_CenteredLoss):
    """dinov2's class-token DINO loss (``dinov2.loss.DINOLoss``), fused.

    ``center`` is a buffer [1, out_dim]. ``forward(student_output_list,
    teacher_out_softmaxed_centered_list)`` is dinov2's double sum over
    student crops and teacher targets, ``-sum_s sum_t mean_b sum_k t[b, k] *
    log_softmax(s[b] / student_temp)_k`` (every pair, same-view pairs
    included), computed as one fused call over the stacked student crops
    against the sum of the targets. Student crops are [B, K] tensors (a list,
    or a [S, B, K] tensor), the targets likewise; returns a 0-dim float32
    tensor (float64 for float64 students), differentiable in the students.
    """

    def __init__(self, out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9):
        super().__init__((1, out_dim), student_temp, center_momentum)

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_output: torch.Tensor, teacher_temp: float):
        """``softmax((teacher_output - center) / teacher_temp)`` over the last
        dimension, after applying a pending center update; at least float32."""
        where = "DINOLoss.softmax_center_teacher"
        _check_dim(where, "teacher_output", teacher_output, 2, self.out_dim)
        return self._centered_softmax(teacher_output, teacher_temp)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(self, teacher_output, teacher_temp, n_iterations=3):
        """:func:`sinkhorn_knopp` over the teacher rows of all ranks: float32 [B, K]."""
        return sinkhorn_knopp(teacher_output, teacher_temp, n_iterations)

    def forward(self, student_output_list, teacher_out_softmaxed_centered_list) -> torch.Tensor:
        students = _rows_of("student_output_list", student_output_list)
        targets = _rows_of(
            "teacher_out_softmaxed_centered_list", teacher_out_softmaxed_centered_list
        )
        if targets[0].shape != students[0].shape:
            raise ValueError(
                f"DINOLoss.forward: teacher_out_softmaxed_centered_list holds "
                f"{tuple(targets[0].shape)} tensors, student_output_list "
                f"{tuple(students[0].shape)}: they must match ([B, K])"
            )
        student = students[0] if len(students) == 1 else torch.cat(students)
        target = targets[0].float()
        for t in targets[1:]:
            target = target + t.float()
        batch = students[0].shape[0]
        weights = torch.full((student.shape[0],), 1.0 / batch, device=student.device)
        return _cross_entropy(student, target, weights, self.student_temp)

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        """Start the center update with this step's teacher rows [B, K]."""
        self.reduce_center_update(teacher_output)

    @torch.no_grad()
    def reduce_center_update(self, teacher_output: torch.Tensor) -> None:
        """The batch sum of the teacher rows, all-reduced asynchronously when
        distributed; applied by :meth:`apply_center_update`."""
        _check_dim("DINOLoss.update_center", "teacher_output", teacher_output, 2, self.out_dim)
        dtype = torch.promote_types(teacher_output.dtype, torch.float32)
        self._start_center_update(teacher_output.sum(dim=0, dtype=dtype), len(teacher_output))


class iBOTPatchLoss(_CenteredLoss):  # noqa: N801 (dinov2's name)
    """dinov2's masked patch-token loss (``dinov2.loss.iBOTPatchLoss``), fused.

    ``center`` is a buffer [1, 1, patch_out_dim]. ``forward_masked`` takes the
    masked tokens' rows [n, K] (student logits, teacher targets) and weights
    each by ``masks_weight`` (default: 1 / the number of masked patches of its
    image), dividing by the number of images; ``forward`` takes the full
    [B, N, K] tokens with the [B, N] masks. Both return dinov2's value as a
    0-dim float32 tensor (float64 for float64 students).
    """

    def __init__(self, patch_out_dim: int, student_temp: float = 0.1, center_momentum: float = 0.9):
        super().__init__((1, 1, patch_out_dim), student_temp, center_momentum)

    @torch.no_grad()
    def softmax_center_teacher(self, teacher_patch_tokens: torch.Tensor, teacher_temp: float):
        """``softmax((teacher_patch_tokens - center) / teacher_temp)``, after
        applying a pending center update; broadcast against the [1, 1, K]
        center as in dinov2 (a [n, K] input gives [1, n, K]); at least float32."""
        where = "iBOTPatchLoss.softmax_center_teacher"
        _check_dim(where, "teacher_patch_tokens", teacher_patch_tokens, None, self.out_dim)
        return self._centered_softmax(teacher_patch_tokens, teacher_temp)

    @torch.no_grad()
    def sinkhorn_knopp_teacher(
        self, teacher_output, teacher_temp, n_masked_patches_tensor, n_iterations=3
    ):
        """:func:`sinkhorn_knopp` over the masked teacher tokens [n, K] of all
        ranks, ``B`` the sum of the ranks' ``n_masked_patches_tensor`` (left
        unchanged): float32 [n, K]."""
        return sinkhorn_knopp(teacher_output, teacher_temp, n_iterations, n_masked_patches_tensor)

    def forward(self, student_patch_tokens, teacher_patch_tokens, student_masks_flat):
        """``-mean_b sum_n mask[b, n] * CE[b, n] / max(1, sum_n mask[b, n])`` over
        [B, N, K] tokens and [B, N] masks (bool, or float weights as dinov2 allows).
        Only the masked tokens go through the operator (selecting them waits
        for the device once, as boolean indexing does)."""
        where = "iBOTPatchLoss.forward"
        _check_dim(where, "student_patch_tokens", student_patch_tokens, 3, self.out_dim)
        _check_same_shape(
            where,
            "teacher_patch_tokens",
            teacher_patch_tokens,
            "student_patch_tokens",
            student_patch_tokens,
        )
        _check_same_shape(
            where,
            "student_masks_flat",
            student_masks_flat,
            "student_patch_tokens[..., 0]",
            student_patch_tokens[..., 0],
        )
        mask = student_masks_flat.float()
        per_image = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        weights = (mask / (per_image * mask.shape[0])).flatten()
        picked = student_masks_flat.flatten().nonzero().squeeze(1)
        return _cross_entropy(
            student_patch_tokens.flatten(0, 1).index_select(0, picked),
            teacher_patch_tokens.flatten(0, 1).index_select(0, picked),
            weights.index_select(0, picked.to(weights.device)),
            self.student_temp,
        )

    def forward_masked(
        self,
        student_patch_tokens_masked,
        teacher_patch_tokens_masked,
        student_masks_flat,
        n_masked_patches=None,
        masks_weight=None,
    ):
        """``-sum_n masks_weight[n] * CE[n] / B`` over the masked tokens' rows
        [n, K] (the first ``n_masked_patches`` when given: the rest is
        padding), ``B = student_masks_flat.shape[0]`` images."""
        where = "iBOTPatchLoss.forward_masked"
        student, teacher = student_patch_tokens_masked, teacher_patch_tokens_masked
        _check_dim(where, "student_patch_tokens_masked", student, 2, self.out_dim)
        _check_dim(where, "teacher_patch_tokens_masked", teacher, 2, self.out_dim)
        _check_dim(where, "student_masks_flat", student_masks_flat, 2)
        if n_masked_patches is not None:
            student, teacher = student[: int(n_masked_patches)], teacher[: int(n_masked_patches)]
        if masks_weight is None:
            masks_weight = _default_masks_weight(student_masks_flat)
        _check_rows(where, "teacher_patch_tokens_masked", teacher, student)
        _check_rows(where, "masks_weight", masks_weight.reshape(-1), student)
        weights = masks_weight.reshape(-1).float() / student_masks_flat.shape[0]
        return _cross_entropy(student, teacher, weights, self.student_temp)

    @torch.no_grad()
    def update_center(self, teacher_patch_tokens: torch.Tensor) -> None:
        """Start the center update with this step's teacher tokens [B, N, K]."""
        self.reduce_center_update(teacher_patch_tokens)

    @torch.no_grad()
    def reduce_center_update(self, teacher_patch_tokens: torch.Tensor) -> None:
        """The sum over the B rows of the token means, all-reduced
        asynchronously when distributed; applied by :meth:`apply_center_update`."""
        _check_dim(
            "iBOTPatchLoss.update_center",
            "teacher_patch_tokens",
            teacher_patch_tokens,
            3,
            self.out_dim,
        )
        dtype = torch.promote_types(teacher_patch_tokens.dtype, torch.float32)
        batch_sum = teacher_patch_tokens.mean(dim=1, dtype=dtype).sum(dim=0)
        self._start_center_update(batch_sum, len(teacher_patch_tokens))


def _check_same_shape(where, name, tensor, other_name, other) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.shape != other.shape:
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(
            f"{where}: {name} has shape {shape}, expected {tuple(other.shape)} as {other_name}"
        )


def _check_rows(where, name, tensor, student) -> None:
    if tensor.shape[0] != student.shape[0]:
        raise ValueError(
            f"{where}: {name} has {tensor.shape[0]} rows, student_patch_tokens_masked "
            f"{student.shape[0]} (after n_masked_patches): they must match"
        )


def _default_masks_weight(masks: torch.Tensor) -> torch.Tensor:
    """dinov2's default: each masked token weighs 1 / the masked count of its image."""
    masks = masks.bool()
    per_image = masks.sum(dim=-1, dtype=torch.float32).clamp(min=1.0)
    return (1.0 / per_image).unsqueeze(-1).expand_as(masks)[masks]


class KoLeoLoss(nn.Module):
    """The Kozachenko-Leonenko entropy regulariser of dinov2
    (``dinov2.loss.KoLeoLoss``): ``-mean_i log(||x_i - x_j(i)|| + eps)`` over
    the L2-normalised rows, ``j(i)`` the nearest other row by inner product.
    Computed in float32 for half inputs (float64 stays float64), autocast off."""

    def __init__(self) -> None:
        super().__init__()
        self.pdist = nn.PairwiseDistance(2, eps=1e-8)

    @torch.no_grad()
    def pairwise_NNs_inner(self, x: torch.Tensor) -> torch.Tensor:  # noqa: N802 (dinov2's name)
        """Index of each row's nearest other row by inner product (rows are
        L2-normalised), the row itself excluded."""
        dots = x @ x.t()
        dots.fill_diagonal_(float("-inf"))
        return dots.argmax(dim=1)

    def forward(self, student_output: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        _check_dim("KoLeoLoss.forward", "student_output", student_output, 2)
        if student_output.shape[0] < 2:
            raise ValueError(
                f"KoLeoLoss.forward: student_output needs at least 2 rows for a nearest "
                f"neighbour, got {student_output.shape[0]}"
            )
        with torch.autocast(student_output.device.type, enabled=False):
            x = student_output
            if x.dtype not in (torch.float32, torch.float64):
                x = x.float()
            x = F.normalize(x, p=2, dim=-1, eps=eps)
            neighbours = self.pairwise_NNs_inner(x)
            distances = self.pdist(x, x[neighbours])
            return -torch.log(distances + eps).mean()
