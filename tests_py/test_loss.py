"""The fused DINO loss against the paper's double loop (tests_py/reference.py):
value, gradient and center, on fresh random inputs; operator checks,
torch.compile, distributed equivalence, and CUDA against CPU."""

import itertools
import subprocess
import sys
from pathlib import Path

import dino_opt
import pytest
import torch
import torch.nn.functional as F
from dino_opt import DINOLoss, NonFiniteLossError, dino_loss
from reference import center_update_reference, dino_loss_reference

TOLERANCE = {  # (relative on the loss, relative to max |grad| on the gradient)
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-2,
}

# Every value of each axis appears; K and batch are paired to keep the sizes
# CI-friendly (the largest is 12 views x 3 samples x 65536).
VIEWS = [(2, 1), (2, 2), (4, 1), (4, 2), (6, 2), (10, 1), (10, 2), (12, 2)]
SIZES = [(1, 3), (7, 64), (4096, 3), (65536, 1), (65536, 3), (7, 1)]
CASES = [
    (s, t, k, b)
    for (s, t), (k, b) in itertools.product(VIEWS, SIZES)
    if s * b * k <= 12 * 3 * 65536
]


def make_inputs(ncrops, views, dim, batch, dtype, gen, scale=1.0, device="cpu"):
    def randn(*shape):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    student = randn(ncrops * batch, dim)
    teacher = randn(views * batch, dim)
    center = 0.1 * torch.randn(1, dim, generator=gen, dtype=torch.float64).float()
    return student.to(device), teacher.to(device), center.to(device)


