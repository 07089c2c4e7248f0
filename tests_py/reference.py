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
