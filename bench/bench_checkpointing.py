"""Activation checkpointing policies: peak memory and step time of a DINO
training step with none (the baseline), full, selective, every-2nd-block
checkpointing and selective at each rung of ``auto``'s ladder (rising
``recompute_threshold``), beside the memory model's prediction
(dino_opt.tune.estimate_memory).

    python bench/bench_checkpointing.py [--backbone vit_tiny] [--batch-size 16]
        [--steps 7] [--threads 1] [--compile] [--json PATH]

Each row builds the models as ``dino-opt train`` does (build_models,
MemoryOptimizedDINOTrainer, AdamW; float32 on the CPU) with
``hardware.activation_checkpointing`` / ``hardware.checkpoint_every`` set, then:

- memory: a run of its own under dino_opt.observe.AllocationTrace from
  before the models are built: the bytes of live tensors at the peak of the
  second step (parameters, teacher, AdamW's moments and the step's
  activations; the first step creates the moments). The trace counts every
  tensor the allocator hands out, not the process's resident size.
- time: the median over ``--steps`` steps after one warm-up step, without
  the trace (it slows allocation down), the cases' steps interleaved so that
  the machine's load touches them alike; ``--threads`` torch threads (1 by
  default: on a shared 2-core machine OpenMP's spinning threads make the
  time depend on the neighbours).

``--compile`` adds each policy with ``hardware.compile`` (every block
compiled with its checkpointing inside); the compilation is in the warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dino_opt  # noqa: E402
from common import RESULTS_DIR, machine, print_table, write_json  # noqa: E402
from dino_opt.config import load_config  # noqa: E402
from dino_opt.observe import AllocationTrace  # noqa: E402
from dino_opt.train import (  # noqa: E402
    DINOModel,
    build_loss,
    build_models,
    build_optimizer,
    build_trainer,
)
from dino_opt.tune import checkpointing_ladder, estimate_memory  # noqa: E402

POLICIES = [("none", 1), ("full", 1), ("selective", 1), ("full", 2), ("selective", 2)]
MIB = 2**20


def config(args, policy: str, every: int, compiled: bool, threshold: float = 0.0):
    return load_config(
        None,
        [
            f"model.backbone={args.backbone}",
            "model.patch_size=16",
            "model.out_dim=4096",
            "augmentation.global_crop_size=96",
            "augmentation.local_crop_size=48",
            "augmentation.num_local_views=6",
            f"data.batch_size={args.batch_size}",
            "hardware.device=cpu",
            "hardware.precision=fp32",
            f"hardware.activation_checkpointing={policy}",
            f"hardware.checkpoint_every={every}",
            f"hardware.recompute_threshold={threshold!r}",
            f"hardware.compile={str(compiled).lower()}",
            "optim.freeze_last_layer=0",
        ],
    )


def build(cfg):
    torch.manual_seed(0)
    student, teacher = build_models(cfg)
    model = DINOModel(student, teacher, 0.996)
    optimizer = build_optimizer(cfg, student, torch.device("cpu"), lr=1e-4, weight_decay=0.04)
    return build_trainer(cfg, model, build_loss(cfg), optimizer, torch.device("cpu"))


def crops(cfg, i: int) -> list[torch.Tensor]:
    a, b = cfg.augmentation, cfg.data.batch_size
    g = torch.Generator().manual_seed(i)
    sides = [a.global_crop_size] * 2 + [a.local_crop_size] * a.num_local_views
    return [torch.randn(b, 3, s, s, generator=g) for s in sides]


def step(trainer, cfg, i: int) -> float:
    loss, _ = trainer.train_step_optimized(crops(cfg, i), epoch=1)
    trainer.optimize_step()
    return float(loss)


def measure_memory(cfg) -> dict:
    with AllocationTrace() as trace:
        trainer = build(cfg)
        step(trainer, cfg, 0)
        with torch.profiler.record_function("step"):
            loss = step(trainer, cfg, 1)
    return {"peak_bytes": trace.peak("step"), "kept_bytes": trace.live_at("step"), "loss": loss}


def measure_times(cfgs: list, steps: int) -> list[list[float]]:
    """Step times in ms of every config, interleaved step by step, so that a
    change in the machine's load touches all of them alike."""
    trainers = [build(cfg) for cfg in cfgs]
    for trainer, cfg in zip(trainers, cfgs, strict=True):
        step(trainer, cfg, 0)  # warm-up (and compilation)
    times: list[list[float]] = [[] for _ in cfgs]
    for i in range(steps):
        for trainer, cfg, out in zip(trainers, cfgs, times, strict=True):
            t0 = time.perf_counter()
            step(trainer, cfg, i + 1)
            out.append(1e3 * (time.perf_counter() - t0))
    return times


