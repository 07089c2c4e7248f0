"""The fused Gram anchoring loss (DINOv3): values and gradients against a
float64 reference written from the published algorithm, for every option,
per image and over the batch; the D x D identity against the tiles; the CPU
kernel against the plain-torch fallback; the drop-in GramLoss; operator
checks, torch.compile, the fake kernels, argument errors; the CUDA kernel
against the CPU kernel and the reference (skipped without a GPU)."""

import warnings

import pytest
import torch
from dino_opt.dinov3 import GramLoss
from dino_opt.ops import (
    fallback_warned,
    gram_clamp_allowance,
    gram_loss,
    gram_loss_backward_torch,
    gram_loss_torch,
)
from reference import gram_loss_reference

# Relative on the loss; relative to max |grad| on the gradient. bfloat16 and
# float16 inputs are computed in float32 (the reference takes the same
# rounded inputs), but the gradient is returned in their dtype: 2^-8 of it.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

# (apply_norm, remove_neg, remove_only_teacher_neg)
OPTIONS = [
    (True, False, False),
    (True, True, False),
    (True, False, True),
    (False, False, False),
    (False, True, False),
    (False, False, True),
]
OPTION_IDS = [
    "norm",
    "norm-remove_neg",
    "norm-teacher_neg",
    "raw",
    "raw-remove_neg",
    "raw-teacher_neg",
]
# [B, N, D] per image and [M, D] over the batch: N > D (the identity) and
# N < D (tiles), odd sizes, one row, more rows than a tile (512).
SHAPES = [
    (3, 37, 16),
    (2, 7, 33),
    (4, 1, 5),
    (2, 2, 3),
    (50, 8),
    (5, 40),
    (1, 4),
    (1100, 12),
    (2, 530, 7),
]


def make_inputs(gen, shape, dtype=torch.float64, device="cpu"):
    """Student features and a teacher near them (as a Gram teacher is an
    earlier student), a mix of positive and negative similarities."""
    student = torch.randn(shape, generator=gen, dtype=torch.float64) + 0.3
    teacher = student + 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
    return student.to(device, dtype), teacher.to(device, dtype)


def reference_and_grad(student, teacher, options, grad=1.0):
    """The reference in float64 on the same (rounded) values, and its gradient."""
    s64 = student.detach().cpu().double().requires_grad_()
    apply_norm, remove_neg, teacher_neg = options
    ref = gram_loss_reference(
        s64, teacher.cpu().double(), student.dim() == 3, apply_norm, remove_neg, teacher_neg
    )
    (grad * ref).backward()
    return ref.detach(), s64.grad


def run_op(student, teacher, options, form=0, grad=0.7):
    s = student.detach().clone().requires_grad_()
    loss = torch.ops.dino_opt.gram_loss(s, teacher, *options, form)
    (grad * loss).backward()
    return loss.detach(), s.grad


def floors(student, options):
    """The scale of the terms that cancel in the loss, and in its gradient: the
    loss of the student's Gram matrix alone and its gradient w.r.t. the
    (normalised) rows over the smallest row norm, in float64. A loss near 0
    (one row, or every similarity clamped) is compared to these."""
    x = student.detach().cpu().double()
    rows = torch.nn.functional.normalize(x, dim=-1) if options[0] else x
    rows.requires_grad_()
    alone = gram_loss_reference(rows, torch.zeros_like(rows), rows.dim() == 3, False)
    alone.backward()
    smallest = x.norm(dim=-1).min().item() if options[0] else 1.0
    return alone.item(), rows.grad.abs().max().item() / smallest


def allowance(student, teacher, options, grad=0.7):
    """gram_clamp_allowance for (a loss, a gradient of) these inputs: what the
    clamp's jumps at 0 may change for pairs within rounding of 0. It must stay
    a small share of the pairs, so that the comparison keeps its teeth."""
    loss_bound, grad_bound, share = gram_clamp_allowance(
        grad, student.cpu(), teacher.cpu(), *options
    )
    assert share < 0.01, f"{share:.2%} of the pairs lie within rounding of 0"
    return loss_bound, grad_bound


