"""What frequent checkpoints cost a training step: synchronous writes
(``checkpoint.async=false``: the step waits for torch.save, the SHA-256, the
fsync and the renames) against dino_opt's asynchronous writer (the step
waits only for the copy of the state to host buffers), with
``checkpoint.every_steps`` in {1, 10, 100}, on the demo model and on
ViT-S/16 with DINO's head (out_dim 65536) and crops (2x224 + 8x96).

The loop is the training job's: the trainer's step on synthetic crops, and
every N steps the job's state (student, teacher, optimizer, loss center)
saved through a ``CheckpointManager`` (sync) or an ``AsyncCheckpointWriter``
(async) into a temporary folder beside the results (the disk a run would
use). Each row is the mean step time over a window of steps with saves
against the same window without (interleaved, best of ``--repeats``). A
row marked ``derived`` (every_steps above ``--direct-max``) is the extra
time of one save measured at every_steps=10 spread over N steps.

    python bench/bench_checkpoint.py [--models demo,vit_small] [--batch-size 64,4]
        [--every 1,10,100] [--direct-max 100,10] [--repeats 2] [--quick] [--json PATH]

--quick (make bench-check): no training steps; the time a save holds the
step up, sync (the whole write) against async (the copy to host buffers),
median of --repeats saves of each model's state, in turn.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine, print_table, write_json  # noqa: E402
from dino_opt.checkpoint import AsyncCheckpointWriter, CheckpointManager  # noqa: E402
from dino_opt.config import DEMO_PRESET, Config, apply_overrides  # noqa: E402
from dino_opt.train import (  # noqa: E402  # noqa: E402
    DINOModel,
    MemoryOptimizedDINOTrainer,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    trainer_options,  # noqa: E402
)

MODELS = {
    "demo": lambda: Config.from_dict(DEMO_PRESET),
    # DINO's ViT-S/16 recipe: 2 x 224 + 8 x 96 crops, head out_dim 65536
    "vit_small": lambda: apply_overrides(Config(), []),
}


DEFAULT_BATCH = {"demo": 64, "vit_small": 4}  # a CPU's sizes; on a GPU give --batch-size 64
DEFAULT_DIRECT_MAX = {"demo": 100, "vit_small": 10}


def _per_model(text: str | None, names: list[str], defaults: dict) -> list[int]:
    if text is None:
        return [defaults[n] for n in names]
    values = [int(x) for x in text.split(",")]
    if len(values) == 1:
        return values * len(names)
    if len(values) != len(names):
        raise SystemExit(f"give one value, or one per model ({len(names)}), not {text!r}")
    return values


class _Loop:
    """The training step and the job's checkpoint state of one model."""

    def __init__(self, cfg: Config, batch: int, device: torch.device):
        cfg = apply_overrides(cfg, [f"data.batch_size={batch}", "hardware.device=cpu"])
        torch.manual_seed(0)
        student, teacher = build_models(cfg)
        self.student, self.teacher = student.to(device), teacher.to(device)
        schedules = build_schedules(cfg, 1000)
        model = DINOModel(self.student, self.teacher, schedules.momentum)
        self.loss = build_loss(cfg).to(device)
        self.optimizer = build_optimizer(cfg, self.student, device)
        self.trainer = MemoryOptimizedDINOTrainer(
            model, self.loss, self.optimizer, trainer_options(cfg), device
        )
        self.trainer.set_schedules(schedules, 100)
        a = cfg.augmentation
        g, lc = a.global_crop_size, a.local_crop_size
        self.crops = [torch.randn(batch, 3, g, g, device=device) for _ in range(2)]
        self.crops += [
            torch.randn(batch, 3, lc, lc, device=device) for _ in range(a.num_local_views)
        ]
        self.step = 0

    def train_step(self) -> None:
        self.trainer.train_step_optimized(self.crops, epoch=1)
        self.trainer.optimize_step()
        self.step += 1

    def state(self) -> dict:
        return {
            "student": self.student.state_dict(),
            "teacher": self.teacher.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loss": self.loss.state_dict(),
            "step": self.step,
        }

    def sync(self) -> None:
        if self.crops[0].is_cuda:
            torch.cuda.synchronize()


def _window(loop: _Loop, steps: int, every: int, save) -> float:
    """Seconds per step over ``steps`` steps, saving every ``every`` (0: never)."""
    loop.sync()
    start = time.perf_counter()
    for i in range(1, steps + 1):
        loop.train_step()
        if every and i % every == 0:
            save(loop.state(), i)
    loop.sync()
    return (time.perf_counter() - start) / steps


def _measure(loop: _Loop, folder: Path, every: int, steps: int, repeats: int) -> dict:
    """Step time without saves, with synchronous and with asynchronous ones."""
    manager = CheckpointManager(folder, keep_last=2)
    writer = AsyncCheckpointWriter(manager)
    modes = {
        "none": None,
        "sync": lambda state, i: manager.save(state, epoch=0, step=loop.step),
        "async": lambda state, i: writer.save(state, epoch=0, step=loop.step),
    }
    best = {m: float("inf") for m in modes}
    copy = float("inf")
    for _ in range(repeats):
        for mode, save in modes.items():
            t = _window(loop, steps, every if save else 0, save)
            if mode == "async":
                t_wait = time.perf_counter()
                writer.wait()  # the write of the window's last save, if still going
                t += (time.perf_counter() - t_wait) / steps
                copy = min(copy, writer.last_copy_seconds)
            best[mode] = min(best[mode], t)
    return {**best, "copy_seconds": copy}


