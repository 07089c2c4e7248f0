"""The cost of distilling into several students at once: one training step
(forward, backward, optimizer, EMA) of 1, 2 and 3 students trained together
from one frozen teacher forward (``recipe.distill.students``) against the
same students trained in separate runs, each with its own teacher forward,
in one process, beside the teacher's forward alone.

    python bench/bench_distill.py [--device cpu|cuda] [--batch N] [--quick] [--json PATH]

The networks, loss, optimizer and trainer are the job's
(``dino_opt.train.build``) on the ``--demo distill`` preset (64-pixel
global crops, batch 64): a ViT-S/16 teacher (384 wide), students ViT-T/16,
ResNet-18 and ConvNeXt-T in that order. The weights are random: a step's
cost does not depend on them. Separate runs cost the sum of each
student's own step; the saving is the teacher forwards not repeated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    RESULTS_DIR,
    device_slug,
    machine,
    print_table,
    time_ms,
    write_json,
)
from dino_opt.config import Config, apply_overrides  # noqa: E402
from dino_opt.models import VisionTransformer  # noqa: E402
from dino_opt.train import (  # noqa: E402
    DEMO_PRESETS,
    DINOModel,
    build_loss,
    build_models,
    build_optimizer,
    build_trainer,
)
from dino_opt.train.distill import FrozenTeacher  # noqa: E402

STUDENTS = ("vit_tiny", "resnet18", "convnext_tiny")


def _config(students: tuple[str, ...], batch: int, device: torch.device) -> Config:
    first, *others = students
    names = ",".join(others)
    preset = {**DEMO_PRESETS["distill"]}
    distill = {**preset["recipe"]["distill"], "teacher": "random", "teacher_dim": 384}
    preset["recipe"] = {**preset["recipe"], "distill": distill}
    return apply_overrides(
        Config.from_dict(preset),
        [
            f"model.backbone={first}",
            f"recipe.distill.students=[{names}]",
            f"data.batch_size={batch}",
            f"hardware.device={device.type}",
        ],
    )


def _teacher(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    vit = VisionTransformer(patch_size=16, embed_dim=384, depth=12, num_heads=6, img_size=64)
    return vit.to(device).requires_grad_(False).eval()


def _trainer(cfg: Config, teacher: torch.nn.Module, device: torch.device):
    student, ema = build_models(cfg)
    student, ema = student.to(device), ema.to(device)
    loss_fn = build_loss(cfg).to(device)
    loss_fn.attach_teacher(FrozenTeacher(teacher, 16, 1.0))
    model = DINOModel(student, ema, 0.97, copy_buffers=True)
    return build_trainer(cfg, model, loss_fn, build_optimizer(cfg, student, device), device)


def _step(trainer, crops) -> None:
    trainer.train_step_optimized(crops, 0)
    trainer.optimize_step()


def _interleaved_ms(calls: dict, device: torch.device, warmup: int, repeats: int) -> dict:
    """Median time of each of ``calls``, timed in turn within each round (a
    shared machine's drift falls on all of them alike)."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    samples = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            samples[name].append(time_ms(lambda _, c=call: c(), device, warmup=0, repeats=1))
    return {name: statistics.median(v) for name, v in samples.items()}


@torch.no_grad()
def _teacher_forward(teacher: torch.nn.Module, crops) -> None:
    teacher.forward_features(torch.cat(crops))


class _Counter:
    """Counts a module's forward passes (a hook on its patch embedding)."""

    def __init__(self, teacher: torch.nn.Module):
        self.calls = 0
        teacher.patch_embed.register_forward_hook(self._hook)

    def _hook(self, *_) -> None:
        self.calls += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="batch 8, 1 warm-up, 3 rounds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    batch, warmup, repeats = (8, 1, 3) if args.quick else (args.batch, 2, 7)
    teacher = _teacher(device)
    counter = _Counter(teacher)
    crops = [torch.randn(batch, 3, 64, 64, device=device) for _ in range(2)]
    trainers = {
        name: _trainer(_config((name,), batch, device), teacher, device) for name in STUDENTS
    }
    for n in range(2, len(STUDENTS) + 1):
        trainers[n] = _trainer(_config(STUDENTS[:n], batch, device), teacher, device)
    calls = {name: (lambda t=trainer: _step(t, crops)) for name, trainer in trainers.items()}
    calls["teacher"] = lambda: _teacher_forward(teacher, crops)
    ms = _interleaved_ms(calls, device, warmup, repeats)
    teacher_ms = ms["teacher"]
    rows, records = [], []
    for n in range(1, len(STUDENTS) + 1):
        students = STUDENTS[:n]
        trainer = trainers[n if n > 1 else students[0]]
        counter.calls = 0
        _step(trainer, crops)
        ours = ms[n if n > 1 else students[0]]
        separate = sum(ms[s] for s in students)
        rows.append(["+".join(students), ours, separate, separate / ours, counter.calls, n])
        records.append(
            {
                "students": list(students),
                "together_ms": ours,
                "separate_ms": separate,
                "separate_over_together": separate / ours,
                "teacher_forwards_together": counter.calls,
                "teacher_forwards_separate": n,
            }
        )
    alone = {s: ms[s] for s in STUDENTS}
    title = (
        f"Distillation step, {n} students or fewer from a ViT-S/16 teacher, batch {batch}, "
        f"64 px, {device_slug(device)} (median of {repeats}); teacher forward alone "
        f"{teacher_ms:.1f} ms"
    )
    columns = [
        "students",
        "together_ms",
        "separate_ms",
        "separate/together",
        "teacher fwd (together)",
        "teacher fwd (separate)",
    ]
    print_table(title, columns, rows)
    out = args.json or RESULTS_DIR / f"distill_{device_slug(device)}.json"
    write_json(
        out,
        {
            "machine": machine(),
            "batch": batch,
            "repeats": repeats,
            "teacher_forward_ms": teacher_ms,
            "alone_ms": alone,
            "rows": records,
        },
    )


if __name__ == "__main__":
    main()
