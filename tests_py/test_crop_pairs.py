"""High-resolution adaptation: crop-size pairs drawn per batch (DINOv3's
``global_local_crop_pairs_ratios``). The config keys and their one-line
errors, the native loader's batches at their drawn pair (shapes, masks, the
frequencies of the pairs, the same pairs on every rank, for a seed and after
a resume), and `dino-opt train` of the dinov3 recipe with two pairs end to
end (both shapes trained, resume bit for bit)."""

import json
import math
from pathlib import Path

import pytest
import torch
from dino_opt.cli import main
from dino_opt.config import ConfigError, GramConfig, load_config
from dino_opt.data import MultiCropDataset, MultiCropLoader, builtin_dataset
from dino_opt.train import GramTeacher, build_models
from dino_opt.tune.memory.model import estimate_memory
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

PAIRS = ["augmentation.global_crop_size=[32,48]", "augmentation.local_crop_size=[16,24]"]


# ---------------------------------------------------------------- config


def test_one_size_is_one_pair_and_lists_parse_and_round_trip(tmp_path):
    cfg = load_config(None, [])
    assert (cfg.augmentation.global_crop_size, cfg.augmentation.local_crop_size) == (224, 96)
    assert cfg.augmentation.crop_size_pairs == [(224, 96)]
    assert cfg.augmentation.crop_size_ratios is None
    # a list of one size is that size
    one = load_config(None, ["augmentation.global_crop_size=[256]"])
    assert one.augmentation.global_crop_size == 256
    cfg = load_config(
        None,
        [
            "augmentation.global_crop_size=[512,768,768]",
            "augmentation.local_crop_size=[112,112,224]",
            "augmentation.crop_size_ratios=[0.3,0.6,0.1]",
        ],
    )
    a = cfg.augmentation
    assert a.crop_size_pairs == [(512, 112), (768, 112), (768, 224)]
    assert a.crop_size_ratios == (0.3, 0.6, 0.1) and a.largest_crop_sizes == (768, 224)
    # an int beside a list stands for every pair
    both = load_config(None, ["augmentation.global_crop_size=[512,768]"])
    assert both.augmentation.crop_size_pairs == [(512, 96), (768, 96)]
    path = tmp_path / "c.yaml"
    from dino_opt.config import save_config

    save_config(cfg, path)
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (
            ["augmentation.global_crop_size=[32,48]", "augmentation.local_crop_size=[16,24,32]"],
            "augmentation.global_crop_size has 2 sizes but augmentation.local_crop_size has 3",
        ),
        (
            [*PAIRS, "augmentation.crop_size_ratios=[0.5,0.4]"],
            "augmentation.crop_size_ratios must sum to 1, got 0.9",
        ),
        (
            [*PAIRS, "augmentation.crop_size_ratios=[1.0]"],
            "augmentation.crop_size_ratios has 1 ratios for 2 crop-size pair(s)",
        ),
        (
            [*PAIRS, "augmentation.crop_size_ratios=[1.5,-0.5]"],
            "every entry of augmentation.crop_size_ratios must be in [0, 1]",
        ),
        (
            ["augmentation.global_crop_size=[32,44]", "augmentation.local_crop_size=[16,24]"],
            "augmentation.global_crop_size [32, 44]: 44 must be a multiple of model.patch_size (8)",
        ),
        (
            ["augmentation.global_crop_size=[32,0]"],
            "every entry of augmentation.global_crop_size must be >= 1",
        ),
        (
            ["augmentation.local_crop_size=[16,true]"],
            "augmentation.local_crop_size must be an int or a non-empty list of ints",
        ),
        (
            [*PAIRS, "recipe.name=dinov3", "recipe.gram.teacher_crop_size=[48,64,96]"],
            "recipe.gram.teacher_crop_size has 3 sizes for 2 crop-size pair(s)",
        ),
        (
            [
                "augmentation.global_crop_size=[48,48]",
                "augmentation.local_crop_size=[16,24]",
                "recipe.name=dinov3",
                "recipe.gram.teacher_crop_size=[64,96]",
            ],
            "gives the global crop size 48 two sides (64 and 96)",
        ),
    ],
)
def test_bad_crop_pairs_are_one_line_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*TINY, *overrides])
    assert len(e.value.errors) == 1 and "\n" not in str(e.value), str(e.value)
    assert needle in str(e.value)