def rounding_tolerance(dtype, max_logit):
    """What rounding the logits alone costs: in the accumulation type (float64
    for float64 inputs, else float32) each softmax is off by up to about
    eps x max|logit| of itself, in any implementation."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return 2 * torch.finfo(acc).eps * max_logit


def max_logit(student, teacher, center, st, tt):
    s = student.detach().double().abs().max().item() / st
    u = (teacher.detach().double() - center.double()).abs().max().item() / tt
    return max(s, u)


def check_against_reference(student, teacher, center, ncrops, dtype, st=0.1, tt=0.04):
    """Our loss and gradient (in `dtype`) vs the double loop in float64 on the
    same values, within the dtype's tolerance plus what rounding logits of
    this size costs (logits x300 reach 3e4: a relative 7e-3 in float32)."""
    s = student.detach().clone().requires_grad_()
    loss = dino_loss(s, teacher, center, st, tt, ncrops)
    loss.backward()
    s64 = student.detach().double().requires_grad_()
    ref = dino_loss_reference(s64, teacher.double(), center.double(), st, tt, ncrops)
    ref.backward()
    tol = TOLERANCE[dtype] + rounding_tolerance(dtype, max_logit(student, teacher, center, st, tt))
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    # Relative, with a floor of 1: a loss near 0 (student and teacher agree) has
    # the absolute rounding error of terms of order log K.
    assert abs(loss.item() - ref.item()) <= tol * max(abs(ref.item()), 1.0), (
        loss.item(),
        ref.item(),
    )
    assert s.grad.dtype == dtype
    # Relative to the larger of the gradient and 1 / (ts * n_terms * B), the
    # gradient of one confidently wrong sample: where student and teacher agree,
    # the gradient (q - p) is tiny and carries the rounding error of q and p.
    batch = student.shape[0] // ncrops
    n_terms = (teacher.shape[0] // batch) * (ncrops - 1)
    scale = max(s64.grad.abs().max().item(), 1.0 / (st * n_terms * batch))
    err = (s.grad.double() - s64.grad).abs().max().item()
    assert err <= tol * scale, f"grad error {err} vs scale {scale}"


@pytest.mark.parametrize("ncrops, views, dim, batch", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_matches_reference(ncrops, views, dim, batch, dtype, gen):
    student, teacher, center = make_inputs(ncrops, views, dim, batch, dtype, gen)
    check_against_reference(student, teacher, center, ncrops, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "ncrops, views, dim, batch", [(10, 2, 4096, 3), (2, 1, 65536, 1), (12, 2, 7, 64)]
)
def test_half_precision_inputs(ncrops, views, dim, batch, dtype, gen):
    student, teacher, center = make_inputs(ncrops, views, dim, batch, dtype, gen)
    check_against_reference(student, teacher, center, ncrops, dtype)


def test_large_logits_and_sharp_teacher_are_stable(gen):
    # Logits of magnitude 1e4 with teacher temperature 0.04: exp would overflow
    # without max subtraction.
    student, teacher, center = make_inputs(10, 2, 4096, 3, torch.float32, gen, scale=1e4)
    loss = dino_loss(student, teacher, center, 0.1, 0.04, 10)
    ref = dino_loss_reference(student.double(), teacher.double(), center.double(), 0.1, 0.04, 10)
    assert torch.isfinite(loss)
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())


def test_result_does_not_depend_on_thread_count(gen):
    student, teacher, center = make_inputs(10, 2, 65536, 2, torch.float32, gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.dino_opt.dino_loss(student, teacher, center, 0.1, 0.04, 10)
        torch.set_num_threads(max(2, threads))
        many = torch.ops.dino_opt.dino_loss(student, teacher, center, 0.1, 0.04, 10)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


def test_non_contiguous_inputs_and_1d_center(gen):
    student, teacher, center = make_inputs(4, 2, 33, 3, torch.float64, gen)
    loss = dino_loss(
        student.t().contiguous().t(), teacher[:, :].t().contiguous().t(), center[0], 0.1, 0.04, 4
    )
    ref = dino_loss_reference(student, teacher, center, 0.1, 0.04, 4)
    assert abs(loss.item() - ref.item()) <= 1e-10 * abs(ref.item())


def test_non_finite_inputs_are_not_hidden(gen):
    student, teacher, center = make_inputs(4, 2, 16, 2, torch.float32, gen)
    student[3, 5] = float("nan")
    assert torch.isnan(dino_loss(student, teacher, center, 0.1, 0.04, 4))
    teacher[1, 2] = float("inf")
    assert not torch.isfinite(
        dino_loss(
            teacher=teacher,
            student=student.nan_to_num(),
            center=center,
            student_temp=0.1,
            teacher_temp=0.04,
            ncrops=4,
        )
    )
    loss_fn = DINOLoss(16, 4, 0.04, 0.04, 0, 1, check_finite=True)
    with pytest.raises(NonFiniteLossError, match="student_output: 1, teacher_output: 1"):
        loss_fn(student, teacher, 0)


# Parts of a step: the student's views in groups (crop batching), each part
# through the operator with its view range, must add up to the whole step.
GROUPINGS = [
    (10, 2, [range(0, 10)]),
    (10, 2, [range(0, 3), range(3, 7), range(7, 10)]),
    (10, 2, [range(0, 1), range(1, 2), range(2, 10)]),
    (12, 2, [range(i, i + 1) for i in range(12)]),
    (6, 1, [range(0, 2), range(2, 6)]),
    (4, 2, [range(1, 4), range(0, 1)]),  # any order
]


def parts_and_whole(student, teacher, center, ncrops, groups, batch, dtype):
    whole_s = student.detach().clone().requires_grad_()
    whole = dino_loss(whole_s, teacher, center, 0.1, 0.04, ncrops)
    whole.backward()
    parts_s = student.detach().clone().requires_grad_()
    total = 0
    for g in groups:
        rows = parts_s[g.start * batch : g.stop * batch]
        part = dino_loss(
            rows, teacher, center, 0.1, 0.04, len(g), view_offset=g.start, total_views=ncrops
        )
        part.backward()
        total = total + part.detach()
    return whole, whole_s.grad, total, parts_s.grad


@pytest.mark.parametrize("ncrops, views, groups", GROUPINGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_parts_of_a_step_add_up_to_the_step(ncrops, views, groups, dtype, gen):
    batch = 3
    student, teacher, center = make_inputs(ncrops, views, 4097, batch, dtype, gen)
    whole, whole_grad, total, parts_grad = parts_and_whole(
        student, teacher, center, ncrops, groups, batch, dtype
    )
    tol = TOLERANCE[dtype]
    assert abs(total.item() - whole.item()) <= tol * max(abs(whole.item()), 1.0)
    scale = whole_grad.abs().max().item()
    assert (parts_grad - whole_grad).abs().max().item() <= tol * scale
    ref = dino_loss_reference(
        student.double(), teacher.double(), center.double(), 0.1, 0.04, ncrops
    )
    assert abs(total.item() - ref.item()) <= tol * max(abs(ref.item()), 1.0)


def test_a_part_is_its_share_of_the_reference_double_loop(gen):
    # Views 3..5 of 10 alone: only the pairs (t, v) with v in 3..5, over the whole step's terms.
    student, teacher, center = make_inputs(10, 2, 33, 4, torch.float64, gen)
    part = dino_loss(student[12:24], teacher, center, 0.1, 0.04, 3, view_offset=3, total_views=10)
    s = F.log_softmax(student / 0.1, dim=-1).chunk(10)
    p = F.softmax((teacher - center) / 0.04, dim=-1).chunk(2)
    want = sum(-(p[t] * s[v]).sum(-1).mean() for t in range(2) for v in range(3, 6)) / (2 * 9)
    assert abs(part.item() - want.item()) <= 1e-12 * abs(want.item())
    with_global = dino_loss(
        student[:8], teacher, center, 0.1, 0.04, 2, view_offset=0, total_views=10
    )
    want = sum(-(p[t] * s[v]).sum(-1).mean() for t in range(2) for v in range(2) if v != t) / 18
    assert abs(with_global.item() - want.item()) <= 1e-12 * abs(want.item())


@pytest.mark.parametrize(
    "ncrops, kwargs, message",
    [
        (3, {"view_offset": 8, "total_views": 10}, r"student views \[8, 11\) .* within the 10"),
        (3, {"view_offset": -1, "total_views": 10}, r"student views \[-1, 2\)"),
        (1, {"total_views": 1}, "total_views must be at least 2"),
        (2, {"view_offset": 1}, "view_offset=1 needs total_views"),
        (1, {"view_offset": 0, "total_views": 1}, "total_views must be at least 2"),
    ],
)
def test_view_range_errors(ncrops, kwargs, message, gen):
    student, teacher, center = make_inputs(ncrops, 1, 8, 2, torch.float32, gen)
    with pytest.raises(RuntimeError, match=message):
        dino_loss(student, teacher, center, 0.1, 0.04, ncrops, **kwargs)


def test_view_ranges_through_opcheck_and_compile(gen):
    student, teacher, center = make_inputs(6, 2, 5, 3, torch.float64, gen)
    args = (student[3:12], teacher, center, 0.1, 0.04, 3, 1, 6)
    torch.library.opcheck(torch.ops.dino_opt.dino_loss.default, args)
    rows = student[3:12].clone().requires_grad_()
    torch.autograd.gradcheck(
        lambda s: dino_loss(s, teacher, center, 0.1, 0.04, 3, view_offset=1, total_views=6), (rows,)
    )
    compiled = torch.compile(
        lambda s: dino_loss(s, teacher, center, 0.1, 0.04, 3, view_offset=1, total_views=6),
        fullgraph=True,
    )
    eager = dino_loss(student[3:12], teacher, center, 0.1, 0.04, 3, view_offset=1, total_views=6)
    assert torch.allclose(compiled(student[3:12]), eager, rtol=1e-12)


def neg_inf_chunk_inputs(gen, dtype=torch.float32, device="cpu"):
    """K = 3 chunks of 4096 (the CPU kernel's chunk) + 5: one teacher row and one
    student row have a whole chunk of -inf logits, the others are finite."""
    student, teacher, center = make_inputs(4, 2, 3 * 4096 + 5, 3, dtype, gen, device=device)
    teacher[4, 4096 : 2 * 4096] = float("-inf")
    student[7, :4096] = float("-inf")
    return student, teacher, center


def test_a_chunk_of_neg_inf_logits_keeps_the_log_sum_exp_finite(gen):
    student, teacher, center = neg_inf_chunk_inputs(gen)
    _, student_lse, teacher_lse = torch.ops.dino_opt.dino_loss(
        student, teacher, center, 0.1, 0.04, 4
    )
    want_s = torch.logsumexp(student.double() / 0.1, dim=-1)
    want_t = torch.logsumexp((teacher.double() - center.double()) / 0.04, dim=-1)
    assert torch.isfinite(want_s).all() and torch.isfinite(want_t).all()
    torch.testing.assert_close(student_lse.double(), want_s, rtol=1e-6, atol=0)
    torch.testing.assert_close(teacher_lse.double(), want_t, rtol=1e-6, atol=0)


def test_a_teacher_chunk_of_neg_inf_gives_the_reference_loss_and_gradient(gen):
    student, teacher, center = neg_inf_chunk_inputs(gen)
    student[7, :4096] = 0.0  # only the teacher's -inf chunk: the reference loss is finite
    check_against_reference(student, teacher, center, 4, torch.float32)


def test_a_student_chunk_of_neg_inf_gives_the_reference_loss(gen):
    # -inf student logits where the teacher puts mass: the reference loss is +inf.
    student, teacher, center = neg_inf_chunk_inputs(gen)
    ref = dino_loss_reference(student.double(), teacher.double(), center.double(), 0.1, 0.04, 4)
    assert ref.item() == float("inf")
    assert dino_loss(student, teacher, center, 0.1, 0.04, 4).item() == float("inf")


@pytest.mark.parametrize(
    "student_shape, teacher_shape, center_shape, kwargs, message",
    [
        ((8, 16), (4, 15), (16,), {}, "student has out_dim 16 but teacher has out_dim 15"),
        (
            (9, 16),
            (4, 16),
            (16,),
            {},
            "student has 9 rows, which is not a positive multiple of ncrops=4",
        ),
        (
            (8, 16),
            (5, 16),
            (16,),
            {},
            "teacher has 5 rows, which is not a positive multiple of the batch size 2",
        ),
        ((8, 16), (10, 16), (16,), {}, "teacher has 5 views but the student only 4"),
        ((8, 16), (4, 16), (15,), {}, r"center must have shape \[16\] or \[1, 16\], got \[15\]"),
        ((8, 16), (4, 16), (2, 16), {}, r"center must have shape"),
        ((8, 16), (4, 16), (16,), {"student_temp": 0.0}, "student_temp must be positive"),
        ((8, 16), (4, 16), (16,), {"teacher_temp": -1.0}, "teacher_temp must be positive"),
        ((8, 16), (4, 16), (16,), {"ncrops": 1}, "ncrops .* must be at least 2"),
        ((8,), (4, 16), (16,), {}, r"student must be 2-D"),
    ],
)
def test_clear_errors(student_shape, teacher_shape, center_shape, kwargs, message):
    args = {"student_temp": 0.1, "teacher_temp": 0.04, "ncrops": 4, **kwargs}
    with pytest.raises(RuntimeError, match=message):
        dino_loss(
            torch.randn(student_shape),
            torch.randn(teacher_shape),
            torch.zeros(center_shape),
            **args,
        )


def test_dtype_errors():
    with pytest.raises(
        RuntimeError, match="teacher has dtype BFloat16 but student has dtype Float"
    ):
        dino_loss(torch.randn(8, 4), torch.randn(4, 4).bfloat16(), torch.zeros(4), 0.1, 0.04, 4)
    with pytest.raises(RuntimeError, match="student has dtype Long"):
        dino_loss(
            torch.zeros(8, 4, dtype=torch.long),
            torch.zeros(4, 4, dtype=torch.long),
            torch.zeros(4),
            0.1,
            0.04,
            4,
        )
    with pytest.raises(RuntimeError, match="center has dtype Int"):
        dino_loss(
            torch.randn(8, 4), torch.randn(4, 4), torch.zeros(4, dtype=torch.int32), 0.1, 0.04, 4
        )


def test_opcheck_and_gradcheck(gen):
    student, teacher, center = make_inputs(4, 2, 5, 3, torch.float64, gen)
    student.requires_grad_()
    args = (student, teacher, center, 0.1, 0.04, 4)
    torch.library.opcheck(torch.ops.dino_opt.dino_loss.default, args)
    loss, slse, tlse = torch.ops.dino_opt.dino_loss(*args)
    torch.library.opcheck(
        torch.ops.dino_opt.dino_loss_backward.default,
        (
            torch.tensor(1.0, dtype=torch.float64),
            student.detach(),
            teacher,
            center,
            slse,
            tlse,
            0.1,
            0.04,
            4,
        ),
    )
    torch.autograd.gradcheck(lambda s: dino_loss(s, teacher, center, 0.1, 0.04, 4), (student,))


def test_torch_compile_fullgraph_step(gen):
    head = torch.nn.Linear(16, 32)
    loss_fn = DINOLoss(32, 4, 0.04, 0.04, 0, 3)

    @torch.compile(fullgraph=True)
    def step(x, teacher_out):
        return loss_fn(head(x), teacher_out, 1)

    x = torch.randn(4 * 3, 16, generator=gen)
    teacher_out = torch.randn(2 * 3, 32, generator=gen)
    # The reference in float64, so that the comparison sees only our float32 error.
    eager_head = torch.nn.Linear(16, 32).double()
    eager_head.load_state_dict(head.state_dict())
    eager_loss = dino_loss_reference(
        eager_head(x.double()), teacher_out.double(), torch.zeros(1, 32).double(), 0.1, 0.04, 4
    )
    eager_loss.backward()
    loss = step(x, teacher_out)
    loss.backward()
    assert loss.item() == pytest.approx(eager_loss.item(), rel=1e-5)
    ref_grad = eager_head.weight.grad
    assert (head.weight.grad.double() - ref_grad).abs().max() <= 1e-5 * ref_grad.abs().max()
    torch.testing.assert_close(
        loss_fn.center, center_update_reference(torch.zeros(1, 32), teacher_out, 0.9)
    )


# ----------------------------------------------------------------- DINOLoss


def test_dino_loss_module_follows_the_original_for_ten_steps(gen):
    out_dim, ncrops, nepochs = 64, 6, 10
    ours = DINOLoss(out_dim, ncrops, 0.04, 0.07, 5, nepochs)
    schedule = torch.cat(
        [
            torch.linspace(0.04, 0.07, 5, dtype=torch.float64),
            torch.full((5,), 0.07, dtype=torch.float64),
        ]
    )
    assert torch.allclose(torch.from_numpy(ours.teacher_temp_schedule), schedule)
    center = torch.zeros(1, out_dim)
    for epoch in range(10):
        student, teacher, _ = make_inputs(ncrops, 2, out_dim, 5, torch.float32, gen)
        loss = ours(student, teacher, epoch)
        ref = dino_loss_reference(
            student.double(), teacher.double(), center.double(), 0.1, schedule[epoch].item(), ncrops
        )
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
        center = center_update_reference(center, teacher, 0.9)
        torch.testing.assert_close(ours.center, center, rtol=1e-6, atol=1e-7)
    state = ours.state_dict()
    assert torch.equal(state["center"], ours.center)
    restored = DINOLoss(out_dim, ncrops, 0.04, 0.07, 5, nepochs)
    restored.load_state_dict(state)
    assert torch.equal(restored.center, ours.center)


def test_center_of_a_float64_teacher_is_summed_in_float64(gen):
    # Rows of 1e8 beside rows of 1: a float32 sum loses the ones entirely.
    loss_fn = DINOLoss(8, 4, 0.04, 0.04, 0, 1).double()
    teacher = torch.ones(2 * 3, 8, dtype=torch.float64)
    teacher[::2] = 1e8 + torch.rand(3, 8, generator=gen, dtype=torch.float64)
    student = torch.randn(4 * 3, 8, generator=gen, dtype=torch.float64)
    loss_fn(student, teacher, 0)
    want = center_update_reference(torch.zeros(1, 8, dtype=torch.float64), teacher, 0.9)
    assert loss_fn.center.dtype == torch.float64
    torch.testing.assert_close(loss_fn.center, want, rtol=1e-15, atol=0)


def test_center_of_a_bfloat16_teacher_is_summed_in_float32(gen):
    loss_fn = DINOLoss(8, 4, 0.04, 0.04, 0, 1)
    teacher = torch.randn(2 * 64, 8, generator=gen).to(torch.bfloat16)
    loss_fn(torch.randn(4 * 64, 8, generator=gen).to(torch.bfloat16), teacher, 0)
    want = center_update_reference(torch.zeros(1, 8), teacher.float(), 0.9)
    assert loss_fn.center.dtype == torch.float32
    torch.testing.assert_close(loss_fn.center, want, rtol=1e-6, atol=1e-7)


def test_loading_a_checkpoint_drops_a_pending_center_update(gen):
    loss_fn = DINOLoss(8, 4, 0.04, 0.04, 0, 3)
    saved = {"center": torch.full((1, 8), 0.5)}
    student, teacher, _ = make_inputs(4, 2, 8, 2, torch.float32, gen)
    loss_fn(student, teacher, 0)
    loss_fn._pending_center = (torch.ones(8), 1, None)  # as if an all-reduce were in flight
    loss_fn.load_state_dict(saved)
    loss_fn.apply_center_update()
    assert torch.equal(loss_fn.center, saved["center"])


def test_dino_loss_module_arguments():
    with pytest.raises(
        IndexError, match="epoch 3 is outside the teacher temperature schedule of 3 epochs"
    ):
        DINOLoss(8, 4, 0.04, 0.07, 2, 3)(torch.randn(8, 8), torch.randn(4, 8), 3)
    with pytest.raises(ValueError, match="warmup_teacher_temp_epochs=5 must be in"):
        DINOLoss(8, 4, 0.04, 0.07, 5, 3)
    # Mixed precision: a bfloat16 student with a float32 teacher is promoted, not refused.
    loss = DINOLoss(8, 4, 0.04, 0.07, 0, 3)(torch.randn(8, 8).bfloat16(), torch.randn(4, 8), 0)
    assert loss.dtype == torch.float32


def test_distributed_two_ranks_equal_one_process_over_the_whole_batch(tmp_path, gen):
    ncrops, views, batch, out_dim, steps = 4, 2, 6, 32, 4
    students = [torch.randn(ncrops * batch, out_dim, generator=gen) for _ in range(steps)]
    teachers = [torch.randn(views * batch, out_dim, generator=gen) for _ in range(steps)]
    data = tmp_path / "data.pt"
    torch.save(
        dict(
            ncrops=ncrops,
            teacher_views=views,
            batch=batch,
            out_dim=out_dim,
            students=students,
            teachers=teachers,
        ),
        data,
    )
    worker = Path(__file__).parent / "workers" / "dist_loss_worker.py"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                str(rank),
                "2",
                str(tmp_path / "init"),
                str(data),
                str(tmp_path / f"out{rank}.pt"),
            ],
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err.decode()[-2000:]
    single = DINOLoss(out_dim, ncrops, 0.04, 0.07, 2, 5)
    expected = [
        single(s, t, epoch=i % 5).item()
        for i, (s, t) in enumerate(zip(students, teachers, strict=True))
    ]
    outs = [torch.load(tmp_path / f"out{rank}.pt") for rank in range(2)]
    for step in range(steps):
        # Each rank's loss is the mean over its samples; equal shards average to the global loss.
        mean = (outs[0]["losses"][step] + outs[1]["losses"][step]) / 2
        assert mean == pytest.approx(expected[step], rel=1e-5)
    for out in outs:
        torch.testing.assert_close(out["center"], single.center, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------- CUDA


# The CUDA kernels against the CPU operator (same inputs, both accumulate in
# float32: close to rounding) and against the float64 reference (within the
# dtype's tolerance), loss, log-sum-exps and gradient. The cases cover every
# teacher-view count T in {1, 2} with every student-view count S in
# {2, 4, 6, 10, 12} (each unrolled branch and shared-memory slot of the
# kernels), every batch in {1, 3, 64, 257} with every K in
# {1, 7, 4096, 65536, 65537} (one and several chunks, odd tails), the three
# input dtypes, misaligned and non-contiguous layouts and logits x300.

HALF = (torch.bfloat16, torch.float16)
# CUDA vs CPU: the gradient is rounded to its dtype on each side, so half
# types may differ by an ulp of the largest gradient.
CUDA_CPU_GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-9}


def cuda_generator(gen):
    seed = int(torch.randint(2**62, (1,), generator=gen))
    return torch.Generator(device="cuda").manual_seed(seed)


def laid_out(x, layout):
    """x (contiguous, on the GPU) as a tensor of the same values in `layout`."""
    if layout == "contiguous":
        return x
    if layout == "misaligned":  # contiguous, but one element past an aligned start
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        out = buf[1:].view(x.shape)
        out.copy_(x)
        return out
    if layout == "transposed":  # column-major
        return x.t().contiguous().t()
    if layout == "strided":  # every other column of a wider buffer
        wide = torch.empty(x.shape[0], 2 * x.shape[1], dtype=x.dtype, device=x.device)
        wide[:, ::2] = x
        return wide[:, ::2]
    raise ValueError(layout)


def cuda_inputs(ncrops, views, dim, batch, dtype, gen, scale=1.0, layout="contiguous"):
    g = cuda_generator(gen)
    student = (scale * torch.randn(ncrops * batch, dim, generator=g, device="cuda")).to(dtype)
    teacher = (scale * torch.randn(views * batch, dim, generator=g, device="cuda")).to(dtype)
    center = 0.1 * torch.randn(1, dim, generator=g, device="cuda")
    return laid_out(student, layout), laid_out(teacher, layout), center


def check_cuda_against_cpu(student, teacher, center, ncrops, st=0.1, tt=0.04):
    """The CUDA operator's outputs and gradient against the CPU operator's."""
    gpu = torch.ops.dino_opt.dino_loss(student, teacher, center, st, tt, ncrops)
    cpu_args = (student.cpu(), teacher.cpu(), center.cpu())
    cpu = torch.ops.dino_opt.dino_loss(*cpu_args, st, tt, ncrops)
    for name, g, c in zip(("loss", "student_lse", "teacher_lse"), gpu, cpu, strict=True):
        assert g.device.type == "cuda" and g.dtype == c.dtype, name
        torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-5, msg=name)
    grad = torch.tensor(0.7, dtype=cpu[0].dtype)
    g_gpu = torch.ops.dino_opt.dino_loss_backward(
        grad.cuda(), student, teacher, center, gpu[1], gpu[2], st, tt, ncrops
    )
    g_cpu = torch.ops.dino_opt.dino_loss_backward(grad, *cpu_args, cpu[1], cpu[2], st, tt, ncrops)
    assert g_gpu.dtype == student.dtype and g_gpu.shape == student.shape
    # Relative to the gradient, or to one confidently wrong sample's where it is
    # near 0: there it is (q - p), the difference of two rounded probabilities.
    batch = student.shape[0] // ncrops
    n_terms = (teacher.shape[0] // batch) * (ncrops - 1)
    floor = grad.item() / (st * n_terms * batch)
    scale = max(g_cpu.double().abs().max().item(), floor)
    err = (g_gpu.cpu().double() - g_cpu.double()).abs().max().item()
    assert err <= CUDA_CPU_GRAD_TOL[student.dtype] * scale, f"grad: {err} vs scale {scale}"


def check_cuda(ncrops, views, dim, batch, dtype, gen, scale=1.0, layout="contiguous"):
    student, teacher, center = cuda_inputs(ncrops, views, dim, batch, dtype, gen, scale, layout)
    check_cuda_against_cpu(student, teacher, center, ncrops)
    check_against_reference(student, teacher, center, ncrops, dtype)


VIEW_COUNTS = [(s, t) for t in (1, 2) for s in (2, 4, 6, 10, 12)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("ncrops, views", VIEW_COUNTS)
def test_cuda_every_view_count(ncrops, views, dtype, gen):
    check_cuda(ncrops, views, 65537, 3, dtype, gen)


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3, 64, 257])
@pytest.mark.parametrize("dim", [1, 7, 4096, 65536, 65537])
def test_cuda_every_batch_and_out_dim(dim, batch, gen):
    check_cuda(10, 2, dim, batch, torch.float32, gen)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("dim, batch", [(7, 257), (65537, 1), (65536, 64), (1, 3)])
def test_cuda_half_inputs_odd_and_large(dim, batch, dtype, gen):
    check_cuda(12, 2, dim, batch, dtype, gen)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("layout", ["misaligned", "transposed", "strided"])
def test_cuda_misaligned_and_non_contiguous_inputs(layout, dtype, gen):
    check_cuda(10, 2, 4099, 5, dtype, gen, layout=layout)
    check_cuda(4, 1, 7, 3, dtype, gen, layout=layout)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, *HALF], ids=str)
@pytest.mark.parametrize("ncrops, views, dim", [(10, 2, 65537), (2, 1, 4096), (12, 2, 7)])
def test_cuda_logits_times_300(ncrops, views, dim, dtype, gen):
    check_cuda(ncrops, views, dim, 4, dtype, gen, scale=300.0)


@pytest.mark.cuda
@pytest.mark.parametrize("ncrops, views, groups", GROUPINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_parts_of_a_step(ncrops, views, groups, dtype, gen):
    student, teacher, center = cuda_inputs(ncrops, views, 65537, 3, dtype, gen)
    whole, whole_grad, total, parts_grad = parts_and_whole(
        student, teacher, center, ncrops, groups, 3, dtype
    )
    assert abs(total.item() - whole.item()) <= 1e-5 * max(abs(whole.item()), 1.0)
    err = (parts_grad.double() - whole_grad.double()).abs().max().item()
    assert err <= CUDA_CPU_GRAD_TOL[dtype] * whole_grad.double().abs().max().item()
    for g in groups:  # each part's outputs and gradient against the CPU operator
        rows = student[g.start * 3 : g.stop * 3]
        gpu = torch.ops.dino_opt.dino_loss(
            rows, teacher, center, 0.1, 0.04, len(g), g.start, ncrops
        )
        cpu = torch.ops.dino_opt.dino_loss(
            rows.cpu(), teacher.cpu(), center.cpu(), 0.1, 0.04, len(g), g.start, ncrops
        )
        for a, b in zip(gpu, cpu, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_float64(gen):
    student, teacher, center = cuda_inputs(10, 2, 65537, 3, torch.float64, gen)
    check_against_reference(student, teacher, center.double(), 10, torch.float64)
    gpu = torch.ops.dino_opt.dino_loss(student, teacher, center, 0.1, 0.04, 10)
    cpu = torch.ops.dino_opt.dino_loss(student.cpu(), teacher.cpu(), center.cpu(), 0.1, 0.04, 10)
    for g, c in zip(gpu, cpu, strict=True):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-12, atol=1e-12)


@pytest.mark.cuda
def test_cuda_chunks_of_neg_inf_logits(gen):
    student, teacher, center = neg_inf_chunk_inputs(gen, device="cuda")
    check_cuda_against_cpu(student, teacher, center, 4)
    _, student_lse, teacher_lse = torch.ops.dino_opt.dino_loss(
        student, teacher, center, 0.1, 0.04, 4
    )
    assert torch.isfinite(student_lse).all() and torch.isfinite(teacher_lse).all()
    assert dino_loss(student, teacher, center, 0.1, 0.04, 4).item() == float("inf")
    student[7, :4096] = 0.0
    check_against_reference(student, teacher, center, 4, torch.float32)


@pytest.mark.cuda
@pytest.mark.slow
def test_cuda_compiled_module_matches_the_reference_at_the_scheduled_temperature(gen):
    loss_fn = DINOLoss(4096, 10, 0.04, 0.07, 2, 5).cuda()
    epoch = 1
    teacher_temp = float(loss_fn.teacher_temp_schedule[epoch])
    assert teacher_temp == pytest.approx(0.07)  # the end of the 2-epoch warm-up
    student, teacher, _ = cuda_inputs(10, 2, 4096, 8, torch.float32, gen)
    student.requires_grad_()
    step = torch.compile(lambda s, t: loss_fn(s, t, epoch), fullgraph=True)
    loss = step(student, teacher)
    (0.7 * loss).backward()
    s64 = student.detach().double().requires_grad_()
    ref = dino_loss_reference(
        s64, teacher.double(), torch.zeros(1, 4096, device="cuda").double(), 0.1, teacher_temp, 10
    )
    (0.7 * ref).backward()
    assert loss.device.type == "cuda"
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    err = (student.grad.double() - s64.grad).abs().max().item()
    assert err <= 1e-5 * s64.grad.abs().max().item()
    torch.testing.assert_close(
        loss_fn.center, center_update_reference(torch.zeros(1, 4096, device="cuda"), teacher, 0.9)
    )


@pytest.mark.cuda
def test_cuda_errors_name_the_argument_on_the_wrong_device(gen):
    student, teacher, center = cuda_inputs(4, 2, 16, 2, torch.float32, gen)
    on_one = "student, teacher and center must be on one device"
    with pytest.raises(RuntimeError, match=f"{on_one}, got cpu, cuda:0 and cuda:0"):
        dino_loss(student.cpu(), teacher, center, 0.1, 0.04, 4)
    with pytest.raises(RuntimeError, match=f"{on_one}, got cuda:0, cpu and cuda:0"):
        dino_loss(student, teacher.cpu(), center, 0.1, 0.04, 4)
    with pytest.raises(RuntimeError, match=f"{on_one}, got cuda:0, cuda:0 and cpu"):
        dino_loss(student, teacher, center.cpu(), 0.1, 0.04, 4)
    loss, slse, tlse = torch.ops.dino_opt.dino_loss(student, teacher, center, 0.1, 0.04, 4)
    with pytest.raises(RuntimeError, match="grad is on cpu but student is on cuda:0"):
        torch.ops.dino_opt.dino_loss_backward(
            torch.tensor(1.0), student, teacher, center, slse, tlse, 0.1, 0.04, 4
        )
    assert dino_opt.build_info()["cuda_available"]


@pytest.mark.parametrize("views", [1, 2])
def test_one_logit_gives_exactly_zero_gradient(views, gen):
    # K = 1: every softmax is exactly 1 and the gradient exactly 0, provided each
    # logit is the same number in every pass. The first GPU run broke this (a
    # multiply-add contracted in one pass and not in another); the CPU and CUDA
    # kernels must both keep it.
    student, teacher, center = make_inputs(6, views, 1, 5, torch.float32, gen, scale=50.0)
    s = student.clone().requires_grad_()
    loss = dino_loss(s, teacher, center, 0.1, 0.04, 6)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(s.grad) == 0


@pytest.mark.parametrize("dim", [7, 4096, 65537])
def test_logits_times_300_against_the_reference(dim, gen):
    # teacher logits up to ~3e4: float32 holds them to ~2e-3, which bounds any
    # float32 loss's agreement with the float64 formula (rounding_tolerance)
    inputs = make_inputs(10 if dim == 65537 else 4, 2, dim, 2, torch.float32, gen, scale=300.0)
    check_against_reference(*inputs, 10 if dim == 65537 else 4, torch.float32)


@pytest.mark.cuda
def test_cuda_one_logit_gives_exactly_zero_gradient(gen):
    student, teacher, center = make_inputs(6, 2, 1, 5, torch.float32, gen, 50.0, "cuda")
    s = student.clone().requires_grad_()
    dino_loss(s, teacher, center, 0.1, 0.04, 6).backward()
    assert torch.count_nonzero(s.grad) == 0


def test_the_cpu_kernels_flush_subnormals_and_leave_the_callers_mode_as_it_was():
    # Far-below-max logits make subnormal softmax weights; the kernels flush
    # them only while a work item runs (the calling thread runs some of them)
    # and restore the thread's mode, so the result matches the reference and
    # the calling thread still computes subnormals afterwards.
    torch.manual_seed(0)
    student = (torch.randn(4 * 3, 4096, dtype=torch.float64) * 30).requires_grad_()
    teacher = torch.randn(2 * 3, 4096, dtype=torch.float64) * 30
    center = torch.zeros(1, 4096, dtype=torch.float64)
    ours = dino_loss(student, teacher, center, 0.1, 0.04, 4)
    ours.backward()
    ref_student = student.detach().clone().requires_grad_()
    ref = dino_loss_reference(ref_student, teacher, center, 0.1, 0.04, ncrops=4)
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=0)
    torch.testing.assert_close(student.grad, ref_student.grad, rtol=1e-9, atol=1e-300)
    tiny = torch.tensor([1e-39, 1e-310], dtype=torch.float64)
    assert (tiny.float()[:1] * 1.0).item() != 0.0 and (tiny[1:] * 1.0).item() != 0.0