def _rows_for(name: str, loop: _Loop, args, tmp: Path) -> list[dict]:
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(loop.state()))
    rows, per_save = [], None
    for every in args.every:
        if every <= args.direct_max:
            steps = max(every * args.saves, args.min_steps)
            m = _measure(loop, tmp / f"{name}-{every}", every, steps, args.repeats)
            base = m["none"]
            row = {
                "model": name,
                "every_steps": every,
                "how": "measured",
                "steps": steps,
                "step_s": base,
                "sync_step_s": m["sync"],
                "async_step_s": m["async"],
                "copy_s": m["copy_seconds"],
            }
            if every == 10:
                per_save = {k: (m[k] - base) * every for k in ("sync", "async")}
        else:
            base = rows[-1]["step_s"]
            row = {
                "model": name,
                "every_steps": every,
                "how": "derived",
                "steps": None,
                "step_s": base,
                "sync_step_s": base + per_save["sync"] / every,
                "async_step_s": base + per_save["async"] / every,
                "copy_s": None,
            }
        row["state_mb"] = nbytes / 1e6
        row["sync_overhead"] = row["sync_step_s"] / base - 1
        row["async_overhead"] = row["async_step_s"] / base - 1
        rows.append(row)
        _print_row(row)
    return rows


def _blocking(loop: _Loop, folder: Path, repeats: int) -> dict:
    """Median seconds that one save holds the caller up, sync and async."""
    manager = CheckpointManager(folder, keep_last=2)
    writer = AsyncCheckpointWriter(manager)
    times = {"sync": [], "async": []}
    for _ in range(repeats):
        loop.step += 1
        t0 = time.perf_counter()
        manager.save(loop.state(), epoch=0, step=loop.step)
        times["sync"].append(time.perf_counter() - t0)
        loop.step += 1
        t0 = time.perf_counter()
        writer.save(loop.state(), epoch=0, step=loop.step)
        times["async"].append(time.perf_counter() - t0)
        writer.wait()  # untimed: the write goes on beside the next steps
    return {f"{k}_blocking_s": statistics.median(v) for k, v in times.items()}


def quick(args, names, batches, tmp: Path) -> list[dict]:
    rows = []
    for name, batch in zip(names, batches, strict=True):
        loop = _Loop(MODELS[name](), batch, torch.device("cpu"))
        row = {"model": name, **_blocking(loop, tmp / name, args.repeats)}
        row["sync_vs_async"] = row["sync_blocking_s"] / row["async_blocking_s"]
        print(
            f"  {name}: a save holds the step {row['sync_blocking_s']:.3f} s sync, "
            f"{row['async_blocking_s']:.3f} s async",
            flush=True,
        )
        rows.append(row)
    return rows


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _print_row(r: dict) -> None:
    print(
        f"  {r['model']} every {r['every_steps']}: step {r['step_s']:.3f} s, sync "
        f"{100 * r['sync_overhead']:+.1f} %, async {100 * r['async_overhead']:+.1f} % "
        f"({r['how']})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,vit_small")
    parser.add_argument(
        "--batch-size", default=None, help="one per model (default 64 demo, 4 vit_small)"
    )
    parser.add_argument("--saves", type=int, default=3, help="saves per measured window")
    parser.add_argument("--min-steps", type=int, default=6)
    parser.add_argument(
        "--direct-max",
        default=None,
        help="per model: every_steps above this are derived (default 100 demo, 10 vit_small)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--every", default="1,10,100", help="checkpoint.every_steps values")
    parser.add_argument("--quick", action="store_true", help="save blocking times only")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.every = [int(n) for n in args.every.split(",")]
    names = args.models.split(",")
    batches = _per_model(args.batch_size, names, DEFAULT_BATCH)
    limits = _per_model(args.direct_max, names, DEFAULT_DIRECT_MAX)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_checkpoint.", dir=RESULTS_DIR.parent.parent))
    if args.quick:
        try:
            rows = quick(args, names, batches, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        write_json(args.json or Path(tmp.name + ".json"), {"machine": machine(), "quick": rows})
        return
    try:
        for name, batch, limit in zip(names, batches, limits, strict=True):
            print(f"{name}: batch {batch} on {device}", flush=True)
            loop = _Loop(MODELS[name](), batch, device)
            run = argparse.Namespace(**{**vars(args), "direct_max": limit})
            rows += [{**r, "batch": batch} for r in _rows_for(name, loop, run, tmp)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table = table_of(rows)
    print_table(
        f"Step time with checkpoints every N steps, sync vs async ({device.type})",
        table["columns"],
        table["rows"],
    )
    slug = device.type if device.type == "cpu" else torch.cuda.get_device_name().replace(" ", "_")
    path = args.json or RESULTS_DIR / f"checkpoint_{slug}.json"
    write_json(path, {"machine": machine(), "device": str(device), "rows": rows, "table": table})


def table_of(rows: list[dict]) -> dict:
    """The printed table of ``rows`` (columns and rows), also in the JSON:
    the docs render it from there."""
    return {
        "columns": [
            "model",
            "batch",
            "state MB",
            "every N",
            "step s",
            "sync s",
            "async s",
            "sync overhead",
            "async overhead",
            "async copy s",
            "how",
        ],
        "rows": [
            [
                r["model"],
                r["batch"],
                round(r["state_mb"]),
                r["every_steps"],
                f"{r['step_s']:.3f}",
                f"{r['sync_step_s']:.3f}",
                f"{r['async_step_s']:.3f}",
                f"{100 * r['sync_overhead']:+.1f} %",
                f"{100 * r['async_overhead']:+.1f} %",
                "-" if r["copy_s"] is None else f"{r['copy_s']:.3f}",
                r["how"],
            ]
            for r in rows
        ],
    }


if __name__ == "__main__":
    main()
