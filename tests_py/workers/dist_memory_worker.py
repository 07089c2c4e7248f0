"""One gloo rank of the memory model's check: a tiny DINO step (teacher
forward, student forward, the DINO loss, backward, clipping, AdamW) with the
student in DistributedDataParallel or sharded by torch's fully_shard (each
block, the head, the root; the teacher alike). The states are measured by
their tensors' storages (parameters, teacher, AdamW's moments, the gradients
after the backward pass; DDP's buckets as the bytes its constructor
allocates), the second step by AllocationTrace: its peak above the bytes
live when it started. Also a sharded distillation (features: one or two
students; heads) from a frozen teacher, with the job's trainer. Writes
OUT/rank{rank}.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.config import load_config
from dino_opt.job.groups import layout_of
from dino_opt.job.sharding import spread
from dino_opt.models import VisionTransformer
from dino_opt.observe import AllocationTrace
from dino_opt.train import (
    DINOModel,
    build_loss,
    build_models,
    build_optimizer,
    build_student,
    recipe_of,
)
from dino_opt.train.distill import FrozenTeacher
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

# ViT-T/8 at 32/16 px, 2 global + 4 local crops, batch 16 per rank, float32.
MEMORY_RUN = [
    "model.backbone=vit_tiny",
    "model.patch_size=8",
    "model.out_dim=1024",
    "model.hidden_dim=256",
    "model.bottleneck_dim=64",
    "augmentation.global_crop_size=32",
    "augmentation.local_crop_size=16",
    "augmentation.num_local_views=4",
    "data.batch_size=16",
    "hardware.precision=fp32",
    "hardware.device=cpu",
]


def _shard(net: torch.nn.Module) -> None:
    for block in net.backbone.blocks:
        fully_shard(block)
    fully_shard(net.head)
    fully_shard(net)


def _crops(cfg, seed: int) -> list[torch.Tensor]:
    a, b = cfg.augmentation, cfg.data.batch_size
    g = torch.Generator().manual_seed(seed)
    sides = [a.global_crop_size] * 2 + [a.local_crop_size] * a.num_local_views
    return [torch.randn(b, 3, s, s, generator=g) for s in sides]


def _forward_backward(student, teacher, loss_fn, cfg, seed: int) -> float:
    crops = _crops(cfg, seed)
    with torch.no_grad():
        teacher_out = teacher(crops[:2])
    loss = loss_fn(student(crops), teacher_out, 0)
    loss.backward()
    return float(loss.detach())


def _optimizer_step(student, optimizer, cfg) -> None:
    torch.nn.utils.clip_grad_norm_(list(student.parameters()), cfg.optim.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _bytes(tensors) -> int:
    """Bytes of the (local shards of the) tensors' storages, each storage once."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(
        {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in local
            if t is not None
        }.values()
    )


def measure(strategy: str, policy: str) -> dict:
    """Bytes of one configuration on this rank (see the module docstring)."""
    torch.manual_seed(0)  # every rank builds the same weights
    cfg = load_config(None, [*MEMORY_RUN, f"hardware.activation_checkpointing={policy}"])
    rank = dist.get_rank()
    with AllocationTrace() as trace:
        student, teacher = build_models(cfg)
        if strategy == "fsdp":
            _shard(student)
            _shard(teacher)
            wrapped = student
        else:
            with torch.profiler.record_function("ddp"):
                wrapped = DistributedDataParallel(student, init_sync=False)
            with torch.profiler.record_function("after ddp"):
                pass
        loss_fn = build_loss(cfg)
        optimizer = build_optimizer(cfg, student, torch.device("cpu"), lr=1e-3)
        losses = [_forward_backward(wrapped, teacher, loss_fn, cfg, seed=rank)]
        _optimizer_step(student, optimizer, cfg)
        with torch.profiler.record_function("step"):
            losses.append(_forward_backward(wrapped, teacher, loss_fn, cfg, seed=10 + rank))
            gradients = _bytes(p.grad for p in student.parameters())
            _optimizer_step(student, optimizer, cfg)
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return {
        "parameters": _bytes(student.parameters()),
        "teacher": _bytes(teacher.parameters()),
        "optimizer": _bytes(states),
        "buckets": trace.live_at("after ddp") - trace.live_at("ddp") if strategy == "ddp" else 0,
        "gradients": gradients,
        "step": trace.peak("step") - trace.live_at("step"),
        "losses": losses,
    }


