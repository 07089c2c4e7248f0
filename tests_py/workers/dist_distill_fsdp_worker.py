"""One rank of the in-process test of a distillation's frozen teacher under
FSDP: joins a gloo group through a file, builds the run as the job does
(the teacher opened and placed, then its backbone sharded block by block
beside the student), and writes to OUT/rank{rank}.json what it holds of
the teacher, the teacher's tokens before and after sharding, the losses of
two steps and the student's FSDP units."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.config import load_config
from dino_opt.job.sharding import spread
from dino_opt.runtime import is_sharded
from dino_opt.train import (
    DINOModel,
    attach_teacher,
    build_loss,
    build_models,
    build_optimizer,
    build_trainer,
)
from dino_opt.weights import weights_reader
from torch.distributed.tensor import DTensor

DEVICE = torch.device("cpu")


def main(rank: int, world: int, init_file: str, out: str, teacher_file: str, *overrides) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            *overrides,
            f"recipe.distill.teacher={teacher_file}",
            "recipe.distill.teacher_dim=384",
            "hardware.precision=fp32",
            "distributed.strategy=fsdp",
        ],
    )
    student, ema = build_models(cfg)
    loss_fn = build_loss(cfg)
    network = attach_teacher(cfg, loss_fn, weights_reader(), DEVICE)
    numel = sum(p.numel() for p in network.parameters())
    g = torch.Generator().manual_seed(0)
    side = cfg.augmentation.global_crop_size
    images = torch.randn(4, 3, side, side, generator=g)
    before = loss_fn.teacher_tokens(images, (4, 4))
    trained, ema = spread(cfg, student, ema, DEVICE, (), network)
    after = loss_fn.teacher_tokens(images, (4, 4))
    params = list(network.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    model = DINOModel(student, ema, 0.9, copy_buffers=True)
    model.student = trained
    trainer = build_trainer(cfg, model, loss_fn, build_optimizer(cfg, student, DEVICE), DEVICE)
    losses = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        crops = [torch.randn(2, 3, side, side, generator=gen) for _ in range(2)]
        loss, _ = trainer.train_step_optimized(crops, 0)
        trainer.optimize_step()
        losses.append(loss.item())
    result = {
        "numel": numel,
        "local_numel": local,
        "sharded": is_sharded(network),
        "all_dtensors": all(isinstance(p, DTensor) for p in params),
        "frozen": not any(p.requires_grad for p in params),
        "tokens_diff": max(
            (before.cls - after.cls).abs().max().item(),
            (before.patches - after.patches).abs().max().item(),
        ),
        "losses": losses,
        "student_units": [n for n, m in student.named_modules() if is_sharded(m)],
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
