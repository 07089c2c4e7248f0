"""Plain PyTorch references written from the DINO paper's algorithm, used as
ground truth by the tests and as baselines by bench/bench_loss.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dino_loss_reference(student, teacher, center, student_temp, teacher_temp, ncrops):
    """The original double loop: for every teacher view t and every student view
    v != t, mean over samples of -sum_k softmax((T_t - c)/tt)_k log_softmax(S_v/ts)_k;
    averaged over the pairs. Computes in the inputs' dtype."""
    student_out = (student / student_temp).chunk(ncrops)
    teacher_views = teacher.shape[0] // (student.shape[0] // ncrops)
    teacher_out = F.softmax((teacher - center) / teacher_temp, dim=-1).detach().chunk(teacher_views)
    total, n_terms = 0, 0
    for iq, q in enumerate(teacher_out):
        for v, s in enumerate(student_out):
            if v == iq:
                continue
            total = total + torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
            n_terms += 1
    return total / n_terms


def dino_loss_dinov2_form(student, teacher, center, student_temp, teacher_temp, ncrops):
    """The dinov2 form: one log-softmax per student view, the teacher softmax
    once, then the same pair sums."""
    teacher_views = teacher.shape[0] // (student.shape[0] // ncrops)
    log_q = F.log_softmax(student / student_temp, dim=-1).chunk(ncrops)
    p = F.softmax((teacher - center) / teacher_temp, dim=-1).detach().chunk(teacher_views)
    total, n_terms = 0, 0
    for t, pt in enumerate(p):
        for v, lq in enumerate(log_q):
            if v == t:
                continue
            total = total - torch.sum(pt * lq, dim=-1).mean()
            n_terms += 1
    return total / n_terms


def center_update_reference(center, teacher, momentum, world_size=1):
    """DINO's center update for one step (teacher rows summed over all ranks)."""
    batch_center = torch.sum(teacher, dim=0, keepdim=True) / (len(teacher) * world_size)
    return center * momentum + batch_center * (1 - momentum)


def ibot_loss_reference(student, targets, weights, student_temp):
    """iBOT's masked-patch cross-entropy from its formula:
    -sum_n w_n sum_k T[n % M, k] log_softmax(S[n] / tau)_k, with 0 log 0 = 0
    where a target is exactly 0. Computes in the inputs' dtype; targets are
    repeated over the student rows (M dividing N)."""
    t = targets.repeat(student.shape[0] // max(targets.shape[0], 1), 1)
    log_q = F.log_softmax(student / student_temp, dim=-1)
    terms = torch.where(t == 0, torch.zeros_like(log_q), t * log_q)
    return -(terms.sum(-1) * weights).sum()


def ibot_loss_dinov2_form(student, targets, weights, student_temp, n_images):
    """The dinov2 form of the masked-patch loss (without xFormers): a full
    log-softmax, its product with the targets, the weighted sum over the
    masked tokens, divided by the number of images."""
    log_q = F.log_softmax(student / student_temp, dim=-1)
    return -(torch.sum(targets * log_q, dim=-1) * weights).sum() / n_images


def gram_loss_reference(
    student,
    teacher,
    img_level=True,
    apply_norm=True,
    remove_neg=False,
    remove_only_teacher_neg=False,
):
    """DINOv3's Gram anchoring loss as its paper describes it, in the inputs'
    dtype: the rows normalised, the full Gram matrices (one per image with
    ``img_level``, else one over all rows), the negative similarities set to 0
    as asked, then the mean squared difference. ``remove_only_teacher_neg``
    clamps the teacher's similarities only, as dinov3's code runs it: it sets
    the teacher's negatives to 0 first and then the student's where both are
    negative, a mask that is then empty."""
    if apply_norm:
        student, teacher = F.normalize(student, dim=-1), F.normalize(teacher, dim=-1)
    if not img_level:
        student, teacher = (
            student.reshape(-1, student.shape[-1]),
            teacher.reshape(-1, teacher.shape[-1]),
        )
    sim_s = student @ student.transpose(-1, -2)
    sim_t = teacher @ teacher.transpose(-1, -2)
    if remove_neg:
        sim_s = sim_s.masked_fill(sim_s < 0, 0.0)
        sim_t = sim_t.masked_fill(sim_t < 0, 0.0)
    elif remove_only_teacher_neg:  # in dinov3's order: the teacher first
        sim_t = sim_t.masked_fill(sim_t < 0, 0.0)
        sim_s = sim_s.masked_fill((sim_s < 0) & (sim_t < 0), 0.0)
    return ((sim_s - sim_t) ** 2).mean()


def block_reference(block, x, draws, rope=None):
    """A pre-norm ViT block with stochastic depth as published: each residual
    branch times a 0/1 mask of the samples (here the given ``draws``, one
    index tensor per branch) and the scale batch / kept."""
    b = x.shape[0]

    def masked(branch, index):
        mask = torch.zeros(b, 1, 1, dtype=x.dtype)
        mask[index] = 1.0
        return branch * mask * (b / index.numel())

    attn = block.attn(block.norm1(x)) if rope is None else block.attn(block.norm1(x), rope)
    x = x + masked(block.ls1(attn), draws[0])
    return x + masked(block.ls2(block.mlp(block.norm2(x))), draws[1])
