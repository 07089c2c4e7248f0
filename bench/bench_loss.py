"""DINO loss, forward + backward: dino_opt's fused operator vs the reference
double loop of the original code vs the dinov2 form (one log-softmax per
student view), on the DINO recipe: B=64 per device, 2 global + 8 local and
2 global + 10 local crops, out_dim 65536, fp32 and bf16 logits. Second table:
the iBOT masked-patch loss, dino_opt.ibot_loss vs dinov2's plain form, on
dinov2's masking of the B * 2 global crops (see ibot_masked_tokens).

    python bench/bench_loss.py [--device cpu|cuda] [--batch 64] [--only dino|ibot] [--quick]
                               [--json PATH]

Time: median of forward + backward after a warm-up. Memory: peak allocated
above the inputs during forward + backward (the student gradient included).
Floor: forward and backward must each read the logits once and the
backward writes the gradient: (2 * (S + T) + S) * B * K * bytes over the
copy bandwidth measured in the same run (on a CPU the gradient's
write-allocate reads are not counted: a floor below what a cached store
can reach) (iBOT: the forward reads S and T once, the backward
reads them and writes the gradient, (3N * S_bytes + 2M * T_bytes) * K). bf16
baselines run under autocast, as DINO runs them.
On the CPU the bench runs in the environment it is given, as a user's script
does: the committed figures (docs/results/loss_cpu.json) are of the default
environment, those of loss_cpu_thp.json of THP_MEM_ALLOC_ENABLE=1 (PyTorch's
CPU allocator asks for transparent huge pages); the JSON records which.
--quick (make bench-check): float32, 2+8 crops at B=16 (a gradient above
glibc's mmap threshold, as at B=64) against the reference loop, iBOT at B=8,
no memory peaks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

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
from dino_opt.ops import release_cpu_buffers  # noqa: E402
from reference import (  # noqa: E402
    dino_loss_dinov2_form,
    dino_loss_reference,
    ibot_loss_dinov2_form,
)

STUDENT_TEMP, TEACHER_TEMP = 0.1, 0.04
VARIANTS = {
    "dino_opt": dino_opt.dino_loss,
    "reference_loop": dino_loss_reference,
    "dinov2_form": dino_loss_dinov2_form,
}


def _baseline_autocast(name, device, dtype):
    """Autocast for a baseline in half precision, as DINO and dinov2 run
    them; dino_opt's operator takes the half-precision logits as they are."""
    if name != "dino_opt" and dtype != torch.float32:
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def run_variant(name, inputs, ncrops, device, dtype):
    fn = VARIANTS[name]
    n_sets = len(inputs)

    def step(i):
        student, teacher, center = inputs[i % n_sets]
        student.grad = None
        with _baseline_autocast(name, device, dtype):
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


def measure_times(configs, args, device, on_gpu, repeats, bandwidth):
    variants = ("dino_opt", "reference_loop") if args.quick else tuple(VARIANTS)
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
        for name in variants:
            step = run_variant(name, inputs, ncrops, device, dtype)
            row[f"{name}_ms"] = time_ms(step, device, warmup=5 if on_gpu else 2, repeats=repeats)
        elem = torch.empty((), dtype=dtype).element_size()
        floor_bytes = (2 * (ncrops + 2) + ncrops) * args.batch * args.dim * elem
        row["floor_ms"] = floor_bytes / (bandwidth * 1e9) * 1e3
        results.append(row)
    return results


def measure_peaks(results, configs, args, device):
    for row, (ncrops, dtype) in zip(results, configs, strict=True):
        inputs = make_inputs(ncrops, args.batch, args.dim, dtype, device)
        for name in VARIANTS:
            step = run_variant(name, inputs, ncrops, device, dtype)
            step(0)  # warm: lazily created state is not counted
            inputs[0][0].grad = None
            release_cpu_buffers()  # the gradient's buffer counts, as on a first step
            row[f"{name}_peak_mib"] = peak_extra_bytes(lambda step=step: step(0), device) / 2**20
            inputs[0][0].grad = None
        print(row, flush=True)


