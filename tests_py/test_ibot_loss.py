"""The fused iBOT masked-patch loss against its formula written in plain
PyTorch (tests_py/reference.py) in float64, on fresh random inputs: values
and gradients for every student dtype, target broadcast (M < N), 0 log 0,
no rows, operator checks, torch.compile, the fake kernels, the argument
errors, the plain-torch fallback, the DINO loss where the two coincide, and
CUDA against the CPU kernel."""

import warnings

import dino_opt
import pytest
import torch
from dino_opt import ibot_loss
from dino_opt.ops import fallback_warned, ibot_loss_backward_torch, ibot_loss_torch
from reference import ibot_loss_reference

TOLERANCE = {  # relative on the loss, relative to max |grad| on the gradient
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-2,
}
TEMP = 0.1


def make_inputs(gen, n, m, k, dtype=torch.float64, target_dtype=None, device="cpu"):
    """Student logits x3, target rows softmax(randn / 0.3) with about a fifth
    of them exactly 0 and one row scaled (sum 1.7), weights about 1 / n."""
    student = (3 * torch.randn(n, k, generator=gen, dtype=torch.float64)).to(dtype)
    targets = torch.softmax(torch.randn(m, k, generator=gen, dtype=torch.float64) / 0.3, -1)
    targets = targets * (torch.rand(m, k, generator=gen, dtype=torch.float64) > 0.2)
    if m:
        targets[0] *= 1.7
    targets = targets.to(target_dtype or dtype)
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    weights = ((torch.rand(n, generator=gen, dtype=torch.float64) + 0.5) / max(n, 1)).to(
        weight_dtype
    )
    return student.to(device), targets.to(device), weights.to(device)


def reference_and_grad(student, targets, weights, grad=1.0):
    """The formula in float64 on the same (rounded) values: loss and d loss / d student."""
    s64 = student.detach().cpu().double().requires_grad_()
    ref = ibot_loss_reference(s64, targets.cpu().double(), weights.cpu().double(), TEMP)
    (grad * ref).backward()
    return ref.detach(), s64.grad


def check_against_reference(student, targets, weights, tol):
    """Loss and gradient vs the formula in float64, within `tol` plus what
    rounding the logits costs (about eps x max|logit| of each probability, in
    the accumulation type)."""
    acc = torch.float64 if student.dtype == torch.float64 else torch.float32
    max_logit = student.detach().double().abs().max().item() / TEMP
    tol = tol + 2 * torch.finfo(acc).eps * max_logit
    s = student.detach().clone().requires_grad_()
    loss = ibot_loss(s, targets, weights, TEMP)
    (0.7 * loss).backward()
    ref, ref_grad = reference_and_grad(student, targets, weights, 0.7)
    assert loss.dtype == (torch.float64 if student.dtype == torch.float64 else torch.float32)
    assert abs(loss.item() - ref.item()) <= tol * max(abs(ref.item()), 1.0), (loss, ref)
    assert s.grad.dtype == student.dtype and s.grad.shape == student.shape
    scale = ref_grad.abs().max().item()
    err = (s.grad.cpu().double() - ref_grad).abs().max().item()
    assert err <= tol * scale, f"grad error {err} vs scale {scale}"


# (N, M, K): one and several CPU chunks of 4096, odd tails, M = N and M < N.
SIZES = [(1, 1, 1), (5, 5, 7), (6, 3, 4096), (8, 2, 4097), (3, 3, 3 * 4096 + 5), (64, 64, 300)]


@pytest.mark.parametrize("n, m, k", SIZES)
def test_float64_matches_the_formula(n, m, k, gen):
    check_against_reference(*make_inputs(gen, n, m, k), TOLERANCE[torch.float64])


