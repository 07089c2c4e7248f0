"""photometric_torch, the plain-torch form of dino_opt::multicrop_photometric
that runs on devices without a compiled kernel, against the CPU kernel on fresh
random uint8 crops and random valid parameter rows: every field, all 24 jitter
orders, blur sigmas from 0 to ones the clamp of the kernel size decides,
crops from 1 x 1 to 224 x 224, the three output dtypes, both layouts; argument
and parameter-row errors.

Tolerance: float32 outputs within 1e-5 / min(std) (~4.5e-5) after
normalisation, the bound test_photometric.py allows between the kernel and
torchvision. Both sides run the same float32 operations in the same order; the
only reductions done in another order are the float64 contrast mean and the
float64 blur taps, which move a result by an ulp at most. Measured: identical
bits on every crop so far (max |diff| 0 for all three dtypes). bfloat16 and
float16 outputs are one rounding of the float32 result, so they may differ by
one ulp of the output dtype where the float32 values straddle a rounding
boundary. Values a solarised crop holds within 1e-5 of the threshold may be
off (rounding decides their side), if they are few.
"""

import ast
import importlib.util
import itertools
from pathlib import Path

import dino_opt  # noqa: F401  (registers the operators)
import pytest
import torch
from dino_opt.ops.photometric_torch import photometric_torch

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
TOL = 1e-5 / min(STD)
THRESHOLD = 128 / 255
ORDERS = list(itertools.permutations(range(4)))
SMALL_SIGMAS = (0.0, 1e-3, 0.3, 0.5, 1.0, 1.7, 2.0, 4.0, 7.5, 1e3, 1e30)
LARGE_SIGMAS = (0.0, 0.1, 0.5, 1.0, 1.37, 2.0)


def kernel(images, params, mean=MEAN, std=STD, dtype=torch.float32, channels_last=False):
    return torch.ops.dino_opt.multicrop_photometric(
        images, params, list(mean), list(std), dtype, channels_last
    )


def random_images(n, h, w, gen):
    """Even crops noise, odd crops a grey ramp that turns into a flat random
    colour halfway (greys, ties between channels, smooth runs for the blur)."""
    noise = torch.randint(0, 256, (n, h, w, 3), generator=gen, dtype=torch.uint8)
    ramp = torch.linspace(0, 255, max(h * w, 1)).view(1, h, w, 1).round().to(torch.uint8)
    colour = torch.randint(0, 256, (n, 1, 1, 3), generator=gen, dtype=torch.uint8)
    smooth = torch.where(ramp > 128, colour, ramp.expand(n, h, w, 3))
    return torch.where(torch.arange(n).view(n, 1, 1, 1) % 2 == 0, noise, smooth)


def pick(values, n, gen):
    return torch.tensor(values, dtype=torch.float32)[
        torch.randint(len(values), (n,), generator=gen)
    ]


def random_rows(n, gen, sigmas=SMALL_SIGMAS, jitter_p=0.8, orders=None):
    """Valid rows covering every column: flags on and off, factors in [0, 2.5]
    with some exact identities (1; hue 0) and zeros, hue in [-0.5, 0.5] with
    its ends, a random order per row (or `orders`), blur sigmas from `sigmas`."""

    def flag(p):
        return (torch.rand(n, generator=gen) < p).float()

    def factors(width):
        f = 2.5 * torch.rand(n, width, generator=gen)
        u = torch.rand(n, width, generator=gen)
        return torch.where(u < 0.15, 1.0, torch.where(u < 0.2, 0.0, f))

    hue = torch.rand(n, generator=gen) - 0.5
    u = torch.rand(n, generator=gen)
    hue = torch.where(u < 0.15, 0.0, torch.where(u < 0.2, 0.5, torch.where(u < 0.25, -0.5, hue)))
    if orders is None:
        orders = [torch.randperm(4, generator=gen).tolist() for _ in range(n)]
    rows = torch.zeros(n, 13)
    rows[:, 0] = flag(0.5)
    rows[:, 1] = flag(jitter_p)
    rows[:, 2:5] = factors(3)
    rows[:, 5] = hue
    rows[:, 6:10] = torch.tensor(orders, dtype=torch.float32)
    rows[:, 10] = flag(0.25)
    rows[:, 11] = pick(sigmas, n, gen)
    rows[:, 12] = flag(0.4)
    return rows


