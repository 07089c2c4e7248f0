"""The DINOv3 recipe as a whole: its configuration (the recipe.gram_* keys
and their errors), the Gram term of a step against the float64 reference of
the published formula, the Gram teacher's schedule (loaded from the EMA
teacher, refreshed, at most max_updates times) and its file, the demo, and
`dino-opt train` end to end (the gram loss logged, resume bit for bit)."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from dino_opt.cli import main
from dino_opt.config import ConfigError, GramConfig, load_config, recipe_names
from dino_opt.data import mask_targets
from dino_opt.ops import warmup_cosine_constant
from dino_opt.train import (
    DEMO_PRESETS,
    DINOModel,
    DINOv2Loss,
    DINOv3Loss,
    DINOv3Trainer,
    GramTeacher,
    PatchStudentOutputs,
    attach_frozen_copies,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    build_trainer,
    refresh_due,
)
from dino_opt.train.recipes import recipe_of
from dino_opt.train.recipes.dinov3 import gram_weight_schedule
from dino_opt.weights import weights_reader
from reference import gram_loss_reference
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

DINOV3_TINY = [
    *TINY,
    "recipe.name=dinov3",
    "recipe.centering=sinkhorn_knopp",
    "recipe.ibot.separate_head=true",
    "recipe.ibot.out_dim=64",
    "model.drop_path_rate=0",
]


# ---------------------------------------------------------------- config


def test_gram_keys_parse_with_their_defaults():
    gram = {"ckpt": "teacher.pt", "it_load_ema_teacher": -1, "max_updates": 3}
    cfg = load_config({"recipe": {"name": "dinov3", "gram": gram}})
    g = cfg.recipe.gram
    assert (g.ckpt, g.it_load_ema_teacher, g.max_updates) == ("teacher.pt", -1, 3)
    assert (g.loss_weight, g.update_frequency, g.tokens_used) == (1.0, 50000, "all")
    assert g.teacher_crop_size is None and g.img_level and g.normalized
    # another recipe does not read them
    load_config(None, ["recipe.name=dinov2", "recipe.gram.it_load_ema_teacher=-1"])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["recipe.gram.it_load_ema_teacher=-1"], "needs weights for its Gram teacher"),
        (
            ["recipe.gram.remove_neg=true", "recipe.gram.remove_only_teacher_neg=true"],
            "exclude each other",
        ),
        (["recipe.gram.tokens_used=masked"], "needs recipe.gram.img_level=false"),
        (["recipe.gram.teacher_crop_size=30"], "multiple of model.patch_size"),
        (["recipe.gram.update_frequency=0"], "recipe.gram.update_frequency"),
        (
            [
                "recipe.gram.loss_weight_warmup_epochs=2",
                "recipe.gram.loss_weight_cosine_epochs=1",
                "schedule.epochs=2",
                "schedule.warmup_epochs=0",
            ],
            "must be <= schedule.epochs",
        ),
        (["recipe.gram.loss_weight_end=-1"], "recipe.gram.loss_weight_end"),
        (["recipe.gram.tokens_used=some"], "recipe.gram.tokens_used"),
        (["model.backbone=resnet18", "model.patch_size=16"], "needs a ViT backbone"),
    ],
)
def test_gram_key_errors_in_one_line(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*DINOV3_TINY, *overrides])
    assert len(e.value.errors) == 1 and needle in str(e.value) and "\n" not in str(e.value)


def test_the_packaged_dinov3_configs_are_dinov3s_recipes():
    assert {
        "dinov3_vitl16",
        "dinov3_vitl16_pretrain",
        "dinov3_vitl16_gram_anchor",
        "dinov3_vitl16_high_res_adapt",
    } <= set(recipe_names())
    im1k = load_config("dinov3_vitl16")
    r, o, s = im1k.recipe, im1k.optim, im1k.schedule
    assert (im1k.model.backbone, r.name, r.centering, r.gram.use_loss) == (
        "vit_large_dinov3",
        "dinov3",
        "sinkhorn_knopp",
        False,
    )
    assert (o.lr, o.layerwise_decay, o.scaling_rule, s.epochs, s.momentum_teacher) == (
        1e-3,
        0.9,
        "sqrt_wrt_1024",
        100,
        0.992,
    )
    pretrain = load_config("dinov3_vitl16_pretrain")
    assert pretrain.augmentation.global_crop_size == 256 and not pretrain.recipe.gram.use_loss
    assert pretrain.optim.min_lr == pretrain.optim.lr  # constant after the warm-up
    with pytest.raises(ConfigError, match="needs weights for its Gram teacher"):
        load_config("dinov3_vitl16_gram_anchor")  # the pretrained run must be named
    gram = load_config("dinov3_vitl16_gram_anchor", ["recipe.gram.ckpt=pretrain.pt"]).recipe.gram
    assert (gram.update_frequency, gram.max_updates, gram.img_level) == (10000, 3, True)
    weights = gram_weight_schedule(
        load_config("dinov3_vitl16_gram_anchor", ["recipe.gram.ckpt=pretrain.pt"]), 1000
    )
    assert weights[0] == 0 and weights[999] == 2.0 and np.all(weights[999:] == 2.0)
    assert np.all(np.diff(weights[:1000]) >= 0)
    hires = load_config("dinov3_vitl16_high_res_adapt", ["recipe.gram.ckpt=gram.pt"])
    assert hires.augmentation.crop_size_pairs == [
        (512, 112),
        (768, 112),
        (768, 160),
        (768, 224),
        (768, 336),
    ]
    assert hires.augmentation.crop_size_ratios == (0.3, 0.3, 0.3, 0.05, 0.05)
    assert hires.recipe.gram.teacher_crop_size == (768, 1152, 1152, 1152, 1152)
    assert not hires.recipe.gram.rep_update and hires.recipe.gram.loss_weight == 1.5


# ------------------------------------------------------------ the Gram term


def _outputs(gen, b=3, n=16, d=8, k=32):
    """Random float64 student outputs and teacher targets of a DINOv2 step,
    and the mask information of random masks."""
    masks = torch.rand(2 * b, 4, 4, generator=gen) < 0.4
    info = mask_targets(masks)
    m = len(info["mask_indices_list"])
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    student = PatchStudentOutputs(r(2 * b, k), r(2 * b, k), r(m, k), r(2 * b, d), r(2 * b, n, d))
    return student, info, r(2 * b, n, d)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(img_level=False),
        dict(remove_neg=True),
        dict(normalized=False),
        dict(remove_only_teacher_neg=True, img_level=False, tokens_used="masked"),
        dict(img_level=False, tokens_used="unmasked"),
    ],
    ids=["image", "batch", "remove_neg", "raw", "teacher_neg-masked", "unmasked"],
)
def test_the_step_adds_the_weighted_gram_loss_to_dinov2s(options):
    gen = torch.Generator().manual_seed(0)
    student, info, gram_teacher = _outputs(gen)
    kw = dict(student_temp=0.1, centering="sinkhorn_knopp")
    dinov2 = DINOv2Loss(32, 32, 2, **kw).double()
    dinov3 = DINOv3Loss(32, 32, 2, gram=GramConfig(loss_weight=0.7, **options), **kw).double()
    cls, patch = (
        torch.randn(6, 32, generator=gen),
        torch.randn(len(info["mask_indices_list"]), 32, generator=gen),
    )
    targets = dinov2.teacher_targets(cls, patch, 0.04, info["n_masked_patches"])
    base, base_parts = dinov2(student, targets, info)
    total, parts = dinov3(student, targets._replace(gram=gram_teacher), info)
    keep = {
        "all": slice(None),
        "masked": info["collated_masks"],
        "unmasked": ~info["collated_masks"],
    }[options.get("tokens_used", "all")]
    ref = gram_loss_reference(
        student.global_patches[keep],
        gram_teacher[keep],
        options.get("img_level", True),
        options.get("normalized", True),
        options.get("remove_neg", False),
        options.get("remove_only_teacher_neg", False),
    )
    torch.testing.assert_close(parts["gram"], ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(total, base + 0.7 * ref, rtol=1e-10, atol=1e-12)
    assert set(parts) == set(base_parts) | {"gram"}
    # no Gram teacher features yet: DINOv2's loss, no gram part
    total, parts = dinov3(student, targets, info)
    assert torch.equal(total, base) and "gram" not in parts


def _trainer(extra=(), seed=0):
    torch.manual_seed(seed)
    cfg = load_config(None, [*DINOV3_TINY, "hardware.precision=fp32", *extra])
    student, teacher = build_models(cfg)
    model = DINOModel(student, teacher, 0.9)
    opt = build_optimizer(cfg, student, torch.device("cpu"))
    loss = build_loss(cfg)
    attach_frozen_copies(cfg, loss, teacher, weights_reader())  # as the job makes them
    trainer = build_trainer(cfg, model, loss, opt, "cpu")
    trainer.set_schedules(build_schedules(cfg, 5), 3)
    return cfg, trainer


def _batch(cfg, b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    gs, ls = cfg.augmentation.global_crop_size, cfg.augmentation.local_crop_size
    crops = [torch.randn(b, 3, gs, gs, generator=g) for _ in range(2)]
    crops += [torch.randn(b, 3, ls, ls, generator=g) for _ in range(2)]
    side = gs // cfg.model.patch_size
    return crops, torch.rand(2 * b, side, side, generator=g) < 0.4


def test_the_trainers_gram_term_is_the_gram_loss_of_the_students_patch_tokens():
    cfg, trainer = _trainer()
    assert isinstance(trainer, DINOv3Trainer)
    crops, masks = _batch(cfg)
    _, metrics = trainer.train_step_optimized(crops, 0, masks=masks)  # iteration 0: loaded
    info = mask_targets(masks)
    with torch.no_grad():
        student = trainer.model.student(
            crops, masks=info["collated_masks"], mask_indices=info["mask_indices_list"]
        )
        teacher = trainer.model.teacher.backbone.forward_features(torch.cat(crops[:2]))
    ref = gram_loss_reference(
        student.global_patches.double(), teacher["x_norm_patchtokens"].double()
    )
    torch.testing.assert_close(metrics["gram"].double(), ref, rtol=1e-5, atol=1e-7)
    grads = [p.grad for p in trainer.model.student.backbone.parameters() if p.grad is not None]
    assert grads and all(p.grad is None for p in trainer.gram_teacher.parameters())


def test_the_gram_teacher_on_larger_crops_is_resized_to_the_students_grid():
    cfg, trainer = _trainer(["recipe.gram.teacher_crop_size=64"])
    crops, _ = _batch(cfg)
    tokens = trainer.gram_teacher.patch_tokens(crops[:2])
    side = cfg.augmentation.global_crop_size // cfg.model.patch_size
    assert tokens.shape == (8, side * side, 192) and torch.isfinite(tokens).all()
    same = _trainer()[1].gram_teacher.patch_tokens(crops[:2])
    assert not torch.allclose(tokens, same)


# ------------------------------------------------------------ the schedule


def test_refresh_rule_and_the_gram_teachers_schedule():
    options = GramConfig(
        it_load_ema_teacher=3, update_frequency=4, it_first_update=6, max_updates=2
    )
    gram, teacher = GramTeacher(options), torch.nn.Linear(2, 2)
    gram.attach(teacher)
    loads, refreshes = [], []
    for it in range(20):
        teacher.weight.data.fill_(it)
        if gram.before_step(it, teacher):
            loads.append(it)
        teacher.weight.data.fill_(it + 0.5)  # the optimizer step's EMA
        if gram.after_step(it, teacher):
            refreshes.append(it)
            assert torch.equal(gram.backbone.weight, teacher.weight)
    # loaded at the start of iteration 3; refreshed when (it + 1) >= 6 and
    # (it + 1) % 4 == 0, twice at most: after iterations 7 and 11
    assert loads == [3] and refreshes == [7, 11] and gram.updates == 2
    assert torch.all(gram.backbone.weight == 11.5)
    assert not refresh_due(dataclasses.replace(options, rep_update=False), 7, 0)
    assert refresh_due(dataclasses.replace(options, max_updates=None), 19, 9)


def test_the_trainer_follows_the_schedule_over_optimizer_steps():
    schedule = [
        "recipe.gram.it_load_ema_teacher=1",
        "recipe.gram.update_frequency=2",
        "recipe.gram.it_first_update=2",
        "recipe.gram.max_updates=1",
    ]
    cfg, trainer = _trainer(schedule)
    teacher, gram = trainer.model.teacher.backbone, trainer.gram_teacher
    seen, snapshot = [], None
    for it in range(5):
        crops, masks = _batch(cfg, seed=it)
        _, metrics = trainer.train_step_optimized(crops, 0, masks=masks)
        seen.append("gram" in metrics)
        assert trainer.optimize_step()
        if it == 1:  # refreshed after iteration 1 ((1 + 1) % 2 == 0), then never (max 1)
            snapshot = {k: v.clone() for k, v in teacher.state_dict().items()}
    assert seen == [False, True, True, True, True] and gram.updates == 1 and gram.loaded
    for k, v in gram.backbone.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
    assert any(not torch.equal(v, teacher.state_dict()[k]) for k, v in snapshot.items())
    state = trainer.loss_fn.state_dict()
    assert state["gram_teacher._extra_state"] == {"loaded": True, "updates": 1}
    restored = _trainer(["recipe.gram.it_load_ema_teacher=1"], seed=1)[1]
    restored.loss_fn.load_state_dict(state)
    assert (restored.gram_teacher.loaded, restored.gram_teacher.updates) == (True, 1)
    for k, v in restored.gram_teacher.backbone.state_dict().items():
        assert torch.equal(v, snapshot[k]), k


def _weight_reference(start, peak, end, warmup, total, cosine):
    """DINOv3's Gram weight schedule, one iteration at a time: linear from
    start (peak not reached), a half cosine from peak to end whose last value
    is end, then end."""
    out = []
    for i in range(total):
        if i < warmup:
            out.append(start + (peak - start) * i / warmup)
        elif i < warmup + cosine:
            t = (i - warmup) / (cosine - 1) if cosine > 1 else 0.0
            out.append(end + (peak - end) * (1 + math.cos(math.pi * t)) / 2)
        else:
            out.append(end)
    return out


@pytest.mark.parametrize(
    "start, peak, end, warmup, total, cosine",
    [
        (0.0, 2.0, 0.5, 7, 40, 20),
        (1.0, 1.0, 1.0, 0, 9, 9),
        (0.3, 2.0, 0.0, 5, 12, 7),
        (0.0, 0.0, 2.0, 0, 25, 1),
        (2.0, 1.0, 3.0, 10, 10, 0),
    ],
)
def test_the_gram_weight_schedule_matches_the_formula(start, peak, end, warmup, total, cosine):
    got = warmup_cosine_constant(start, peak, end, warmup, total, cosine)
    ref = _weight_reference(start, peak, end, warmup, total, cosine)
    assert got.dtype == np.float64 and np.allclose(got, ref, rtol=0, atol=1e-12)
    rest = warmup_cosine_constant(start, peak, end, warmup, total)  # cosine over the rest
    assert np.allclose(rest, _weight_reference(start, peak, end, warmup, total, total - warmup))
    with pytest.raises(ValueError, match="fit in the"):
        warmup_cosine_constant(start, peak, end, warmup, total, total - warmup + 1)


def test_the_trainer_takes_the_gram_weight_of_each_iteration():
    keys = [
        "recipe.gram.loss_weight=2",
        "recipe.gram.loss_weight_start=0",
        "recipe.gram.loss_weight_end=0.5",
        "recipe.gram.loss_weight_warmup_epochs=1",
        "schedule.epochs=3",
        "schedule.warmup_epochs=1",
    ]
    cfg, trainer = _trainer(keys)
    schedules = build_schedules(cfg, 4)
    weights = schedules.gram_weight
    assert np.allclose(weights, _weight_reference(0.0, 2.0, 0.5, 4, 12, 8))
    for it in (0, 2, 5, 11):
        trainer.set_schedules(schedules, it)
        assert trainer.loss_fn.gram_weight == weights[it]
    constant = build_schedules(load_config(None, DINOV3_TINY), 4).gram_weight
    assert np.all(constant == 1.0)  # the defaults: recipe.gram.loss_weight throughout
    assert build_schedules(load_config(None, TINY), 4).gram_weight is None  # no Gram term


def test_without_gram_anchoring_the_step_is_dinov2s():
    off = ["recipe.gram.use_loss=false", "recipe.gram.it_load_ema_teacher=-1"]
    cfg, trainer = _trainer(off)  # no weights are needed: no Gram teacher at all
    assert trainer.gram_teacher.backbone is None
    assert recipe_of(cfg).frozen_backbone_copies(cfg) == 0
    v2 = _trainer(["recipe.name=dinov2"])[1]
    for it in range(2):
        crops, masks = _batch(cfg, seed=it)
        loss, metrics = trainer.train_step_optimized(crops, 0, masks=masks)
        ref, _ = v2.train_step_optimized(crops, 0, masks=masks)
        assert "gram" not in metrics and torch.equal(loss, ref)
        assert trainer.optimize_step() and v2.optimize_step()
    assert not trainer.gram_teacher.loaded


def test_the_gram_teacher_from_a_file_and_a_file_that_does_not_fit(tmp_path):
    cfg, trainer = _trainer()
    backbone = trainer.model.teacher.backbone
    weights = {f"backbone.{k}": v + 1 for k, v in backbone.state_dict().items()}
    good = tmp_path / "good.pt"
    torch.save({"teacher": weights, "step": 3}, good)
    _, loaded = _trainer([f"recipe.gram.ckpt={good}", "recipe.gram.it_load_ema_teacher=-1"])
    assert loaded.gram_teacher.loaded
    for k, v in loaded.gram_teacher.backbone.state_dict().items():
        assert torch.equal(v, weights[f"backbone.{k}"]), k
    bad = tmp_path / "bad.pt"
    torch.save({k: v[..., :1] for k, v in backbone.state_dict().items()}, bad)
    with pytest.raises(ValueError, match="bad.pt' does not fit the Gram teacher") as e:
        _trainer([f"recipe.gram.ckpt={bad}"])
    assert "\n" not in str(e.value)


def test_the_dinov3_demo_is_the_dinov2_demo_with_a_gram_teacher():
    dinov2, dinov3 = load_config(DEMO_PRESETS["dinov2"]), load_config(DEMO_PRESETS["dinov3"])
    a, b = dinov2.to_flat_dict(), dinov3.to_flat_dict()
    changed = {k for k in a if a[k] != b[k]}
    assert changed == {
        "recipe.name",
        "recipe.ibot.separate_head",
        "recipe.ibot.out_dim",
        "recipe.gram.it_load_ema_teacher",
        "recipe.gram.update_frequency",
        "recipe.gram.it_first_update",
        "recipe.gram.max_updates",
    }
    assert b["recipe.ibot.out_dim"] == b["model.out_dim"]


# ------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


# 10 optimizer steps: the Gram teacher loaded at the start of iteration 2,
# refreshed after iterations 3 and 5 (then max_updates)
GRAM_SCHEDULE = [
    "recipe.gram.it_load_ema_teacher=2",
    "recipe.gram.update_frequency=2",
    "recipe.gram.it_first_update=4",
    "recipe.gram.max_updates=2",
]


def _cmd(out: Path, root: Path, *extra: str) -> list[str]:
    return train_args(out, root, *DINOV3_TINY, *GRAM_SCHEDULE, *RESUMABLE, *extra)


def test_train_logs_the_gram_loss_and_resumes_bit_for_bit(train_root, tmp_path):
    ref = tmp_path / "ref"
    run_cli_ok(_cmd(ref, train_root))
    rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss_gram" in r] == list(range(3, 11))
    assert all(r["loss_gram"] >= 0 for r in rows if "loss_gram" in r)
    out = tmp_path / "run"
    run_killed_and_resumed(out, _cmd(out, train_root))
    a, b = final_state(out), final_state(ref)
    assert b["loss"]["gram_teacher._extra_state"] == {"loaded": True, "updates": 2}
    assert any(k.startswith("gram_teacher.backbone.") for k in b["loss"])
    assert_same_states(a, b)


def test_a_gram_checkpoint_that_is_missing_is_one_line(train_root, tmp_path, capsys):
    missing = tmp_path / "missing.pt"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                "--output-dir",
                str(tmp_path / "out"),
                "--quiet",
                f"data.root={train_root}",
                *DINOV3_TINY,
                f"recipe.gram.ckpt={missing}",
            ]
        )
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if "error" in x]
    assert e.value.code == 2 and len(lines) == 1 and str(missing) in lines[0], err
