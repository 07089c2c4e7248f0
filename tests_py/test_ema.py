"""The EMA teacher operator and its Python API.

CPU kernel: bit-exact against an emulation of its arithmetic in plain torch
ops, close to a float64 reference and to torch._foreach_lerp_. CUDA kernel
(tests marked `cuda`): bit-exact against the CPU kernel."""

import copy
import math

import dino_opt
import numpy as np
import pytest
import torch
from dino_opt import EMATeacher, cosine_scheduler, update_teacher
from dino_opt.ops import ema_update_
from torch import nn

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 2, 3, 7, 16, 17, 31, 33, 1000, 32768, 32769, 100_003]


def acc_dtype(teacher_dtype):
    return torch.float64 if teacher_dtype == torch.float64 else torch.float32


def kernel_emulation(t, s, m):
    """What the kernel computes: m*t + (1-m)*s in the accumulation type, each
    multiplication and the addition rounded separately, one rounding to t's dtype."""
    acc = acc_dtype(t.dtype)
    return (t.to(acc) * m + s.to(acc) * (1.0 - m)).to(t.dtype)


def randn(shape, dtype, gen, device="cpu"):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)


def tolerance(dtype):
    # One rounding to the teacher dtype plus float32 arithmetic.
    return {
        torch.float64: dict(rtol=1e-12, atol=1e-12),
        torch.float32: dict(rtol=2e-6, atol=1e-6),
        torch.bfloat16: dict(rtol=2**-8, atol=1e-3),
        torch.float16: dict(rtol=2**-10, atol=1e-3),
    }[dtype]


