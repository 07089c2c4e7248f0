"""The plain-torch kernels that run where no kernel was compiled (CUDA
without nvcc, MPS, XPU, ROCm): the same values and gradients as the compiled
CPU kernels (and the float64 reference), registered for exactly the devices
without a kernel of their own, and reached through the dispatcher by forcing
it on the CPU."""

import warnings

import dino_opt  # noqa: F401  (registers the operators)
import pytest
import torch
from dino_opt.ops import (
    FALLBACK_OPS,
    dino_loss_backward_torch,
    dino_loss_torch,
    ema_update_torch,
    fallback_warned,
)
from reference import dino_loss_reference

OPS = sorted(FALLBACK_OPS)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(torch.randint(0, 2**31, ()).item())


def loss_inputs(gen, dtype, views=4, teachers=2, batch=3, dim=300):
    student = (torch.randn(views * batch, dim, generator=gen) * 4).to(dtype)
    teacher = (torch.randn(teachers * batch, dim, generator=gen) * 4).to(dtype)
    center = torch.randn(
        dim, generator=gen, dtype=torch.float64 if dtype == torch.float64 else None
    )
    return student, teacher, center


def kernel_loss(student, teacher, center, *args):
    return torch.ops.dino_opt.dino_loss(student, teacher, center, *args)


def close(a, b, rtol, atol=0.0):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("views,offset,total", [(4, 0, -1), (2, 0, -1), (3, 1, 6), (1, 5, 6)])
def test_the_loss_equals_the_kernel(gen, dtype, views, offset, total):
    s, t, c = loss_inputs(gen, dtype, views=views)
    args = (0.1, 0.04, views, offset, total)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    ours_all, theirs_all = dino_loss_torch(s, t, c, *args), kernel_loss(s, t, c, *args)
    for ours, theirs in zip(ours_all, theirs_all, strict=True):
        assert ours.dtype == theirs.dtype
        close(ours, theirs, rtol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("views,offset,total", [(4, 0, -1), (3, 1, 6)])
def test_the_gradient_equals_the_kernel(gen, dtype, views, offset, total):
    s, t, c = loss_inputs(gen, dtype, views=views)
    args = (0.1, 0.04, views, offset, total)
    _, s_lse, t_lse = kernel_loss(s, t, c, *args)
    grad = torch.tensor(1.7, dtype=s_lse.dtype)
    ours = dino_loss_backward_torch(grad, s, t, c, s_lse, t_lse, *args)
    theirs = torch.ops.dino_opt.dino_loss_backward(grad, s, t, c, s_lse, t_lse, *args)
    assert ours.dtype == theirs.dtype == s.dtype
    scale = theirs.double().abs().max().item()
    close(
        ours,
        theirs,
        0,
        (1e-12 if dtype == torch.float64 else 1e-2 if dtype == torch.bfloat16 else 1e-5) * scale,
    )


def test_the_loss_and_gradient_equal_the_float64_reference(gen):
    s, t, c = loss_inputs(gen, torch.float64, views=6)
    x = s.clone().requires_grad_(True)
    expected = dino_loss_reference(x, t, c, 0.1, 0.04, 6)
    expected.backward()
    loss, s_lse, t_lse = dino_loss_torch(s, t, c, 0.1, 0.04, 6)
    close(loss, expected.detach(), 1e-12)
    one = torch.ones((), dtype=torch.float64)
    close(dino_loss_backward_torch(one, s, t, c, s_lse, t_lse, 0.1, 0.04, 6), x.grad, 0, 1e-14)


def test_neg_inf_teacher_logits_add_nothing_as_in_the_kernel(gen):
    # 0 log 0 = 0: a teacher probability of exactly 0 adds nothing, even
    # against a student log-probability of -inf.
    s, t, c = loss_inputs(gen, torch.float32, dim=600)
    t[:, 100:300] = float("-inf")
    s[:, 100:300] = float("-inf")
    ours = dino_loss_torch(s, t, c, 0.1, 0.04, 4)
    theirs = kernel_loss(s, t, c, 0.1, 0.04, 4)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.isfinite(a).all()
        close(a, b, 2e-5)


def test_loss_argument_errors_are_named():
    s = torch.randn(8, 10)
    with pytest.raises(RuntimeError, match="ncrops"):
        dino_loss_torch(s, torch.randn(4, 10), torch.zeros(10), 0.1, 0.04, 1)
    with pytest.raises(RuntimeError, match="do not fit"):
        dino_loss_torch(s, torch.randn(4, 11), torch.zeros(10), 0.1, 0.04, 4)
    with pytest.raises(RuntimeError, match="student is torch.float32 but teacher"):
        dino_loss_torch(s, torch.randn(4, 10, dtype=torch.float64), torch.zeros(10), 0.1, 0.04, 4)


@pytest.mark.parametrize(
    "teacher_dtype,student_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float64, torch.float32),
    ],
)
def test_the_ema_equals_the_kernel(gen, teacher_dtype, student_dtype):
    shapes = [(1000,), (7, 3), (2, 5, 4), (1,)]
    teacher = [torch.randn(s, generator=gen).to(teacher_dtype) for s in shapes]
    student = [torch.randn(s, generator=gen).to(student_dtype) for s in shapes]
    expected = [x.clone() for x in teacher]
    torch.ops.dino_opt.ema_update_(expected, student, 0.993)
    ema_update_torch(teacher, student, 0.993)
    for a, b in zip(teacher, expected, strict=True):
        # A few roundings of the teacher's dtype at most (the kernel's fused
        # multiply-add against lerp).
        eps = torch.finfo(teacher_dtype).eps
        close(a, b, 0, 4 * eps * b.double().abs().max().item())