def check(loss, grad, ref, ref_grad, tol, floor=(0.0, 0.0), allow=(0.0, 0.0)):
    """Loss relative to the reference, gradient relative to max|reference
    gradient|, each with `floor` (from floors()) below the reference's scale,
    beyond `allow` (from allowance(): the clamp's ambiguous pairs)."""
    assert torch.isfinite(ref)
    atol = tol * floor[0] + allow[0] + 1e-300
    torch.testing.assert_close(loss.double().cpu(), ref, rtol=tol, atol=atol)
    scale = max(ref_grad.abs().max().item(), floor[1])
    excess = ((grad.double().cpu() - ref_grad).abs() - allow[1]).clamp_min(0)
    err = excess.max().item()
    assert err <= tol * scale, f"grad: {err} beyond the allowance vs {tol} x {scale}"


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_float64_matches_the_reference(shape, options, gen):
    student, teacher = make_inputs(gen, shape)
    loss, grad = run_op(student, teacher, options)
    assert loss.dtype == torch.float64 and grad.shape == student.shape
    ref, ref_grad = reference_and_grad(student, teacher, options, 0.7)
    check(loss, grad, ref, ref_grad, TOLERANCE[torch.float64], floors(student, options))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(3, 37, 16), (2, 7, 33), (1100, 12), (5, 40)], ids=str)
@pytest.mark.parametrize("options", OPTIONS[:3], ids=OPTION_IDS[:3])
def test_lower_precision_matches_the_reference(shape, options, dtype, gen):
    student, teacher = make_inputs(gen, shape, dtype)
    loss, grad = run_op(student, teacher, options)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    ref, ref_grad = reference_and_grad(student, teacher, options, 0.7)
    check(loss, grad, ref, ref_grad, TOLERANCE[dtype], allow=allowance(student, teacher, options))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape", [(3, 37, 16), (2, 7, 33), (1100, 12), (40, 64), (2, 600, 24)], ids=str
)
@pytest.mark.parametrize("apply_norm", [True, False])
def test_the_identity_form_equals_the_tiled_form(shape, apply_norm, dtype, gen):
    student, teacher = make_inputs(gen, shape, dtype)
    options = (apply_norm, False, False)
    loss_identity, grad_identity = run_op(student, teacher, options, form=1)
    loss_tiles, grad_tiles = run_op(student, teacher, options, form=2)
    ref, ref_grad = reference_and_grad(student, teacher, options, 0.7)
    check(loss_identity, grad_identity, ref, ref_grad, TOLERANCE[dtype])
    check(loss_tiles, grad_tiles, ref, ref_grad, TOLERANCE[dtype])
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(loss_identity, loss_tiles, rtol=tol, atol=0)


@pytest.mark.parametrize(
    "options", OPTIONS[1:3] + OPTIONS[4:], ids=OPTION_IDS[1:3] + OPTION_IDS[4:]
)
def test_float32_at_scale_stays_within_the_clamp_allowance(options, gen):
    """16.8 million pairs in float32: a few dozen similarities lie within
    rounding of 0, where the clamp's slope jumps; beyond what
    gram_clamp_allowance grants those pairs, the gradient is float32-exact."""
    student, teacher = make_inputs(gen, (4096, 256), torch.float32)
    loss, grad = run_op(student, teacher, options)
    ref, ref_grad = reference_and_grad(student, teacher, options, 0.7)
    check(
        loss,
        grad,
        ref,
        ref_grad,
        TOLERANCE[torch.float32],
        allow=allowance(student, teacher, options),
    )


@pytest.mark.parametrize("apply_norm", [True, False])
def test_the_clamp_allowance_covers_a_similarity_on_zero(apply_norm, gen):
    """Student rows 0 and 1 orthogonal, the teacher's pair similar: nudged by
    1e-17 either side of 0, the pair is kept or clamped, and the two float64
    gradients differ by no more than the allowance at the unnudged inputs."""
    student = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    student[0], student[1] = 0, 0
    student[0, 0], student[1, 1] = 1.5, 0.8
    teacher = student + 0.1 * torch.randn(6, 8, generator=gen, dtype=torch.float64)
    teacher[1, 0] = 1.0  # the teacher's similarity of rows 0 and 1 well above 0
    options = (apply_norm, True, False)
    grads = []
    for nudge in (1e-17, -1e-17):
        nudged = student.clone()
        nudged[1, 0] = nudge
        grads.append(
            gram_loss_backward_torch(
                torch.tensor(1.0, dtype=torch.float64), nudged, teacher, *options, 0
            )
        )
    jump = (grads[0] - grads[1]).abs()
    assert jump.max() > 1e-3  # the clamp decides something here
    _, bound, share = gram_clamp_allowance(1.0, student, teacher, *options)
    assert share == 2 / 36  # the pair (0, 1) and (1, 0)
    assert bool((jump <= bound + 1e-15).all()), (jump - bound).max()