@pytest.mark.parametrize("student_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("teacher_dtype", DTYPES, ids=str)
def test_cpu_matches_emulation_exactly_and_float64_reference(teacher_dtype, student_dtype, gen):
    m = float(torch.rand((), generator=gen, dtype=torch.float64))
    teacher = [randn((n,), teacher_dtype, gen) for n in SIZES]
    student = [randn((n,), student_dtype, gen) for n in SIZES]
    exact = [kernel_emulation(t, s, m) for t, s in zip(teacher, student, strict=True)]
    ref64 = [m * t.double() + (1 - m) * s.double() for t, s in zip(teacher, student, strict=True)]
    ema_update_(teacher, student, m)
    for n, t, want, ref in zip(SIZES, teacher, exact, ref64, strict=True):
        assert t.dtype == teacher_dtype
        assert torch.equal(t, want), f"n={n}: differs from the kernel's arithmetic"
        torch.testing.assert_close(t.double(), ref, **tolerance(teacher_dtype))


def test_cpu_matches_foreach_lerp(gen):
    shapes = [(384, 3, 16, 16), (1, 197, 384), (1152, 384), (1152,), (384,), (1536, 384), (5,)]
    teacher = [randn(s, torch.float32, gen) for s in shapes]
    student = [randn(s, torch.float32, gen) for s in shapes]
    lerped = [t.clone() for t in teacher]
    torch._foreach_lerp_(lerped, student, 1 - 0.996)
    ema_update_(teacher, student, 0.996)
    for ours, theirs in zip(teacher, lerped, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_many_small_tensors_of_mixed_sizes(gen):
    sizes = torch.randint(0, 5000, (600,), generator=gen).tolist()
    teacher = [randn((n,), torch.float32, gen) for n in sizes]
    student = [randn((n,), torch.float32, gen) for n in sizes]
    want = [kernel_emulation(t, s, 0.9) for t, s in zip(teacher, student, strict=True)]
    ema_update_(teacher, student, 0.9)
    assert all(torch.equal(t, w) for t, w in zip(teacher, want, strict=True))


def test_unaligned_views_and_layouts(gen):
    base_t = randn((10_000,), torch.float32, gen)
    base_s = randn((10_000,), torch.bfloat16, gen)
    untouched = base_t.clone()  # before any update: the parts outside the views must stay
    cases = [
        (base_t[1:4097], base_s[3:4099]),  # odd storage offsets
        (randn((64, 48), torch.float32, gen).t(), randn((48, 64), torch.float32, gen)),
        (randn((300,), torch.float32, gen), randn((600,), torch.float32, gen)[::2]),
        (
            randn((8, 3, 5, 5), torch.float32, gen).contiguous(memory_format=torch.channels_last),
            randn((8, 3, 5, 5), torch.float16, gen).contiguous(memory_format=torch.channels_last),
        ),
        (
            randn((8, 3, 5, 5), torch.float32, gen).contiguous(memory_format=torch.channels_last),
            randn((8, 3, 5, 5), torch.float32, gen),
        ),
    ]
    for t, s in cases:
        want = kernel_emulation(t, s, 0.75)
        ptr, strides = t.data_ptr(), t.stride()
        ema_update_([t], [s], 0.75)
        assert t.data_ptr() == ptr and t.stride() == strides, "must update in place"
        assert torch.equal(t, want)
    # The parts of the base buffer outside the updated view stay as they were.
    assert torch.equal(base_t[:1], untouched[:1])
    assert torch.equal(base_t[4097:], untouched[4097:])


def test_momentum_endpoints_and_empty_lists(gen):
    t, s = randn((1000,), torch.float32, gen), randn((1000,), torch.float32, gen)
    t0 = t.clone()
    ema_update_([t], [s], 1.0)
    assert torch.equal(t, t0)
    ema_update_([t], [s], 0.0)
    assert torch.equal(t, s)
    ema_update_([], [], 0.5)
    torch.ops.dino_opt.ema_update_([], [], 0.5)


def test_update_bumps_the_teacher_version_so_autograd_sees_it():
    teacher, student = torch.zeros(4), torch.ones(4)
    before = teacher._version
    ema_update_([teacher], [student], 0.5)
    assert teacher._version > before
    # A value saved for backward and then updated must not be used silently.
    weight = torch.ones(4, requires_grad=True)
    saved = torch.zeros(4)
    loss = (weight * saved).sum()
    ema_update_([saved], [student], 0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_non_finite_student_values_propagate():
    t = torch.zeros(4)
    s = torch.tensor([1.0, float("nan"), float("inf"), -1.0])
    ema_update_([t], [s], 0.5)
    assert t[0] == 0.5 and math.isnan(t[1]) and t[2] == float("inf") and t[3] == -0.5


@pytest.mark.parametrize(
    "teacher, student, momentum, message",
    [
        ([torch.zeros(4)] * 2, [torch.zeros(4)], 0.9, "teacher has 2 tensors but student has 1"),
        ([torch.zeros(4)], [torch.zeros(4)], 1.5, r"momentum must be in \[0, 1\], got 1.5"),
        ([torch.zeros(4)], [torch.zeros(4)], float("nan"), r"momentum must be in \[0, 1\]"),
        ([torch.zeros(4)], [torch.zeros(3, 2)], 0.9, r"teacher\[0\] has shape \[4\] but student"),
        ([torch.zeros(4, dtype=torch.long)], [torch.zeros(4)], 0.9, r"teacher\[0\] has dtype Long"),
        ([torch.zeros(4)], [torch.zeros(4, dtype=torch.int32)], 0.9, r"student\[0\] has dtype Int"),
        (
            [torch.zeros(4, requires_grad=True)],
            [torch.zeros(4)],
            0.9,
            r"teacher\[0\] requires grad",
        ),
        ([torch.zeros(1).expand(4)], [torch.zeros(4)], 0.9, "overlapping memory"),
        ([torch.zeros(4), torch.zeros(2)], [torch.zeros(4), torch.zeros(3)], 0.9, r"teacher\[1\]"),
    ],
)
def test_clear_errors(teacher, student, momentum, message):
    with pytest.raises(RuntimeError, match=message):
        ema_update_(teacher, student, momentum)


def test_opcheck(gen):
    samples = [
        ([randn((10,), torch.float32, gen)], [randn((10,), torch.float32, gen)], 0.9),
        (
            [randn((3, 4), torch.float32, gen), randn((7,), torch.bfloat16, gen)],
            [randn((3, 4), torch.bfloat16, gen).requires_grad_(), randn((7,), torch.bfloat16, gen)],
            0.996,
        ),
        ([], [], 0.5),
    ]
    for args in samples:
        torch.library.opcheck(torch.ops.dino_opt.ema_update_.default, args)


def test_torch_compile_fullgraph(gen):
    @torch.compile(fullgraph=True)
    def step(teacher, student, m):
        ema_update_(teacher, student, m)
        return teacher[0].sum()

    teacher = [randn((33,), torch.float32, gen), randn((4, 5), torch.float32, gen)]
    student = [randn((33,), torch.float32, gen), randn((4, 5), torch.float16, gen)]
    want = [kernel_emulation(t, s, 0.99) for t, s in zip(teacher, student, strict=True)]
    total = step(teacher, student, 0.99)
    assert all(torch.equal(t, w) for t, w in zip(teacher, want, strict=True))
    torch.testing.assert_close(total, want[0].sum())  # inductor may sum in another order


# ----------------------------------------------------------------- schedules


def test_cosine_scheduler_values():
    base, final, epochs, niter, warm = 0.996, 1.0, 5, 7, 2
    sched = cosine_scheduler(base, final, epochs, niter, warm, start_warmup_value=0.5)
    assert sched.shape == (epochs * niter,) and sched.dtype == np.float64
    warm_iters = warm * niter
    n = epochs * niter - warm_iters
    for i in range(warm_iters):
        assert sched[i] == pytest.approx(0.5 + (base - 0.5) * i / (warm_iters - 1))
    for i in range(n):
        want = final + 0.5 * (base - final) * (1 + math.cos(math.pi * i / n))
        assert sched[warm_iters + i] == pytest.approx(want, abs=1e-15)
    plain = cosine_scheduler(0.996, 1.0, 100, 10)
    assert plain[0] == 0.996 and np.all(np.diff(plain) > 0) and plain[-1] < 1.0
    assert plain[500] == pytest.approx(0.998)


@pytest.mark.parametrize(
    "args, message",
    [
        ((0.9, 1.0, 0, 10), "epochs"),
        ((0.9, 1.0, 2, 0), "niter_per_ep"),
        ((0.9, 1.0, 2, 5, 3), "warmup"),
    ],
)
def test_cosine_scheduler_errors(args, message):
    with pytest.raises(ValueError, match=message):
        cosine_scheduler(*args)


# ----------------------------------------------------------------- EMATeacher


def small_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 9, 5))


def dino_reference_update(student, teacher, m):
    """The EMA loop of the original DINO training script."""
    with torch.no_grad():
        for param_q, param_k in zip(student.parameters(), teacher.parameters(), strict=True):
            param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def perturb(module, gen):
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.device))


