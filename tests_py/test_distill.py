"""Distillation's pieces: the backbone tokens of ViTs and ResNets, the grid
alignment, the feature loss against a float64 reference written from its
formula (values and gradients), the teacher's input size, and one step of
each trainer (the frozen teacher's forward counted once per batch; the heads
trainer's targets are the frozen teacher's)."""

import copy
import json
from pathlib import Path

import dino_opt.models as models_module
import pytest
import torch
import torchvision
import yaml
from dino_opt.cli import main
from dino_opt.config import Config, ConfigError, DistillConfig, load_config
from dino_opt.models import DINOHead, Tokens, VisionTransformer, backbone_tokens, pool_to_grid
from dino_opt.runtime import device as device_module
from dino_opt.train import (
    DEMO_PRESETS,
    DINOModel,
    DINOv2Loss,
    DINOv2Trainer,
    DINOv2Wrapper,
    build_models,
    frozen_teacher_dtype,
    parameters_in,
)
from dino_opt.train.distill import (
    FeatureDistillLoss,
    FeatureDistillTrainer,
    FeatureDistillWrapper,
    FeatureProjector,
    FrozenTeacher,
    HeadsDistillLoss,
    HeadsDistillTrainer,
    LocalViews,
    StudentBank,
    TokenWhitener,
    teacher_side,
)
from gloo_ranks import run_ranks
from tiny import (
    RESUMABLE,
    TINY,
    assert_same_states,
    final_state,
    run_cli_ok,
    run_killed_and_resumed,
    tiny_train_only,
    train_args,
)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


def _vit(patch=8, dim=32):
    torch.manual_seed(0)
    return VisionTransformer(
        patch_size=patch,
        embed_dim=dim,
        depth=2,
        num_heads=2,
        img_size=32,
        drop_path_rate=0.0,
        use_mask_token=True,
    ).eval()


# ---------------------------------------------------------------- tokens


def test_vit_tokens_are_its_normalised_class_and_patch_tokens(gen):
    vit = _vit()
    x = torch.randn(3, 3, 32, 48, generator=gen)
    t = backbone_tokens(vit, x)
    out = vit.forward_features(x)
    assert torch.equal(t.cls, out["x_norm_clstoken"])
    assert torch.equal(t.patches, out["x_norm_patchtokens"]) and t.grid == (4, 6)


def test_resnet_tokens_are_its_pooled_feature_and_last_map(gen):
    net = torchvision.models.resnet18(weights=None).eval()
    net.fc = torch.nn.Identity()
    x = torch.randn(2, 3, 64, 96, generator=gen)
    t = backbone_tokens(net, x)
    with torch.no_grad():
        assert torch.allclose(t.cls, net(x), atol=1e-6)
    assert t.grid == (2, 3) and t.patches.shape == (2, 6, 512)
    with pytest.raises(ValueError, match="gives no patch features"):
        backbone_tokens(torch.nn.Linear(3, 3), x)


def _pool_reference(patches, grid, to):
    (h, w), (th, tw) = grid, to
    fh, fw = h // th, w // tw
    maps = patches.reshape(patches.shape[0], h, w, -1)
    out = torch.zeros(patches.shape[0], th, tw, patches.shape[-1], dtype=patches.dtype)
    for i in range(th):
        for j in range(tw):
            out[:, i, j] = maps[:, i * fh : (i + 1) * fh, j * fw : (j + 1) * fw].mean((1, 2))
    return out.reshape(patches.shape[0], th * tw, -1)


@pytest.mark.parametrize(
    "grid, to", [((4, 4), (2, 2)), ((6, 4), (3, 1)), ((4, 4), (4, 4)), ((8, 6), (2, 3))]
)
def test_pool_to_grid_averages_blocks(grid, to, gen):
    patches = torch.randn(2, grid[0] * grid[1], 5, generator=gen, dtype=torch.float64)
    assert torch.allclose(pool_to_grid(patches, grid, to), _pool_reference(patches, grid, to))


@pytest.mark.parametrize("grid, to", [((4, 4), (3, 3)), ((2, 2), (4, 4)), ((5, 4), (2, 2))])
def test_grids_that_do_not_divide_are_one_line(grid, to):
    with pytest.raises(ValueError, match="cannot be aligned") as e:
        pool_to_grid(torch.zeros(1, grid[0] * grid[1], 2), grid, to)
    assert "\n" not in str(e.value)


def test_teacher_side():
    assert teacher_side(224, 1.0, 16) == 224 and teacher_side(224, 0.875, 14) == 196
    assert teacher_side(64, 2.0, 16) == 128
    with pytest.raises(ValueError, match="not a multiple of its patch"):
        teacher_side(96, 1.0, 14)
    with pytest.raises(ValueError, match="distill.teacher_scale"):
        teacher_side(96, 0.3, 16)


# ------------------------------------------------------------ the feature loss


