"""The photometric operator (dino_opt::multicrop_photometric) against
torchvision's functional ops on the same float image x = u8 / 255 and the same
parameters, one op at a time and composed; output dtypes and layouts; opcheck;
argument errors. CUDA tests (marked `cuda`): the CUDA kernel against the CPU
kernel.

Tolerance: 1e-5 on values in [0, 1] (single-op tests use mean 0 and std 1, so
the output is the augmented image itself). Both sides compute in float32; they
differ only in rounding: torchvision's kernels may fuse a*b + c, divide where
we multiply by a reciprocal (rgb -> hsv), take the contrast mean in float32
(ours sums in double), and blur with the 2-D outer-product kernel (ours is
separable). Each op contributes a few float32 ulps (~1e-7); 1e-5 leaves margin
while any wrong formula or constant (e.g. gray weights 0.299 for 0.2989) is
off by > 1e-4. After normalisation the bound is divided by the smallest std.
"""

import itertools
import math

import pytest
import torch
import torchvision.transforms.v2.functional as F
from dino_opt.ops import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PHOTOMETRIC_PARAM_COLUMNS,
    multicrop_photometric,
)

TOL = 1e-5
IDENTITY_NORM = dict(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
NORM_TOL = TOL / min(IMAGENET_STD)
THRESHOLD = 128 / 255


def make_row(
    flip=0,
    jitter=0,
    brightness=1.0,
    contrast=1.0,
    saturation=1.0,
    hue=0.0,
    order=(0, 1, 2, 3),
    grayscale=0,
    sigma=0.0,
    solarize=0,
):
    return [
        float(flip),
        float(jitter),
        brightness,
        contrast,
        saturation,
        hue,
        *map(float, order),
        float(grayscale),
        sigma,
        float(solarize),
    ]


def rows_tensor(rows):
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, len(PHOTOMETRIC_PARAM_COLUMNS))


def blur_kernel_size(sigma):
    return 2 * math.ceil(3 * sigma) + 1 if sigma > 0 else 0