def compare(
    images, params, dtype=torch.float32, channels_last=False, mean=MEAN, std=STD, device="cpu"
):
    """photometric_torch on `device` against the CPU kernel; returns the max |difference|."""
    got = photometric_torch(images.to(device), params.to(device), mean, std, dtype, channels_last)
    assert got.device.type == torch.device(device).type
    got = got.cpu()
    want = kernel(images, params, mean, std, dtype, channels_last)
    n, h, w, _ = images.shape
    assert got.shape == (n, 3, h, w) and got.dtype == dtype
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert got.is_contiguous(memory_format=fmt)
    diff = (got.float() - want.float()).abs()
    # One ulp of the output dtype (none for float32) on top of the float32 bound.
    bound = TOL + (0.0 if dtype == torch.float32 else torch.finfo(dtype).eps) * want.float().abs()
    # Where a solarised crop sits on the threshold, rounding decides the side: such
    # values are excused, as long as they are few.
    unsolarized = params.clone()
    unsolarized[:, 12] = 0
    before = kernel(images, unsolarized, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    near = params[:, 12].bool().view(-1, 1, 1, 1) & ((before - THRESHOLD).abs() < 1e-5)
    excused = near & (diff > bound)
    assert excused.float().mean() < 0.02, "too many values off on the threshold"
    diff = diff.masked_fill(excused, 0)
    worst = diff.max().item() if diff.numel() else 0.0
    assert (diff <= bound).all(), f"max |diff| {worst:.3g}, {(diff > bound).sum()} values off"
    if dtype != torch.float32 and device == "cpu":
        # One round-to-nearest-even conversion of the float32 result.
        full = photometric_torch(images, params, mean, std, torch.float32, channels_last)
        assert torch.equal(got, full.to(dtype))
    print(
        f"{tuple(images.shape)} {dtype}: max |diff| {worst:.3g}, "
        f"{(got == want).float().mean().item():.4%} identical"
    )
    return worst


SIZES = [(1, 1, 24), (2, 3, 24), (7, 5, 24), (32, 32, 12), (96, 96, 4), (224, 224, 2)]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("h,w,n", SIZES, ids=[f"{h}x{w}" for h, w, _ in SIZES])
def test_matches_kernel_on_random_rows(h, w, n, dtype, channels_last, gen):
    sigmas = SMALL_SIGMAS if h * w <= 32 * 32 else LARGE_SIGMAS
    compare(random_images(n, h, w, gen), random_rows(n, gen, sigmas), dtype, channels_last)


@pytest.mark.parametrize("h,w", [(7, 5), (32, 32)])
def test_every_jitter_order(h, w, gen):
    params = random_rows(len(ORDERS), gen, jitter_p=1.0, orders=ORDERS)
    params[:, 2:5] = 0.5 + torch.rand(len(ORDERS), 3, generator=gen)  # never the identity
    params[:, 5] = 0.8 * torch.rand(len(ORDERS), generator=gen) - 0.4
    params[:, 10:13] = 0  # the jitter alone
    compare(random_images(len(ORDERS), h, w, gen), params)
    params[:, 10:13] = random_rows(len(ORDERS), gen)[:, 10:13]
    compare(random_images(len(ORDERS), h, w, gen), params)


@pytest.mark.parametrize("h,w", [(1, 9), (9, 1), (2, 3), (5, 5), (3, 40), (17, 2)])
@pytest.mark.parametrize("sigma", [0.4, 2.0, 10.0, 1e30])
def test_blur_kernel_clamped_on_tiny_crops(h, w, sigma, gen):
    # 2 ceil(3 sigma) + 1 taps wanted; the sides allow at most 2 (side - 1) + 1.
    params = random_rows(4, gen)
    params[:, 11] = sigma
    compare(random_images(4, h, w, gen), params)


def test_large_sigma_on_a_larger_crop(gen):
    params = random_rows(3, gen)
    params[:, 11] = torch.tensor([5.0, 12.0, 40.0])
    compare(random_images(3, 40, 57, gen), params)


def single_op_rows():
    identity = [0, 0, 1, 1, 1, 0, 0, 1, 2, 3, 0, 0, 0]
    changes = [
        {0: 1},  # flip
        {1: 1, 2: 1.37},  # brightness
        {1: 1, 2: 0.0},
        {1: 1, 3: 0.6},  # contrast
        {1: 1, 3: 0.0},
        {1: 1, 4: 2.0},  # saturation
        {1: 1, 4: 0.0},
        {1: 1, 5: 0.5},  # hue
        {1: 1, 5: -0.5},
        {1: 1, 5: 0.13},
        {1: 1, 5: -1e-4},
        {10: 1},  # grayscale
        {11: 1.3},  # blur
        {12: 1},  # solarize
    ]
    rows = []
    for change in changes:
        row = list(identity)
        for column, value in change.items():
            row[column] = value
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)


