"""``dino-opt presets``: the hardware presets table and what
``hardware.preset=auto`` picks here (:func:`~dino_opt.tune.resolve_preset`,
``--measure``: :func:`~dino_opt.tune.measure_batch_size`); with
``--memory-model``, the per-rank memory of DDP and FSDP training
(:func:`~dino_opt.tune.memory_table`)."""

from __future__ import annotations

import argparse
import dataclasses

from ..config import PRESETS, apply_overrides, load_config
from ..models import CHECKPOINT_POLICIES
from ..train import recipe_of, resolve_recipe
from ..tune import (
    MEMORY_ARCHS,
    STRATEGIES,
    USABLE_MEMORY_FRACTION,
    arch_config,
    largest_batch,
    measure_batch_size,
    memory_table,
    resolve_hardware,
    resolve_preset,
)
from ..weights import weights_reader
from .common import json_argument, print_json

__all__ = ["add_parser", "run"]


# `--memory` without a number: the memory model's table.
_MEMORY_TABLE = -1.0


def run(args: argparse.Namespace) -> int:
    if args.memory == _MEMORY_TABLE:
        args.memory, args.memory_model = None, True
    if args.memory_model:
        return _memory_model(args)
    if args.measure and args.memory is not None:
        raise ValueError("--measure times this machine's device; leave out --memory")
    cfg = load_config(args.config, args.overrides)  # the crops and device to plan for
    a = cfg.augmentation
    name = cfg.hardware.preset if cfg.hardware.preset != "off" else "auto"
    choice = resolve_preset(
        name,
        device=cfg.hardware.device,
        memory_gb=args.memory,
        global_crop_size=a.global_crop_size,
        local_crop_size=a.local_crop_size,
        patch_size=cfg.model.patch_size,
    )
    report: dict = {
        "presets": {n: dataclasses.asdict(p) for n, p in PRESETS.items()},
        "chosen": choice.preset.name,
        "reason": choice.reason,
        "values": choice.values,
    }
    if args.measure:
        measured_cfg, _ = resolve_hardware(
            load_config(args.config, [*args.overrides, f"hardware.preset={name}"])
        )
        report["measured"] = measure_batch_size(
            measured_cfg, max_batch_size=args.max_batch, steps=args.steps
        )
    if args.json:
        print_json(report)
        return 0
    _print_presets(report, choice, name)
    return 0


def _print_presets(report: dict, choice, name: str) -> None:
    print(f"{'preset':7s} {'memory':>11s}  {'backbone':9s} {'batch':>5s} {'local':>5s}  cards")
    for p in PRESETS.values():
        memory = "no GPU" if p.memory_gb == 0 else f">= {p.min_memory_gb:.1f} GiB"
        mark = " <-" if p.name == choice.preset.name else ""
        print(
            f"{p.name:7s} {memory:>11s}  {p.backbone:9s} {p.batch_size:5d} "
            f"{p.num_local_views:5d}  {p.note}{mark}"
        )
    print(f"\n{choice.reason}")
    print(f"hardware.preset={name} sets: {' '.join(choice.overrides())}")
    measured = report.get("measured")
    if measured:
        print(f"\n{'batch':>5s} {'fits':>5s} {'images/s':>9s} {'peak GiB':>9s}  error")
        for t in measured["trials"]:
            ips = f"{t['images_per_second']:9.1f}" if t["images_per_second"] else f"{'-':>9s}"
            print(
                f"{t['batch_size']:5d} {str(t['fits']):>5s} {ips} "
                f"{t['peak_memory_gb']:9.3f}  {t['error'] or ''}"
            )
        print(
            f"measured on {measured['device']}: data.batch_size={measured['batch_size']} "
            f"({measured['images_per_second']:.1f} images/s; largest that fits: "
            f"{measured['largest_fitting_batch_size']})"
        )