def test_the_clamp_allowance_is_zero_without_clamping_or_pairs_near_zero(gen):
    student, teacher = make_inputs(gen, (3, 40, 16), torch.float32)
    loss_bound, grad_bound, share = gram_clamp_allowance(1.0, student, teacher, True, False, False)
    assert loss_bound == 0 and share == 0 and not grad_bound.any()
    # Two clusters far apart: every similarity is far from 0, of either sign.
    sign = torch.where(torch.rand(64, 1, generator=gen) < 0.5, -1.0, 1.0)
    student = sign * (3 + torch.randn(64, 8, generator=gen).mul(0.1).add_(torch.ones(8)))
    teacher = student + 0.05 * torch.randn(64, 8, generator=gen)
    for options in (OPTIONS[1], OPTIONS[2], OPTIONS[4], OPTIONS[5]):
        loss_bound, grad_bound, share = gram_clamp_allowance(0.5, student, teacher, *options)
        assert loss_bound == 0 and share == 0 and not grad_bound.any()


def test_zero_rows_take_the_normalisation_eps_as_the_reference_does(gen):
    student, teacher = make_inputs(gen, (2, 9, 4))
    student[0, 3] = 0
    teacher[1, 5] = 0
    for options in OPTIONS[:3]:
        for form in (0, 2):
            loss, grad = run_op(student, teacher, options, form)
            check(loss, grad, *reference_and_grad(student, teacher, options, 0.7), 1e-10)


def test_the_teacher_gets_no_gradient(gen):
    student, teacher = make_inputs(gen, (2, 9, 4))
    s, t = student.clone().requires_grad_(), teacher.clone().requires_grad_()
    torch.ops.dino_opt.gram_loss(s, t).backward()
    assert t.grad is None and s.grad is not None
    gram_loss(s, t).backward()
    assert t.grad is None


def test_no_rows_give_nan_as_the_mean_of_nothing_and_an_empty_gradient():
    for shape in [(0, 4), (2, 0, 4)]:
        x = torch.ones(shape, requires_grad=True)
        loss = gram_loss(x, torch.ones(shape))
        assert loss.isnan() and loss.shape == ()
        loss.backward()
        assert x.grad.shape == shape


# ----------------------------------------------------------------- drop-in class


@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("img_level", [True, False])
def test_gram_loss_module_matches_the_reference(options, img_level, gen):
    apply_norm, remove_neg, teacher_neg = options
    module = GramLoss(
        apply_norm=apply_norm, remove_neg=remove_neg, remove_only_teacher_neg=teacher_neg
    )
    student, teacher = make_inputs(gen, (3, 21, 10), torch.float32)
    s = student.clone().requires_grad_()
    loss = module(s, teacher, img_level=img_level)
    loss.backward()
    s64 = student.double().requires_grad_()
    ref = gram_loss_reference(s64, teacher.double(), img_level, *options)
    ref.backward()
    check(loss.detach(), s.grad, ref.detach(), s64.grad, TOLERANCE[torch.float32])
    if not img_level:  # [B * N, D] is taken too
        flat = module(student.flatten(0, 1), teacher.flatten(0, 1), img_level=False)
        torch.testing.assert_close(flat, loss.detach(), rtol=1e-6, atol=0)


def test_gram_loss_module_defaults_and_errors(gen):
    module = GramLoss()
    assert (module.apply_norm, module.img_level, module.remove_neg) == (True, True, True)
    assert module.remove_only_teacher_neg is False
    student, teacher = make_inputs(gen, (2, 8, 6), torch.float32)
    ref = gram_loss_reference(student.double(), teacher.double(), True, True, True, False)
    torch.testing.assert_close(module(student, teacher).double(), ref, rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="exclude each other"):
        GramLoss(remove_neg=True, remove_only_teacher_neg=True)
    with pytest.raises(ValueError, match=r"img_level=True needs \[B, N, D\] features"):
        module(student.flatten(0, 1), teacher.flatten(0, 1))


def test_the_module_compiles_with_fullgraph(gen):
    module = GramLoss(remove_neg=False)
    student, teacher = make_inputs(gen, (2, 13, 6), torch.float32)

    def step(x):
        return 3 * module(x.tanh(), teacher, img_level=False)

    x1, x2 = student.clone().requires_grad_(), student.clone().requires_grad_()
    eager = step(x1)
    eager.backward()
    compiled = torch.compile(step, fullgraph=True)(x2)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-8)


