"""Gram anchoring loss (DINOv3), forward + backward: dino_opt's fused operator
vs dinov3's form (the plain torch formula that makes both Gram matrices
whole: float32 cast, normalise, matmul, clamp, mean squared difference), per
image [B, N, D] and over the batch [B * N, D], fp32 and bf16 features.

    python bench/bench_gram_loss.py [--device cpu|cuda] [--rows 8192] [--dim 1024]
                                    [--image-rows 256] [--json PATH]

Time: median of forward + backward after a warm-up. Memory: peak above the
inputs during forward + backward of a warm step (the student gradient included), measured
as bench_loss.py measures it. Floor: the gradient's bytes (memory); FLOPs
over the measured rate of one [M, D] x [D, D] matmul (time), M = B * N rows
and n rows per Gram matrix (N per image, M over the batch): without clamping
the lesser of the D x D identity, 8 M D^2 (S^T S and T^T T symmetric, M D^2
each; S^T T, 2 M D^2; the backward's S (S^T S) and T (T^T S), 4 M D^2), and
the tiles, 4 M n D (both similarity matrices symmetric, M n D each; the
backward's C S, 2 M n D); with clamping the tiles.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read by torch's CPU allocator

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests_py"))
from common import (  # noqa: E402
    RESULTS_DIR,
    device_slug,
    machine,
    peak_extra_bytes,
    pin_host_mmap_threshold,
    print_table,
    time_ms,
    write_json,
)
from dino_opt.dinov3 import GramLoss  # noqa: E402
from reference import gram_loss_reference  # noqa: E402

COLUMNS = [
    "config",
    "ours ms",
    "dinov3 ms",
    "speed-up",
    "floor ms",
    "ours MiB",
    "dinov3 MiB",
    "floor MiB",
]


def dinov3_form(remove_neg):
    def form(student, teacher, img_level):
        return gram_loss_reference(student.float(), teacher.float(), img_level, True, remove_neg)

    return form


def ours(remove_neg):
    module = GramLoss(remove_neg=remove_neg)
    return lambda student, teacher, img_level: module(student, teacher, img_level=img_level)


def make_step(fn, config, args, device):
    level, dtype, remove_neg = config
    shape = (args.rows // args.image_rows, args.image_rows, args.dim)
    gen = torch.Generator().manual_seed(0)
    student = (torch.randn(shape, generator=gen) + 0.2).to(device, dtype).requires_grad_()
    teacher = (student.detach().float() + 0.5 * torch.randn(shape, generator=gen)).to(device, dtype)
    img_level = level == "image"

    def step(i):
        fn(remove_neg)(student, teacher, img_level).backward()
        student.grad = None

    return step


def matmul_gflops(args, device) -> float:
    a = torch.randn(args.rows, args.dim, device=device)
    b = torch.randn(args.dim, args.dim, device=device)
    ms = time_ms(lambda i: a @ b, device, warmup=2, repeats=5)
    return 2 * args.rows * args.dim**2 / (ms * 1e-3) / 1e9


def label(config) -> str:
    level, dtype, remove_neg = config
    clamp = ", remove_neg" if remove_neg else ""
    return f"{level} {str(dtype)[6:]}{clamp}"


def floor_flops(config, args) -> float:
    level, _, remove_neg = config
    n = args.image_rows if level == "image" else args.rows
    tiles = 4 * args.rows * n * args.dim
    return tiles if remove_neg else min(tiles, 8 * args.rows * args.dim**2)


def measure(configs, args, device, repeats, gflops):
    rows = []
    for config in configs:
        times = {
            name: time_ms(make_step(fn, config, args, device), device, warmup=1, repeats=repeats)
            for name, fn in (("ours", ours), ("dinov3", dinov3_form))
        }
        rows.append(
            {"config": label(config), "ours_ms": times["ours"], "dinov3_ms": times["dinov3"]}
        )
    if device.type == "cpu":
        pin_host_mmap_threshold()
    for config, row in zip(configs, rows, strict=True):
        for name, fn in (("ours", ours), ("dinov3", dinov3_form)):
            step = make_step(fn, config, args, device)
            step(0)  # warm: the peak of a step in a running training, not of the first one
            row[f"{name}_peak_mib"] = peak_extra_bytes(lambda step=step: step(0), device) / 2**20
        row["floor_mib"] = args.rows * args.dim * config[1].itemsize / 2**20
        row["floor_ms"] = floor_flops(config, args) / (gflops * 1e9) * 1e3
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=8192, help="B * N")
    parser.add_argument("--image-rows", type=int, default=256, help="N, patches per image")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--json", type=Path, help="default docs/results/gram_loss_<device>.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    repeats = args.repeats or (20 if device.type == "cuda" else 3)
    gflops = matmul_gflops(args, device)
    configs = [
        ("batch", torch.float32, False),
        ("batch", torch.bfloat16, False),
        ("batch", torch.float32, True),
        ("image", torch.float32, False),
        ("image", torch.bfloat16, False),
    ]
    results = measure(configs, args, device, repeats, gflops)
    table = [
        [
            r["config"],
            r["ours_ms"],
            r["dinov3_ms"],
            r["dinov3_ms"] / r["ours_ms"],
            r["floor_ms"],
            r["ours_peak_mib"],
            r["dinov3_peak_mib"],
            r["floor_mib"],
        ]
        for r in results
    ]
    slug = device_slug(device)
    print_table(
        f"Gram loss forward+backward, B*N={args.rows}, N={args.image_rows} per image, "
        f"D={args.dim}, {slug} (median of {repeats}; peak memory above the inputs of a warm step; "
        f"matmul {gflops:.0f} GFLOP/s)",
        COLUMNS,
        table,
    )
    payload = {
        "machine": machine(),
        "matmul_gflops": gflops,
        "repeats": repeats,
        "shape": {"rows": args.rows, "image_rows": args.image_rows, "dim": args.dim},
        "results": results,
        "table": {"columns": COLUMNS, "rows": table},
    }
    write_json(args.json or RESULTS_DIR / f"gram_loss_{slug}.json", payload)


if __name__ == "__main__":
    main()