def _standard(x):
    rows = x.reshape(-1, x.shape[-1]).double()
    mean = rows.sum(0) / rows.shape[0]
    std = (((rows - mean) ** 2).sum(0) / rows.shape[0] + 1e-6).sqrt()
    return ((x.double() - mean) / std).to(x.dtype)


def _loss_reference(s, t, o):
    """The feature loss written out in float64, token by token."""

    def cosine(a, b):
        rows = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        sims = [
            (x @ y) / torch.clamp(x.norm() * y.norm(), min=1e-8) for x, y in zip(*rows, strict=True)
        ]
        return sum(1 - v for v in sims) / len(sims)

    def smooth_l1(a, b):
        d = (a - b).abs().flatten()
        return torch.where(d < 1, 0.5 * d**2, d - 0.5).mean()

    if o.standardize:  # each channel over every token of the batch
        t = Tokens(*(_standard(x) for x in (t.cls, t.patches)), t.grid)
    cls = o.cosine_weight * cosine(s.cls, t.cls) + o.smooth_l1_weight * smooth_l1(s.cls, t.cls)
    patch = o.cosine_weight * cosine(s.patches, t.patches)
    patch = patch + o.smooth_l1_weight * smooth_l1(s.patches, t.patches)
    return o.cls_weight * cls + o.patch_weight * patch


@pytest.mark.parametrize(
    "o",
    [
        DistillConfig(),
        DistillConfig(cls_weight=0.3, patch_weight=2.0),
        DistillConfig(cosine_weight=0.0, smooth_l1_weight=1.5),
        DistillConfig(cosine_weight=2.0, smooth_l1_weight=0.0),
        DistillConfig(standardize=True, cls_weight=0.5),
    ],
)
def test_feature_loss_matches_its_formula_with_gradients(o, gen):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 1.5

    s = Tokens(r(4, 8).requires_grad_(), r(4, 6, 8).requires_grad_(), (2, 3))
    t = Tokens(r(4, 8), r(4, 6, 8), (2, 3))
    loss, parts = FeatureDistillLoss(o)(s, t)
    # the loss computes in float32: compare with the reference at that precision
    ref = _loss_reference(
        Tokens(s.cls.float(), s.patches.float(), s.grid),
        Tokens(t.cls.float(), t.patches.float(), t.grid),
        o,
    )
    assert torch.allclose(loss.double(), ref.double(), rtol=1e-5)
    got = torch.autograd.grad(loss, [s.cls, s.patches])
    s64 = Tokens(s.cls.detach().requires_grad_(), s.patches.detach().requires_grad_(), s.grid)
    want = torch.autograd.grad(_loss_reference(s64, t, o), [s64.cls, s64.patches])
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)
    assert set(parts) == {
        "distill_cls_cosine",
        "distill_cls_smooth_l1",
        "distill_patch_cosine",
        "distill_patch_smooth_l1",
    }


def _local_reference(local, t_cls, o):
    """The local crops' terms written out in float64: every (local crop,
    global crop) pair of each image, cosine and smooth-L1 averaged over them."""
    n_local, batch, _ = local.shape
    t = t_cls.reshape(-1, batch, t_cls.shape[-1])
    cos, l1, pairs = 0.0, 0.0, 0
    for i in range(n_local):
        for g in range(t.shape[0]):
            for b in range(batch):
                x, y = local[i, b], t[g, b]
                cos = cos + 1 - (x @ y) / torch.clamp(x.norm() * y.norm(), min=1e-8)
                d = (x - y).abs()
                l1 = l1 + torch.where(d < 1, 0.5 * d**2, d - 0.5).mean()
                pairs += 1
    return o.local_weight * (o.cosine_weight * cos + o.smooth_l1_weight * l1) / pairs


@pytest.mark.parametrize(
    "o",
    [
        DistillConfig(local_weight=1.0),
        DistillConfig(local_weight=2.0, standardize=True),
        DistillConfig(local_weight=0.5, cosine_weight=2.0, smooth_l1_weight=0.25),
    ],
)
def test_local_crop_terms_match_their_formula_with_gradients(o, gen):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 1.5

    s = Tokens(r(6, 8), r(6, 4, 8), (2, 2))  # 2 global crops of 3 images
    t = Tokens(r(6, 8), r(6, 4, 8), (2, 2))
    local = r(4, 3, 8).requires_grad_()  # 4 local crops of the same 3 images
    loss, parts = FeatureDistillLoss(o)(LocalViews(s, local), t)
    t_cls = _standard(t.cls) if o.standardize else t.cls  # the global crops' statistics
    ref = _loss_reference(s, t, o) + _local_reference(local, t_cls, o)
    assert torch.allclose(loss.double(), ref.detach(), rtol=1e-5)
    assert {"distill_local_cosine", "distill_local_smooth_l1"} <= set(parts)
    got = torch.autograd.grad(loss, local)[0]
    want = torch.autograd.grad(_local_reference(local, t_cls, o), local)[0]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------ whitening


