"""One rank of the in-process test of the dinov3 recipe's Gram teacher under
FSDP: joins a gloo group through a file, builds the run as the job does
(the Gram teacher made before the teacher is sharded, then sharded as the
teacher's backbone), trains a few steps with the Gram teacher loaded from the
EMA teacher and refreshed, and writes what it saw to OUT/rank{rank}.json."""

import copy
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
    attach_frozen_copies,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    build_trainer,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

DEVICE = torch.device("cpu")
# iteration 0 loads the Gram teacher from the EMA teacher; it is refreshed
# after iteration 1 only (max_updates 1)
GRAM = [
    "recipe.gram.it_load_ema_teacher=0",
    "recipe.gram.update_frequency=2",
    "recipe.gram.it_first_update=2",
    "recipe.gram.max_updates=1",
]


def _batch(cfg, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gs, ls = cfg.augmentation.global_crop_size, cfg.augmentation.local_crop_size
    crops = [torch.randn(b, 3, gs, gs, generator=g) for _ in range(2)]
    crops += [torch.randn(b, 3, ls, ls, generator=g) for _ in range(2)]
    side = gs // cfg.model.patch_size
    return crops, torch.rand(2 * b, side, side, generator=g) < 0.4


def _whole(module: torch.nn.Module) -> dict:
    """Collective: the module's state dict as whole tensors."""
    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
        for k, v in module.state_dict().items()
    }


def main(rank: int, world: int, init_file: str, out: str, *overrides: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = load_config(
        None, [*overrides, *GRAM, "hardware.precision=fp32", "distributed.strategy=fsdp"]
    )
    student, teacher = build_models(cfg)
    loss_fn = build_loss(cfg)
    frozen = attach_frozen_copies(cfg, loss_fn, teacher)
    gram = loss_fn.gram_teacher
    whole_copy = copy.deepcopy(teacher.backbone)  # the teacher's weights, unsharded
    trained, teacher = spread(cfg, student, teacher, DEVICE, frozen)
    model = DINOModel(student, teacher, 0.9)
    model.student = trained
    optimizer = build_optimizer(cfg, student, DEVICE)
    trainer = build_trainer(cfg, model, loss_fn, optimizer, DEVICE)
    schedules = build_schedules(cfg, 4, world_size=world)
    report = {
        "frozen": [id(m) for m in frozen] == [id(gram.backbone)],
        "sharded": is_sharded(gram.backbone),
    }

    # the same placements as the teacher's backbone, one shard per rank
    mine = dict(gram.backbone.named_parameters())
    theirs = dict(model.teacher.backbone.named_parameters())
    report["names_match"] = mine.keys() == theirs.keys()
    report["all_dtensors"] = all(isinstance(p, DTensor) for p in mine.values())
    report["placements_match"] = all(
        p.placements == theirs[n].placements and p.shape == theirs[n].shape for n, p in mine.items()
    )
    report["local_numel"] = sum(p.to_local().numel() for p in mine.values())
    report["numel"] = sum(p.numel() for p in mine.values())

    # its patch tokens, sharded, equal those of the unsharded teacher's
    # backbone once it is loaded from the (not yet trained) teacher
    crops, masks = _batch(cfg, seed=99)
    gram.copy_from(model.teacher.backbone)
    with torch.no_grad():
        tokens = gram.patch_tokens(crops[:2])
        reference = whole_copy.forward_features(torch.cat(crops[:2]))["x_norm_patchtokens"]
    report["tokens_diff"] = (tokens - reference).abs().max().item()
    report["resharded_after_forward"] = all(isinstance(p, DTensor) for p in gram.parameters())
    gram.loaded = False  # as built: the schedule loads it

    losses, grams = [], []
    after_refresh = None
    for it in range(4):
        trainer.set_schedules(schedules, it)
        crops, masks = _batch(cfg, seed=10 * it + rank)  # each rank its own images
        loss, metrics = trainer.train_step_optimized(crops, 0, masks=masks)
        assert trainer.optimize_step()
        losses.append(float(loss))
        grams.append(float(metrics["gram"]) if "gram" in metrics else None)
        if it == 1:  # refreshed after iteration 1 from the EMA teacher
            after_refresh = _whole(model.teacher.backbone)
    report["losses"], report["grams"] = losses, grams
    report["updates"], report["loaded"] = gram.updates, gram.loaded
    report["still_sharded"] = all(isinstance(p, DTensor) for p in gram.parameters())
    final = _whole(gram.backbone)
    report["equals_refresh"] = all(torch.equal(v, after_refresh[k]) for k, v in final.items())
    teacher_now = _whole(model.teacher.backbone)
    report["teacher_moved_on"] = any(not torch.equal(v, teacher_now[k]) for k, v in final.items())

    # a copy sharded otherwise (its root unit left whole) is refused in one line
    other = copy.deepcopy(whole_copy)
    for block in other.blocks:
        fully_shard(block)
    wrong = type(gram)(gram.options)
    wrong.backbone = other
    try:
        wrong.copy_from(model.teacher.backbone)
        report["mismatch_error"] = None
    except ValueError as e:
        report["mismatch_error"] = str(e)

    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
