"""The DINOv2 recipe as a whole: its configuration (the recipe section, the
packaged YAML configs, the sqrt scaling rule), DINOv2's parameter groups and
schedules, the composed loss of a step against a plain float64 form written
here from DINOv2's published step, the trainer's step, and `dino-opt train`
end to end (metrics of each loss, resume bit for bit)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dino_opt.config import ConfigError, effective_lr, load_config, recipe_names
from dino_opt.data import mask_targets
from dino_opt.ops import Schedules
from dino_opt.train import (
    DEMO_PRESETS,
    DINOModel,
    DINOv2Loss,
    DINOv2Trainer,
    StudentOutputs,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    build_trainer,
    dinov2_param_groups,
    layer_id,
)
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

DINOV2_TINY = [
    *TINY,
    "recipe.name=dinov2",
    "model.layerscale_init=1e-5",
    "model.drop_path_uniform=true",
    "optim.layerwise_decay=0.9",
    "optim.patch_embed_lr_mult=0.2",
]


# ---------------------------------------------------------------- config


def test_recipe_shorthand_and_packaged_configs_load():
    cfg = load_config({"recipe": "dinov2"})
    assert cfg.recipe.name == "dinov2" and cfg.recipe.ibot.mask_ratio_min_max == (0.1, 0.5)
    assert {"dinov2_vits14", "dinov2_vitl14", "dinov2_vitg14"} <= set(recipe_names())
    g = load_config("dinov2_vitg14", ["data.batch_size=4"])
    assert (g.model.backbone, g.model.patch_size, g.model.ffn_layer) == (
        "vit_giant2",
        14,
        "swiglufused",
    )
    assert g.recipe.centering == "sinkhorn_knopp" and g.recipe.ibot.separate_head
    assert g.data.batch_size == 4 and g.augmentation.local_crop_size == 98


def test_recipe_errors_name_the_key():
    with pytest.raises(ConfigError, match="recipe.name"):
        load_config({"recipe": "ibot"})
    with pytest.raises(ConfigError, match="needs a ViT backbone"):
        load_config({"recipe": "dinov2", "model": {"backbone": "resnet18"}})
    with pytest.raises(ConfigError, match="recipe.ibot.mask_sample_probability"):
        load_config({"recipe": {"name": "dinov2", "ibot": {"mask_sample_probability": 0}}})


def test_sqrt_scaling_rule():
    cfg = load_config(
        None,
        [
            "optim.scaling_rule=sqrt_wrt_1024",
            "optim.lr=0.004",
            "data.batch_size=64",
            "optim.accumulation_steps=2",
        ],
    )
    assert effective_lr(cfg, world_size=4) == pytest.approx(0.004 * math.sqrt(512 / 1024))
    linear = load_config(None, ["optim.lr=0.0005", "data.batch_size=64"])
    assert effective_lr(linear, world_size=8) == pytest.approx(0.0005 * 512 / 256)


# ------------------------------------------------------ groups, schedules


def _expected_multipliers(name: str, n: int, decay: float, patch: float) -> tuple:
    """DINOv2's rule, written out: embeddings layer 0, block i layer i + 1,
    the rest n + 1; lr decay ** (n + 1 - layer); the patch embedding times
    ``patch``; no weight decay on biases, norms and gammas."""
    layer = n + 1
    if name.startswith("backbone."):
        short = name.split(".")[1]
        if short in ("pos_embed", "patch_embed", "mask_token", "cls_token"):
            layer = 0
        elif short == "blocks":
            layer = int(name.split(".")[2]) + 1
    lr = decay ** (n + 1 - layer) * (patch if "patch_embed" in name else 1.0)
    wd = 0.0 if name.endswith(".bias") or "norm" in name or "gamma" in name else 1.0
    return lr, wd, "last_layer" in name


def test_dinov2_param_groups_follow_the_rule():
    cfg = load_config(None, DINOV2_TINY)
    student, _ = build_models(cfg)
    groups = dinov2_param_groups(student, 0.9, 0.2)
    n = len(student.backbone.blocks)
    owner = {id(p): g for g in groups for p in g["params"]}
    names = {n: p for n, p in student.named_parameters() if p.requires_grad}
    assert len(owner) == len(names)
    for name, p in names.items():
        g = owner[id(p)]
        lr, wd, last = _expected_multipliers(name, n, 0.9, 0.2)
        assert g["lr_multiplier"] == pytest.approx(lr), name
        assert (g["wd_multiplier"], g["is_last_layer"]) == (wd, last), name
    assert layer_id("backbone.blocks.3.attn.qkv.weight", n) == 4
    assert layer_id("head.mlp.0.weight", n) == n + 1


def test_dinov2_schedules_and_the_frozen_last_layer():
    s = Schedules.dinov2(
        base_lr=1e-3,
        min_lr=1e-6,
        weight_decay=0.04,
        weight_decay_end=0.4,
        momentum_teacher=0.992,
        warmup_teacher_temp=0.04,
        teacher_temp=0.07,
        warmup_teacher_temp_epochs=2,
        freeze_last_layer_epochs=1,
        epochs=4,
        warmup_epochs=1,
        niter_per_epoch=5,
    )
    assert len(s.teacher_temp) == 20 and s.teacher_temp[0] == pytest.approx(0.04)
    assert s.teacher_temp[9] == pytest.approx(0.07) and (s.teacher_temp[10:] == 0.07).all()
    assert (s.last_layer_lr[:5] == 0).all() and (s.last_layer_lr[5:] == s.lr[5:]).all()
    cfg = load_config(None, DINOV2_TINY)
    student, teacher = build_models(cfg)
    opt = build_optimizer(cfg, student, torch.device("cpu"))
    trainer = build_trainer(cfg, DINOModel(student, teacher), build_loss(cfg), opt, "cpu")
    sched = build_schedules(cfg, 5)
    trainer.set_schedules(sched, 2)
    for g in opt.param_groups:
        expected = 0.0 if g["is_last_layer"] else sched.lr[2] * g["lr_multiplier"]
        assert g["lr"] == pytest.approx(expected)
        assert g["weight_decay"] == pytest.approx(sched.weight_decay[2] * g["wd_multiplier"])
    assert trainer.terms.teacher_temp == pytest.approx(sched.teacher_temp[2])


# ------------------------------------------------------------- the loss


def _koleo(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    x = F.normalize(x, dim=-1, eps=eps)
    dots = x @ x.T
    dots.fill_diagonal_(-1)
    nearest = dots.argmax(dim=1)
    return -torch.log(torch.linalg.vector_norm(x - x[nearest], dim=-1) + eps).mean()


def _reference_total(st: StudentOutputs, t_cls, t_patch, masks, n_local, temp, w):
    """DINOv2's step loss from head outputs, centering mode, zero centers."""
    b = t_cls.shape[0] // 2
    targets = F.softmax(torch.cat((t_cls[b:], t_cls[:b])) / temp, dim=-1).view(2, b, -1)
    patch_targets = F.softmax(t_patch / temp, dim=-1)
    n_terms = 2 * (1 + n_local)
    local = sum(
        -(t * F.log_softmax(s / 0.1, dim=-1)).sum(-1).mean()
        for s in st.local_logits.chunk(n_local)
        for t in targets
    )
    glob = -(targets.flatten(0, 1) * F.log_softmax(st.global_logits / 0.1, -1)).sum(-1).mean()
    counts = masks.sum(-1)
    weight = (1.0 / counts.clamp(min=1)).repeat_interleave(counts)
    ibot = (-(patch_targets * F.log_softmax(st.patch_logits / 0.1, -1)).sum(-1) * weight).sum()
    ibot = ibot / masks.shape[0]
    koleo = sum(_koleo(c) for c in st.global_cls.chunk(2))
    return w[0] * (local + 2 * glob) / n_terms + w[1] * ibot + w[2] * koleo