def _anisotropic(gen, *shape):
    """Tokens [..., D] whose covariance spans four decades (a few large
    directions, as a DINO teacher's), around a mean far from 0."""
    d = shape[-1]
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0]
    scales = torch.logspace(0, -2, d, dtype=torch.float64)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scales) @ basis.T + 3.0


def _zca_reference(cov, floor):
    values, vectors = torch.linalg.eigh(cov)
    values = values.clamp_min(0)
    return vectors @ torch.diag((values + floor * values.max()).rsqrt()) @ vectors.T


def test_the_whitener_matches_its_formula_batch_after_batch(gen):
    """Running statistics: those of all the tokens so far while fewer than
    1 / (1 - momentum) batches were seen, then a mixture giving the new
    batch 1 - momentum; each batch whitened with the statistics that
    include it, then with those of every third batch (float64 reference)."""
    w = TokenWhitener(6, floor=1e-3, momentum=0.6, refresh=3)
    mean, cov = torch.zeros(6, dtype=torch.float64), torch.zeros(6, 6, dtype=torch.float64)
    seen = []
    for i in range(8):
        x = _anisotropic(gen, 4, 9, 6)
        got = w(x.float())
        rows = x.reshape(-1, 6)
        seen.append(rows)
        m = min(0.6, i / (i + 1))
        b = rows.mean(0)
        cov = m * cov + (1 - m) * torch.cov(rows.T, correction=0)
        cov = cov + m * (1 - m) * torch.outer(mean - b, mean - b)
        mean = m * mean + (1 - m) * b
        if i < 2:  # the pooled statistics of every token so far
            pooled = torch.cat(seen)
            assert torch.allclose(mean, pooled.mean(0))
            assert torch.allclose(cov, torch.cov(pooled.T, correction=0))
        if i < 2 or i % 3 == 0:  # pooled exactly (1 / (1 - 0.6) = 2.5 batches), then refreshed
            zca = _zca_reference(cov, 1e-3)
        want = (x - mean) @ zca
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert torch.allclose(got.double(), want, rtol=1e-3, atol=1e-3), i
        assert torch.allclose(w.mean, mean, atol=1e-6)
        assert torch.allclose(w.cov, cov, rtol=1e-4, atol=1e-8)
    assert int(w.batches) == 8
    resumed = TokenWhitener(6, floor=1e-3, momentum=0.6, refresh=3)
    resumed(_anisotropic(gen, 5, 6).float())  # a used one: loading replaces its count too
    resumed.load_state_dict(w.state_dict())  # continues where it was: batch 9, 10 (refreshed)
    for _ in range(2):
        x = _anisotropic(gen, 5, 6).float()
        assert torch.equal(resumed(x), w(x))


def test_whitened_tokens_have_the_identity_covariance(gen):
    x = _anisotropic(gen, 8000, 5).float()
    out = TokenWhitener(5, floor=1e-7)(x).double()
    assert out.mean(0).abs().max() < 1e-3
    assert torch.allclose(
        torch.cov(out.T, correction=0), torch.eye(5, dtype=torch.float64), atol=2e-3
    )
    with pytest.raises(ValueError, match="floor"):
        TokenWhitener(5, floor=0.0)


def test_the_teachers_tokens_are_whitened_before_they_are_pooled(gen):
    """With ``whiten``: the frozen teacher's class tokens and patch tokens
    each through their own whitener, at the teacher's grid, then averaged
    onto the student's; the running statistics are the loss's state."""
    teacher = _vit(patch=8, dim=48)
    images = torch.randn(3, 3, 32, 32, generator=gen)
    loss = FeatureDistillLoss(DistillConfig(whiten=1e-3, teacher_dim=48))
    loss.attach_teacher(FrozenTeacher(teacher, 8))
    got = loss.teacher_tokens(images, (2, 2))
    raw = backbone_tokens(teacher, images)
    cls, patch = TokenWhitener(48, 1e-3), TokenWhitener(48, 1e-3)
    assert torch.allclose(got.cls, cls(raw.cls), atol=1e-5)
    assert torch.allclose(
        got.patches, pool_to_grid(patch(raw.patches), raw.grid, (2, 2)), atol=1e-5
    )
    state = loss.state_dict()
    assert {"whiteners.cls.mean", "whiteners.patch.cov", "whiteners.cls.batches"} <= set(state)
    assert torch.equal(state["whiteners.patch.mean"], patch.mean)
    with pytest.raises(ValueError, match="teacher_dim"):
        FeatureDistillLoss(DistillConfig(whiten=1e-3))


