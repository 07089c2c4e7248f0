"""DINO loss, forward + backward: dino_opt's fused operator vs the reference
double loop of the original code vs the dinov2 form (one log-softmax per
student view), on the DINO recipe: B=64 per device, 2 global + 8 local and
2 global + 10 local crops, out_dim 65536, fp32 and bf16 logits.

    python bench/bench_loss.py [--device cpu|cuda] [--batch 64] [--json PATH]

Time: median of forward + backward after a warm-up. Memory: peak allocated
above the inputs during forward + backward (the student gradient included).
Floor (GPU): forward and backward must each read the logits once and the
backward writes the gradient: (2 * (S + T) + S) * B * K * bytes over the
measured copy bandwidth. bf16 baselines run under autocast, as DINO runs them.
On the CPU, PyTorch's allocator is told to use transparent huge pages
(THP_MEM_ALLOC_ENABLE=1, unless set otherwise): every variant allocates
hundreds of MiB per step, and without it page faults dominate and vary.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read by torch's CPU allocator

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests_py"))
import dino_opt  # noqa: E402
from common import (  # noqa: E402
    RESULTS_DIR,
    copy_bandwidth_gbps,
    device_slug,
    machine,
    peak_extra_bytes,
    pin_host_mmap_threshold,
    print_table,
    time_ms,
    write_json,
)
from reference import dino_loss_dinov2_form, dino_loss_reference  # noqa: E402

STUDENT_TEMP, TEACHER_TEMP = 0.1, 0.04
VARIANTS = {
    "dino_opt": dino_opt.dino_loss,
    "reference_loop": dino_loss_reference,
    "dinov2_form": dino_loss_dinov2_form,
}


def run_variant(name, inputs, ncrops, device, dtype):
    fn = VARIANTS[name]
    n_sets = len(inputs)

    def step(i):
        student, teacher, center = inputs[i % n_sets]
        student.grad = None
        autocast = (
            torch.autocast(device.type, dtype=dtype)
            if name != "dino_opt" and dtype != torch.float32
            else contextlib.nullcontext()
        )
        with autocast:
            loss = fn(student, teacher, center, STUDENT_TEMP, TEACHER_TEMP, ncrops)
        loss.backward()
        return loss

    return step


def make_inputs(ncrops, batch, dim, dtype, device):
    # Two input sets, rotated so that caches do not hold the previous call's data.
    inputs = []
    for _ in range(2):
        student = torch.randn(ncrops * batch, dim, device=device).to(dtype).requires_grad_()
        teacher = torch.randn(2 * batch, dim, device=device).to(dtype)
        center = 0.1 * torch.randn(1, dim, device=device)
        inputs.append((student, teacher, center))
    return inputs


def measure(configs, args, device, on_gpu, repeats, bandwidth):
    """All timings first, then all memory peaks (pinning glibc's mmap threshold
    for the CPU peaks would change allocation costs under the timings)."""
    results = []
    for ncrops, dtype in configs:
        inputs = make_inputs(ncrops, args.batch, args.dim, dtype, device)
        row = {
            "ncrops": ncrops,
            "teacher_views": 2,
            "batch": args.batch,
            "dim": args.dim,
            "dtype": str(dtype),
        }
        for name in VARIANTS:
            step = run_variant(name, inputs, ncrops, device, dtype)
            row[f"{name}_ms"] = time_ms(step, device, warmup=5 if on_gpu else 2, repeats=repeats)
        elem = torch.empty((), dtype=dtype).element_size()
        floor_bytes = (2 * (ncrops + 2) + ncrops) * args.batch * args.dim * elem
        row["floor_ms"] = floor_bytes / (bandwidth * 1e9) * 1e3 if on_gpu else None
        results.append(row)
    if not on_gpu:
        pin_host_mmap_threshold()
    for row, (ncrops, dtype) in zip(results, configs, strict=True):
        inputs = make_inputs(ncrops, args.batch, args.dim, dtype, device)
        for name in VARIANTS:
            step = run_variant(name, inputs, ncrops, device, dtype)
            step(0)  # warm: lazily created state is not counted
            inputs[0][0].grad = None
            row[f"{name}_peak_mib"] = peak_extra_bytes(lambda step=step: step(0), device) / 2**20
            inputs[0][0].grad = None
        print(row, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=65536)
    parser.add_argument("--repeats", type=int)
    parser.add_argument(
        "--json", type=Path, help="output file (default docs/results/loss_<device>.json)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    repeats = args.repeats or (20 if on_gpu else 5)
    bandwidth = copy_bandwidth_gbps(device)
    configs = [(ncrops, dtype) for ncrops in (10, 12) for dtype in (torch.float32, torch.bfloat16)]
    results = measure(configs, args, device, on_gpu, repeats, bandwidth)

    rows = []
    for r in results:
        label = f"2+{r['ncrops'] - 2} crops {r['dtype'].replace('torch.', '')}"
        for base in ("reference_loop", "dinov2_form"):
            rows.append(
                [
                    f"{label} vs {base}",
                    r["dino_opt_ms"],
                    r[f"{base}_ms"],
                    r[f"{base}_ms"] / r["dino_opt_ms"],
                    r["dino_opt_peak_mib"],
                    r[f"{base}_peak_mib"],
                    r["dino_opt_peak_mib"] / r[f"{base}_peak_mib"],
                    r["floor_ms"] if on_gpu else "-",
                    r["dino_opt_ms"] / r["floor_ms"] if on_gpu else "-",
                ]
            )
    columns = [
        "case",
        "ours_ms",
        "base_ms",
        "base/ours",
        "ours_MiB",
        "base_MiB",
        "ours/base_mem",
        "floor_ms",
        "ours/floor",
    ]
    print_table(
        f"DINO loss forward+backward, B={args.batch}, K={args.dim}, {device_slug(device)} "
        f"(median of {repeats}; peak memory above the inputs)",
        columns,
        rows,
    )
    out = args.json or RESULTS_DIR / f"loss_{device_slug(device)}.json"
    write_json(
        out,
        {
            "bench": "loss",
            "device": device_slug(device),
            "machine": machine(),
            "copy_bandwidth_gbps": bandwidth,
            "repeats": repeats,
            "results": results,
            "table": {"columns": columns, "rows": rows},
        },
    )


if __name__ == "__main__":
    main()
