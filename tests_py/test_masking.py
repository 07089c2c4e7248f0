"""DINOv2's block masks: the Python drop-ins (MaskingGenerator,
collate_data_and_cast), mask_targets, and the native loader's masks (layout,
plan, determinism, resume, the crops left as they were, bad arguments)."""

import math
import pickle
import random

import numpy as np
import pytest
import torch
from dino_opt import _C
from dino_opt.data import (
    Batch,
    MaskingGenerator,
    MultiCropDataset,
    MultiCropLoader,
    collate_data_and_cast,
    mask_targets,
    mask_upperbound,
    multicrop_collate,
)
from dino_opt.tune import OptimizedDataLoader
from PIL import Image

SMALL = dict(global_size=32, local_size=16, n_local=2)
MASKS = dict(patch_size=4)  # an 8 x 8 grid of 32 px global crops
GRID = 8


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """14 small JPEGs (smooth colour ramps with some noise)."""
    root = tmp_path_factory.mktemp("masks")
    rng = np.random.default_rng(4)
    for i in range(14):
        h, w = rng.integers(40, 90, 2)
        y, x = np.mgrid[0:h, 0:w]
        img = np.stack([x * 255 / w, y * 255 / h, np.full((h, w), 40 * (i % 6))], -1)
        img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
        Image.fromarray(img).save(root / f"img{i:02d}.jpg", quality=90)
    return root


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    grid = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def bounding_box(mask: np.ndarray) -> tuple[int, int, int]:
    """(height, width, set cells) of the cells that are set."""
    ys, xs = np.nonzero(mask)
    return ys.max() - ys.min() + 1, xs.max() - xs.min() + 1, len(ys)


def samples(b: int, n_local: int = 2) -> list:
    """DINOv2-style samples whose crops tell their sample and view apart."""
    return [
        (
            {
                "global_crops": [torch.full((3, 4, 4), 10.0 * s + v) for v in range(2)],
                "local_crops": [torch.full((3, 2, 2), 10.0 * s + 2 + v) for v in range(n_local)],
            },
            (),
        )
        for s in range(b)
    ]


# ---------------------------------------------------------------- MaskingGenerator


@pytest.mark.parametrize("size,max_patches", [(14, 98), ((7, 9), 20), (2, 2)])
def test_generator_never_masks_more_than_asked(size, max_patches):
    gen = MaskingGenerator(size, max_num_patches=max_patches)
    h, w = gen.get_shape()
    random.seed(0)
    for request in range(h * w + 1):
        mask = gen(request)
        assert mask.dtype == np.bool_ and mask.shape == (h, w)
        assert mask.sum() <= request
    assert not gen().any()


@pytest.mark.parametrize("height,width", [(14, 14), (5, 12)])
def test_generator_rectangles_respect_area_and_aspect(height, width):
    gen = MaskingGenerator((height, width), min_num_patches=4, max_num_patches=60, min_aspect=0.5)
    random.seed(1)
    seen = 0
    for _ in range(500):
        mask = np.zeros((height, width), dtype=bool)
        limit = random.uniform(4, 60)
        added = gen._add_rectangle(mask, limit)
        if not added:
            continue
        seen += 1
        h, w, n = bounding_box(mask)
        assert n == h * w == added <= limit  # one rectangle, within the limit
        assert h < height and w < width
        assert (h + 0.5) * (w + 0.5) >= 4  # rounded sqrt(area * aspect), sqrt(area / aspect)
        assert (h - 0.5) / (w + 0.5) <= 2 and (h + 0.5) / (w - 0.5) >= 0.5
    assert seen > 400