def test_the_whitener_averages_over_the_ranks(tmp_path, gen):
    """Two gloo ranks, each with its own tokens: both hold the statistics
    of all the tokens, as one process fed them all."""
    tokens = _anisotropic(gen, 3, 2, 4, 6)  # [steps, ranks, N, D]
    torch.save(tokens, tmp_path / "tokens.pt")
    worker = Path(__file__).parent / "workers" / "dist_whiten_worker.py"
    ranks = run_ranks(worker, tmp_path, str(tmp_path / "tokens.pt"), timeout=300)
    whole = TokenWhitener(6, 1e-3)
    for step in tokens:
        whole(step.reshape(-1, 6).float())
    for r in ranks:
        assert torch.allclose(torch.tensor(r["mean"], dtype=torch.float64), whole.mean)
        assert torch.allclose(torch.tensor(r["cov"], dtype=torch.float64), whole.cov)
        assert r["batches"] == 3


# ------------------------------------------------------------ the trainers


class Counting(torch.nn.Module):
    """A backbone that counts its forward passes."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls, self.patch_size = inner, 0, inner.patch_size
        self.sides = []

    def forward_features(self, x):
        self.calls += 1
        self.sides.append(x.shape[-1])
        return self.inner.forward_features(x)


def _feature_trainer(student_backbone, teacher_backbone, width, scale=1.0, local_weight=0.0):
    o = DistillConfig(teacher_scale=scale, local_weight=local_weight)
    student = FeatureDistillWrapper(student_backbone, FeatureProjector(width, 48))
    model = DINOModel(student, copy.deepcopy(student).requires_grad_(False), 0.9)
    loss = FeatureDistillLoss(o)
    loss.attach_teacher(FrozenTeacher(teacher_backbone, teacher_backbone.patch_size, scale))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    config = {"precision": "fp32", "accumulation_steps": 1, "freeze_last_layer": 0}
    return FeatureDistillTrainer(model, loss, opt, config, "cpu")


def test_feature_step_runs_the_teacher_once_and_trains_the_projector(gen):
    teacher = Counting(_vit(patch=8, dim=48))
    trainer = _feature_trainer(_vit(patch=8, dim=32), teacher, 32)
    crops = [torch.randn(3, 3, 32, 32, generator=gen) for _ in range(2)]
    crops += [torch.randn(3, 3, 16, 16, generator=gen) for _ in range(2)]
    before = copy.deepcopy(trainer.model.student.state_dict())
    for _ in range(3):
        loss, metrics = trainer.train_step_optimized(crops, 0)
        assert trainer.optimize_step()
    assert teacher.calls == 3 and torch.isfinite(loss) and "distill_patch_cosine" in metrics
    after = trainer.model.student.state_dict()
    assert not torch.equal(before["head.cls.weight"], after["head.cls.weight"])
    assert not torch.equal(
        before["backbone.blocks.0.attn.qkv.weight"], after["backbone.blocks.0.attn.qkv.weight"]
    )
    ema = trainer.model.teacher.state_dict()["head.cls.weight"]
    assert not torch.equal(ema, before["head.cls.weight"])  # the student's EMA follows


@pytest.mark.parametrize("local_weight", [0.0, 1.0])
def test_local_crops_go_through_the_student_only_with_a_local_weight(local_weight, gen):
    teacher, student = Counting(_vit(patch=8, dim=48)), Counting(_vit(patch=8, dim=32))
    trainer = _feature_trainer(student, teacher, 32, local_weight=local_weight)
    crops = [torch.randn(3, 3, 32, 32, generator=gen) for _ in range(2)]
    crops += [torch.randn(3, 3, 16, 16, generator=gen) for _ in range(4)]
    loss, metrics = trainer.train_step_optimized(crops, 0)
    assert teacher.sides == [32]  # the teacher sees the global crops only
    assert student.sides == ([32, 16] if local_weight else [32])
    assert ("distill_local_cosine" in metrics) == bool(local_weight)
    parts = ("cls", "patch", "local") if local_weight else ("cls", "patch")
    total = sum(metrics[f"distill_{p}_cosine"] + metrics[f"distill_{p}_smooth_l1"] for p in parts)
    assert torch.allclose(loss, total)
    assert trainer.optimize_step()


def test_a_resnet_student_with_local_crops_learns_from_them(gen):
    net = torchvision.models.resnet18(weights=None)
    net.fc = torch.nn.Identity()
    trainer = _feature_trainer(net, _vit(patch=8, dim=48), 512, local_weight=1.0)
    crops = [torch.randn(2, 3, 64, 64, generator=gen) for _ in range(2)]
    crops += [torch.randn(2, 3, 32, 32, generator=gen) for _ in range(3)]  # a 1 x 1 map each
    student = trainer.model.student
    out = student(torch.cat(crops[:2]), crops[2:])
    assert isinstance(out, LocalViews) and out.local_cls.shape == (3, 2, 48)
    loss, metrics = trainer.train_step_optimized(crops, 0)
    assert torch.isfinite(metrics["distill_local_cosine"])
    # the local terms alone reach the backbone
    student.zero_grad()
    only = FeatureDistillLoss(DistillConfig(cls_weight=0, patch_weight=0, local_weight=1.0))
    only.attach_teacher(trainer.loss_fn.frozen)
    views = student(torch.cat(crops[:2]), crops[2:])
    only(views, only.teacher_tokens(torch.cat(crops[:2]), views.tokens.grid))[0].backward()
    assert student.backbone.layer1[0].conv1.weight.grad.abs().sum() > 0
    assert student.head.patch.weight.grad is None or not student.head.patch.weight.grad.any()
    # BatchNorm's running statistics are the global crops' alone
    alone = copy.deepcopy(student.backbone)
    backbone_tokens(alone, torch.cat(crops[:2]))
    student(torch.cat(crops[:2]), crops[2:])
    for name, value in alone.state_dict().items():
        if "running" in name:
            assert torch.equal(value, student.backbone.state_dict()[name]), name


def test_a_resnet_student_learns_from_a_vit_teacher_on_a_coarser_grid(gen):
    net = torchvision.models.resnet18(weights=None)
    net.fc = torch.nn.Identity()
    trainer = _feature_trainer(net, _vit(patch=8, dim=48), 512)  # 64 px: ViT 8 x 8, ResNet 2 x 2
    crops = [torch.randn(2, 3, 64, 64, generator=gen) for _ in range(2)]
    loss, _ = trainer.train_step_optimized(crops, 0)
    assert torch.isfinite(loss) and trainer.optimize_step()


def test_a_teacher_at_another_resolution(gen):
    teacher = Counting(_vit(patch=8, dim=48))
    trainer = _feature_trainer(_vit(patch=8, dim=32), teacher, 32, scale=2.0)
    loss, _ = trainer.train_step_optimized([torch.randn(2, 3, 32, 32, generator=gen)] * 2, 0)
    # 64 px for the teacher: its 8 x 8 grid averaged onto the student's 4 x 4
    assert teacher.sides == [64] and torch.isfinite(loss)
    crops = [torch.randn(2, 3, 32, 32, generator=gen)] * 2
    for scale, match in (
        (0.75, "3 x 3 grid .* cannot be aligned with a 4 x 4"),
        (0.7, "not a multiple of its patch"),
    ):
        bad = _feature_trainer(_vit(patch=8, dim=32), _vit(patch=8, dim=48), 32, scale=scale)
        with pytest.raises(ValueError, match=match):
            bad.train_step_optimized(crops, 0)


def _resnet18():
    torch.manual_seed(0)
    net = torchvision.models.resnet18(weights=None)
    net.fc = torch.nn.Identity()
    return net


def _students():
    """Three students of a ViT-S-like teacher: two ViTs and a ResNet-18."""
    return {
        "vit_a": FeatureDistillWrapper(_vit(patch=8, dim=32).train(), FeatureProjector(32, 48)),
        "vit_b": FeatureDistillWrapper(
            _vit(patch=16, dim=24).train(), FeatureProjector(24, 48, hidden=16)
        ),
        "resnet": FeatureDistillWrapper(_resnet18(), FeatureProjector(512, 48)),
    }


def _trainer_of(student, teacher_backbone, clip=0.05, device="cpu", precision="fp32"):
    student, teacher_backbone = student.to(device), teacher_backbone.to(device)
    model = DINOModel(student, copy.deepcopy(student).requires_grad_(False), 0.9, copy_buffers=True)
    loss = FeatureDistillLoss(DistillConfig())
    loss.attach_teacher(FrozenTeacher(teacher_backbone, teacher_backbone.patch_size))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    config = {
        "precision": precision,
        "accumulation_steps": 1,
        "freeze_last_layer": 0,
        "gradient_clip": clip,
    }
    return FeatureDistillTrainer(model, loss, opt, config, device)


def test_students_of_one_teacher_train_as_each_would_alone(gen):
    """A bank of three students: one teacher forward per batch, and every
    student (weights, EMA, BatchNorm statistics) bit for bit as trained
    alone: own loss, own clipping (small enough to clip), own EMA."""
    teacher = Counting(_vit(patch=8, dim=48))
    bank = _trainer_of(StudentBank(_students()), teacher)
    crops = [[torch.randn(2, 3, 64, 64, generator=gen) for _ in range(2)] for _ in range(3)]
    for batch in crops:
        loss, metrics = bank.train_step_optimized(batch, 0)
        assert bank.optimize_step()
    assert teacher.calls == 3  # one forward per batch for the three students
    assert {"vit_a", "resnet", "distill_patch_cosine_vit_b"} <= set(metrics)
    assert torch.allclose(loss, sum(metrics[n] for n in ("vit_a", "vit_b", "resnet")))
    for name, alone in _students().items():
        one = _trainer_of(alone, _vit(patch=8, dim=48))
        for batch in crops:
            one.train_step_optimized(batch, 0)
            one.optimize_step()
        for net in ("student", "teacher"):
            ours = getattr(bank.model, net).members[name].state_dict()
            for key, value in getattr(one.model, net).state_dict().items():
                assert torch.equal(ours[key], value), f"{name} {net}.{key}"
    ema = bank.model.teacher.members["resnet"].backbone.bn1.running_mean
    assert ema.abs().sum() > 0  # the EMA carries the student's BatchNorm statistics
    with pytest.raises(ValueError, match="two students or more"):
        StudentBank({"one": _students()["vit_a"]})


def test_a_teacher_in_bfloat16_on_a_gpu_keeps_its_buffers_and_its_tokens(gen, monkeypatch):
    monkeypatch.setattr(device_module, "cpu_computes_bf16", lambda: False)

    def cfg(precision):
        return load_config(None, [*TINY, f"hardware.precision={precision}"])

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert frozen_teacher_dtype(cfg("bf16"), cuda) == torch.bfloat16
    # a CPU without native bfloat16 (test_step: one with it)
    assert frozen_teacher_dtype(cfg("bf16"), cpu) is None
    assert frozen_teacher_dtype(cfg("fp16"), cuda) is None
    assert frozen_teacher_dtype(cfg("fp32"), cuda) is None
    # the mixed forward (bf16 parameters, float32 inputs and buffers) under
    # autocast, as a GPU runs it, here on the CPU's bf16 autocast
    vit = _vit(patch=8, dim=48)
    vit.register_buffer("periods", torch.linspace(1, 2, 5))
    assert_bfloat16_teacher_close(vit, torch.randn(4, 3, 32, 32, generator=gen))


def assert_bfloat16_teacher_close(vit, x):
    """``vit`` stored in bfloat16 (its buffers in float32), under bfloat16
    autocast on ``x``'s device: its tokens near the float32 ``vit``'s."""
    half = parameters_in(copy.deepcopy(vit), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    assert half.periods.dtype == torch.float32
    loss = FeatureDistillLoss(DistillConfig())
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        loss.attach_teacher(FrozenTeacher(vit, 8))
        want = loss.teacher_tokens(x, (4, 4))
        loss.attach_teacher(FrozenTeacher(half, 8))
        got = loss.teacher_tokens(x, (4, 4))
    for a, b in ((got.cls, want.cls), (got.patches, want.patches)):
        assert torch.allclose(a.float(), b.float(), atol=0.1, rtol=0.05)


def _bank_losses(device, precision, crops, teacher=None):
    """Three steps of a ViT and a ResNet-18 student of one teacher on
    ``device``: the losses, and the trainer."""
    students = {k: v for k, v in _students().items() if k != "vit_b"}
    teacher = teacher if teacher is not None else _vit(patch=8, dim=48)
    trainer = _trainer_of(StudentBank(students), teacher, device=device, precision=precision)
    losses = []
    for batch in crops:
        losses.append(trainer.train_step_optimized(batch, 0)[0].item())
        assert trainer.optimize_step()
    return losses, trainer


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_students_train_as_on_the_cpu(gen):
    """A ViT and a ResNet-18 of one teacher, three float32 steps on the GPU
    against the same on the CPU: the losses within float32 rounding (cuDNN
    and cuBLAS sum in other orders), every student and EMA weight on the GPU."""
    crops = [[torch.randn(2, 3, 64, 64, generator=gen) for _ in range(2)] for _ in range(3)]
    cpu, _ = _bank_losses("cpu", "fp32", crops)
    gpu, trainer = _bank_losses("cuda", "fp32", crops)
    assert gpu == pytest.approx(cpu, rel=1e-3)
    for net in (trainer.model.student, trainer.model.teacher):
        assert all(p.device.type == "cuda" for p in net.parameters())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_bfloat16_teacher_under_autocast(gen):
    """The run's GPU setting: the frozen teacher stored in bfloat16 with its
    buffers in float32, the step under bfloat16 autocast: its tokens near
    the float32 teacher's, and three steps of two students near float32's."""
    vit = _vit(patch=8, dim=48).cuda()
    vit.register_buffer("periods", torch.linspace(1, 2, 5, device="cuda"))
    assert_bfloat16_teacher_close(vit, torch.randn(4, 3, 32, 32, generator=gen).cuda())
    crops = [[torch.randn(2, 3, 64, 64, generator=gen) for _ in range(2)] for _ in range(3)]
    full, _ = _bank_losses("cuda", "fp32", crops)
    bf16, _ = _bank_losses(
        "cuda", "bf16", crops, parameters_in(_vit(patch=8, dim=48), torch.bfloat16)
    )
    assert bf16 == pytest.approx(full, rel=0.05)


def _heads_wrapper(backbone, out_dim=64, ibot_dim=40):
    head = DINOHead(backbone.embed_dim, out_dim, hidden_dim=32, bottleneck_dim=16)
    ibot = DINOHead(backbone.embed_dim, ibot_dim, hidden_dim=32, bottleneck_dim=16)
    return DINOv2Wrapper(backbone, head, ibot)


def test_heads_targets_are_the_frozen_teachers(gen):
    # the teacher has the student's shapes (so that DINOv2's own step can take it
    # as its EMA teacher, the reference) but weights of its own
    student = _heads_wrapper(_vit(patch=8, dim=32))
    teacher = _heads_wrapper(_vit(patch=8, dim=32)).eval()
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    config = {"precision": "fp32", "accumulation_steps": 1, "freeze_last_layer": 0}
    kw = dict(centering="sinkhorn_knopp")

    def trainer(cls, loss_fn, teacher_net):
        s = copy.deepcopy(student)
        model = DINOModel(s, teacher_net, 0.9)
        return cls(model, loss_fn, torch.optim.SGD(s.parameters(), lr=0.0), config, "cpu")

    distill_loss = HeadsDistillLoss(64, 40, 2, **kw)
    distill_loss.attach_teacher(FrozenTeacher(copy.deepcopy(teacher), 8))
    ema = copy.deepcopy(student).requires_grad_(False)
    ours = trainer(HeadsDistillTrainer, distill_loss, ema)
    # the reference: DINOv2's step whose (EMA) teacher is the frozen network itself
    ref = trainer(DINOv2Trainer, DINOv2Loss(64, 40, 2, **kw), copy.deepcopy(teacher))
    ref.model.teacher.load_state_dict(teacher.state_dict())  # the EMA starts as the student
    crops = [torch.randn(4, 3, 32, 32, generator=gen) for _ in range(2)]
    crops += [torch.randn(4, 3, 16, 16, generator=gen) for _ in range(2)]
    masks = torch.rand(8, 4, 4, generator=gen) < 0.4
    a, pa = ours.train_step_optimized(crops, 0, masks=masks)
    b, pb = ref.train_step_optimized(crops, 0, masks=masks)
    assert torch.allclose(a, b, rtol=1e-6) and set(pa) == set(pb)
    coarse = HeadsDistillLoss(64, 40, 2, **kw)
    coarse.attach_teacher(FrozenTeacher(copy.deepcopy(teacher), 8, scale=2.0))
    mismatch = trainer(HeadsDistillTrainer, coarse, copy.deepcopy(ema))
    with pytest.raises(ValueError, match="patch grid"):
        mismatch.train_step_optimized(crops, 0, masks=masks)


# ------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


@pytest.fixture(scope="module")
def teacher_run(train_root, tmp_path_factory):
    """A tiny DINOv2 run (ViT-T/8, width 192, a separate iBOT head of 40): the teacher."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    teacher = [
        *TINY,
        "recipe.name=dinov2",
        "recipe.ibot.separate_head=true",
        "recipe.ibot.out_dim=40",
        "schedule.epochs=1",
        "schedule.warmup_epochs=0",
    ]
    run_cli_ok(_cmd(out, train_root, *teacher))
    return out


