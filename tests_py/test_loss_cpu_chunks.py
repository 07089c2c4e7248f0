"""The CPU DINO loss forward reads each chunk of K once: per chunk, the
teacher's unnormalised weights exp(u - chunk max) against the student's logits
(csrc/ops/cpu/dino_loss_cpu.cpp). Cases that this form must keep: a NaN
hidden among -inf logits, a -inf student logit where the teacher's probability
is tiny but not 0, and large logits against the float64 reference."""

import pytest
import torch
from dino_opt import dino_loss
from reference import dino_loss_reference

ST, TT = 0.1, 0.04


def inputs(views, teachers, batch, dim, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    student = scale * torch.randn(views * batch, dim, generator=gen)
    teacher = scale * torch.randn(teachers * batch, dim, generator=gen)
    center = 0.1 * torch.randn(dim, generator=gen)
    return student, teacher, center


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_nan_among_neg_inf_student_logits_gives_nan(dtype):
    student, teacher, center = inputs(4, 2, 2, 2 * 4096 + 37, seed=0)
    student[3, :4096] = float("-inf")
    student[3, 100] = float("nan")
    assert torch.isnan(dino_loss(student.to(dtype), teacher.to(dtype), center, ST, TT, 4))


def test_a_nan_among_neg_inf_teacher_logits_is_not_hidden():
    student, teacher, center = inputs(4, 2, 2, 2 * 4096 + 37, seed=1)
    teacher[1, 4096:8192] = float("-inf")
    teacher[1, 5000] = float("nan")
    assert not torch.isfinite(dino_loss(student, teacher, center, ST, TT, 4))


@pytest.mark.parametrize("position", [5, 4096 + 17, 2 * 4096 + 34])  # vector body, tail
def test_neg_inf_student_logit_where_the_teacher_probability_is_tiny(position):
    # Teacher logits u: about 0, -50 over the chunk that holds `position` and
    # -100 there. Its probability, about exp(-100 - log K), is 0 in float32
    # once normalised but not in float64, where the reference loss is +inf; its
    # weight against the chunk's max, exp(-50), is not 0 in float32.
    dim = 2 * 4096 + 37
    student, teacher, _ = inputs(4, 2, 2, dim, seed=2, scale=0.01)
    center = torch.zeros(dim)
    chunk = position // 4096 * 4096
    teacher[0, chunk : chunk + 4096] = -50 * TT
    teacher[0, position] = -100 * TT
    student[2, position] = float("-inf")  # view 1 of sample 0, paired with teacher view 0
    ref = dino_loss_reference(student.double(), teacher.double(), center.double(), ST, TT, 4)
    assert ref.item() == float("inf")
    assert dino_loss(student, teacher, center, ST, TT, 4).item() == float("inf")


@pytest.mark.parametrize("scale", [10.0, 30.0])
def test_large_logits_against_the_float64_reference(scale):
    student, teacher, center = inputs(10, 2, 2, 65536, seed=3, scale=scale)
    loss = dino_loss(student, teacher, center, ST, TT, 10)
    ref = dino_loss_reference(student.double(), teacher.double(), center.double(), ST, TT, 10)
    assert abs(loss.item() - ref.item()) <= 2e-6 * abs(ref.item()), (loss.item(), ref.item())