def test_composed_loss_equals_dinov2_step_in_float64():
    torch.manual_seed(0)
    b, k, n_local, dim, tokens = 4, 32, 3, 8, 16
    masks = torch.rand(2 * b, 4, tokens // 4) < 0.3
    masks[0] = False  # an unmasked crop
    m = int(masks.sum())
    loss = DINOv2Loss(k, k, n_local, weights=(1.0, 0.7, 0.1)).double()
    t_cls, t_patch = torch.randn(2 * b, k, dtype=torch.float64), torch.randn(m, k).double()
    shapes = ((n_local * b, k), (2 * b, k), (m, k), (2 * b, dim))
    st = StudentOutputs(*(torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes))
    targets = loss.teacher_targets(t_cls, t_patch, 0.05, torch.tensor([m]))
    total, parts = loss(st, targets, mask_targets(masks))
    expected = _reference_total(st, t_cls, t_patch, masks.flatten(1), n_local, 0.05, (1, 0.7, 0.1))
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=1e-8)
    got = torch.autograd.grad(total, list(st))
    want = torch.autograd.grad(expected, list(st))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-9)
    assert set(parts) == {"dino_local", "dino_global", "koleo", "ibot"}


# ------------------------------------------------------------ the step


def _batch(cfg, b=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    gs, ls = cfg.augmentation.global_crop_size, cfg.augmentation.local_crop_size
    crops = [torch.randn(b, 3, gs, gs, generator=g) for _ in range(2)]
    crops += [
        torch.randn(b, 3, ls, ls, generator=g) for _ in range(cfg.augmentation.num_local_views)
    ]
    side = gs // cfg.model.patch_size
    masks = torch.rand(2 * b, side, side, generator=g) < 0.4
    return crops, masks


@pytest.mark.parametrize(
    "extra", [[], ["recipe.centering=sinkhorn_knopp", "recipe.ibot.separate_head=true"]]
)
def test_a_step_trains_the_student_and_the_mask_token(extra):
    torch.manual_seed(0)
    cfg = load_config(None, [*DINOV2_TINY, *extra])
    student, teacher = build_models(cfg)
    model = DINOModel(student, teacher, 0.9)
    opt = build_optimizer(cfg, student, torch.device("cpu"))
    trainer = build_trainer(cfg, model, build_loss(cfg), opt, "cpu")
    assert isinstance(trainer, DINOv2Trainer)
    trainer.set_schedules(build_schedules(cfg, 5), 7)
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    crops, masks = _batch(cfg)
    loss, metrics = trainer.train_step_optimized(crops, 1, masks=masks)
    assert torch.isfinite(loss) and {"dino_global", "ibot", "koleo"} <= set(metrics)
    assert student.backbone.mask_token.grad is not None
    assert student.backbone.mask_token.grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())
    assert trainer.optimize_step()
    moved = [n for n, p in teacher.named_parameters() if not torch.equal(p, before[n])]
    assert moved, "the EMA did not move the teacher"
    with pytest.raises(ValueError, match="masks"):
        trainer.train_step_optimized(crops, 1)


# ------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


def _cmd(out: Path, root: Path, *extra: str) -> list[str]:
    return train_args(out, root, *DINOV2_TINY, *RESUMABLE, *extra)


def test_train_logs_each_loss_and_resumes_bit_for_bit(train_root, tmp_path):
    ref = tmp_path / "ref"
    run_cli_ok(_cmd(ref, train_root))
    rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert {"loss_dino_global", "loss_dino_local", "loss_ibot", "loss_koleo"} <= set(rows[-1])
    out = tmp_path / "run"
    run_killed_and_resumed(out, _cmd(out, train_root))
    a, b = final_state(out), final_state(ref)
    assert_same_states(a, b)


def test_the_dinov2_demo_is_the_dino_demo_with_the_recipe():
    dino, dinov2 = load_config(DEMO_PRESETS["dino"]), load_config(DEMO_PRESETS["dinov2"])
    assert dinov2.recipe.name == "dinov2" and dinov2.model.img_size == 224
    assert dinov2.recipe.centering == "sinkhorn_knopp"
    a, b = dino.to_flat_dict(), dinov2.to_flat_dict()
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {"recipe.name", "recipe.centering", "model.img_size"}
