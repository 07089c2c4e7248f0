"""DINO photometric augmentation: dino_opt's multicrop_photometric operator vs
a torchvision.transforms.v2 per-crop loop doing the same ops with the same
parameters on tensors, on DINO's crops of one batch of 64 images (2 global
224^2 crops and 8 local 96^2 crops per image), on the CPU and on the GPU.

    python bench/bench_photometric.py [--device cpu|cuda] [--json PATH] [--images N]
                                      [--threads N]

Parameters are sampled as DINO's DataAugmentationDINO does (docs/design.md, "The algorithm"):
flip 0.5, colour jitter 0.8 in random order, grayscale 0.2, blur with sigma
in [0.1, 2] (p = 1 on global crop 1, 0.1 on global crop 2, 0.5 on local crops),
solarisation 0.2 on global crop 2. Inputs are uint8 [N, H, W, 3] crops, as the
loader produces them; outputs float32 (and bfloat16) [N, 3, H, W].

Floor (GPU): the kernel reads N*H*W*3 bytes and writes N*3*H*W output
elements, so (1 + sizeof(out)) * N*H*W*3 bytes over the measured copy bandwidth.

On the CPU each call allocates its output, and the kernel's first writes
fault in those fresh pages: for the float32 batch (134 MB) that is about 70 ms
of a single-threaded call on a 2-core EPYC VM (9 ms to rewrite reused memory).
The native loader writes into a reused pinned pool instead.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torchvision.transforms.v2.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dino_opt  # noqa: E402
from common import (  # noqa: E402
    RESULTS_DIR,
    copy_bandwidth_gbps,
    device_slug,
    machine,
    print_table,
    time_ms,
    write_json,
)
from dino_opt.ops import IMAGENET_MEAN, IMAGENET_STD, multicrop_photometric  # noqa: E402

GLOBAL_SIZE, LOCAL_SIZE, N_LOCAL = 224, 96, 8


def dino_params(n: int, gen: torch.Generator, blur_p: float, solarize_p: float) -> torch.Tensor:
    """One parameter row per crop, with DINO's probabilities and ranges."""
    u = torch.rand((n, 10), generator=gen)
    rows = torch.zeros((n, 13))
    rows[:, 0] = (u[:, 0] < 0.5).float()
    rows[:, 1] = (u[:, 1] < 0.8).float()
    rows[:, 2] = 0.6 + 0.8 * u[:, 2]  # brightness 0.4
    rows[:, 3] = 0.6 + 0.8 * u[:, 3]  # contrast 0.4
    rows[:, 4] = 0.8 + 0.4 * u[:, 4]  # saturation 0.2
    rows[:, 5] = -0.1 + 0.2 * u[:, 5]  # hue 0.1
    rows[:, 6:10] = torch.stack([torch.randperm(4, generator=gen) for _ in range(n)]).float()
    rows[:, 10] = (u[:, 6] < 0.2).float()
    rows[:, 11] = torch.where(u[:, 7] < blur_p, 0.1 + 1.9 * u[:, 8], torch.zeros(n))
    rows[:, 12] = (u[:, 9] < solarize_p).float()
    return rows


