"""Profiler and memory tracker overhead on a training-like DINO loop.

    python bench/bench_profiler.py [--device cpu|cuda] [--steps 200] [--json PATH]

Variants, on the same model and data, run interleaved in blocks of 10 steps in
a shuffled order, so that drift of the machine hits them alike:
  plain     no instrumentation;
  dino_opt  the lesson's seven blocks as ranges (host clock, CUDA events on a
            GPU, NVTX), MemoryTracker step peaks and its sampling thread;
  lesson    the lesson's DINOProfiler approach written from its text, made
            correct: time.time() around each block, with torch.cuda.synchronize()
            before each reading on a GPU (else it times launches), the
            allocated memory per block, and its MemoryTracker.start_step()
            (which empties the CUDA cache) every step.
Also the cost of one range (push + pop) with no work inside, ours vs the
lesson's profile_block.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dino_opt  # noqa: E402
from common import RESULTS_DIR, device_slug, machine, print_table, write_json  # noqa: E402
from dino_opt.observe import (
    DINOProfiler,  # noqa: E402
    MemoryTracker,  # noqa: E402
)

BLOCKS = [
    "data_movement",
    "student_forward",
    "teacher_forward",
    "loss_computation",
    "backward_pass",
    "optimizer_step",
    "teacher_update",
]


class LessonProfiler:
    """The lesson's DINOProfiler.profile_block, with the synchronisation it needs
    to time GPU work, and its MemoryTracker.start_step()."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.timings, self.memory = {}, {}

    @contextlib.contextmanager
    def profile_block(self, name):
        if self.cuda:
            torch.cuda.synchronize()
        start = time.time()
        start_mem = torch.cuda.memory_allocated() if self.cuda else 0
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            end = time.time()
            end_mem = torch.cuda.memory_allocated() if self.cuda else 0
            self.timings.setdefault(name, []).append(end - start)
            self.memory.setdefault(name, []).append((end_mem - start_mem) / 2**20)

    def start_step(self):
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