def comparison_rows(results, label_of, baselines):
    rows = []
    for r in results:
        for base in (b for b in baselines if f"{b}_ms" in r):
            peaks = "dino_opt_peak_mib" in r
            rows.append(
                [
                    f"{label_of(r)} vs {base}",
                    r["dino_opt_ms"],
                    r[f"{base}_ms"],
                    r[f"{base}_ms"] / r["dino_opt_ms"],
                    r["dino_opt_peak_mib"] if peaks else "-",
                    r[f"{base}_peak_mib"] if peaks else "-",
                    r["dino_opt_peak_mib"] / r[f"{base}_peak_mib"] if peaks else "-",
                    r["floor_ms"],
                    r["dino_opt_ms"] / r["floor_ms"],
                ]
            )
    return rows


COLUMNS = [
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


# ------------------------------------------------------------------ iBOT


def ibot_masked_tokens(batch, n_tokens=256, mask_probability=0.5, ratios=(0.1, 0.5)):
    """Masked tokens of each masked global crop, as dinov2's collate draws
    them for B images of 2 global crops (224 / 14 -> 256 tokens):
    int(2B * mask_probability) crops are masked, crop i with a ratio drawn in
    [r_i, r_i+1] of linspace(0.1, 0.5, n + 1), here its midpoint, so that
    the count is fixed."""
    n_masked = int(2 * batch * mask_probability)
    edges = torch.linspace(*ratios, n_masked + 1).tolist()
    return [int(n_tokens * (edges[i] + edges[i + 1]) / 2) for i in range(n_masked)]


def ibot_fused(student, targets, weights, student_temp, n_crops):
    return dino_opt.ibot_loss(student, targets, weights, student_temp) / n_crops


IBOT_VARIANTS = {"dino_opt": ibot_fused, "dinov2_form": ibot_loss_dinov2_form}
IBOT_DTYPES = (torch.float32, torch.bfloat16)


def ibot_inputs(args, dtype, device):
    """Student logits of the masked tokens, float32 teacher probabilities (as
    under autocast), weights 1 / masked tokens of the token's crop."""
    counts = ibot_masked_tokens(args.batch)
    n = sum(counts)
    student = torch.randn(n, args.dim, device=device).to(dtype).requires_grad_()
    targets = torch.softmax(torch.randn(n, args.dim, device=device) / 0.5, dim=-1)
    weights = torch.repeat_interleave(
        1.0 / torch.tensor(counts, dtype=torch.float32), torch.tensor(counts)
    ).to(device)
    return student, targets, weights


def ibot_step(name, inputs, n_crops, device, dtype):
    fn = IBOT_VARIANTS[name]
    student, targets, weights = inputs

    def step(i):
        student.grad = None
        with _baseline_autocast(name, device, dtype):
            loss = fn(student, targets, weights, STUDENT_TEMP, n_crops)
        loss.backward()
        return loss

    return step


def ibot_times(args, device, on_gpu, repeats, bandwidth):
    # One input set: at ~5000 x 65536 each tensor is far larger than any cache.
    results = []
    for dtype in IBOT_DTYPES[: 1 if args.quick else 2]:
        inputs = ibot_inputs(args, dtype, device)
        n, dim = inputs[0].shape
        row = {
            "tokens": n,
            "images": args.batch,
            "dim": dim,
            "dtype": str(dtype),
            "targets_dtype": str(inputs[1].dtype),
        }
        for name in IBOT_VARIANTS:
            step = ibot_step(name, inputs, 2 * args.batch, device, dtype)
            row[f"{name}_ms"] = time_ms(step, device, warmup=5 if on_gpu else 2, repeats=repeats)
        floor_bytes = (3 * inputs[0].element_size() + 2 * inputs[1].element_size()) * n * dim
        row["floor_ms"] = floor_bytes / (bandwidth * 1e9) * 1e3
        results.append(row)
        del inputs
    return results


def ibot_peaks(results, args, device):
    for row, dtype in zip(results, IBOT_DTYPES, strict=False):
        inputs = ibot_inputs(args, dtype, device)
        for name in IBOT_VARIANTS:
            step = ibot_step(name, inputs, 2 * args.batch, device, dtype)
            step(0)  # warm: lazily created state is not counted
            inputs[0].grad = None
            release_cpu_buffers()  # the gradient's buffer counts, as on a first step
            row[f"{name}_peak_mib"] = peak_extra_bytes(lambda step=step: step(0), device) / 2**20
            inputs[0].grad = None
        print(row, flush=True)
        del inputs


# ------------------------------------------------------------------ main


def merged_payload(path: Path, slug: str) -> dict:
    """The results file as it is (a run of one table keeps the other's rows)."""
    if path.exists():
        payload = json.loads(path.read_text())
        if payload.get("device") == slug:
            return payload
    return {"bench": "loss", "device": slug}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, help="images per step (default 64; --quick 16)")
    parser.add_argument("--dim", type=int, default=65536)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--only", choices=("dino", "ibot"), help="one table (default: both)")
    parser.add_argument("--quick", action="store_true", help="the bench-check subset (see above)")
    parser.add_argument(
        "--json", type=Path, help="output file (default docs/results/loss_<device>.json)"
    )
    return parser.parse_args()