def test_ema_teacher_builds_a_frozen_copy_and_follows_dino(gen):
    student = small_net()
    ema = EMATeacher(student, total_steps=10)
    reference = copy.deepcopy(ema.teacher)
    assert ema.teacher is not student
    assert all(not p.requires_grad for p in ema.teacher.parameters())
    assert all(p.requires_grad for p in student.parameters())
    schedule = cosine_scheduler(0.996, 1.0, 1, 10)
    for step in range(10):
        perturb(student, gen)
        m = ema.update(step)
        assert m == schedule[step]
        dino_reference_update(student, reference, m)
    for ours, theirs in zip(ema.teacher.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_ema_teacher_schedules():
    student = nn.Linear(3, 3)
    assert EMATeacher(student, momentum_schedule=0.9).momentum(123) == 0.9
    assert EMATeacher(student, momentum_schedule=[0.5, 0.6]).momentum(1) == 0.6
    assert (
        EMATeacher(student, momentum_schedule=lambda step: 1 - 0.1 / (step + 1)).momentum(9) == 0.99
    )
    with pytest.raises(ValueError, match="total_steps"):
        EMATeacher(student)
    with pytest.raises(IndexError, match="step 2 is outside the momentum schedule of 2 steps"):
        EMATeacher(student, momentum_schedule=[0.5, 0.6]).update(2)
    with pytest.raises(ValueError, match=r"momentum at step 0 is 1.5"):
        EMATeacher(student, momentum_schedule=1.5).update(0)


def test_ema_teacher_with_given_teacher_and_buffers(gen):
    student, teacher = small_net(), small_net()
    ema = EMATeacher(student, teacher, momentum_schedule=0.5, copy_buffers=True)
    assert ema.teacher is teacher
    for t, s in zip(teacher.state_dict().values(), student.state_dict().values(), strict=True):
        assert torch.equal(t, s)
    student.train()(torch.randn(4, 3, 5, 5, generator=gen))  # moves the BN statistics
    ema.update(0)
    assert torch.equal(teacher[1].running_mean, student[1].running_mean)
    assert torch.equal(teacher[1].num_batches_tracked, student[1].num_batches_tracked)


def test_ema_teacher_rejects_a_different_architecture():
    with pytest.raises(ValueError, match="does not match student parameter"):
        EMATeacher(nn.Linear(3, 4), nn.Linear(4, 3), momentum_schedule=0.9)
    with pytest.raises(ValueError, match="teacher has 2 parameters but student has 4"):
        update_teacher(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)), nn.Linear(3, 3), 0.9)