def natural_crops(n: int, size: int, gen: torch.Generator) -> torch.Tensor:
    """Smooth colour fields with a little noise, uint8 [n, size, size, 3]."""
    low = torch.rand((n, 3, size // 12, size // 12), generator=gen)
    img = torch.nn.functional.interpolate(low, size=(size, size), mode="bicubic")
    img = img + 0.02 * torch.randn((n, 3, size, size), generator=gen)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def torchvision_crop(img: torch.Tensor, row: list[float]) -> torch.Tensor:
    """The baseline: torchvision.transforms.v2 functional ops on one crop."""
    flip, jitter, b, c, s, h = row[:6]
    order = [int(v) for v in row[6:10]]
    gray, sigma, sol = row[10:]
    x = F.to_dtype(img.permute(2, 0, 1), torch.float32, scale=True)
    if flip:
        x = F.horizontal_flip(x)
    if jitter:
        ops = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
        factors = (b, c, s, h)
        for code in order:
            x = ops[code](x, factors[code])
    if gray:
        x = F.rgb_to_grayscale(x, num_output_channels=3)
    if sigma > 0:
        k = 2 * math.ceil(3 * sigma) + 1
        x = F.gaussian_blur(x, [k, k], [sigma, sigma])
    if sol:
        x = F.solarize(x, 128 / 255)
    return F.normalize(x, list(IMAGENET_MEAN), list(IMAGENET_STD))


def make_sets(n_images: int, n_sets: int, device: torch.device, seed: int = 0) -> list[dict]:
    """Input sets (rotated between calls so that caches hold none of the data a
    call reads): the global crops (crop 1 and crop 2 of every image) and the
    local crops, uint8 on `device`, with their parameter rows."""
    gen = torch.Generator().manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        g1 = dino_params(n_images, gen, blur_p=1.0, solarize_p=0.0)
        g2 = dino_params(n_images, gen, blur_p=0.1, solarize_p=0.2)
        local = dino_params(n_images * N_LOCAL, gen, blur_p=0.5, solarize_p=0.0)
        groups = {
            "global": (natural_crops(2 * n_images, GLOBAL_SIZE, gen), torch.cat([g1, g2])),
            "local": (natural_crops(N_LOCAL * n_images, LOCAL_SIZE, gen), local),
        }
        sets.append(
            {
                name: (imgs.to(device), params.to(device), params.tolist())
                for name, (imgs, params) in groups.items()
            }
        )
    return sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--json", type=Path, help="output file (default docs/results/photometric_<device>.json)"
    )
    parser.add_argument("--images", type=int, default=64, help="images per batch (10 crops each)")
    parser.add_argument("--repeats", type=int, help="timed calls of our operator")
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for both sides (torch.set_num_threads; default: torch's); "
        "1 gives per-core figures that a busy machine does not distort",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    repeats = args.repeats or (50 if on_gpu else 10)
    base_repeats = 5 if on_gpu else 3
    n_sets = 3 if on_gpu else 2
    sets = make_sets(args.images, n_sets, device)
    bandwidth = copy_bandwidth_gbps(device) if on_gpu else None

    def ours(group, dtype):
        def run(i):
            imgs, params, _ = sets[i % n_sets][group]
            return multicrop_photometric(imgs, params, dtype=dtype)

        return run

    def baseline(group):
        def run(i):
            imgs, _, rows = sets[i % n_sets][group]
            return [torchvision_crop(img, row) for img, row in zip(imgs, rows, strict=True)]

        return run

    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for group in ("global", "local", "batch"):
            groups = ("global", "local") if group == "batch" else (group,)
            crops = sum(sets[0][g][0].shape[0] for g in groups)
            elems = sum(sets[0][g][0].numel() for g in groups)

            def run_ours(i, groups=groups, dtype=dtype):
                for g in groups:
                    ours(g, dtype)(i)

            ms = time_ms(run_ours, device, warmup=3, repeats=repeats)
            row = {
                "case": group,
                "dtype": str(dtype).replace("torch.", ""),
                "crops": crops,
                "ours_ms": ms,
                "ours_us_per_crop": ms * 1e3 / crops,
                "images_per_s": args.images / ms * 1e3 if group == "batch" else None,
            }
            if dtype == torch.float32:

                def run_base(i, groups=groups):
                    for g in groups:
                        baseline(g)(i)

                row["baseline_ms"] = time_ms(run_base, device, warmup=1, repeats=base_repeats)
            if on_gpu:
                nbytes = elems * (1 + torch.empty((), dtype=dtype).element_size())
                row["floor_ms"] = nbytes / (bandwidth * 1e9) * 1e3
            results.append(row)

    rows = []
    for r in results:
        base = r.get("baseline_ms")
        floor = r.get("floor_ms")
        rows.append(
            [
                f"{r['case']} ({r['crops']} crops) {r['dtype']}",
                r["ours_ms"],
                base if base is not None else "-",
                base / r["ours_ms"] if base is not None else "-",
                floor if floor is not None else "-",
                r["ours_ms"] / floor if floor is not None else "-",
            ]
        )
    threads = torch.get_num_threads()
    where = (
        f"{device_slug(device)}, copy bandwidth {bandwidth:.0f} GB/s"
        if on_gpu
        else f"cpu, {threads} threads"
    )
    batch = next(r for r in results if r["case"] == "batch")
    print(
        f"\nour operator: {batch['images_per_s']:.0f} images/s (10 crops each, float32) on {where}"
    )
    columns = ["case", "ours_ms", "torchvision_ms", "torchvision/ours", "floor_ms", "ours/floor"]
    print_table(
        f"Photometric augmentation of {args.images} images' crops, {where} "
        f"(median of {repeats}, baseline {base_repeats}; ms)",
        columns,
        rows,
    )
    out = args.json or RESULTS_DIR / f"photometric_{device_slug(device)}.json"
    write_json(
        out,
        {
            "bench": "photometric",
            "device": device_slug(device),
            "machine": machine(),
            "build_info": dino_opt.build_info(),
            "copy_bandwidth_gbps": bandwidth,
            "images": args.images,
            "repeats": repeats,
            "results": results,
            "table": {"columns": columns, "rows": rows},
        },
    )


if __name__ == "__main__":
    main()