def environment() -> dict:
    """What decides the CPU allocation costs: PyTorch's THP switch and the
    kernel's transparent huge page mode."""
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        thp = None
    return {"THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE"), "kernel_thp": thp}


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args.batch = args.batch or (16 if args.quick else 64)
    repeats = args.repeats or (20 if on_gpu else 7 if args.quick else 5)
    bandwidth = copy_bandwidth_gbps(device)
    configs = [(ncrops, dtype) for ncrops in (10, 12) for dtype in (torch.float32, torch.bfloat16)]
    configs = configs[:1] if args.quick else configs
    if args.only == "ibot":
        configs = []
    # All timings first, then all memory peaks (pinning glibc's mmap threshold
    # for the CPU peaks would change allocation costs under the timings).
    results = measure_times(configs, args, device, on_gpu, repeats, bandwidth)
    ibot_args = argparse.Namespace(**{**vars(args), "batch": 8 if args.quick else args.batch})
    ibot = ibot_times(ibot_args, device, on_gpu, repeats, bandwidth) if args.only != "dino" else []
    if not args.quick:
        if not on_gpu:
            pin_host_mmap_threshold()
        measure_peaks(results, configs, args, device)
        if ibot:
            ibot_peaks(ibot, ibot_args, device)

    slug = device_slug(device)
    out = args.json or RESULTS_DIR / f"loss_{slug}.json"
    payload = merged_payload(out, slug)
    if results:
        rows = comparison_rows(
            results,
            lambda r: f"2+{r['ncrops'] - 2} crops {r['dtype'].replace('torch.', '')}",
            ("reference_loop", "dinov2_form"),
        )
        print_table(
            f"DINO loss forward+backward, B={args.batch}, K={args.dim}, {slug} "
            f"(median of {repeats}; peak memory above the inputs)",
            COLUMNS,
            rows,
        )
        payload.update(
            machine=machine(),
            environment=environment(),
            copy_bandwidth_gbps=bandwidth,
            repeats=repeats,
            results=results,
            table={"columns": COLUMNS, "rows": rows},
        )
    if ibot:
        rows = comparison_rows(
            ibot,
            lambda r: f"{r['tokens']} tokens {r['dtype'].replace('torch.', '')}",
            ("dinov2_form",),
        )
        print_table(
            f"iBOT patch loss forward+backward, B={ibot_args.batch} images x 2 global crops, "
            f"K={args.dim}, {slug} (median of {repeats}; peak memory above the inputs)",
            COLUMNS,
            rows,
        )
        payload["ibot"] = {
            "machine": machine(),
            "environment": environment(),
            "copy_bandwidth_gbps": bandwidth,
            "repeats": repeats,
            "results": ibot,
            "table": {"columns": COLUMNS, "rows": rows},
        }
    write_json(out, payload)


if __name__ == "__main__":
    main()