def test_update_teacher_unwraps_data_parallel(gen):
    student = small_net()
    teacher = copy.deepcopy(student).requires_grad_(False)
    reference = copy.deepcopy(teacher)
    perturb(student, gen)
    update_teacher(nn.DataParallel(student), teacher, 0.99)
    dino_reference_update(student, reference, 0.99)
    for ours, theirs in zip(teacher.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


def test_bf16_teacher_of_fp32_student(gen):
    student = small_net()
    ema = EMATeacher(student, copy.deepcopy(student).to(torch.bfloat16), momentum_schedule=0.9)
    perturb(student, gen)
    before = [p.clone() for p in ema.teacher.parameters()]
    ema.update(0)
    for t, t0, s in zip(ema.teacher.parameters(), before, student.parameters(), strict=True):
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, kernel_emulation(t0, s, 0.9))


# ----------------------------------------------------------------- CUDA


def to_cuda(tensors):
    """Copies of CPU tensors on the GPU, each its own allocation, through one
    host-to-device copy: a copy per tensor waits on the GPU each time, which
    with other processes on the GPU takes a time slice each."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1) for t in tensors]).cuda()
    parts = flat.split([t.numel() for t in tensors])
    return [p.view(t.shape).clone() for p, t in zip(parts, tensors, strict=True)]


def equal_to_cpu(cpu, gpu):
    """Which GPU tensors equal their CPU twins bitwise, through one copy back."""
    back = torch.cat([g.reshape(-1) for g in gpu]).cpu().split([g.numel() for g in gpu])
    return [torch.equal(c.reshape(-1), b) for c, b in zip(cpu, back, strict=True)]


def cpu_and_cuda_pairs(sizes, teacher_dtype, student_dtype, gen):
    cpu_t = [randn((n,), teacher_dtype, gen) for n in sizes]
    cpu_s = [randn((n,), student_dtype, gen) for n in sizes]
    return cpu_t, cpu_s, to_cuda(cpu_t), to_cuda(cpu_s)


@pytest.mark.cuda
@pytest.mark.parametrize("student_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("teacher_dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_bitwise(teacher_dtype, student_dtype, gen):
    cpu_t, cpu_s, gpu_t, gpu_s = cpu_and_cuda_pairs(SIZES, teacher_dtype, student_dtype, gen)
    ema_update_(cpu_t, cpu_s, 0.9964)
    ema_update_(gpu_t, gpu_s, 0.9964)
    for n, same in zip(SIZES, equal_to_cpu(cpu_t, gpu_t), strict=True):
        assert same, f"n={n}"


@pytest.mark.cuda
@pytest.mark.parametrize("count", [1000, 2500])
def test_cuda_many_tensors_of_mixed_sizes(count, gen):
    sizes = torch.randint(0, 70_000, (count,), generator=gen).tolist()
    cpu_t, cpu_s, gpu_t, gpu_s = cpu_and_cuda_pairs(sizes, torch.float32, torch.bfloat16, gen)
    ema_update_(cpu_t, cpu_s, 0.99)
    ema_update_(gpu_t, gpu_s, 0.99)
    assert all(equal_to_cpu(cpu_t, gpu_t))


@pytest.mark.cuda
def test_cuda_unaligned_and_non_contiguous(gen):
    base_t = randn((20_000,), torch.float32, gen).cuda()
    base_s = randn((20_000,), torch.float16, gen).cuda()
    untouched = base_t.cpu()
    cases = [
        (base_t[1:12_289], base_s[5:12_293]),
        (base_t[3:4099], base_s[0:4096]),
        (
            randn((64, 48), torch.float32, gen).cuda().t(),
            randn((48, 64), torch.float32, gen).cuda(),
        ),
        (
            randn((8, 3, 5, 5), torch.bfloat16, gen)
            .cuda()
            .contiguous(memory_format=torch.channels_last),
            randn((8, 3, 5, 5), torch.bfloat16, gen)
            .cuda()
            .contiguous(memory_format=torch.channels_last),
        ),
    ]
    for t, s in cases:
        want = t.cpu()
        ema_update_([want], [s.cpu()], 0.8)
        ema_update_([t], [s], 0.8)
        assert torch.equal(t.cpu(), want)
    # Nothing outside the two views of the base buffer was written.
    outside = torch.ones(20_000, dtype=torch.bool)
    outside[1:12_289] = False
    outside[3:4099] = False
    assert torch.equal(base_t.cpu()[outside], untouched[outside])


@pytest.mark.cuda
def test_cuda_runs_on_the_current_stream(gen):
    t = randn((1 << 22,), torch.float32, gen).cuda()
    s = randn((1 << 22,), torch.float32, gen).cuda()
    want = kernel_emulation(t.cpu(), s.cpu(), 0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ema_update_([t], [s], 0.5)
        result = t.clone()
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(result.cpu(), want)


@pytest.mark.cuda
def test_cuda_errors_name_the_device():
    with pytest.raises(RuntimeError, match=r"teacher\[0\] is on cuda:0 but student\[0\] is on cpu"):
        ema_update_([torch.zeros(4, device="cuda")], [torch.zeros(4)], 0.9)
    with pytest.raises(RuntimeError, match=r"teacher\[1\] is on cpu"):
        ema_update_(
            [torch.zeros(4, device="cuda"), torch.zeros(4)],
            [torch.zeros(4, device="cuda")] * 2,
            0.9,
        )


@pytest.mark.cuda
def test_cuda_opcheck_compile_and_ema_teacher(gen):
    args = (
        [randn((3, 4), torch.float32, gen).cuda()],
        [randn((3, 4), torch.bfloat16, gen).cuda()],
        0.9,
    )
    torch.library.opcheck(torch.ops.dino_opt.ema_update_.default, args)

    @torch.compile(fullgraph=True)
    def step(teacher, student):
        ema_update_(teacher, student, 0.99)

    t = [randn((1000,), torch.float32, gen).cuda()]
    s = [randn((1000,), torch.float32, gen).cuda()]
    want = kernel_emulation(t[0].cpu(), s[0].cpu(), 0.99)
    step(t, s)
    assert torch.equal(t[0].cpu(), want)

    student = small_net().cuda()
    ema = EMATeacher(student, total_steps=5)
    reference = copy.deepcopy(ema.teacher)
    perturb(student, torch.Generator().manual_seed(0))
    m = ema.update(1)
    dino_reference_update(student, reference, m)
    for ours, theirs in zip(ema.teacher.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    assert dino_opt.build_info()["device_name"]