def predicted(cfg) -> int:
    """The model's peak of one process (no DDP buckets)."""
    e = estimate_memory(cfg, strategy="ddp", world_size=1)
    return e.peak - e.buckets


def case_name(row: dict) -> str:
    name = row["policy"]
    if row["recompute_threshold"]:
        name += f" >= {row['recompute_threshold']:.1f} FLOP/B"
    if row["every"] != 1:
        name += f" every {row['every']}"
    return name + (" + compile" if row["compile"] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="vit_tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=7, help="timed steps per case")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)"
    )
    parser.add_argument("--compile", action="store_true", help="also each policy compiled")
    parser.add_argument("--json", type=Path, help="default docs/results/checkpointing_cpu.json")
    args = parser.parse_args()
    cases = [(p, e, False, 0.0) for p, e in POLICIES]
    ladder = checkpointing_ladder(config(args, "none", 1, False))
    cases += [(p, 1, False, t) for p, t in ladder if p == "selective"]
    cases += [(p, e, True, 0.0) for p, e in POLICIES if args.compile and e == 1]
    torch.set_num_threads(args.threads)
    cfgs = [config(args, *case) for case in cases]
    results = []
    for (policy, every, compiled, threshold), cfg in zip(cases, cfgs, strict=True):
        row = {
            "policy": policy,
            "every": every,
            "compile": compiled,
            "recompute_threshold": threshold,
            "model_peak_bytes": predicted(cfg),
            **measure_memory(cfg),
        }
        results.append(row)
        print(f"{case_name(row)}: {row['peak_bytes'] / MIB:.1f} MiB", flush=True)
    for row, times in zip(results, measure_times(cfgs, args.steps), strict=True):
        row.update(step_ms=statistics.median(times), step_ms_all=times)
    base = results[0]
    columns = [
        "case",
        "peak_MiB",
        "model_MiB",
        "model/measured",
        "peak/none",
        "step_ms",
        "step/none",
    ]
    rows = [
        [
            case_name(r),
            r["peak_bytes"] / MIB,
            r["model_peak_bytes"] / MIB,
            r["model_peak_bytes"] / r["peak_bytes"],
            r["peak_bytes"] / base["peak_bytes"],
            r["step_ms"],
            r["step_ms"] / base["step_ms"],
        ]
        for r in results
    ]
    cfg = config(args, "none", 1, False)
    a = cfg.augmentation
    print_table(
        f"DINO step, {args.backbone}/16, batch {args.batch_size}, 2 x {a.global_crop_size}^2 + "
        f"{a.num_local_views} x {a.local_crop_size}^2 crops, fp32, cpu ({torch.get_num_threads()} "
        f"threads); peak: tensor bytes (AllocationTrace); step: median of {args.steps}",
        columns,
        rows,
    )
    write_json(
        args.json or RESULTS_DIR / "checkpointing_cpu.json",
        {
            "bench": "checkpointing",
            "device": "cpu",
            "machine": machine(),
            "build_info": dino_opt.build_info(),
            "backbone": args.backbone,
            "batch_size": args.batch_size,
            "crops": [a.global_crop_size, a.local_crop_size, a.num_local_views],
            "results": results,
            "table": {"columns": columns, "rows": rows},
        },
    )


if __name__ == "__main__":
    main()
