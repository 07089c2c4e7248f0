"""The DINO head in a frozen-last-layer epoch: forward and backward of a
step's rows with the last layer frozen as dino_opt's step freezes it (its
weights read detached, so no weight gradient) against DINO's way (the
gradient computed, then dropped), under the step's autocast, beside the
floor of the frozen form.

    python bench/bench_head.py [--device cpu|cuda] [--rows 40 640] [--json PATH]

Rows: a step's crops, 4 images x 10 crops (the CPU recipe row) and 64 x 10
(a GPU's). Floor: the frozen form's matrix-product FLOPs (forward, the
inputs' gradients, the MLP's weight gradients) over the measured ``torch.mm``
rate (CPU) or the datasheet's (GPU, when known).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dino_opt  # noqa: E402
from common import (  # noqa: E402
    RESULTS_DIR,
    device_peak_flops,
    device_slug,
    machine,
    print_table,
    time_ms,
    write_json,
)
from dino_opt.models import DINOHead  # noqa: E402
from dino_opt.runtime import resolve_precision  # noqa: E402

IN_DIM, HIDDEN, BOTTLENECK, OUT_DIM = 384, 2048, 256, 65536  # ViT-S/16's DINO head


def matmul_flops(rows: int, frozen: bool) -> float:
    """Matrix-product FLOPs of the head's forward and backward on ``rows``."""
    dims = [IN_DIM, HIDDEN, HIDDEN, BOTTLENECK, OUT_DIM]
    layer = [2 * rows * a * b for a, b in zip(dims[:-1], dims[1:], strict=True)]
    forward = sum(layer)
    inputs_grad = sum(layer[1:])  # the first layer's input needs none
    weights_grad = sum(layer[:-1]) + (0 if frozen else layer[-1])
    return forward + inputs_grad + weights_grad


def step_fn(head: DINOHead, x: torch.Tensor, frozen: bool, dtype: torch.dtype | None):
    last = head.last_layer

    def step(_i: int) -> None:
        last.frozen = frozen
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
            out = head(x)
        out.float().sum().backward()
        for p in last.parameters():  # DINO's way drops it here
            p.grad = None
        head.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, nargs="+", default=[40, 640])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = resolve_precision("auto", device)
    torch.manual_seed(0)
    head = DINOHead(IN_DIM, OUT_DIM, hidden_dim=HIDDEN, bottleneck_dim=BOTTLENECK).to(device)
    rate = device_peak_flops(device)
    results, rows = [], []
    for n in args.rows:
        x = torch.randn(n, IN_DIM, device=device)
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for frozen in (False, True):
                fn = step_fn(head, x, frozen, dtype)
                times[frozen].append(time_ms(fn, device, warmup=2, repeats=args.repeats))
        published, ours = statistics.median(times[False]), statistics.median(times[True])
        floor = matmul_flops(n, frozen=True) / rate * 1e3 if rate else None
        results.append(
            {
                "rows": n,
                "published_ms": published,
                "dino_opt_ms": ours,
                "floor_ms": floor,
                "published_rounds_ms": times[False],
                "dino_opt_rounds_ms": times[True],
                "flops_published": matmul_flops(n, frozen=False),
                "flops_dino_opt": matmul_flops(n, frozen=True),
            }
        )
        rows.append(
            [
                n,
                f"{published:.1f}",
                f"{ours:.1f}",
                "-" if floor is None else f"{floor:.1f}",
                "-" if floor is None else f"{ours / floor:.1f}x",
                f"{published / ours:.2f}x",
            ]
        )
    dtype_name = str(dtype).removeprefix("torch.") if dtype else "float32"
    print_table(
        f"DINO head ({IN_DIM}-{HIDDEN}-{HIDDEN}-{BOTTLENECK}-{OUT_DIM}), forward and backward in "
        f"a frozen-last-layer epoch, {device.type}, {dtype_name}; median of {args.repeats} calls "
        f"x {args.rounds} interleaved rounds",
        ["rows", "published ms", "dino_opt ms", "floor ms", "over floor", "speed-up"],
        rows,
    )
    write_json(
        args.json or RESULTS_DIR / f"head_frozen_{device_slug(device)}.json",
        {
            "bench": "head_frozen",
            "device": str(device),
            "dtype": dtype_name,
            "machine": machine(),
            "build_info": dino_opt.build_info(),
            "matmul_rate_flops": rate,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
