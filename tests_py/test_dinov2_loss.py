"""The DINOv2 recipe's losses (dino_opt.ops.dinov2_loss) against float64
references written here from dinov2's formulas: softmax centering,
Sinkhorn-Knopp, the class-token and patch-token cross-entropies, KoLeo and the
center updates; values and gradients in float32 and bfloat16, the checkpoint
state, the errors, and two gloo ranks against one process over both shards."""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dino_opt.ops.dinov2_loss import DINOLoss, KoLeoLoss, iBOTPatchLoss, sinkhorn_knopp
from gloo_ranks import launch_ranks

HALF = (torch.bfloat16, torch.float16)
# (relative on the loss, relative to the largest reference gradient)
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# --- float64 references, from the formulas -------------------------------------------------


def ref_softmax_center(teacher, center, temp):
    return F.softmax((teacher.double() - center.double()) / temp, dim=-1)


def ref_sinkhorn_knopp(teacher, temp, n_iterations, n_samples=None):
    """dinov2's order on Q [K, B]: total mass 1; then per iteration rows (the
    prototypes) to 1/K and columns (the samples) to 1/B; columns scaled to 1."""
    q = torch.exp(teacher.double() / temp).t()
    k, b = q.shape[0], q.shape[1] if n_samples is None else n_samples
    q = q / q.sum()
    for _ in range(n_iterations):
        q = q / q.sum(dim=1, keepdim=True) / k
        q = q / q.sum(dim=0, keepdim=True) / b
    return (q * b).t()


def ref_cross_entropy(target, student, temp):
    """Per row: -sum_k target_k log_softmax(student / temp)_k."""
    return -(target.double() * F.log_softmax(student / temp, dim=-1)).sum(dim=-1)


def ref_dino_loss(students, targets, temp):
    """dinov2's double sum over student crops and teacher targets."""
    return sum(ref_cross_entropy(t, s, temp).mean() for s in students for t in targets)


def ref_ibot_loss(student, teacher, masks, temp):
    """[B, N, K] tokens: per image, the masked tokens' mean; then the mean over images."""
    per_token = ref_cross_entropy(teacher, student, temp) * masks.double()
    return (per_token.sum(dim=-1) / masks.double().sum(dim=-1).clamp(min=1)).mean()


def ref_masks_weight(masks):
    """1 / the masked count of its image for each masked token, in row-major order."""
    weights = []
    for row in masks.tolist():
        weights += [1.0 / max(sum(row), 1)] * sum(row)
    return torch.tensor(weights, dtype=torch.float64)


def ref_ibot_masked_loss(student, teacher, masks, temp, n=None, weights=None):
    weights = ref_masks_weight(masks) if weights is None else weights.double()
    per_token = ref_cross_entropy(teacher[:n], student[:n], temp)
    return (per_token * weights).sum() / masks.shape[0]


def ref_koleo(x, eps=1e-8):
    """Nearest other row by Euclidean distance on the normalised rows, then
    -mean log(||x_i - x_j + 1e-8|| + eps) (PairwiseDistance's eps inside)."""
    x = x / x.norm(dim=-1, keepdim=True).clamp(min=eps)
    dist = torch.cdist(x.detach(), x.detach()).fill_diagonal_(float("inf"))
    nearest = dist.argmin(dim=1)
    return -torch.log((x - x[nearest] + 1e-8).norm(dim=-1) + eps).mean()


def ref_center(center, batch_center, momentum):
    return center.double() * momentum + batch_center.double() * (1 - momentum)


# --- helpers ------------------------------------------------------------------------------


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


def targets(gen, *shape):
    return F.softmax(randn(gen, *shape, scale=3.0) / 0.5, dim=-1)


def check_loss_and_grad(loss, leaves, ref, ref_leaves, dtype):
    """Our loss against the float64 reference and each leaf's gradient."""
    tol = TOLERANCE[dtype]
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert loss.item() == pytest.approx(ref.item(), rel=tol * 0.1 if dtype in HALF else tol)
    torch.autograd.backward([loss, ref])
    for ours, theirs in zip(leaves, ref_leaves, strict=True):
        assert ours.grad.dtype == dtype
        scale = theirs.grad.abs().max().item()
        torch.testing.assert_close(ours.grad.double(), theirs.grad, rtol=0, atol=tol * scale)


def leaves_of(tensors):
    """Leaves in their dtype and their float64 copies, both requiring grad."""
    ours = [t.detach().clone().requires_grad_() for t in tensors]
    return ours, [t.detach().double().requires_grad_() for t in tensors]