def _cmd(out: Path, root: Path, *config: str) -> list[str]:
    return train_args(out, root, *RESUMABLE, *config)


def _student(teacher: Path, *extra: str) -> list[str]:
    return [
        *TINY,
        "recipe.name=distill",
        f"recipe.distill.teacher={teacher}",
        "model.drop_path_rate=0",
        *extra,
    ]


@pytest.mark.parametrize(
    "mode, extra", [("features", ()), ("heads", ()), ("features", ("recipe.distill.whiten=0.001",))]
)
def test_distillation_trains_and_resumes_bit_for_bit(
    mode, extra, train_root, teacher_run, tmp_path
):
    """(With whitening: its running statistics are in the checkpoint.)"""
    config = _student(teacher_run, f"recipe.distill.mode={mode}", *extra)
    ref = tmp_path / "ref"
    run_cli_ok(_cmd(ref, train_root, *config))
    rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    part = "loss_distill_patch_cosine" if mode == "features" else "loss_ibot"
    assert all(part in r for r in rows if "loss" in r)
    saved = yaml.safe_load((ref / "config.yaml").read_text())["recipe"]
    if mode == "features":  # the teacher's width, read when the run started
        assert saved["distill"]["teacher_dim"] == 192
    else:  # the student's heads take the teacher's widths
        assert saved["ibot"]["out_dim"] == 40 and saved["ibot"]["separate_head"]
    out = tmp_path / "run"
    run_killed_and_resumed(out, _cmd(out, train_root, *config))
    a, b = final_state(out), final_state(ref)
    assert not any("frozen" in k or k.startswith("teacher.") for k in b["loss"])  # not saved
    assert_same_states(a, b)
    # what the evaluations and the export read: the run's networks rebuilt from its config
    _, teacher = build_models(Config.from_dict(b["config"]))
    teacher.load_state_dict(b["teacher"])