def reference(img, row, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """torchvision's pipeline on one uint8 [H, W, 3] crop with the float32
    parameter row. Returns the output [3, H, W] and the image as it enters
    solarisation (to mask values that sit on the threshold)."""
    row = [float(v) for v in row]
    flip, jitter, b, c, s, h = row[:6]
    order = [int(v) for v in row[6:10]]
    gray, sigma, sol = row[10:]
    x = img.permute(2, 0, 1).float() / 255
    if flip:
        x = F.horizontal_flip(x)
    if jitter:
        for code in order:
            if code == 0:
                x = F.adjust_brightness(x, b)
            elif code == 1:
                x = F.adjust_contrast(x, c)
            elif code == 2:
                x = F.adjust_saturation(x, s)
            else:
                x = F.adjust_hue(x, h)
    if gray:
        x = F.rgb_to_grayscale(x, num_output_channels=3)
    if sigma > 0:
        height, width = x.shape[-2:]
        k = blur_kernel_size(sigma)
        # The kernel is clamped so that the reflect padding stays inside the crop.
        kx, ky = min(k, 2 * width - 1), min(k, 2 * height - 1)
        if kx > 1 or ky > 1:
            x = F.gaussian_blur(x, [kx, ky], [sigma, sigma])
    before_solarize = x.clone()
    if sol:
        x = F.solarize(x, THRESHOLD)
    return F.normalize(x, list(mean), list(std)), before_solarize


def reference_batch(images, params, **norm):
    pairs = [reference(img, row, **norm) for img, row in zip(images, params, strict=True)]
    return torch.stack([out for out, _ in pairs]), torch.stack([pre for _, pre in pairs])


def noise_images(n, h, w, gen):
    return torch.randint(0, 256, (n, h, w, 3), generator=gen, dtype=torch.uint8)


def natural_images(n, h, w, gen):
    """Smooth colour fields with a ramp and a little noise: like photographs,
    most neighbouring pixels are close and values cover the whole range."""
    low = torch.rand((n, 3, max(2, h // 12), max(2, w // 12)), generator=gen)
    img = torch.nn.functional.interpolate(low, size=(h, w), mode="bicubic", align_corners=False)
    ramp = torch.linspace(0, 1, w).view(1, 1, 1, w)
    img = 0.75 * img + 0.25 * ramp + 0.02 * torch.randn((n, 3, h, w), generator=gen)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def special_image():
    """Every combination of 8 levels per channel (512 pixels, 16 x 32): greys
    (r = g = b), saturated primaries and secondaries, ties between two maxima,
    black and white, and the solarisation threshold 128."""
    levels = torch.tensor([0, 1, 64, 127, 128, 200, 254, 255], dtype=torch.uint8)
    px = torch.tensor(list(itertools.product(levels.tolist(), repeat=3)), dtype=torch.uint8)
    return px.view(16, 32, 3)


def sample_images(gen, sizes=((96, 96), (37, 61))):
    out = [special_image().unsqueeze(0)]
    for h, w in sizes:
        out.append(natural_images(2, h, w, gen))
        out.append(noise_images(1, h, w, gen))
    return out


def dino_rows(n, gen, blur_p=0.5, solarize_p=0.2):
    """Parameters sampled as DINO's augmentation samples them (docs/design.md, "The algorithm")."""

    def u():
        return float(torch.rand((), generator=gen))

    rows = []
    for _ in range(n):
        rows.append(
            make_row(
                flip=u() < 0.5,
                jitter=u() < 0.8,
                brightness=0.6 + 0.8 * u(),
                contrast=0.6 + 0.8 * u(),
                saturation=0.8 + 0.4 * u(),
                hue=-0.1 + 0.2 * u(),
                order=torch.randperm(4, generator=gen).tolist(),
                grayscale=u() < 0.2,
                sigma=0.1 + 1.9 * u() if u() < blur_p else 0.0,
                solarize=u() < solarize_p,
            )
        )
    return rows_tensor(rows)


def check_single_op(images, row):
    params = rows_tensor([row] * images.shape[0])
    got = multicrop_photometric(images, params, **IDENTITY_NORM)
    want, _ = reference_batch(images, params, **IDENTITY_NORM)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_identity_params_give_normalised_input_exactly(gen):
    images = noise_images(3, 17, 29, gen)
    got = multicrop_photometric(images, rows_tensor([make_row()] * 3))
    want = F.normalize(images.permute(0, 3, 1, 2).float() / 255, IMAGENET_MEAN, IMAGENET_STD)
    assert torch.equal(got, want)


@pytest.mark.parametrize("factor", [0.0, 0.3, 0.6, 1.0, 1.37, 2.5])
def test_brightness(factor, gen):
    for images in sample_images(gen):
        check_single_op(images, make_row(jitter=1, brightness=factor))


@pytest.mark.parametrize("factor", [0.0, 0.5, 0.6, 1.4, 3.0])
def test_contrast(factor, gen):
    for images in sample_images(gen):
        check_single_op(images, make_row(jitter=1, contrast=factor))


@pytest.mark.parametrize("factor", [0.0, 0.8, 1.2, 2.0])
def test_saturation(factor, gen):
    for images in sample_images(gen):
        check_single_op(images, make_row(jitter=1, saturation=factor))


@pytest.mark.parametrize(
    "hue", [-0.5, -0.45, -0.3, -0.1, -0.05, -1e-4, 1e-4, 0.05, 0.1, 0.2, 1 / 3, 0.4, 0.5]
)
def test_hue(hue, gen):
    # The special image holds grey pixels, saturated primaries and ties.
    for images in sample_images(gen):
        check_single_op(images, make_row(jitter=1, hue=hue))


def test_hue_many_random_values(gen):
    images = natural_images(1, 24, 40, gen)
    for hue in (torch.rand(30, generator=gen) - 0.5).tolist():
        check_single_op(images, make_row(jitter=1, hue=hue))


def test_grayscale(gen):
    for images in sample_images(gen):
        check_single_op(images, make_row(grayscale=1))


@pytest.mark.parametrize("sigma", [1e-3, 0.1, 0.5, 1.0, 1.37, 2.0])
def test_blur(sigma, gen):
    for images in sample_images(gen, sizes=((96, 96), (37, 61), (224, 224))):
        check_single_op(images, make_row(sigma=sigma))


@pytest.mark.parametrize("h,w", [(1, 9), (9, 1), (2, 3), (5, 5), (7, 40)])
def test_blur_kernel_clamped_to_small_crops(h, w, gen):
    # sigma 2 wants 13 taps; these sides allow at most 2 * side - 1.
    check_single_op(noise_images(2, h, w, gen), make_row(sigma=2.0))


def test_solarize_inverts_from_the_threshold_on(gen):
    # Every uint8 value, 128 (the threshold itself) included: exact, as both sides
    # compute x >= float32(128/255) ? 1 - x : x.
    values = torch.arange(256, dtype=torch.uint8).repeat_interleave(3).view(1, 16, 16, 3)
    params = rows_tensor([make_row(solarize=1)])
    got = multicrop_photometric(values, params, **IDENTITY_NORM)
    want, _ = reference_batch(values, params, **IDENTITY_NORM)
    assert torch.equal(got, want)
    x = values[0, ..., 0].float() / 255
    assert torch.equal(got[0, 0], torch.where(x >= THRESHOLD, 1 - x, x))
    for images in sample_images(gen):
        check_single_op(images, make_row(solarize=1))


def test_flip_mirrors(gen):
    images = noise_images(2, 13, 21, gen)
    got = multicrop_photometric(images, rows_tensor([make_row(flip=1)] * 2))
    plain = multicrop_photometric(images, rows_tensor([make_row()] * 2))
    assert torch.equal(got, plain.flip(-1))
    check_single_op(images, make_row(flip=1))


def test_normalise_with_other_statistics(gen):
    images = natural_images(2, 31, 17, gen)
    mean, std = (0.1, 0.9, 0.5), (0.05, 2.0, 0.3)
    got = multicrop_photometric(images, rows_tensor([make_row()] * 2), mean=mean, std=std)
    want = F.normalize(images.permute(0, 3, 1, 2).float() / 255, mean, std)
    assert torch.equal(got, want)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4))), ids=str)