class Setup:
    """A small DINO step: MLP student and EMA teacher, 4 crops, fused loss."""

    def __init__(self, device, width, out_dim, batch, crops=4):
        torch.manual_seed(0)
        self.device = device
        self.student = nn.Sequential(
            nn.Linear(width, width),
            nn.GELU(),
            nn.Linear(width, width),
            nn.GELU(),
            nn.Linear(width, out_dim),
        ).to(device)
        self.ema = dino_opt.EMATeacher(self.student, momentum_schedule=0.996)
        self.loss = dino_opt.DINOLoss(out_dim, crops, 0.04, 0.04, 0, 1).to(device)
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=1e-4)
        self.crops = [torch.randn(batch, width) for _ in range(crops)]
        if device.type == "cuda":
            self.crops = [c.pin_memory() for c in self.crops]
        self.steps = 0

    def step(self, block):
        with block("data_movement"):
            crops = [c.to(self.device, non_blocking=True) for c in self.crops]
        with block("student_forward"):
            s = torch.cat([self.student(c) for c in crops])
        with block("teacher_forward"), torch.no_grad():
            t = torch.cat([self.ema.teacher(c) for c in crops[:2]])
        with block("loss_computation"):
            loss = self.loss(s, t, 0)
        with block("backward_pass"):
            loss.backward()
        with block("optimizer_step"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        with block("teacher_update"):
            self.ema.update(self.steps)
        self.steps += 1


def timed_step(setup, device, run):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def loop_overhead(args, device):
    setup = Setup(device, args.width, args.out_dim, args.batch)
    ours = DINOProfiler(device)
    tracker = MemoryTracker(device, sample_period=0.1, sampling=True)
    lesson = LessonProfiler(device)

    def plain():
        setup.step(lambda name: contextlib.nullcontext())

    def with_ours():
        tracker.start_step()
        setup.step(ours.profile_block)
        ours.profiler.step(args.batch)
        tracker.end_step()

    def with_lesson():
        lesson.start_step()
        setup.step(lesson.profile_block)

    variants = {"plain": plain, "dino_opt": with_ours, "lesson": with_lesson}
    times = {k: [] for k in variants}
    for _ in range(10):  # warm-up
        for run in variants.values():
            run()
    # One step of each variant per round, in a shuffled order: adjacent steps
    # see the same machine state, so per-round ratios cancel the drift.
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for _ in range(args.steps):
        shuffle(order)
        for name in order:
            times[name].append(timed_step(setup, device, variants[name]))
    tracker.close()
    ratios = {
        k: statistics.median(a / b for a, b in zip(times[k], times["plain"], strict=True))
        for k in ("dino_opt", "lesson")
    }
    step_ms = {k: statistics.median(v) for k, v in times.items()}
    return step_ms, ratios, ours.get_summary_stats(), ours, tracker


def range_cost_us(device, n=20000):
    ours = DINOProfiler(device, track_memory=False)
    lesson = LessonProfiler(device)
    out = {}
    for name, block in (("dino_opt", ours.profile_block), ("lesson", lesson.profile_block)):
        for _ in range(1000):
            with block("empty"):
                pass
        t0 = time.perf_counter()
        for _ in range(n):
            with block("empty"):
                pass
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def tracker_step_us(device, n=2000):
    tracker = MemoryTracker(device)
    t0 = time.perf_counter()
    for _ in range(n):
        tracker.start_step()
        tracker.end_step()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int)
    parser.add_argument("--out-dim", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plots", type=Path, help="folder for the profile and memory plots")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.width = args.width or (4096 if device.type == "cuda" else 384)
    step_ms, ratios, stats, ours, tracker = loop_overhead(args, device)
    per_range = range_cost_us(device)
    tracker_step = tracker_step_us(device)
    # The instrumentation's own cost per step, from its measured per-call costs.
    direct = (len(BLOCKS) * per_range["dino_opt"] + tracker_step) / (step_ms["plain"] * 1e3)
    rows = [
        [
            "step time: dino_opt ranges + tracker vs none (ms)",
            step_ms["dino_opt"],
            step_ms["plain"],
            ratios["dino_opt"],
        ],
        [
            "step time: lesson profiler vs none (ms)",
            step_ms["lesson"],
            step_ms["plain"],
            ratios["lesson"],
        ],
        [
            "one empty range: dino_opt vs lesson (us)",
            per_range["dino_opt"],
            per_range["lesson"],
            per_range["dino_opt"] / per_range["lesson"],
        ],
        ["tracker start_step + end_step (us)", tracker_step, "-", "-"],
    ]
    print_table(
        f"Profiling overhead, {device_slug(device)}, {len(BLOCKS)} ranges per step, "
        f"{args.steps} rounds (last column: median of per-round ratios)",
        ["case", "ours", "baseline", "ours/baseline"],
        rows,
    )
    overhead = {k: 100 * (ratios[k] - 1) for k in ("dino_opt", "lesson")}
    print(
        f"overhead over the plain step, paired: dino_opt {overhead['dino_opt']:+.2f}%, "
        f"lesson {overhead['lesson']:+.2f}%; dino_opt's own calls: {100 * direct:.2f}% of a step"
    )
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
        ours.plot_performance_analysis(args.plots / f"profile_{device_slug(device)}.png")
        tracker.plot_timeline(args.plots / f"memory_timeline_{device_slug(device)}.png")
    out = args.json or RESULTS_DIR / f"profiler_{device_slug(device)}.json"
    write_json(
        out,
        {
            "bench": "profiler",
            "device": device_slug(device),
            "machine": machine(),
            "step_ms": step_ms,
            "overhead_percent": overhead,
            "direct_overhead_percent": 100 * direct,
            "tracker_step_us": tracker_step,
            "range_us": per_range,
            "block_stats": stats,
            "steps": args.steps,
            "table": {"columns": ["case", "ours", "baseline", "ours/baseline"], "rows": rows},
        },
    )


if __name__ == "__main__":
    main()