# --- Sinkhorn-Knopp -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n_iterations", [0, 1, 3])
def test_sinkhorn_knopp_is_dinov2s_in_float32(dtype, n_iterations, gen):
    teacher = randn(gen, 24, 40, dtype=dtype)
    q = sinkhorn_knopp(teacher, 0.07, n_iterations)
    assert q.dtype == torch.float32 and q.shape == (24, 40)
    ref = ref_sinkhorn_knopp(teacher, 0.07, n_iterations)
    torch.testing.assert_close(q.double(), ref, rtol=2e-5, atol=1e-7)
    if n_iterations:  # each row an assignment
        torch.testing.assert_close(q.sum(dim=1), torch.ones(24), rtol=1e-5, atol=0)


def test_sinkhorn_knopp_large_logits_do_not_overflow(gen):
    # exp(logit / 0.04) is beyond float32 (dinov2's Q would be inf); the spread is not.
    teacher = 4.0 + randn(gen, 16, 32, scale=0.3)
    assert not torch.isfinite(torch.exp(teacher / 0.04)).all()
    q = sinkhorn_knopp(teacher, 0.04)
    assert torch.isfinite(q).all()
    ref = ref_sinkhorn_knopp(teacher, 0.04, 3)
    torch.testing.assert_close(q.double(), ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("n_masked", [10, 17])
def test_sinkhorn_knopp_n_masked_patches_sets_b(as_tensor, n_masked, gen):
    teacher = randn(gen, 10, 12, dtype=torch.bfloat16)
    count = torch.tensor([n_masked]) if as_tensor else n_masked
    q = sinkhorn_knopp(teacher, 0.1, 3, n_masked_patches=count)
    torch.testing.assert_close(
        q.double(), ref_sinkhorn_knopp(teacher, 0.1, 3, n_masked), rtol=2e-5, atol=1e-7
    )
    if as_tensor:  # the caller's count is not all-reduced in place
        assert count.tolist() == [n_masked]


def test_teacher_sinkhorn_knopp_methods(gen):
    teacher = randn(gen, 9, 20)
    q = DINOLoss(20).sinkhorn_knopp_teacher(teacher, 0.05, n_iterations=2)
    torch.testing.assert_close(q, sinkhorn_knopp(teacher, 0.05, 2), rtol=0, atol=0)
    n = torch.tensor([11])
    q = iBOTPatchLoss(20).sinkhorn_knopp_teacher(teacher, 0.05, n_masked_patches_tensor=n)
    torch.testing.assert_close(
        q.double(), ref_sinkhorn_knopp(teacher, 0.05, 3, 11), rtol=2e-5, atol=1e-7
    )


# --- centers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dino_softmax_center_and_center_updates(dtype, gen):
    loss, center = DINOLoss(30, center_momentum=0.7), torch.zeros(1, 30, dtype=torch.float64)
    for _ in range(3):
        teacher = randn(gen, 8, 30, dtype=dtype)
        probs = loss.softmax_center_teacher(teacher, 0.04)
        assert probs.dtype == torch.float32 and probs.shape == (8, 30)
        torch.testing.assert_close(
            probs.double(), ref_softmax_center(teacher, center, 0.04), rtol=1e-4, atol=1e-6
        )
        before = loss.center.clone()
        loss.update_center(teacher)
        assert not loss.updated and torch.equal(loss.center, before)  # applied when next needed
        center = ref_center(center, teacher.double().mean(dim=0, keepdim=True), 0.7)
    loss.apply_center_update()
    assert loss.updated and loss.center.shape == (1, 30) and loss.center.dtype == torch.float32
    # Summed in float32 even for a bfloat16 teacher.
    torch.testing.assert_close(loss.center.double(), center, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ibot_softmax_center_and_center_updates(dtype, gen):
    loss, center = (
        iBOTPatchLoss(16, center_momentum=0.8),
        torch.zeros(1, 1, 16, dtype=torch.float64),
    )
    for shape in [(1, 13, 16), (3, 5, 16), (2, 7, 16)]:
        tokens = randn(gen, *shape, dtype=dtype)
        probs = loss.softmax_center_teacher(tokens, 0.07)
        assert probs.dtype == torch.float32 and probs.shape == shape
        torch.testing.assert_close(
            probs.double(), ref_softmax_center(tokens, center, 0.07), rtol=1e-4, atol=1e-6
        )
        loss.update_center(tokens)
        center = ref_center(center, tokens.double().mean(dim=1).mean(dim=0), 0.8)
    # dinov2's broadcast: [n, K] rows against the [1, 1, K] center give [1, n, K].
    assert loss.softmax_center_teacher(randn(gen, 4, 16), 0.07).shape == (1, 4, 16)
    assert loss.center.shape == (1, 1, 16) and loss.center.dtype == torch.float32
    torch.testing.assert_close(loss.center.double(), center, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls, shape", [(DINOLoss, (6, 12)), (iBOTPatchLoss, (2, 5, 12))])
def test_center_state_dict_applies_a_pending_update_and_round_trips(cls, shape, gen):
    loss = cls(12)
    teacher = randn(gen, *shape)
    loss.update_center(teacher)
    state = loss.state_dict()
    assert loss.updated and torch.equal(state["center"], loss.center)
    expected = 0.1 * teacher.double().reshape(-1, 12).mean(dim=0)
    torch.testing.assert_close(state["center"].double().reshape(-1), expected)
    fresh = cls(12)
    fresh.update_center(randn(gen, *shape))  # pending, dropped by the load
    fresh.load_state_dict(state)
    assert fresh.updated and torch.equal(fresh.center, state["center"])
    fresh.apply_center_update()
    assert torch.equal(fresh.center, state["center"])


# --- the cross-entropies -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_dino_loss_is_dinov2s_double_sum(dtype, as_tensor, gen):
    crops = [randn(gen, 5, 33, dtype=dtype) for _ in range(3)]
    probs = [targets(gen, 5, 33) for _ in range(2)]
    students, ref_students = leaves_of(crops)
    args = (torch.stack(students), torch.stack(probs)) if as_tensor else (students, probs)
    loss = DINOLoss(33, student_temp=0.1)(*args)
    ref = ref_dino_loss(ref_students, probs, 0.1)
    check_loss_and_grad(loss, students, ref, ref_students, dtype)


def test_dino_loss_global_crops_form_and_teacher_gets_no_gradient(gen):
    (student,), (ref_student,) = leaves_of([randn(gen, 8, 20)])
    probs = targets(gen, 8, 20).requires_grad_()
    loss = DINOLoss(20, student_temp=0.2)([student], [probs])
    ref = ref_dino_loss([ref_student], [probs.detach()], 0.2)
    check_loss_and_grad(loss, [student], ref, [ref_student], torch.float32)
    assert probs.grad is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ibot_forward_is_dinov2s_masked_mean(dtype, gen):
    masks = torch.rand(4, 9, generator=gen) < 0.4
    masks[1] = False  # an image without masks: its count is clamped to 1
    masks[2, 0] = True
    (student,), (ref_student,) = leaves_of([randn(gen, 4, 9, 24, dtype=dtype)])
    teacher = targets(gen, 4, 9, 24)
    loss = iBOTPatchLoss(24)(student, teacher, masks)
    ref = ref_ibot_loss(ref_student, teacher, masks, 0.1)
    check_loss_and_grad(loss, [student], ref, [ref_student], dtype)
    assert not student.grad[~masks].any()


def test_ibot_forward_float_masks_weigh_the_tokens(gen):
    masks = torch.rand(3, 6, generator=gen) * (torch.rand(3, 6, generator=gen) < 0.6)
    (student,), (ref_student,) = leaves_of([randn(gen, 3, 6, 10)])
    teacher = targets(gen, 3, 6, 10)
    loss = iBOTPatchLoss(10)(student, teacher, masks)
    ref = ref_ibot_loss(ref_student, teacher, masks, 0.1)
    check_loss_and_grad(loss, [student], ref, [ref_student], torch.float32)


def test_ibot_forward_with_nothing_masked_is_zero(gen):
    student = randn(gen, 2, 3, 8).requires_grad_()
    loss = iBOTPatchLoss(8)(student, targets(gen, 2, 3, 8), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and not student.grad.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("given_weights", [False, True])
def test_ibot_forward_masked_is_dinov2s(dtype, given_weights, gen):
    masks = torch.rand(3, 10, generator=gen) < 0.5
    masks[0, :2] = True
    n = int(masks.sum())
    # Rows past n are the padding of dinov2's buffer: cut by n_masked_patches.
    (student,), (ref_student,) = leaves_of([randn(gen, n + 4, 24, dtype=dtype)])
    teacher = targets(gen, n + 4, 24)
    weights = torch.rand(n, generator=gen) if given_weights else None
    loss = iBOTPatchLoss(24, student_temp=0.15).forward_masked(
        student, teacher, masks, n_masked_patches=n, masks_weight=weights
    )
    ref = ref_ibot_masked_loss(ref_student, teacher, masks, 0.15, n, weights)
    check_loss_and_grad(loss, [student], ref, [ref_student], dtype)
    assert not student.grad[n:].any()


def test_ibot_forward_masked_equals_forward_on_the_masked_tokens(gen):
    masks = torch.rand(3, 8, generator=gen) < 0.5
    masks[:, 0] = True
    student, teacher = randn(gen, 3, 8, 16), targets(gen, 3, 8, 16)
    loss = iBOTPatchLoss(16)
    full = loss(student, teacher, masks)
    masked = loss.forward_masked(student[masks], teacher[masks], masks)
    assert masked.item() == pytest.approx(full.item(), rel=1e-6)


# --- KoLeo -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_koleo_is_the_nearest_neighbour_log_distance(dtype, gen):
    (x,), (ref_x,) = leaves_of([randn(gen, 12, 8, dtype=dtype)])
    loss = KoLeoLoss()(x)
    check_loss_and_grad(loss, [x], ref_koleo(ref_x), [ref_x], dtype)


def test_koleo_nearest_neighbour_excludes_the_row_itself(gen):
    x = F.normalize(randn(gen, 10, 4), dim=-1)
    nearest = KoLeoLoss().pairwise_NNs_inner(x)
    dist = torch.cdist(x, x).fill_diagonal_(float("inf"))
    assert torch.equal(nearest, dist.argmin(dim=1))
    pair = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])  # the other row at inner product -1
    assert KoLeoLoss().pairwise_NNs_inner(pair).tolist() == [1, 0]


@pytest.mark.parametrize("eps", [1e-8, 1e-4])
def test_koleo_duplicates_stay_finite(eps, gen):
    x = randn(gen, 6, 5)
    x[3] = x[0]
    x = x.requires_grad_()
    loss = KoLeoLoss()(x, eps=eps)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert loss.item() == pytest.approx(ref_koleo(x.detach().double(), eps).item(), rel=1e-6)


def test_koleo_ignores_autocast(gen):
    x = randn(gen, 7, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = KoLeoLoss()(x)
    assert loss.dtype == torch.float32
    # a mean of float32 logs of O(1): its rounding is absolute, some float32
    # eps, so a loss near zero has no relative precision (300 seeds: <= 7.2e-8)
    eps32 = torch.finfo(torch.float32).eps
    assert loss.item() == pytest.approx(ref_koleo(x.double()).item(), rel=1e-6, abs=4 * eps32)


# --- errors ------------------------------------------------------------------------------------

R = torch.randn
ERRORS = [
    (lambda: sinkhorn_knopp(R(5), 0.1), "sinkhorn_knopp: teacher_output must be a 2-D"),
    (
        lambda: sinkhorn_knopp(R(2, 3), 0.1, n_masked_patches=torch.tensor([1, 2])),
        "n_masked_patches must be one count",
    ),
    (lambda: DINOLoss(8).softmax_center_teacher(R(4, 9), 0.1), "teacher_output has 9 columns"),
    (lambda: DINOLoss(8).update_center(R(2, 4, 8)), "teacher_output must be a 2-D"),
    (lambda: DINOLoss(8)([R(4, 8)], [R(5, 8)]), "teacher_out_softmaxed_centered_list holds"),
    (lambda: DINOLoss(8)([R(4, 8), R(3, 8)], [R(4, 8)]), r"student_output_list\[1\] has shape"),
    (lambda: DINOLoss(8)([], [R(4, 8)]), "student_output_list must be a non-empty"),
    (lambda: DINOLoss(8)(R(4, 8), [R(4, 8)]), "student_output_list must be a 3-D"),
    (lambda: DINOLoss(8, center_momentum=1.5), "center_momentum must be in"),
    (
        lambda: iBOTPatchLoss(8)(R(2, 5, 8), R(2, 4, 8), R(2, 5) > 0),
        "teacher_patch_tokens has shape",
    ),
    (lambda: iBOTPatchLoss(8)(R(2, 5, 8), R(2, 5, 8), R(2, 4) > 0), "student_masks_flat has shape"),
    (
        lambda: iBOTPatchLoss(8)(R(2, 5, 9), R(2, 5, 9), R(2, 5) > 0),
        "student_patch_tokens has 9 columns",
    ),
    (
        lambda: iBOTPatchLoss(8).forward_masked(R(3, 8), R(3, 8), R(2, 5) > 0, masks_weight=R(4)),
        "masks_weight has 4 rows",
    ),
    (
        lambda: iBOTPatchLoss(8).forward_masked(R(3, 8), R(2, 8), R(2, 5) > 0, masks_weight=R(3)),
        "teacher_patch_tokens_masked has 2 rows",
    ),
    (
        lambda: iBOTPatchLoss(8).forward_masked(R(3, 9), R(3, 9), R(2, 5) > 0),
        "student_patch_tokens_masked has 9 columns",
    ),
    (lambda: iBOTPatchLoss(8).update_center(R(4, 8)), "teacher_patch_tokens must be a 3-D"),
    (
        lambda: iBOTPatchLoss(8).softmax_center_teacher(R(4, 7), 0.1),
        "teacher_patch_tokens has 7 columns",
    ),
    (lambda: KoLeoLoss()(R(1, 8)), "student_output needs at least 2 rows"),
    (lambda: KoLeoLoss()(R(8)), "student_output must be a 2-D"),
]


@pytest.mark.parametrize("call, message", ERRORS, ids=[m for _, m in ERRORS])
def test_bad_inputs_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- distributed ---------------------------------------------------------------------------


def run_ranks(tmp_path: Path, data: dict, world: int = 2) -> list[dict]:
    torch.save(data, tmp_path / "data.pt")
    worker = Path(__file__).parent / "workers" / "dist_dinov2_loss_worker.py"
    files = (tmp_path / "init", tmp_path / "data.pt")
    launch_ranks(
        worker,
        world,
        lambda rank: [*map(str, files), str(tmp_path / f"rank{rank}.pt")],
        timeout=120,
    )
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    print(f"seed={gen.initial_seed()}")
    data = {
        "sk_counts": [5, 9],
        "sk_logits": randn(gen, 14, 24, dtype=torch.bfloat16),
        "dino_counts": [[4, 4], [3, 5], [6, 2]],
        "dino_teachers": [randn(gen, 8, 24) for _ in range(3)],
        "ibot_counts": [2, 3],
        "ibot_tokens": [randn(gen, 5, 6, 24) for _ in range(3)],
    }
    return data, run_ranks(tmp_path_factory.mktemp("dinov2_dist"), data)


def by_rank(tensor, counts, dim=0):
    return list(tensor.split(counts, dim=dim))


def test_two_ranks_sinkhorn_knopp_equals_one_process(two_ranks):
    data, ranks = two_ranks
    whole = sinkhorn_knopp(data["sk_logits"], 0.05, 3)
    for rank, part in enumerate(by_rank(whole, data["sk_counts"])):
        torch.testing.assert_close(ranks[rank]["sk"], part, rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(ranks[rank]["sk_ibot"], part, rtol=1e-5, atol=1e-8)
        assert ranks[rank]["n_masked_after"].tolist() == [data["sk_counts"][rank]]


def test_two_ranks_centers_equal_one_process(two_ranks):
    data, ranks = two_ranks
    dino, ibot = DINOLoss(24, center_momentum=0.8), iBOTPatchLoss(24)
    for step, (counts, teacher, tokens) in enumerate(
        zip(data["dino_counts"], data["dino_teachers"], data["ibot_tokens"], strict=True)
    ):
        probs = by_rank(dino.softmax_center_teacher(teacher, 0.07), counts)
        patch_probs = by_rank(ibot.softmax_center_teacher(tokens, 0.05), data["ibot_counts"])
        dino.update_center(teacher)
        ibot.update_center(tokens)
        for rank, got in enumerate(ranks):
            torch.testing.assert_close(got["dino_probs"][step], probs[rank], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(
                got["ibot_probs"][step], patch_probs[rank], rtol=1e-5, atol=1e-7
            )
    for got in ranks:
        assert got["updated_before_state_dict"] == (False, False)
        assert got["updated_after_state_dict"] == (True, True)
        torch.testing.assert_close(got["dino_center"], dino.state_dict()["center"])
        torch.testing.assert_close(got["ibot_center"], ibot.state_dict()["center"])
        assert torch.equal(got["loaded_center"], torch.ones(1, 24)) and got["loaded_updated"]


@pytest.mark.parametrize(
    "make",
    [lambda: DINOLoss(12, center_momentum=0.6), lambda: iBOTPatchLoss(12, center_momentum=0.6)],
)
def test_a_second_update_before_it_is_applied_replaces_the_first(make, gen):
    # dinov2's semantics (kept by dinov3): update_center stores the batch's sum;
    # a second call before apply_center_update overwrites it.
    loss = make()
    shape = (5, 12) if isinstance(loss, DINOLoss) else (2, 5, 12)
    first, second = randn(gen, *shape), randn(gen, *shape)
    loss.update_center(first)
    loss.update_center(second)
    loss.apply_center_update()
    rows = second.double().reshape(-1, 12)
    want = ref_center(torch.zeros(12, dtype=torch.float64), rows.mean(dim=0), 0.6)
    torch.testing.assert_close(loss.center.double().reshape(-1), want, rtol=1e-6, atol=1e-7)