#: A feature distillation of MEMORY_RUN's student (and ``recipe.distill.students``)
#: from a 3-block ViT teacher 96 wide, its networks sharded as the job shards them.
DISTILL_RUN = [
    *MEMORY_RUN,
    "recipe.name=distill",
    "recipe.distill.teacher=teacher.pth",
    "recipe.distill.teacher_dim=96",
    "augmentation.global_crop_size=64",
    "distributed.strategy=fsdp",
]


def distill_teacher() -> torch.nn.Module:
    torch.manual_seed(1)
    net = VisionTransformer(patch_size=8, embed_dim=96, depth=3, num_heads=3, img_size=64)
    return net.requires_grad_(False).eval()


#: The heads mode of it: DINOv2's losses against a frozen teacher with heads.
DISTILL_HEADS = [
    "recipe.distill.mode=heads",
    "recipe.ibot.separate_head=true",
    "recipe.ibot.out_dim=512",
]


#: Students on their own ranks (one each): DDP, the teacher's forward split.
DISTILL_GROUPS = ["distributed.strategy=ddp", "distributed.student_groups=true"]


def distill_config(students: str, heads: bool = False, groups: bool = False):
    extra = (DISTILL_HEADS if heads else []) + (DISTILL_GROUPS if groups else [])
    return load_config(None, [*DISTILL_RUN, f"recipe.distill.students=[{students}]", *extra])


def heads_teacher(cfg) -> torch.nn.Module:
    """A frozen teacher with heads: a network of the student's kind."""
    torch.manual_seed(1)
    return build_models(cfg)[1].requires_grad_(False).eval()


def _distill_step(trainer, cfg, seed: int) -> tuple[float, int]:
    """One step: (its loss, the bytes of the gradients before the update)."""
    g = torch.Generator().manual_seed(seed)
    side = cfg.augmentation.global_crop_size // cfg.model.patch_size
    masks = torch.rand(2 * cfg.data.batch_size, side, side, generator=g) < 0.3  # heads: iBOT's
    loss = trainer.train_step_optimized(_crops(cfg, seed), 0, masks=masks)[0]
    gradients = _bytes(p.grad for p in trainer.model.student.parameters())
    trainer.optimize_step()
    return float(loss), gradients


def measure_distill(students: str, heads: bool = False, groups: bool = False) -> dict:
    """Bytes of a sharded distillation into ``students`` (besides
    MEMORY_RUN's; ``heads``: through the teacher's heads; ``groups``: each
    student on its own rank instead, with DDP) on this rank: as
    :func:`measure`, the frozen teacher's local shards apart."""
    cfg = distill_config(students, heads, groups)
    rank = dist.get_rank()
    layout = layout_of(cfg, rank, dist.get_world_size())
    with AllocationTrace() as trace:
        torch.manual_seed(0)
        student, ema = build_student(cfg, layout.index) if layout else build_models(cfg)
        frozen = heads_teacher(cfg) if heads else distill_teacher()
        loss_fn = build_loss(cfg)
        loss_fn.attach_teacher(FrozenTeacher(frozen, 8))
        if layout is not None:
            loss_fn.frozen.split_over(layout)
        spread(cfg, student, ema, torch.device("cpu"), (), frozen, layout)
        optimizer = build_optimizer(cfg, student, torch.device("cpu"), lr=1e-3)
        options = {
            "precision": "fp32",
            "accumulation_steps": 1,
            "freeze_last_layer": 0,
            "gradient_clip": 3.0,
        }
        kind = recipe_of(cfg).trainer_class(cfg)
        trainer = kind(DINOModel(student, ema, 0.9), loss_fn, optimizer, options, "cpu")
        first, _ = _distill_step(trainer, cfg, rank)
        with torch.profiler.record_function("step"):
            second, gradients = _distill_step(trainer, cfg, 10 + rank)
    states = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return {
        "parameters": _bytes(student.parameters()),
        "teacher": _bytes(ema.parameters()) + _bytes(frozen.parameters()),
        "optimizer": _bytes(states),
        "buckets": 0,
        "gradients": gradients,
        "step": trace.peak("step") - trace.live_at("step"),
        "losses": [first, second],
    }


def main(rank: int, world: int, init_file: str, out: str, runs: list[str]) -> None:
    """``runs``: measured one after the other."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result = {}
    for run in runs:  # STRATEGY:POLICY, distill:STUDENTS, distillgroups:STUDENTS or distillheads:
        kind, arg = run.split(":")
        result[run] = (
            measure_distill(arg, kind == "distillheads", kind == "distillgroups")
            if kind.startswith("distill")
            else measure(kind, arg)
        )
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:])