def test_every_op_alone_on_special_values():
    # Every combination of 8 levels per channel: greys, primaries, ties, black,
    # white and the solarisation threshold 128.
    levels = [0, 1, 64, 127, 128, 200, 254, 255]
    pixels = torch.tensor(list(itertools.product(levels, repeat=3)), dtype=torch.uint8)
    rows = single_op_rows()
    images = pixels.view(1, 16, 32, 3).expand(len(rows), 16, 32, 3).contiguous()
    compare(images, rows, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    for row in rows:  # each op on the whole batch rather than a subset of it
        compare(images[:2], row.repeat(2, 1), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))


def test_jitter_off_ignores_the_jitter_fields(gen):
    images = random_images(6, 9, 11, gen)
    params = random_rows(6, gen, jitter_p=0.0)
    identity = params.clone()
    identity[:, 2:6] = torch.tensor([1.0, 1.0, 1.0, 0.0])
    got = photometric_torch(images, params, MEAN, STD)
    assert torch.equal(got, photometric_torch(images, identity, MEAN, STD))
    compare(images, params)


def test_identity_rows_give_the_normalised_input_exactly(gen):
    images = random_images(3, 17, 29, gen)
    params = torch.tensor([[0, 1, 1, 1, 1, 0, 3, 2, 1, 0, 0, 0, 0]] * 3, dtype=torch.float32)
    x = images.permute(0, 3, 1, 2).float() / 255
    want = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.equal(photometric_torch(images, params, MEAN, STD), want)


def test_other_statistics_and_list_arguments(gen):
    images = random_images(4, 12, 13, gen)
    compare(images, random_rows(4, gen), mean=[0.1, 0.9, 0.5], std=[0.05, 2.0, 0.3])


def test_empty_batch_and_empty_crops(gen):
    out = photometric_torch(
        torch.zeros((0, 8, 8, 3), dtype=torch.uint8), torch.zeros(0, 13), MEAN, STD
    )
    assert out.shape == (0, 3, 8, 8) and out.dtype == torch.float32
    images = torch.zeros((2, 0, 5, 3), dtype=torch.uint8)
    out = photometric_torch(images, random_rows(2, gen), MEAN, STD, torch.float16, True)
    assert out.shape == (2, 3, 0, 5) and out.dtype == torch.float16


def test_non_contiguous_inputs(gen):
    images = random_images(4, 20, 30, gen)
    params = random_rows(4, gen)
    want = photometric_torch(images, params, MEAN, STD)
    strided = torch.cat([images, images], dim=2)[:, :, ::2].copy_(images)
    wide = torch.cat([params, params], dim=1)[:, :13]
    assert not strided.is_contiguous() and not wide.is_contiguous()
    assert torch.equal(photometric_torch(strided, wide, MEAN, STD), want)


def test_imports_only_torch_math_and_collections():
    tree = ast.parse(
        Path(importlib.util.find_spec("dino_opt.ops.photometric_torch").origin).read_text()
    )
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "no imports of other dino_opt modules"
            names.add(node.module)
    assert names <= {"__future__", "torch", "math", "collections.abc"}, names