# ----------------------------------------------------------------- operator checks


@pytest.mark.parametrize("shape", [(2, 7, 5), (9, 4)], ids=str)
@pytest.mark.parametrize("options", OPTIONS[:3], ids=OPTION_IDS[:3])
def test_gradcheck_and_opcheck(shape, options, gen):
    student, teacher = make_inputs(gen, shape)
    x = student.clone().requires_grad_()
    torch.autograd.gradcheck(lambda s: torch.ops.dino_opt.gram_loss(s, teacher, *options), (x,))
    torch.library.opcheck(torch.ops.dino_opt.gram_loss.default, (x, teacher, *options, 0))
    args = (torch.tensor(1.3, dtype=torch.float64), student, teacher, *options, 2)
    torch.library.opcheck(torch.ops.dino_opt.gram_loss_backward.default, args)


def test_meta_tensors_take_the_fake_kernels(gen):
    student, teacher = make_inputs(gen, (2, 7, 5), torch.bfloat16)
    meta = [t.to("meta") for t in (student, teacher)]
    loss = torch.ops.dino_opt.gram_loss(*meta)
    real = torch.ops.dino_opt.gram_loss(student, teacher)
    assert (loss.shape, loss.dtype, loss.device.type) == (real.shape, real.dtype, "meta")
    grad = torch.ops.dino_opt.gram_loss_backward(loss, *meta, True, False, False, 0)
    assert (grad.shape, grad.dtype, grad.device.type) == (student.shape, student.dtype, "meta")


ERRORS = [
    (
        (6,),
        (6,),
        {},
        r"gram_loss: student must be 3-D \[B, N, D\] .* or 2-D \[M, D\] .*got "
        r"shape \[6\]",
    ),
    ((2, 3, 4, 5), (2, 3, 4, 5), {}, r"student must be 3-D .*got shape \[2, 3, 4, 5\]"),
    ((2, 3, 4), (2, 3, 5), {}, r"teacher has shape \[2, 3, 5\] but student has shape \[2, 3, 4\]"),
    ((6, 4), (2, 3, 4), {}, r"teacher has shape \[2, 3, 4\] but student has shape \[6, 4\]"),
    ((6, 4), (6, 4), {"student": torch.long}, r"student has dtype Long; expected float64"),
    ((6, 4), (6, 4), {"teacher": torch.int32}, r"teacher has dtype Int; expected float64"),
    (
        (6, 4),
        (6, 4),
        {"remove_neg": True, "remove_only_teacher_neg": True},
        r"remove_neg and remove_only_teacher_neg exclude each other",
    ),
    ((6, 4), (6, 4), {"form": 3}, r"form must be 0 \(choose\), 1 .* or 2 \(tiles\), got 3"),
    (
        (6, 4),
        (6, 4),
        {"form": 1, "remove_neg": True},
        r"form=1 \(the D x D identity\) holds only without clamping",
    ),
]


@pytest.mark.parametrize("student_shape, teacher_shape, opts, message", ERRORS)
def test_argument_errors_name_the_argument(student_shape, teacher_shape, opts, message):
    student = torch.ones(student_shape, dtype=opts.get("student", torch.float32))
    teacher = torch.ones(teacher_shape, dtype=opts.get("teacher", torch.float32))
    flags = (True, opts.get("remove_neg", False), opts.get("remove_only_teacher_neg", False))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.dino_opt.gram_loss(student, teacher, *flags, opts.get("form", 0))
    grad = torch.ones(())
    with pytest.raises(RuntimeError, match=message.replace("gram_loss:", "gram_loss_backward:")):
        torch.ops.dino_opt.gram_loss_backward(grad, student, teacher, *flags, opts.get("form", 0))


def test_backward_grad_must_be_a_scalar(gen):
    student, teacher = make_inputs(gen, (9, 4), torch.float32)
    with pytest.raises(
        RuntimeError,
        match=r"gram_loss_backward: grad must be a scalar, got "
        r"shape \[2\]",
    ):
        torch.ops.dino_opt.gram_loss_backward(
            torch.ones(2), student, teacher, True, False, False, 0
        )


# ----------------------------------------------------------------- fallback


