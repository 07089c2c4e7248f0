"""One gloo rank of the check that the block options compose with FSDP:
the student's blocks checkpointed selectively and compiled (build_models
with hardware.compile), then sharded by torch's fully_shard (each block, the
head, the root; the teacher alike); two training steps (no drop path) give
the losses of the same run in eager mode. Writes OUT/rank{rank}.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.config import load_config
from dino_opt.train import build_loss, build_models, build_optimizer

from workers.dist_memory_worker import MEMORY_RUN, _forward_backward, _optimizer_step, _shard


def losses(compiled: bool, rank: int) -> tuple[list[float], int]:
    torch.manual_seed(0)
    # Without drop path the 12 blocks share one compiled graph (a rate is a constant of it).
    options = [
        "hardware.activation_checkpointing=selective",
        "model.drop_path_rate=0",
        f"hardware.compile={str(compiled).lower()}",
    ]
    cfg = load_config(None, [*MEMORY_RUN, *options])
    student, teacher = build_models(cfg)
    compiled_blocks = sum(b._compiled_call_impl is not None for b in student.backbone.blocks)
    _shard(student)
    _shard(teacher)
    loss_fn = build_loss(cfg)
    optimizer = build_optimizer(cfg, student, torch.device("cpu"), lr=1e-3)
    out = []
    for i in range(2):
        out.append(_forward_backward(student, teacher, loss_fn, cfg, seed=rank + 10 * i))
        _optimizer_step(student, optimizer, cfg)
    return out, compiled_blocks


def main(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    eager, _ = losses(False, rank)
    compiled, blocks = losses(True, rank)
    result = {"eager": eager, "compiled": compiled, "compiled_blocks": blocks}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