def test_train_with_bad_ratios_says_so_in_one_line(tmp_path, capsys):
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                "--output-dir",
                str(tmp_path / "out"),
                "--quiet",
                *TINY,
                *PAIRS,
                "augmentation.crop_size_ratios=[0.7,0.7]",
            ]
        )
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if "error" in x]
    assert e.value.code == 2 and len(lines) == 1 and "crop_size_ratios" in lines[0], err


def test_the_gram_teacher_resizes_each_pair_to_its_side():
    cfg = load_config(
        None, [*TINY, *PAIRS, "recipe.name=dinov3", "recipe.gram.teacher_crop_size=[48,64]"]
    )
    gram = GramTeacher(GramConfig(teacher_crop_size=(48, 64)), cfg.augmentation.crop_size_pairs)
    assert gram.teacher_crop_size == {32: 48, 48: 64}
    assert cfg.recipe.gram.teacher_sides(cfg.augmentation.crop_size_pairs) == {32: 48, 48: 64}
    _, teacher = build_models(cfg)
    gram.attach(teacher.backbone)
    seen = []
    forward = gram.backbone.forward_features
    gram.backbone.forward_features = lambda x, **kw: seen.append(x.shape[-1]) or forward(x, **kw)
    for side in (32, 48):
        crops = [torch.randn(2, 3, side, side) for _ in range(2)]
        tokens = gram.patch_tokens(crops)
        assert tokens.shape[:2] == (4, (side // 8) ** 2)  # on the student's grid
    assert seen == [48, 64]


def test_the_memory_model_plans_for_the_largest_pair():
    base = [
        "model.backbone=vit_small",
        "model.img_size=224",
        "recipe.name=dinov3",
        "data.batch_size=8",
    ]
    pairs = load_config(
        None,
        [
            *base,
            "augmentation.global_crop_size=[224,512,384]",
            "augmentation.local_crop_size=[96,64,160]",
        ],
    )
    largest = load_config(
        None, [*base, "augmentation.global_crop_size=512", "augmentation.local_crop_size=160"]
    )
    first = load_config(None, [*base, "augmentation.global_crop_size=224"])
    est = [estimate_memory(c) for c in (pairs, largest, first)]
    assert est[0] == est[1] and est[0].peak > est[2].peak


# ---------------------------------------------------------------- loader


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """40 images of 40 px (4 per class)."""
    return (
        builtin_dataset(
            tmp_path_factory.mktemp("builtin") / "data",
            train_per_class=4,
            val_per_class=1,
            test_per_class=0,
            image_size=40,
        )
        / "train"
    )


def _loader(images, **kw) -> MultiCropLoader:
    args = dict(
        batch_size=4,
        global_size=[32, 48],
        local_size=[16, 24],
        n_local=2,
        num_threads=2,
        seed=3,
        crop_size_ratios=[0.5, 0.5],
    )
    return MultiCropLoader(images, **{**args, **kw})


@pytest.mark.parametrize("photometric", ["cpu", "gpu"])
def test_every_crop_of_a_batch_is_at_its_drawn_pair(images, photometric):
    device = {"device": "cpu"} if photometric == "gpu" else {}
    seen = set()
    with _loader(images, masks={"patch_size": 8}, photometric=photometric, **device) as loader:
        assert loader.crop_size_pairs == [(32, 16), (48, 24)]
        for epoch in range(2):
            loader.set_epoch(epoch)
            for k, batch in enumerate(loader):
                g, loc = loader.crop_sizes(k)
                seen.add((g, loc))
                assert [tuple(c.shape) for c in batch.crops] == [(4, 3, g, g)] * 2 + [
                    (4, 3, loc, loc)
                ] * 2
                assert tuple(batch.masks.shape) == (8, g // 8, g // 8)
                assert all(torch.isfinite(c).all() for c in batch.crops)
    assert seen == {(32, 16), (48, 24)}


def test_the_pairs_follow_the_ratios(images):
    ratios = [0.3, 0.3, 0.3, 0.05, 0.05]  # DINOv3's high-resolution adaptation
    sizes = dict(global_size=[32, 48, 48, 48, 48], local_size=[16, 16, 24, 32, 40])
    with _loader(images, crop_size_ratios=ratios, seed=0, **sizes) as loader:
        batches = len(loader)  # 10 a epoch
        draws = [loader.crop_sizes(k, epoch) for epoch in range(5000) for k in range(batches)]
    n = len(draws)
    for pair, p in zip(loader.crop_size_pairs, ratios, strict=True):
        count = draws.count(pair)
        # the draws are fixed by the seed; 6 binomial standard deviations
        # would hold for almost any seed
        assert abs(count - n * p) <= 6 * math.sqrt(n * p * (1 - p)), (pair, count, n * p)


def test_same_seed_same_pairs_on_every_rank_and_another_seed_others(images):
    def pairs(**kw):
        with _loader(images, **kw) as loader:
            return [loader.crop_sizes(k, e) for e in range(20) for k in range(len(loader))]

    first = pairs()
    assert first == pairs()
    assert first != pairs(seed=4)
    # a rank's batch k of an epoch is the same step as every other rank's
    ranks = [pairs(rank=r, world_size=2)[:100] for r in range(2)]
    assert ranks[0] == ranks[1]


def test_a_resumed_loader_gives_the_same_sizes_and_crops(images):
    with _loader(images, seed=7) as whole:
        whole.set_epoch(1)
        reference = [[c.clone() for c in b.crops] for b in whole]
    with _loader(images, seed=7) as first:
        first.set_epoch(1)
        it = iter(first)
        for _ in range(4):
            next(it)
        state = first.state_dict()
    with _loader(images, seed=7) as resumed:
        resumed.load_state_dict(state)
        rest = [[c.clone() for c in b.crops] for b in resumed]
    assert len(rest) == len(reference) - 4
    assert len({tuple(c[0].shape) for c in reference}) == 2  # both pairs in the epoch
    for got, want in zip(rest, reference[4:], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_one_pair_in_a_list_is_the_single_size_loader(images):
    def crops(**kw):
        with MultiCropLoader(images, 4, n_local=2, num_threads=1, seed=2, **kw) as loader:
            assert loader.crop_size_pairs == [(32, 16)]
            return [[c.clone() for c in b.crops] for b in loader]

    plain = crops(global_size=32, local_size=16)
    listed = crops(global_size=[32], local_size=[16], crop_size_ratios=[1.0])
    for a, b in zip(plain, listed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(local_size=[16, 24, 32]), "global_size has 2 sizes but local_size has 3"),
        (dict(crop_size_ratios=[0.5, 0.4]), "must be probabilities .* summing to 1"),
        (dict(crop_size_ratios=[1.0]), "crop_size_ratios has 1 ratios for 2 crop-size pairs"),
        (dict(crop_size_ratios=["a", "b"]), "crop_size_ratios must be a list of numbers"),
        (dict(global_size=[32, 48.0]), "global_size must be an int or a non-empty list of ints"),
        (
            dict(global_size=[32, 44], masks={"patch_size": 8}),
            "crop size pair 1: masks: patch_size 8",
        ),
    ],
)
def test_bad_loader_arguments_are_one_line(images, kwargs, match):
    with pytest.raises(ValueError, match=match) as e:
        _loader(images, **kwargs)
    assert "\n" not in str(e.value)


def test_the_dataset_takes_one_size(images):
    with pytest.raises(ValueError, match="MultiCropDataset takes one global_size"):
        MultiCropDataset(images, global_size=[32, 48], local_size=16)


# ---------------------------------------------------------------- training


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


# the dinov3 recipe (masks, a Gram teacher from iteration 2 at its own side
# per pair) at two pairs of equal probability
RUN = [
    *TINY,
    "recipe.name=dinov3",
    "recipe.centering=sinkhorn_knopp",
    "model.drop_path_rate=0",
    "recipe.ibot.separate_head=true",
    "recipe.ibot.out_dim=64",
    *PAIRS,
    "augmentation.crop_size_ratios=[0.5,0.5]",
    "recipe.gram.teacher_crop_size=[48,64]",
    "recipe.gram.it_load_ema_teacher=2",
    "recipe.gram.rep_update=false",
]


def _cmd(out: Path, root: Path) -> list[str]:
    return train_args(out, root, *RUN, *RESUMABLE)


def _sizes_by_step(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["global_crop_size"], r["local_crop_size"]) for r in rows if "loss" in r}


def test_train_with_two_pairs_sees_both_and_resumes_bit_for_bit(train_root, tmp_path):
    ref = tmp_path / "ref"
    run_cli_ok(_cmd(ref, train_root))
    sizes = _sizes_by_step(ref)
    assert sorted(sizes) == list(range(1, 11))
    assert set(sizes.values()) == {(32, 16), (48, 24)}
    rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    assert any("loss_gram" in r for r in rows)
    out = tmp_path / "run"
    run_killed_and_resumed(out, _cmd(out, train_root))
    resumed = _sizes_by_step(out)
    assert resumed == {step: sizes[step] for step in resumed} and max(resumed) == 10
    a, b = final_state(out), final_state(ref)
    assert_same_states(a, b)