def forced(op):
    """The operator called below the backends: the dispatcher's key for a
    device without a kernel, on CPU tensors (as tests_py/test_fallback.py)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
    return lambda *args: op.redispatch(keys, *args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 37, 16), (2, 7, 33), (600, 12)], ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_the_fallback_forced_on_the_cpu_equals_the_kernel(shape, options, dtype, gen):
    student, teacher = make_inputs(gen, shape, dtype)
    warned_before = ("gram_loss", "cpu") in fallback_warned()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = forced(torch.ops.dino_opt.gram_loss.default)(student, teacher, *options, 0)
    messages = [str(w.message) for w in caught]
    assert warned_before or any("gram_loss: this build has no cpu kernel" in m for m in messages)
    theirs = torch.ops.dino_opt.gram_loss(student, teacher, *options, 0)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape == ()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=tol, atol=0)
    grad = torch.tensor(0.9, dtype=theirs.dtype)
    g_ours = gram_loss_backward_torch(grad, student, teacher, *options, 0)
    g_theirs = torch.ops.dino_opt.gram_loss_backward(grad, student, teacher, *options, 0)
    assert g_ours.dtype == g_theirs.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 1e-2)
    scale = g_theirs.double().abs().max().item()
    torch.testing.assert_close(g_ours.double(), g_theirs.double(), rtol=0, atol=tol * scale)


def test_the_fallback_checks_its_arguments():
    with pytest.raises(RuntimeError, match="must be of one shape"):
        gram_loss_torch(torch.ones(6, 4), torch.ones(6, 5))
    with pytest.raises(RuntimeError, match="exclude each other"):
        gram_loss_torch(torch.ones(6, 4), torch.ones(6, 4), True, True, True)
    with pytest.raises(RuntimeError, match="expected float64"):
        gram_loss_torch(torch.ones(6, 4, dtype=torch.long), torch.ones(6, 4))


# ----------------------------------------------------------------- CUDA

CUDA_SHAPES = [(3, 37, 16), (2, 7, 33), (1100, 12), (2, 530, 7), (8, 256, 384), (4096, 256)]


def check_cuda(gen, shape, dtype, options, form=0):
    """The CUDA operator against the CPU operator and the float64 reference."""
    student, teacher = make_inputs(gen, shape, dtype, device="cuda")
    loss, grad = run_op(student, teacher, options, form)
    assert loss.device.type == "cuda" and grad.device.type == "cuda" and grad.dtype == dtype
    cpu_loss, cpu_grad = run_op(student.cpu(), teacher.cpu(), options, form)
    tol = TOLERANCE[dtype]
    allow = allowance(student, teacher, options)
    check(loss, grad, cpu_loss.double(), cpu_grad.double(), tol, allow=allow)
    check(loss, grad, *reference_and_grad(student, teacher, options, 0.7), tol, allow=allow)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_cuda_matches_the_cpu_kernel_and_the_reference(shape, options, dtype, gen):
    check_cuda(gen, shape, dtype, options)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", [1, 2])
@pytest.mark.parametrize("shape", [(3, 37, 16), (1100, 12), (4096, 256)], ids=str)
def test_cuda_identity_and_tiled_forms(shape, form, gen):
    check_cuda(gen, shape, torch.float32, (True, False, False), form)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_errors_name_the_device(gen):
    student, teacher = make_inputs(gen, (9, 4), torch.float32)
    with pytest.raises(RuntimeError, match="student and teacher must be on one device"):
        torch.ops.dino_opt.gram_loss(student.cuda(), teacher)
    with pytest.raises(RuntimeError, match="grad is on cpu but student is on cuda"):
        torch.ops.dino_opt.gram_loss_backward(
            torch.ones(()), student.cuda(), teacher.cuda(), True, False, False, 0
        )


def test_remove_only_teacher_neg_leaves_the_student_as_dinov3_does():
    """Two patches whose similarity is negative in both matrices: dinov3
    clamps the teacher's first, so the student's stays -1 (not 0)."""
    student = torch.tensor([[[1.0, 0.0], [-1.0, 0.0]]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[[1.0, 0.0], [-2.0, 0.0]]], dtype=torch.float64)
    loss = GramLoss(apply_norm=False, remove_neg=False, remove_only_teacher_neg=True)
    value = loss(student, teacher)
    # S S^T = [[1, -1], [-1, 1]], T T^T clamped = [[1, 0], [0, 4]]: (0 + 1 + 1 + 9) / 4
    assert value.item() == pytest.approx(2.75, abs=1e-12)
    value.backward()
    ref = student.detach().clone().requires_grad_(True)
    gram_loss_reference(ref, teacher, apply_norm=False, remove_only_teacher_neg=True).backward()
    torch.testing.assert_close(student.grad, ref.grad, rtol=1e-12, atol=1e-12)