def test_every_jitter_order(order, gen):
    images = torch.cat([natural_images(2, 40, 52, gen), noise_images(1, 40, 52, gen)])
    rows = []
    for _ in range(images.shape[0]):
        f = torch.rand(4, generator=gen).tolist()
        rows.append(
            make_row(
                jitter=1,
                brightness=0.6 + 0.8 * f[0],
                contrast=0.6 + 0.8 * f[1],
                saturation=0.8 + 0.4 * f[2],
                hue=-0.1 + 0.2 * f[3],
                order=order,
            )
        )
    params = rows_tensor(rows)
    got = multicrop_photometric(images, params, **IDENTITY_NORM)
    want, _ = reference_batch(images, params, **IDENTITY_NORM)
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def assert_matches_reference(images, params, got):
    """Normalised outputs within NORM_TOL, except where a solarised crop's
    value sits within TOL of the threshold, where rounding decides the side."""
    want, before = reference_batch(images, params)
    solarized = params[:, 12].bool().view(-1, 1, 1, 1)
    near = solarized & ((before - THRESHOLD).abs() < TOL)
    # Crops left unjittered hold exactly 128/255 for about 1 value in 256 (both
    # sides invert those, see the solarize test); the mask must never hide more
    # than a small share of the output.
    assert near.float().mean() < 0.02, "too many values on the threshold to test"
    diff = (got.float() - want).abs().masked_fill(near, 0)
    worst = diff.max().item()
    assert worst <= NORM_TOL, f"max |diff| {worst:.3g} > {NORM_TOL:.3g}"
    return worst


