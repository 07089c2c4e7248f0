"""The CPU loss gradients' buffer pool: a step's gradient reuses the storage
of an earlier one only once nothing refers to it, and the values are those of
a fresh buffer."""

import gc

import dino_opt
import pytest
import torch
from dino_opt.ops import release_cpu_buffers

K = 8192  # 24 rows x 8192 floats: 768 KiB below the pool's 1 MiB, 48 rows above


def dino_grad(student, teacher, center, ncrops):
    student = student.detach().requires_grad_()
    dino_opt.dino_loss(student, teacher, center, 0.1, 0.04, ncrops).backward()
    return student.grad


def ibot_grad(student, targets, weights):
    student = student.detach().requires_grad_()
    dino_opt.ibot_loss(student, targets, weights, 0.1).backward()
    return student.grad


@pytest.fixture
def dino_inputs():
    gen = torch.Generator().manual_seed(0)
    student = torch.randn(6 * 8, K, generator=gen)
    teacher = torch.randn(2 * 8, K, generator=gen)
    return student, teacher, 0.1 * torch.randn(K, generator=gen), 6


def test_a_freed_gradient_is_reused_and_a_held_one_is_not(dino_inputs):
    release_cpu_buffers()
    first = dino_grad(*dino_inputs)
    expected = first.clone()
    second = dino_grad(*dino_inputs)  # `first` is alive: a buffer of its own
    assert second.data_ptr() != first.data_ptr()
    torch.testing.assert_close(second, expected, rtol=0, atol=0)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    ptr = first.data_ptr()
    del first
    third = dino_grad(*dino_inputs)
    assert third.data_ptr() == ptr  # the freed storage again
    torch.testing.assert_close(third, expected, rtol=0, atol=0)
    torch.testing.assert_close(second, expected, rtol=0, atol=0)


def test_a_view_keeps_the_storage_in_use(dino_inputs):
    release_cpu_buffers()
    grad = dino_grad(*dino_inputs)
    view = grad[3:5]
    kept = view.clone()
    ptr = grad.untyped_storage().data_ptr()
    del grad
    other = dino_grad(*dino_inputs)
    assert other.untyped_storage().data_ptr() != ptr
    torch.testing.assert_close(view, kept, rtol=0, atol=0)


def test_ibot_gradients_match_after_reuse():
    gen = torch.Generator().manual_seed(1)
    student = torch.randn(64, K, generator=gen)
    targets = torch.softmax(torch.randn(64, K, generator=gen), dim=-1)
    weights = torch.full((64,), 1 / 64)
    expected = ibot_grad(student, targets, weights).clone()
    for _ in range(3):
        torch.testing.assert_close(ibot_grad(student, targets, weights), expected, rtol=0, atol=0)


def test_release_frees_what_is_free_and_keeps_what_is_held(dino_inputs):
    gc.collect()  # earlier tests' gradients
    _, base = release_cpu_buffers()
    held = dino_grad(*dino_inputs)
    freed = dino_grad(*dino_inputs)
    nbytes = freed.numel() * freed.element_size()
    del freed
    released, still = release_cpu_buffers()
    assert (released, still) == (nbytes, base + nbytes)
    del held
    assert release_cpu_buffers() == (nbytes, base)


def test_small_gradients_are_not_pooled():
    gc.collect()
    _, base = release_cpu_buffers()
    gen = torch.Generator().manual_seed(2)
    student, teacher = torch.randn(3 * 8, K, generator=gen), torch.randn(2 * 8, K, generator=gen)
    grad = dino_grad(student, teacher, torch.zeros(K), 3)
    del grad
    assert release_cpu_buffers() == (0, base)