def test_a_resnet_student_from_a_vit_teacher(train_root, teacher_run, tmp_path):
    out = tmp_path / "resnet"
    config = _student(
        teacher_run, "model.backbone=resnet18", "model.patch_size=16", "schedule.epochs=1"
    )
    run_cli_ok(_cmd(out, train_root, *config))
    final = final_state(out)
    assert final["teacher"]["head.patch.weight"].shape == (192, 512)  # ResNet-18 to ViT-T


def test_a_feature_distillation_builds_no_dino_head(monkeypatch):
    # the student's backbone and a projector, the EMA copy of the same: no
    # DINO head is made (at out_dim 65536 two of them cost 180 MB to build)
    made = []
    monkeypatch.setattr(models_module, "DINOHead", lambda *a, **k: made.append(a))
    cfg = load_config(
        None,
        [
            "recipe.name=distill",
            "recipe.distill.teacher=x.pt",
            "recipe.distill.teacher_dim=48",
            "model.backbone=vit_tiny",
            "recipe.distill.students=[resnet18]",
        ],
    )
    assert cfg.student_names == ("vit_tiny", "resnet18")
    student, teacher = build_models(cfg)
    assert isinstance(student, StudentBank) and list(student.members) == ["vit_tiny", "resnet18"]
    for net in (student, teacher):
        assert not any(isinstance(m, DINOHead) for m in net.modules())
        for member in net.members.values():
            assert isinstance(member, FeatureDistillWrapper)
            linears = [m for m in member.head.patch.modules() if isinstance(m, torch.nn.Linear)]
            assert linears[-1].out_features == 48  # the teacher's width
    assert not any(p.requires_grad for p in teacher.parameters())
    assert made == []