def _memory_model(args: argparse.Namespace) -> int:
    if args.measure:
        raise ValueError("--memory-model estimates; leave out --measure")
    config = load_config(args.config, list(args.overrides)) if args.config else None
    teacher = None
    if config is not None and recipe_of(config).external_teacher:  # a distillation's teacher
        reader = weights_reader()
        config = resolve_recipe(config, reader)  # e.g. the teacher's feature width
        d = config.recipe.distill
        heads = d.mode == "heads"
        teacher = reader.open_teacher(d.teacher, heads, config.model.trust_code).network
    rows = memory_table(
        args.arch,
        tuple(args.world),
        tuple(args.strategy),
        tuple(args.checkpointing),
        batch_size=args.batch,
        reshard_after_forward=args.reshard_after_forward == "on",
        config=config,
        overrides=tuple(args.overrides),
        frozen_teacher=teacher,
    )
    usable = None if args.memory is None else args.memory * 2**30 * USABLE_MEMORY_FRACTION
    out = [r.to_dict() for r in rows]
    if usable:
        configs = {r.arch: arch_config(r.arch) if r.arch in MEMORY_ARCHS else config for r in rows}
        for r, row in zip(rows, out, strict=True):
            cfg = apply_overrides(configs[r.arch], args.overrides)
            row["fits"] = r.peak <= usable
            row["largest_batch"] = largest_batch(
                cfg,
                usable,
                strategy=r.strategy,
                world_size=r.world_size,
                checkpointing=r.checkpointing,
                every=r.every,
                reshard_after_forward=r.reshard_after_forward,
                frozen_teacher=teacher,
            )
    if args.json:
        archs = {n: a.source for n, a in MEMORY_ARCHS.items()}
        print_json({"rows": out, "archs": archs})
        return 0
    _print_memory(rows, out, usable)
    return 0


def _print_memory(rows, out: list[dict], usable: float | None) -> None:
    gib = 2**30
    head = (
        f"{'arch':14s} {'batch':>5s} {'strategy':8s} {'world':>5s} {'ckpt':9s} "
        f"{'params':>7s} {'grads':>7s} {'optim':>7s} {'teacher':>7s} {'comm':>7s} "
        f"{'activ':>7s} {'peak':>7s}"
    )
    print(head + ("  fits  max batch" if usable else ""))
    for r, row in zip(rows, out, strict=True):
        values = (
            r.parameters,
            r.gradients,
            r.optimizer,
            r.teacher,
            r.buckets + r.unsharded,
            r.activations + r.transient,
            r.peak,
        )
        line = (
            f"{r.arch:14s} {r.batch_size:5d} {r.strategy:8s} {r.world_size:5d} "
            f"{r.checkpointing:9s} " + " ".join(f"{v / gib:7.2f}" for v in values)
        )
        if usable:
            line += f"  {'yes' if row['fits'] else 'no':>4s}  {row['largest_batch']:9d}"
        print(line)
    print(
        "\nGiB per rank (rank 0). comm: DDP's gradient buckets, or FSDP's gathered units; "
        "activ: activations and the backward's working set; peak: the step's peak."
    )
    if usable:
        print(
            f"fits / max batch (per GPU): peak <= {USABLE_MEMORY_FRACTION:.0%} of --memory "
            "(the rest for the CUDA context and fragmentation)."
        )


def add_parser(sub) -> None:
    h = sub.add_parser(
        "presets", help="hardware presets: the table and what hardware.preset=auto picks here"
    )
    h.add_argument("--config", help="YAML configuration whose crops and device to plan for")
    h.add_argument(
        "--memory",
        type=float,
        nargs="?",
        const=_MEMORY_TABLE,
        help="GB: plan for a GPU with this many GiB instead of this machine's; alone: the "
        "memory model's table (as --memory-model)",
    )
    h.add_argument(
        "--measure",
        action="store_true",
        help="refine the batch size by timing training steps on this machine's device",
    )
    h.add_argument(
        "--max-batch", type=int, help="largest batch --measure tries (default: twice the preset's)"
    )
    h.add_argument("--steps", type=int, default=3, help="timed steps per --measure trial")
    h.add_argument(
        "--memory-model",
        action="store_true",
        help="per-rank memory of DDP vs FSDP training (docs/memory.md); --memory GB marks "
        "the rows that fit",
    )
    h.add_argument(
        "--arch",
        nargs="+",
        choices=list(MEMORY_ARCHS),
        help="--memory-model: architectures (default all; --config: the config's model instead)",
    )
    h.add_argument(
        "--world",
        nargs="+",
        type=int,
        default=[1, 8, 64, 1024],
        help="--memory-model: world sizes (default 1 8 64 1024)",
    )
    h.add_argument(
        "--batch", type=int, help="--memory-model: batch per GPU (default each architecture's)"
    )
    h.add_argument(
        "--strategy",
        nargs="+",
        choices=STRATEGIES,
        default=list(STRATEGIES),
        help="--memory-model: ddp, fsdp or both",
    )
    h.add_argument(
        "--checkpointing",
        nargs="+",
        choices=CHECKPOINT_POLICIES,
        default=list(CHECKPOINT_POLICIES),
        help="--memory-model: activation checkpointing of every block",
    )
    h.add_argument(
        "--reshard-after-forward",
        choices=("on", "off"),
        default="on",
        help="--memory-model: FSDP frees gathered blocks after the forward",
    )
    json_argument(h)
    h.add_argument("overrides", nargs="*", help="key=value, e.g. augmentation.global_crop_size=160")
    h.set_defaults(run=run)