def good_args(n=2, h=6, w=7):
    params = torch.zeros(n, 13)
    params[:, 6:10] = torch.arange(4.0)
    return dict(
        images=torch.zeros((n, h, w, 3), dtype=torch.uint8),
        params=params,
        mean=MEAN,
        std=STD,
        dtype=torch.float32,
    )


BAD_ARGS = [
    (dict(images=torch.zeros((2, 6, 7, 3), dtype=torch.float32)), "images must be uint8"),
    (
        dict(images=torch.zeros((2, 3, 6, 7), dtype=torch.uint8)),
        "images must have shape [N, H, W, 3]",
    ),
    (dict(images=torch.zeros((6, 7, 3), dtype=torch.uint8)), "images must have shape [N, H, W, 3]"),
    (dict(params=torch.zeros((3, 13))), "params has 3 rows but images has N=2"),
    (dict(params=torch.zeros((2, 12))), "params must have shape [N, 13]"),
    (dict(params=torch.zeros((2, 13), dtype=torch.float64)), "params must be float32"),
    (dict(mean=(0.5, 0.5)), "mean must have 3 values"),
    (dict(std=(0.2, 0.2, 0.2, 0.2)), "std must have 3 values"),
    (dict(std=(0.2, 0.0, 0.2)), "std[1] must be finite and nonzero"),
    (dict(std=(0.2, float("inf"), 0.2)), "std[1] must be finite and nonzero"),
    (dict(std=(0.2, 1e-50, 0.2)), "std[1] = 1e-50 rounds to 0 in float32"),
    (dict(mean=(0.5, float("nan"), 0.5)), "mean[1] must be finite"),
    (dict(dtype=torch.float64), "dtype must be float32, bfloat16 or float16"),
    (dict(dtype=torch.uint8), "dtype must be float32, bfloat16 or float16"),
]


@pytest.mark.parametrize("change,message", BAD_ARGS, ids=[m for _, m in BAD_ARGS])
def test_bad_arguments_raise_the_kernels_errors(change, message):
    args = {**good_args(), **change}
    pattern = "multicrop_photometric: " + message.replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(RuntimeError, match=pattern):
        kernel(**args)
    with pytest.raises(RuntimeError, match=pattern):
        photometric_torch(**args)


@pytest.mark.parametrize(
    "column,value",
    [
        (0, 0.5),
        (1, 2.0),
        (10, -1.0),
        (12, float("nan")),
        (2, -0.1),
        (3, float("inf")),
        (4, float("nan")),
        (5, 0.51),
        (5, -0.5001),
        (8, 1.0),
        (9, 4.0),
        (7, float("nan")),
        (6, 0.5),
        (11, -1.0),
        (11, float("nan")),
        (11, float("inf")),
    ],
)
def test_invalid_rows_are_named_as_the_cpu_kernel_names_them(column, value):
    args = good_args(n=4)
    args["params"][2, column] = value
    args["params"][3, 5] = 0.7  # a later bad row: the first one is named
    with pytest.raises(RuntimeError) as expected:
        kernel(**args)
    with pytest.raises(RuntimeError) as got:
        photometric_torch(**args)
    assert str(got.value) == str(expected.value)
    assert str(got.value).startswith("multicrop_photometric: params[2]: ")


def test_params_on_another_device_is_an_error():
    args = good_args()
    args["params"] = args["params"].to("meta")
    with pytest.raises(RuntimeError, match="params is on meta but images is on cpu"):
        photometric_torch(**args)


@pytest.mark.cuda
def test_cuda_matches_the_cpu_kernel(gen):
    # CUDA's exp and reductions may round differently: within the same bounds.
    for h, w, n in [(224, 224, 4), (37, 61, 12), (2, 3, 12)]:
        images = random_images(n, h, w, gen)
        for dtype in (torch.float32, torch.bfloat16):
            compare(images, random_rows(n, gen, LARGE_SIGMAS), dtype, device="cuda")