@pytest.mark.parametrize(
    "extra, needle",
    [
        ([], "needs its teacher"),
        (
            [
                "recipe.distill.teacher=x.pt",
                "recipe.distill.mode=heads",
                "model.backbone=resnet18",
                "model.patch_size=16",
            ],
            "trains a ViT student",
        ),
        (
            [
                "recipe.distill.teacher=x.pt",
                "recipe.distill.mode=heads",
                "recipe.distill.local_weight=1",
            ],
            "recipe.distill.local_weight=1 is for",
        ),
        (
            [
                "recipe.distill.teacher=x.pt",
                "recipe.distill.local_weight=0.5",
                "augmentation.num_local_views=0",
            ],
            "augmentation.num_local_views is 0",
        ),
        (
            [
                "recipe.distill.teacher=x.pt",
                "recipe.distill.mode=heads",
                "recipe.distill.standardize=true",
            ],
            "recipe.distill.standardize is for",
        ),
        (
            [
                "recipe.distill.teacher=x.pt",
                "recipe.distill.mode=heads",
                "recipe.distill.whiten=0.001",
            ],
            "recipe.distill.whiten is for",
        ),
        (
            [
                "recipe.distill.teacher=x.pt",
                "recipe.distill.standardize=true",
                "recipe.distill.whiten=0.001",
            ],
            "choose one",
        ),
        (["recipe.distill.teacher=x.pt", "recipe.distill.whiten=2"], "recipe.distill.whiten"),
    ],
)
def test_config_errors_are_one_line(extra, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*TINY, "recipe.name=distill", *extra])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_teachers_are_one_line(train_root, tmp_path, capsys):
    junk = tmp_path / "junk.pt"
    torch.save({"foo": torch.zeros(3)}, junk)
    cases = [
        (junk, "features", str(junk)),
        (tmp_path / "missing.pt", "features", "does not exist"),
        (junk, "heads", "needs a dino_opt run or checkpoint"),
    ]
    for path, mode, needle in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(
                [
                    "train",
                    "--output-dir",
                    str(tmp_path / f"out_{mode}"),
                    "--quiet",
                    f"data.root={train_root}",
                    *_student(path, f"recipe.distill.mode={mode}"),
                ]
            )
        err = capsys.readouterr().err
        lines = [x for x in err.strip().splitlines() if "error" in x]
        assert e.value.code == 2 and len(lines) == 1 and needle in lines[0], err


def test_the_distill_demo_is_the_dino_demo_with_the_measured_features_settings():
    dino = load_config(DEMO_PRESETS["dino"])
    demo = load_config(DEMO_PRESETS["distill"], ["recipe.distill.teacher=t.pth"])
    r, d = demo.recipe, demo.recipe.distill
    assert (r.name, d.mode, d.local_weight) == ("distill", "features", 1.0)
    assert d.whiten == 1e-4 and d.projector_hidden == 2048
    a, b = dino.to_flat_dict(), demo.to_flat_dict()
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {
        "recipe.name",
        "recipe.distill.teacher",
        "recipe.distill.local_weight",
        "recipe.distill.whiten",
        "recipe.distill.projector_hidden",
    }