@pytest.mark.parametrize("n, m, k", [(6, 3, 4097), (32, 32, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("float_targets", [False, True], ids=["same_targets", "float32_targets"])
def test_lower_precision_students(n, m, k, dtype, float_targets, gen):
    target_dtype = torch.float32 if float_targets else dtype
    check_against_reference(*make_inputs(gen, n, m, k, dtype, target_dtype), TOLERANCE[dtype])


def test_float64_student_with_float32_targets(gen):
    student, targets, weights = make_inputs(gen, 4, 2, 50, torch.float64, torch.float32)
    check_against_reference(student, targets, weights, TOLERANCE[torch.float64])


def test_student_lse_is_the_log_sum_exp(gen):
    student, targets, weights = make_inputs(gen, 6, 3, 9000, torch.float32)
    _, lse = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
    want = torch.logsumexp(student.double() / TEMP, -1)
    torch.testing.assert_close(lse.double(), want, rtol=1e-6, atol=0)


def test_targets_broadcast_over_the_student_rows(gen):
    # M < N: student row n takes target row n % M, as the repeated targets do.
    student, targets, weights = make_inputs(gen, 12, 4, 333)
    repeated = targets.repeat(3, 1)
    x1, x2 = student.clone().requires_grad_(), student.clone().requires_grad_()
    a, b = ibot_loss(x1, targets, weights, TEMP), ibot_loss(x2, repeated, weights, TEMP)
    a.backward()
    b.backward()
    torch.testing.assert_close(a, b, rtol=1e-13, atol=0)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("k", [600, 3 * 4096 + 5])
def test_zero_targets_against_neg_inf_logits_add_nothing(k, gen):
    # 0 log 0 = 0: where the target is exactly 0 the student may be -inf (a
    # whole chunk of -inf included when K spans several chunks).
    student, targets, weights = make_inputs(gen, 4, 2, k, torch.float32)
    student[:, 100:300] = float("-inf")
    targets[:, 100:300] = 0
    if k > 8192:
        student[1, :4096] = float("-inf")
        targets[1, :4096] = 0
    check_against_reference(student, targets, weights, TOLERANCE[torch.float32])
    x = student.clone().requires_grad_()
    ibot_loss(x, targets, weights, TEMP).backward()
    assert torch.isfinite(x.grad).all()


def test_non_finite_inputs_are_not_hidden(gen):
    student, targets, weights = make_inputs(gen, 4, 4, 16, torch.float32)
    student[2, 3] = float("nan")
    assert torch.isnan(ibot_loss(student, targets, weights, TEMP))
    student[2, 3] = float("-inf")  # where the target is not 0: the loss is +inf
    targets[2, 3] = 0.5
    assert ibot_loss(student, targets, weights, TEMP).item() == float("inf")


def test_no_rows_give_zero_and_an_empty_gradient():
    for m in (0, 3):
        student = torch.zeros(0, 5, requires_grad=True)
        loss = ibot_loss(student, torch.zeros(m, 5), torch.zeros(0), TEMP)
        assert loss.item() == 0.0 and loss.dtype == torch.float32
        loss.backward()
        assert student.grad.shape == (0, 5)


def test_result_does_not_depend_on_thread_count(gen):
    student, targets, weights = make_inputs(gen, 16, 8, 3 * 4096 + 7, torch.float32)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(3, threads)):
            torch.set_num_threads(n)
            loss, lse = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
            grad = torch.ops.dino_opt.ibot_loss_backward(
                torch.tensor(0.3), student, targets, weights, lse, TEMP
            )
            outs.append((loss, lse, grad))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_gradcheck_opcheck_and_compile(gen):
    student, targets, weights = make_inputs(gen, 6, 3, 5)
    x = student.clone().requires_grad_()
    torch.autograd.gradcheck(lambda s: ibot_loss(s, targets, weights, TEMP), (x,))
    torch.library.opcheck(torch.ops.dino_opt.ibot_loss.default, (x, targets, weights, TEMP))
    _, lse = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
    args = (torch.tensor(1.3, dtype=torch.float64), student, targets, weights, lse, TEMP)
    torch.library.opcheck(torch.ops.dino_opt.ibot_loss_backward.default, args)

    def step(s):
        return 2 * ibot_loss(s.tanh() * 4, targets, weights, TEMP)

    x1, x2 = student.clone().requires_grad_(), student.clone().requires_grad_()
    eager = step(x1)
    eager.backward()
    compiled = torch.compile(step, fullgraph=True)(x2)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-12, atol=0)
    # the compiled graph fuses tanh's backward: equal to a few float64
    # roundings of the gradient's largest element (a fixed 1e-15 failed where
    # that element is 9.4 and a saturated tanh's is 1.7e-3: 1.6 ulps apart)
    scale = x1.grad.abs().max().item()
    torch.testing.assert_close(
        x2.grad, x1.grad, rtol=1e-12, atol=16 * torch.finfo(torch.float64).eps * scale
    )


def test_meta_tensors_take_the_fake_kernels(gen):
    student, targets, weights = make_inputs(gen, 6, 3, 40, torch.bfloat16, torch.float32)
    meta = [t.to("meta") for t in (student, targets, weights)]
    loss, lse = torch.ops.dino_opt.ibot_loss(*meta, TEMP)
    real = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
    assert [(t.shape, t.dtype) for t in (loss, lse)] == [(r.shape, r.dtype) for r in real]
    grad = torch.ops.dino_opt.ibot_loss_backward(loss, *meta, lse, TEMP)
    assert (grad.shape, grad.dtype, grad.device.type) == (student.shape, student.dtype, "meta")


S, T, W = (6, 16), (3, 16), (6,)
ERRORS = [
    ((6,), T, W, {}, r"ibot_loss: student must be 2-D \[N, K\], got shape \[6\]"),
    (S, (16,), W, {}, r"targets must be 2-D \[M, K\], got shape \[16\]"),
    (S, (3, 15), W, {}, r"student has K=16 but targets has K=15"),
    ((6, 0), (3, 0), W, {}, r"K must be at least 1"),
    (S, (4, 16), W, {}, r"student has 6 rows, which is not a multiple of the 4 rows of targets"),
    (S, (0, 16), W, {}, r"student has 6 rows, which is not a multiple of the 0 rows"),
    (S, T, (5,), {}, r"weights must have shape \[6\] \(one per student row\), got \[5\]"),
    (S, T, (6, 1), {}, r"weights must have shape \[6\]"),
    (S, T, W, {"student_temp": 0.0}, r"student_temp must be positive and finite, got 0"),
    (S, T, W, {"student_temp": -0.1}, r"student_temp must be positive"),
    (S, T, W, {"student_temp": float("nan")}, r"student_temp must be positive"),
    (S, T, W, {"student": torch.long}, r"ibot_loss: student has dtype Long; expected float64"),
    (
        S,
        T,
        W,
        {"targets": torch.half},
        r"targets has dtype Half; expected the student's dtype \(Float\) or float32",
    ),
    (
        S,
        T,
        W,
        {"student": torch.half, "targets": torch.bfloat16},
        r"targets has dtype BFloat16; expected the student's dtype \(Half\) or float32",
    ),
    (S, T, W, {"weights": torch.float64}, r"weights has dtype Double; expected float32$"),
    (S, T, W, {"weights": torch.int32}, r"weights has dtype Int; expected float32"),
    (
        S,
        T,
        W,
        {"student": torch.float64, "weights": torch.half},
        r"weights has dtype Half; expected float32 or float64",
    ),
]


@pytest.mark.parametrize("student_shape, target_shape, weight_shape, opts, message", ERRORS)
def test_argument_errors_name_the_argument(
    student_shape, target_shape, weight_shape, opts, message
):
    student = torch.ones(student_shape, dtype=opts.get("student", torch.float32))
    targets = torch.ones(target_shape, dtype=opts.get("targets", torch.float32))
    weights = torch.ones(weight_shape, dtype=opts.get("weights", torch.float32))
    with pytest.raises(RuntimeError, match=message):
        ibot_loss(student, targets, weights, opts.get("student_temp", TEMP))


def test_backward_argument_errors_name_the_argument(gen):
    student, targets, weights = make_inputs(gen, 6, 3, 16, torch.float32)
    loss, lse = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
    backward = torch.ops.dino_opt.ibot_loss_backward
    with pytest.raises(
        RuntimeError, match=r"ibot_loss_backward: student_lse must have shape \[6\]"
    ):
        backward(loss, student, targets, weights, lse[:5], TEMP)
    with pytest.raises(RuntimeError, match="student_lse has dtype Double; expected Float"):
        backward(loss, student, targets, weights, lse.double(), TEMP)
    with pytest.raises(RuntimeError, match=r"grad must be a scalar, got shape \[2\]"):
        backward(loss.expand(2), student, targets, weights, lse, TEMP)
    with pytest.raises(RuntimeError, match="ibot_loss_backward: student_temp must be positive"):
        backward(loss, student, targets, weights, lse, -1.0)


# ----------------------------------------------------------------- fallback


def forced(op):
    """The operator called below the backends: the dispatcher's key for a
    device without a kernel, on CPU tensors (as tests_py/test_fallback.py)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
    return lambda *args: op.redispatch(keys, *args)


@pytest.mark.parametrize(
    "dtype, target_dtype, m",
    [
        (torch.float64, torch.float64, 6),
        (torch.float32, torch.float32, 3),
        (torch.bfloat16, torch.float32, 6),
        (torch.float16, torch.float16, 2),
    ],
)
def test_the_fallback_forced_on_the_cpu_equals_the_kernel(dtype, target_dtype, m, gen):
    student, targets, weights = make_inputs(gen, 6, m, 4099, dtype, target_dtype)
    student[0, :50] = float("-inf")
    targets[0, :50] = 0
    warned_before = ("ibot_loss", "cpu") in fallback_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = forced(torch.ops.dino_opt.ibot_loss.default)(student, targets, weights, TEMP)
    messages = [str(w.message) for w in caught]
    assert warned_before or any("ibot_loss: this build has no cpu kernel" in m for m in messages)
    assert ("ibot_loss", "cpu") in fallback_warned()
    theirs = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=0)
    grad = torch.tensor(0.9, dtype=theirs[0].dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g_ours = forced(torch.ops.dino_opt.ibot_loss_backward.default)(
            grad, student, targets, weights, theirs[1], TEMP
        )
    g_theirs = torch.ops.dino_opt.ibot_loss_backward(
        grad, student, targets, weights, theirs[1], TEMP
    )
    assert g_ours.dtype == g_theirs.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    scale = g_theirs.double().abs().max().item()
    torch.testing.assert_close(g_ours.double(), g_theirs.double(), rtol=0, atol=tol * scale)


def test_the_fallback_checks_its_arguments_and_handles_no_rows():
    with pytest.raises(RuntimeError, match="do not fit together"):
        ibot_loss_torch(torch.ones(6, 4), torch.ones(4, 4), torch.ones(6), TEMP)
    with pytest.raises(RuntimeError, match=r"weights must have shape \[6\]"):
        ibot_loss_torch(torch.ones(6, 4), torch.ones(3, 4), torch.ones(5), TEMP)
    with pytest.raises(RuntimeError, match="student_temp must be positive"):
        ibot_loss_torch(torch.ones(6, 4), torch.ones(3, 4), torch.ones(6), 0.0)
    loss, lse = ibot_loss_torch(torch.ones(0, 4), torch.ones(0, 4), torch.ones(0), TEMP)
    assert loss.item() == 0.0 and lse.shape == (0,)
    grad = ibot_loss_backward_torch(
        torch.tensor(1.0), torch.ones(0, 4), torch.ones(0, 4), torch.ones(0), lse, TEMP
    )
    assert grad.shape == (0, 4)


# ----------------------------------------------------------------- DINO loss


@pytest.mark.parametrize("batch, k", [(3, 37), (2, 4097)])
def test_equals_the_dino_loss_on_student_views_without_a_teacher_view(batch, k, gen):
    # Local views 2..5 of 6 against 2 teacher views: every pair counts, so the
    # DINO loss is the cross-entropy with the summed teacher probabilities per
    # image (M = B, broadcast over the 4 views) and weight 1 / (B * n_terms).
    views, teachers, total, st, tt = 4, 2, 6, 0.1, 0.04
    f64 = dict(generator=gen, dtype=torch.float64)
    student = 3 * torch.randn(views * batch, k, **f64)
    teacher, center = 3 * torch.randn(teachers * batch, k, **f64), torch.randn(k, **f64)
    x_dino, x_ibot = student.clone().requires_grad_(), student.clone().requires_grad_()
    dino = dino_opt.dino_loss(
        x_dino, teacher, center, st, tt, views, view_offset=2, total_views=total
    )
    probs = torch.softmax((teacher - center) / tt, -1).view(teachers, batch, k)
    n_terms = teachers * (total - 1)
    weights = torch.full((views * batch,), 1.0 / (batch * n_terms), dtype=torch.float64)
    ours = ibot_loss(x_ibot, probs.sum(0), weights, st)
    dino.backward()
    ours.backward()
    torch.testing.assert_close(ours, dino, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        x_ibot.grad, x_dino.grad, rtol=0, atol=1e-12 * x_dino.grad.abs().max()
    )


# ----------------------------------------------------------------- CUDA

HALF = (torch.bfloat16, torch.float16)
# CUDA vs CPU: the gradient is rounded to its dtype on each side, so half
# types may differ by an ulp of the largest gradient.
CUDA_CPU_GRAD_TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.bfloat16: 2**-7,
    torch.float16: 2**-9,
}


def check_cuda_against_cpu(student, targets, weights):
    """The CUDA operator's outputs and gradient against the CPU operator's."""
    gpu = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
    cpu_args = (student.cpu(), targets.cpu(), weights.cpu())
    cpu = torch.ops.dino_opt.ibot_loss(*cpu_args, TEMP)
    rtol = 1e-12 if student.dtype == torch.float64 else 1e-5
    for name, g, c in zip(("loss", "student_lse"), gpu, cpu, strict=True):
        assert g.device.type == "cuda" and g.dtype == c.dtype and g.shape == c.shape, name
        torch.testing.assert_close(g.cpu(), c, rtol=rtol, atol=rtol, msg=name)
    grad = torch.tensor(0.7, dtype=cpu[0].dtype)
    g_gpu = torch.ops.dino_opt.ibot_loss_backward(
        grad.cuda(), student, targets, weights, gpu[1], TEMP
    )
    g_cpu = torch.ops.dino_opt.ibot_loss_backward(grad, *cpu_args, cpu[1], TEMP)
    assert g_gpu.dtype == student.dtype and g_gpu.shape == student.shape
    # Relative to the gradient, or where it is near 0 (tsum * q - p of two
    # rounded probabilities) to the scale of one row's terms.
    floor = grad.item() * weights.double().abs().max().item() / TEMP if len(weights) else 0.0
    scale = max(g_cpu.double().abs().max().item(), floor)
    err = (g_gpu.cpu().double() - g_cpu.double()).abs().max().item()
    assert err <= CUDA_CPU_GRAD_TOL[student.dtype] * scale, f"grad: {err} vs scale {scale}"


def check_cuda(gen, n, m, k, dtype, target_dtype=None):
    inputs = make_inputs(gen, n, m, k, dtype, target_dtype, device="cuda")
    check_cuda_against_cpu(*inputs)
    check_against_reference(*inputs, TOLERANCE[dtype])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("float_targets", [False, True], ids=["same_targets", "float32_targets"])
def test_cuda_every_dtype(dtype, float_targets, gen):
    check_cuda(gen, 12, 4, 2049, dtype, torch.float32 if float_targets else dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("n, m", [(1, 1), (3, 3), (257, 257), (20, 4)])
@pytest.mark.parametrize("k", [1, 7, 2047, 2048, 2049, 65537])
def test_cuda_rows_and_k_not_a_multiple_of_the_block(n, m, k, gen):
    check_cuda(gen, n, m, k, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "dtype, target_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_cuda_large_k_and_many_rows(dtype, target_dtype, gen):
    check_cuda_against_cpu(*make_inputs(gen, 2048, 2048, 65536, dtype, target_dtype, "cuda"))
    check_cuda(gen, 640, 64, 65536, dtype, target_dtype)


@pytest.mark.cuda
def test_cuda_no_rows_and_neg_inf_chunks(gen):
    student = torch.zeros(0, 5, device="cuda", requires_grad=True)
    loss = ibot_loss(student, torch.zeros(0, 5, device="cuda"), torch.zeros(0, device="cuda"), TEMP)
    loss.backward()
    assert loss.item() == 0.0 and student.grad.shape == (0, 5)
    student, targets, weights = make_inputs(gen, 4, 2, 3 * 2048 + 5, torch.float32, device="cuda")
    student[1, :2048] = float("-inf")
    targets[1, :2048] = 0
    student[:, 3000:3100] = float("-inf")
    targets[:, 3000:3100] = 0
    check_cuda_against_cpu(student, targets, weights)
    check_against_reference(student, targets, weights, TOLERANCE[torch.float32])


@pytest.mark.cuda
def test_cuda_misaligned_and_non_contiguous_inputs(gen):
    student, targets, weights = make_inputs(gen, 6, 3, 4099, torch.bfloat16, device="cuda")
    buf = torch.empty(student.numel() + 1, dtype=student.dtype, device="cuda")
    misaligned = buf[1:].view(student.shape)
    misaligned.copy_(student)
    check_cuda_against_cpu(misaligned, targets.t().contiguous().t(), weights)


@pytest.mark.cuda
def test_cuda_errors_name_the_argument_on_the_wrong_device(gen):
    student, targets, weights = make_inputs(gen, 4, 2, 16, torch.float32, device="cuda")
    on_one = "student, targets and weights must be on one device"
    with pytest.raises(RuntimeError, match=f"{on_one}, got cpu, cuda:0 and cuda:0"):
        ibot_loss(student.cpu(), targets, weights, TEMP)
    with pytest.raises(RuntimeError, match=f"{on_one}, got cuda:0, cpu and cuda:0"):
        ibot_loss(student, targets.cpu(), weights, TEMP)
    with pytest.raises(RuntimeError, match=f"{on_one}, got cuda:0, cuda:0 and cpu"):
        ibot_loss(student, targets, weights.cpu(), TEMP)
    loss, lse = torch.ops.dino_opt.ibot_loss(student, targets, weights, TEMP)
    with pytest.raises(RuntimeError, match="grad is on cpu but student is on cuda:0"):
        torch.ops.dino_opt.ibot_loss_backward(
            torch.tensor(1.0), student, targets, weights, lse, TEMP
        )
    with pytest.raises(RuntimeError, match="student_lse is on cpu but student is on cuda:0"):
        torch.ops.dino_opt.ibot_loss_backward(loss, student, targets, weights, lse.cpu(), TEMP)


def test_one_logit_gives_exactly_zero_gradient(gen):
    # K = 1 with a target of 1: the softmax is exactly 1 and the gradient exactly
    # 0 when each logit is the same number in every pass (broken on the first
    # GPU run by a contracted multiply-add; the CUDA test below checks it there).
    student, _, weights = make_inputs(gen, 4, 4, 1, torch.float32)
    s = (50 * student).requires_grad_()
    ibot_loss(s, torch.ones(4, 1), weights, TEMP).backward()
    assert torch.count_nonzero(s.grad) == 0


@pytest.mark.cuda
def test_cuda_one_logit_gives_exactly_zero_gradient(gen):
    student, _, weights = make_inputs(gen, 4, 4, 1, torch.float32, device="cuda")
    s = (50 * student).requires_grad_()
    ibot_loss(s, torch.ones(4, 1, device="cuda"), weights, TEMP).backward()
    assert torch.count_nonzero(s.grad) == 0