def test_ema_argument_errors_are_named():
    t, s = [torch.zeros(3)], [torch.zeros(4)]
    with pytest.raises(RuntimeError, match=r"teacher\[0\] has shape \(3,\) but student\[0\]"):
        ema_update_torch(t, s, 0.9)
    with pytest.raises(RuntimeError, match="momentum must be in"):
        ema_update_torch(t, [torch.zeros(3)], 1.5)
    with pytest.raises(RuntimeError, match="requires grad"):
        ema_update_torch([torch.zeros(3, requires_grad=True)], [torch.zeros(3)], 0.9)
    with pytest.raises(RuntimeError, match="teacher has 1 tensors but student has 0"):
        ema_update_torch(t, [], 0.9)
    ema_update_torch([], [], 0.5)  # nothing to do


@pytest.mark.parametrize("op", OPS)
def test_each_fallback_serves_only_devices_without_a_kernel(op):
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has(op, "CompositeExplicitAutograd")
    assert has(op, "CPU")  # the compiled kernel, which the dispatcher prefers
    assert has(op, "CUDA") == dino_opt.build_info()["cuda_compiled"]


def test_cpu_tensors_run_the_compiled_kernels_without_a_warning(gen):
    s, t, c = loss_inputs(gen, torch.float32)
    before = fallback_warned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dino_opt.dino_loss(s.requires_grad_(True), t, c, 0.1, 0.04, 4).backward()
        torch.ops.dino_opt.ema_update_([torch.zeros(3)], [torch.ones(3)], 0.9)
    assert fallback_warned() == before


def forced(op):
    """The operator called below the backends: the dispatcher's key for a
    device that has no kernel, on CPU tensors."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
    return lambda *args: op.redispatch(keys, *args)


def test_the_dispatcher_reaches_the_fallbacks_with_one_warning_each(gen):
    s, t, c = loss_inputs(gen, torch.float32)
    args = (0.1, 0.04, 4, 0, -1)
    with pytest.warns(RuntimeWarning, match="dino_loss: this build has no cpu kernel"):
        ours = forced(torch.ops.dino_opt.dino_loss.default)(s, t, c, *args)
    for a, b in zip(ours, kernel_loss(s, t, c, *args), strict=True):
        close(a, b, 2e-5)
    teacher, expected = [torch.zeros(5)], [torch.zeros(5)]
    with pytest.warns(RuntimeWarning, match="ema_update_: this build has no cpu kernel"):
        forced(torch.ops.dino_opt.ema_update_.default)(teacher, [torch.ones(5)], 0.75)
    torch.ops.dino_opt.ema_update_(expected, [torch.ones(5)], 0.75)
    close(teacher[0], expected[0], 1e-7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per operator and device type
        forced(torch.ops.dino_opt.dino_loss.default)(s, t, c, *args)
    assert {("dino_loss", "cpu"), ("ema_update_", "cpu")} <= fallback_warned()


def test_meta_tensors_take_the_fake_kernels_with_the_fallbacks_shapes(gen):
    # torch.compile traces with fake tensors: the fake kernels, never the
    # fallbacks, and they promise what the fallbacks return.
    s, t, c = loss_inputs(gen, torch.bfloat16)
    args = (0.1, 0.04, 4, 0, -1)
    before = fallback_warned()
    meta = torch.ops.dino_opt.dino_loss(s.to("meta"), t.to("meta"), c.to("meta"), *args)
    real = dino_loss_torch(s, t, c, *args)
    assert [(m.shape, m.dtype) for m in meta] == [(r.shape, r.dtype) for r in real]
    grad = torch.ops.dino_opt.dino_loss_backward(
        meta[0], s.to("meta"), t.to("meta"), c.to("meta"), meta[1], meta[2], *args
    )
    assert (grad.shape, grad.dtype) == (s.shape, s.dtype)
    assert fallback_warned() == before


def test_a_compiled_step_matches_eager_with_the_fallbacks_registered(gen):
    s, t, c = loss_inputs(gen, torch.float32)

    def step(x):
        return dino_opt.dino_loss(x, t, c, 0.1, 0.04, 4) * 2

    x1, x2 = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    step(x1).backward()
    torch.compile(step, backend="aot_eager", fullgraph=True)(x2).backward()
    close(x1.grad, x2.grad, 1e-6)