def test_generator_draws_from_python_random():
    gen = MaskingGenerator(14, max_num_patches=98)
    random.seed(5)
    a = [gen(60) for _ in range(3)]
    random.seed(5)
    b = [gen(60) for _ in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not np.array_equal(a[0], a[1])
    torch.manual_seed(0)
    random.seed(6)
    c = gen(60)
    torch.manual_seed(1)
    random.seed(6)
    assert np.array_equal(c, gen(60))  # torch's generator does not matter


def test_generator_shape_and_repr():
    gen = MaskingGenerator((6, 10), num_masking_patches=20, min_aspect=0.5)
    assert gen.get_shape() == (6, 10) and gen.num_patches == 60
    assert gen.max_num_patches == 20  # defaults to num_masking_patches, as DINOv2's
    assert gen.log_aspect_ratio == pytest.approx((math.log(0.5), math.log(2.0)))
    assert "6, 10" in repr(gen) and "20" in repr(gen)
    assert MaskingGenerator(5).get_shape() == (5, 5)


def test_native_generator_matches_the_python_one_in_distribution():
    """The loader's C++ generator and MaskingGenerator run the same algorithm
    on different random streams: the masked counts and the extent of the
    masks follow the same distributions."""
    n = 2000
    critical = np.sqrt(-np.log(1e-6 / 2) / 2) * np.sqrt(2 / n)
    random.seed(2)
    for (h, w), request in [((14, 14), 20), ((14, 14), 60), ((14, 14), 150), ((5, 12), 30)]:
        gen = MaskingGenerator((h, w), max_num_patches=0.5 * h * w)
        ours = np.stack([gen(request) for _ in range(n)])
        native = _C.sample_masks(7, [request] * n, h, w, 0.5 * h * w).numpy()
        for stat in (
            lambda m: m.sum((1, 2)),
            lambda m: m.any(2).sum(1),  # rows touched
            lambda m: m.any(1).sum(1),  # columns touched
        ):
            assert ks_statistic(stat(ours), stat(native)) < critical, request


# ---------------------------------------------------------------- collate_data_and_cast


def test_collate_keys_shapes_and_values():
    gen = MaskingGenerator(14, max_num_patches=98)
    random.seed(3)
    out = collate_data_and_cast(samples(6), (0.1, 0.5), 0.5, torch.half, 196, gen)
    assert set(out) == {
        "collated_global_crops",
        "collated_local_crops",
        "collated_masks",
        "mask_indices_list",
        "masks_weight",
        "upperbound",
        "n_masked_patches",
    }
    g, loc = out["collated_global_crops"], out["collated_local_crops"]
    assert g.shape == (12, 3, 4, 4) and g.dtype == torch.half
    assert loc.shape == (12, 3, 2, 2) and loc.dtype == torch.half
    # View-major: every sample's first view, then every sample's second.
    assert g[:, 0, 0, 0].tolist() == [10.0 * s + v for v in range(2) for s in range(6)]
    masks = out["collated_masks"]
    assert masks.shape == (12, 196) and masks.dtype == torch.bool
    counts = masks.sum(1)
    assert int((counts > 0).sum()) == 6  # int(12 * 0.5) crops masked
    assert torch.equal(out["mask_indices_list"], masks.flatten().nonzero().flatten())
    assert out["n_masked_patches"].tolist() == [int(counts.sum())]
    weights = out["masks_weight"]
    assert weights.shape == (int(counts.sum()),) and weights.dtype == torch.float32
    assert float(weights.sum()) == pytest.approx(6.0)  # 1 per masked crop
    crop_of = out["mask_indices_list"] // 196
    torch.testing.assert_close(weights, 1.0 / counts[crop_of].float())
    assert out["upperbound"] == mask_upperbound(12, 196, (0.1, 0.5), 0.5) >= int(counts.sum())


def test_collate_shuffles_which_crops_are_masked():
    gen = MaskingGenerator(8, max_num_patches=32)
    random.seed(7)
    masked = torch.stack(
        [
            collate_data_and_cast(samples(4), (0.1, 0.5), 0.5, torch.float32, 64, gen)[
                "collated_masks"
            ].any(1)
            for _ in range(200)
        ]
    )
    assert (masked.sum(1) == 4).all()
    # Each of the 8 crops is masked in about half of the batches (binomial, sd 7).
    assert ((masked.sum(0) - 100).abs() < 40).all(), masked.sum(0)


def test_collate_masked_fraction_per_ratio_bin():
    """Over many batches, the k-th smallest mask of a batch of 16 masked
    crops holds on average the middle of the k-th of 8 equal bins of (0.1,
    0.5): the plan is stratified, and the generator reaches its requests."""
    gen = MaskingGenerator(14, max_num_patches=98)
    batch = samples(8, n_local=0)
    random.seed(4)
    rows = []
    for _ in range(300):
        counts = collate_data_and_cast(batch, (0.1, 0.5), 0.5, torch.float32, 196, gen)[
            "collated_masks"
        ].sum(1)
        rows.append(counts[counts > 0].sort().values.numpy() / 196)
    means = np.stack(rows).mean(0)
    edges = np.linspace(0.1, 0.5, 9)
    np.testing.assert_allclose(means, (edges[:-1] + edges[1:]) / 2, atol=0.01)


def test_collate_takes_dataset_items(images):
    ds = MultiCropDataset(images, seed=1, **SMALL)
    items = [ds[i] for i in range(3)]
    gen = MaskingGenerator(GRID, max_num_patches=32)
    out = collate_data_and_cast(items, (0.1, 0.5), 0.5, torch.float32, mask_generator=gen)
    stacked = multicrop_collate(items)["crops"]
    assert torch.equal(out["collated_global_crops"], torch.cat(stacked[:2]))
    assert torch.equal(out["collated_local_crops"], torch.cat(stacked[2:]))
    assert out["collated_masks"].shape == (6, GRID * GRID)
    with pytest.raises(ValueError, match="mask_generator"):
        collate_data_and_cast(items, (0.1, 0.5), 0.5, torch.float32)


def test_mask_targets_equals_collate():
    gen = MaskingGenerator(14, max_num_patches=98)
    random.seed(8)
    out = collate_data_and_cast(samples(5), (0.2, 0.4), 0.6, torch.float32, 196, gen)
    masks = out["collated_masks"].view(10, 14, 14)
    got = mask_targets(masks, (0.2, 0.4), 0.6)
    assert set(got) == set(out) - {"collated_global_crops", "collated_local_crops"}
    for key, value in got.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == out[key].dtype and torch.equal(value, out[key]), key
        else:
            assert value == out[key], key
    with pytest.raises(ValueError, match="masks"):
        mask_targets(masks.to(torch.uint8))


@pytest.mark.cuda
def test_mask_targets_on_cuda():
    masks = _C.sample_masks(1, [10, 0, 30, 5], 8, 8, 32.0)
    cpu, gpu = mask_targets(masks), mask_targets(masks.cuda())
    for key, value in cpu.items():
        if isinstance(value, torch.Tensor):
            assert gpu[key].is_cuda and torch.equal(gpu[key].cpu(), value), key


# ---------------------------------------------------------------- the native loader


def loader_masks(loader, start=None) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    if start is not None:
        loader.load_state_dict(start)
    return [(b.masks.clone(), [c.clone() for c in b.crops]) for b in loader]


def test_loader_masks_follow_the_plan(images):
    kw = dict(num_threads=2, seed=3, batch_size=4, **SMALL)
    masks = dict(patch_size=4, ratio=(0.1, 0.5), probability=0.5)
    with MultiCropLoader(images, masks=masks, **kw) as loader:
        assert loader.masks["max_num_patches"] is None
        batches = list(loader)
        assert len(batches) == 3
        n = int(8 * 0.5)
        edges = [0.1 + 0.4 * i / n for i in range(n + 1)]
        for b in batches:
            crops, labels, indices = b  # the tuple is still (crops, labels, indices)
            assert b.masks.shape == (8, GRID, GRID) and b.masks.dtype == torch.bool
            counts = b.masks.flatten(1).sum(1)
            assert int((counts > 0).sum()) == n
            ordered = counts[counts > 0].sort().values.tolist()
            assert all(c <= int(64 * edges[k + 1]) for k, c in enumerate(ordered))
            targets = loader.mask_targets(b.masks)
            assert targets["upperbound"] == mask_upperbound(8, 64, (0.1, 0.5), 0.5)
            assert targets["n_masked_patches"].item() == int(counts.sum())
            assert float(targets["masks_weight"].sum()) == pytest.approx(n)


def test_loader_masks_leave_the_crops_and_are_thread_independent(images):
    kw = dict(seed=9, batch_size=3, drop_last=False, **SMALL)
    with MultiCropLoader(images, num_threads=1, masks=MASKS, **kw) as one:
        a = loader_masks(one)
    with MultiCropLoader(images, num_threads=2, prefetch=2, masks=MASKS, **kw) as two:
        b = loader_masks(two)
    with MultiCropLoader(images, num_threads=2, **kw) as plain:
        c = [(b.masks, b.crops) for b in plain]
    assert len(a) == len(b) == len(c) == 5  # 14 samples: 4 batches of 3 and one of 2
    assert a[-1][0].shape == (4, GRID, GRID)
    for (ma, ca), (mb, cb), (mc, cc) in zip(a, b, c, strict=True):
        assert torch.equal(ma, mb)
        assert mc is None
        assert all(
            torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(ca, cb, cc, strict=True)
        )


def test_loader_masks_resume_exactly_and_change_with_the_epoch(images):
    kw = dict(num_threads=2, seed=4, batch_size=3, masks=MASKS, **SMALL)
    with MultiCropLoader(images, **kw) as full:
        full.set_epoch(1)
        expected = loader_masks(full)
        full.set_epoch(2)
        other_epoch = loader_masks(full)
    assert not torch.equal(expected[0][0], other_epoch[0][0])
    with MultiCropLoader(images, **kw) as first:
        first.set_epoch(1)
        it = iter(first)
        next(it), next(it)
        state = first.state_dict()
    with MultiCropLoader(images, **kw) as resumed:
        rest = loader_masks(resumed, start=state)
    assert len(rest) == len(expected) - 2
    for (m, _), (e, _) in zip(rest, expected[2:], strict=True):
        assert torch.equal(m, e)


def test_loader_masks_in_every_output_form(images):
    kw = dict(num_threads=2, seed=6, batch_size=4, masks=MASKS, **SMALL)
    with (
        MultiCropLoader(images, **kw) as ref,
        MultiCropLoader(images, group_by_resolution=True, **kw) as grouped,
        MultiCropLoader(images, photometric="gpu", device="cpu", **kw) as op,
    ):
        for x, y, z in zip(ref, grouped, op, strict=True):
            assert torch.equal(x.masks, y.masks) and torch.equal(x.masks, z.masks)


def test_batch_keeps_its_masks():
    masks = torch.zeros(4, 2, 2, dtype=torch.bool)
    batch = Batch([torch.zeros(2, 3)] * 2, torch.zeros(2), torch.arange(2), masks)
    assert len(batch) == 3 and Batch(*batch).masks is None
    assert pickle.loads(pickle.dumps(batch)).masks.shape == (4, 2, 2)
    assert batch._replace(labels=torch.ones(2)).masks is masks
    assert OptimizedDataLoader.prefetch_to_gpu(batch, "cpu").masks is not None
    assert "masks=" in repr(batch)


def test_dataset_masks(images):
    ds = MultiCropDataset(images, seed=2, masks=MASKS, **SMALL)
    a, b = ds[3], ds[3]
    assert a["masks"].shape == (2, GRID, GRID) and a["masks"].dtype == torch.bool
    assert torch.equal(a["masks"], b["masks"])
    assert int((a["masks"].flatten(1).sum(1) > 0).sum()) == 1  # int(2 * 0.5) of a batch of one
    plain = MultiCropDataset(images, seed=2, **SMALL)[3]
    assert "masks" not in plain
    assert all(torch.equal(x, y) for x, y in zip(a["crops"], plain["crops"], strict=True))
    batch = multicrop_collate([ds[i] for i in range(3)])
    assert torch.equal(batch["masks"][1], ds[1]["masks"][0])
    assert torch.equal(batch["masks"][4], ds[1]["masks"][1])


@pytest.mark.parametrize(
    "masks,match",
    [
        (True, "masks"),
        ({}, "patch_size"),
        (dict(patch_size=5), "patch_size"),
        (dict(patch_size=4.5), "patch_size"),
        (dict(patch_size=4, ratio=(0.6, 0.2)), "ratio"),
        (dict(patch_size=4, ratio="ab"), "ratio"),
        (dict(patch_size=4, probability=1.5), "probability"),
        (dict(patch_size=4, min_num_patches=0), "min_num_patches"),
        (dict(patch_size=4, max_num_patches=2), "max_num_patches"),
        (dict(patch_size=4, min_aspect=0), "min_aspect"),
        (dict(patch_size=4, max_aspect=0.1), "max_aspect"),
        (dict(patch_size=4, mask_ratio=0.1), "mask_ratio"),
    ],
)
def test_bad_mask_arguments_name_themselves(images, masks, match):
    with pytest.raises(ValueError, match=match):
        MultiCropLoader(images, 2, masks=masks, **SMALL)


def test_mask_targets_needs_a_loader_with_masks(images):
    with MultiCropLoader(images, 2, **SMALL) as loader:
        assert loader.masks is None
        with pytest.raises(ValueError, match="masks"):
            loader.mask_targets(torch.zeros(4, 8, 8, dtype=torch.bool))
