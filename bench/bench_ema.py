"""EMA teacher update: dino_opt's fused operator vs the per-parameter loop of
the original DINO code vs torch._foreach_lerp_ (timm's ModelEmaV3), on the
parameter sets of ViT-S/16 and ViT-B/16, beside the memory-bandwidth floor.

    python bench/bench_ema.py [--device cpu|cuda] [--models ViT-S/16 ...] [--json PATH]

Floor: each step reads teacher and student and writes the teacher, so
(2 * 4 + 4) bytes per fp32 parameter over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

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
from dino_opt.ops import ema_update_  # noqa: E402

MOMENTUM = 0.996


def vit_parameter_shapes(
    embed_dim: int, depth: int, patch: int = 16, img: int = 224
) -> list[tuple]:
    """Parameter shapes of a DINO ViT backbone (timm/dino layout, in order)."""
    d, hidden = embed_dim, 4 * embed_dim
    shapes = [(1, 1, d), (1, (img // patch) ** 2 + 1, d), (d, 3, patch, patch), (d,)]
    for _ in range(depth):
        shapes += [
            (d,),
            (d,),
            (3 * d, d),
            (3 * d,),
            (d, d),
            (d,),
            (d,),
            (d,),
            (hidden, d),
            (hidden,),
            (d, hidden),
            (d,),
        ]
    return shapes + [(d,), (d,)]


MODELS = {"ViT-S/16": vit_parameter_shapes(384, 12), "ViT-B/16": vit_parameter_shapes(768, 12)}


def dino_loop(teacher, student, m):
    """The EMA step of the original DINO training script, one parameter at a time."""
    for param_q, param_k in zip(student, teacher, strict=True):
        param_k.data.mul_(m).add_((1 - m) * param_q.detach().data)


def foreach_lerp(teacher, student, m):
    torch._foreach_lerp_(teacher, student, 1.0 - m)


def flat_pair(teacher, student):
    return [torch.cat([t.flatten() for t in teacher])], [torch.cat([s.flatten() for s in student])]


def bench_model(name, shapes, device, n_sets, warmup, repeats, floor_gbps):
    numel = sum(torch.Size(s).numel() for s in shapes)
    # Several independent parameter sets, rotated between calls so that caches
    # hold none of the data a call reads.
    sets = []
    for _ in range(n_sets):
        teacher = [torch.randn(s, device=device) for s in shapes]
        student = [torch.randn(s, device=device) for s in shapes]
        sets.append((teacher, student, *flat_pair(teacher, student)))
    variants = {
        "dino_opt": lambda i: ema_update_(sets[i % n_sets][0], sets[i % n_sets][1], MOMENTUM),
        "dino_opt_flat": lambda i: ema_update_(sets[i % n_sets][2], sets[i % n_sets][3], MOMENTUM),
        "foreach_lerp": lambda i: foreach_lerp(sets[i % n_sets][0], sets[i % n_sets][1], MOMENTUM),
        "dino_loop": lambda i: dino_loop(sets[i % n_sets][0], sets[i % n_sets][1], MOMENTUM),
    }
    ms = {k: time_ms(fn, device, warmup=warmup, repeats=repeats) for k, fn in variants.items()}
    floor_ms = 12 * numel / (floor_gbps * 1e9) * 1e3
    return {
        "model": name,
        "tensors": len(shapes),
        "params": numel,
        "floor_ms": floor_ms,
        **{f"{k}_ms": v for k, v in ms.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--json", type=Path, help="output file (default docs/results/ema_<device>.json)"
    )
    parser.add_argument("--repeats", type=int, help="timed calls per variant")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(MODELS),
        default=list(MODELS),
        help="parameter sets to time (default: all)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    repeats = args.repeats or (100 if on_gpu else 15)
    bandwidth = copy_bandwidth_gbps(device)
    results = [
        bench_model(
            name,
            shapes,
            device,
            n_sets=3 if on_gpu else 2,
            warmup=10 if on_gpu else 3,
            repeats=repeats,
            floor_gbps=bandwidth,
        )
        for name, shapes in MODELS.items()
        if name in args.models
    ]

    rows = []
    for r in results:
        ours = r["dino_opt_ms"]
        for base in ("foreach_lerp", "dino_loop", "dino_opt_flat"):
            label = {
                "foreach_lerp": "torch._foreach_lerp_",
                "dino_loop": "DINO per-param loop",
                "dino_opt_flat": "dino_opt flat buffers",
            }[base]
            b = r[f"{base}_ms"]
            rows.append(
                [f"{r['model']} vs {label}", ours, b, b / ours, r["floor_ms"], ours / r["floor_ms"]]
            )
    print_table(
        f"EMA update, fp32, {device_slug(device)}, copy bandwidth {bandwidth:.1f} GB/s "
        f"(median of {repeats}; ms)",
        ["case", "ours_ms", "baseline_ms", "baseline/ours", "floor_ms", "ours/floor"],
        rows,
    )
    out = args.json or RESULTS_DIR / f"ema_{device_slug(device)}.json"
    write_json(
        out,
        {
            "bench": "ema",
            "device": device_slug(device),
            "machine": machine(),
            "build_info": dino_opt.build_info(),
            "copy_bandwidth_gbps": bandwidth,
            "momentum": MOMENTUM,
            "repeats": repeats,
            "results": results,
            "table": {
                "columns": [
                    "case",
                    "ours_ms",
                    "baseline_ms",
                    "baseline/ours",
                    "floor_ms",
                    "ours/floor",
                ],
                "rows": rows,
            },
        },
    )


if __name__ == "__main__":
    main()