@pytest.mark.parametrize("h,w", [(96, 96), (224, 224), (37, 61), (1, 1), (3, 200)])
def test_full_random_composition(h, w, gen):
    n = 6 if h * w > 10000 else 24
    images = torch.cat([natural_images(n - n // 3, h, w, gen), noise_images(n // 3, h, w, gen)])
    params = dino_rows(n, gen, blur_p=0.6, solarize_p=0.4)
    got = multicrop_photometric(images, params)
    worst = assert_matches_reference(images, params, got)
    print(f"{h}x{w}: max |ours - torchvision| = {worst:.3g} (normalised)")


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_output_dtypes_and_layouts(dtype, channels_last, gen):
    images = natural_images(5, 33, 47, gen)
    params = dino_rows(5, gen)
    base = multicrop_photometric(images, params)
    got = multicrop_photometric(images, params, dtype=dtype, channels_last=channels_last)
    assert got.dtype == dtype and got.shape == (5, 3, 33, 47)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert got.is_contiguous(memory_format=fmt)
    # One round-to-nearest-even conversion of the float32 result.
    assert torch.equal(got, base.to(dtype))


def test_empty_batch_and_empty_crops():
    out = multicrop_photometric(torch.zeros((0, 8, 8, 3), dtype=torch.uint8), rows_tensor([]))
    assert out.shape == (0, 3, 8, 8) and out.dtype == torch.float32
    out = multicrop_photometric(torch.zeros((2, 0, 5, 3), dtype=torch.uint8), dino_rows(2, None))
    assert out.shape == (2, 3, 0, 5)


def test_non_contiguous_inputs(gen):
    images = noise_images(4, 20, 30, gen)
    params = dino_rows(4, gen)
    want = multicrop_photometric(images, params)
    strided = torch.cat([images, images], dim=2)[:, :, ::2]  # not contiguous
    strided.copy_(images)
    wide = torch.cat([params, params], dim=1)[:, :13]
    assert torch.equal(multicrop_photometric(strided, wide), want)


def test_opcheck(gen):
    images = natural_images(3, 20, 24, gen)
    params = dino_rows(3, gen, blur_p=1.0)
    for kwargs in ({}, {"dtype": torch.bfloat16, "channels_last": True}):
        torch.library.opcheck(
            torch.ops.dino_opt.multicrop_photometric.default,
            (images, params, list(IMAGENET_MEAN), list(IMAGENET_STD)),
            kwargs,
        )


def test_torch_compile_fullgraph(gen):
    @torch.compile(fullgraph=True)
    def augment(images, params):
        return multicrop_photometric(images, params, dtype=torch.bfloat16) * 2

    images = natural_images(2, 16, 16, gen)
    params = dino_rows(2, gen)
    want = multicrop_photometric(images, params, dtype=torch.bfloat16) * 2
    assert torch.equal(augment(images, params), want)


def good_args(n=2, h=6, w=7):
    return dict(
        images=torch.zeros((n, h, w, 3), dtype=torch.uint8),
        params=rows_tensor([make_row()] * n),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
    )


BAD_ARGS = [
    (dict(images=torch.zeros((2, 6, 7, 3), dtype=torch.float32)), "images must be uint8"),
    (dict(images=torch.zeros((2, 3, 6, 7), dtype=torch.uint8)), "shape [N, H, W, 3]"),
    (dict(images=torch.zeros((6, 7, 3), dtype=torch.uint8)), "shape [N, H, W, 3]"),
    (dict(params=rows_tensor([make_row()] * 3)), "params has 3 rows but images has N=2"),
    (dict(params=torch.zeros((2, 12))), "params must have shape [N, 13]"),
    (dict(params=rows_tensor([make_row()] * 2).double()), "params must be float32"),
    (dict(mean=(0.5, 0.5)), "mean must have 3 values"),
    (dict(std=(0.2, 0.2, 0.2, 0.2)), "std must have 3 values"),
    (dict(std=(0.2, 0.0, 0.2)), "std[1] must be finite and nonzero"),
    (dict(mean=(0.5, float("nan"), 0.5)), "mean[1] must be finite"),
    (dict(dtype=torch.float64), "dtype must be float32, bfloat16 or float16"),
    (dict(dtype=torch.uint8), "dtype must be float32, bfloat16 or float16"),
]


@pytest.mark.parametrize("change,message", BAD_ARGS, ids=[m for _, m in BAD_ARGS])
def test_bad_arguments_raise_clear_errors(change, message):
    args = {**good_args(), **change}
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        multicrop_photometric(**args)


@pytest.mark.parametrize(
    "column,value,message",
    [
        (0, 0.5, "flip .column 0. must be 0 or 1"),
        (12, 2.0, "solarize .column 12. must be 0 or 1"),
        (2, -0.1, "brightness .column 2. must be finite and >= 0"),
        (4, float("inf"), "saturation .column 4. must be finite and >= 0"),
        (5, 0.51, r"hue .column 5. must be in \[-0.5, 0.5\]"),
        (8, 1.0, "order .columns 6-9. must be a permutation"),
        (9, 4.0, "order .columns 6-9. must be a permutation"),
        (7, float("nan"), "order .columns 6-9. must be a permutation"),
        (11, -1.0, "blur_sigma .column 11. must be finite and >= 0"),
        (11, float("nan"), "blur_sigma .column 11. must be finite and >= 0"),
    ],
)
def test_invalid_parameter_rows_are_named(column, value, message):
    args = good_args(n=3)
    args["params"][2, column] = value
    with pytest.raises(RuntimeError, match=r"params\[2\]: " + message):
        multicrop_photometric(**args)


# ---------------------------------------------------------------- CUDA


def cuda_vs_cpu(images, params, **kwargs):
    cpu = multicrop_photometric(images, params, **kwargs)
    gpu = multicrop_photometric(images.cuda(), params.cuda(), **kwargs)
    assert gpu.device.type == "cuda" and gpu.dtype == cpu.dtype and gpu.shape == cpu.shape
    assert gpu.stride() == cpu.stride()
    gpu = gpu.cpu()
    diff = (gpu.float() - cpu.float()).abs()
    equal = (gpu == cpu).float().mean().item()
    print(f"CUDA vs CPU: max |diff| {diff.max().item():.3g}, {equal:.6%} bit-identical")
    # Same arithmetic: identical but for the order of the double sum behind the
    # contrast mean and the libm vs CUDA double exp of the blur taps, which
    # almost never move a float32 result by an ulp.
    torch.testing.assert_close(gpu, cpu, atol=1e-6, rtol=0)
    assert equal > 0.999
    return diff.max().item()


@pytest.mark.cuda
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_matches_cpu(dtype, channels_last, gen):
    for h, w in [(224, 224), (96, 96), (37, 61), (1, 1), (5, 300)]:
        n = 8 if h * w > 10000 else 24
        images = torch.cat([natural_images(n - 2, h, w, gen), noise_images(2, h, w, gen)])
        params = dino_rows(n, gen, blur_p=0.6, solarize_p=0.4)
        cuda_vs_cpu(images, params, dtype=dtype, channels_last=channels_last)


@pytest.mark.cuda
def test_cuda_single_crop_and_large_batch(gen):
    cuda_vs_cpu(natural_images(1, 224, 224, gen), dino_rows(1, gen, blur_p=1.0))
    cuda_vs_cpu(natural_images(1, 96, 96, gen), dino_rows(1, gen, blur_p=0.0))
    images = natural_images(512, 96, 96, gen)
    cuda_vs_cpu(images, dino_rows(512, gen), dtype=torch.bfloat16, channels_last=True)


@pytest.mark.cuda
def test_cuda_large_sigma_takes_several_chunks(gen):
    # Radii up to 60 (clamped to the side): the kernel loops over chunks of 48.
    params = dino_rows(6, gen, blur_p=1.0)
    params[:, 11] *= 10
    cuda_vs_cpu(natural_images(6, 70, 130, gen), params)


@pytest.mark.cuda
def test_cuda_every_single_op(gen):
    special = special_image().unsqueeze(0).repeat(1, 2, 2, 1)
    images = torch.cat([special, natural_images(1, 32, 64, gen)])
    rows = [
        make_row(jitter=1, brightness=1.3),
        make_row(jitter=1, contrast=0.6),
        make_row(jitter=1, saturation=1.2),
        make_row(jitter=1, hue=0.5),
        make_row(jitter=1, hue=-0.37),
        make_row(grayscale=1),
        make_row(sigma=2.0),
        make_row(solarize=1),
        make_row(flip=1),
    ]
    for row in rows:
        cuda_vs_cpu(images, rows_tensor([row] * 2))


@pytest.mark.cuda
def test_cuda_invalid_rows_are_applied_safely(gen):
    # The CUDA kernel does not read params back; bad order entries are skipped.
    images = natural_images(2, 40, 40, gen).cuda()
    params = rows_tensor([make_row(jitter=1, contrast=0.5, order=(1, 1, 7, -3), sigma=1e30)] * 2)
    out = multicrop_photometric(images, params.cuda())
    assert torch.isfinite(out).all()


@pytest.mark.cuda
def test_cuda_errors_and_opcheck(gen):
    images = natural_images(2, 20, 24, gen)
    params = dino_rows(2, gen)
    with pytest.raises(RuntimeError, match="params is on cpu but images is on cuda"):
        multicrop_photometric(images.cuda(), params)
    # The CUDA kernel runs (params is on the GPU) and names the CPU argument.
    with pytest.raises(RuntimeError, match="params is on cuda:0 but images is on cpu"):
        multicrop_photometric(images, params.cuda())
    torch.library.opcheck(
        torch.ops.dino_opt.multicrop_photometric.default,
        (images.cuda(), params.cuda(), list(IMAGENET_MEAN), list(IMAGENET_STD)),
        {"dtype": torch.float16},
    )
