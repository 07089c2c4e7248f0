"""One gloo rank of the student-groups test (2 students over 4 ranks: ranks
0-1 train student 0, ranks 2-3 student 1): the frozen teacher's forward of
a batch split over the peers and gathered, the images each rank's teacher
saw, DDP over a student's group only, and the per-student metrics."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.models import VisionTransformer, backbone_tokens
from dino_opt.runtime import all_reduce_metrics, student_groups, wrap_student
from dino_opt.train.distill import FrozenTeacher


def _teacher_tokens(groups) -> dict:
    """The split forward against the whole batch's, and what it saw."""
    torch.manual_seed(3)
    net = VisionTransformer(patch_size=8, embed_dim=64, depth=2, num_heads=2, img_size=32)
    seen = []
    net.patch_embed.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    images = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        whole = backbone_tokens(net, images)
        seen.clear()
        frozen = FrozenTeacher(net, 8)
        frozen.split_over(groups)
        split = frozen.tokens(images)
    return {
        "seen": seen,
        "cls_diff": (split.cls - whole.cls).abs().max().item(),
        "patch_diff": (split.patches - whole.patches).abs().max().item(),
        "shapes": [list(split.cls.shape), list(split.patches.shape)],
    }


def _group_gradient(groups, rank: int, device: torch.device) -> list[float]:
    """A linear layer in DDP over the student's group, each rank its own input."""
    torch.manual_seed(0)
    layer = wrap_student(torch.nn.Linear(2, 1, bias=False), device, groups.group)
    layer(torch.full((1, 2), float(rank + 1))).sum().backward()
    return layer.module.weight.grad.flatten().tolist()


def main(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    groups = student_groups(2, rank, world, batch_size=6)
    result = {"index": groups.index, "data_rank": groups.data_rank, "lead": groups.lead}
    result.update(_teacher_tokens(groups))
    result["gradient"] = _group_gradient(groups, rank, torch.device("cpu"))
    own = torch.tensor(float(rank + 1))
    loss, parts = groups.metrics(["a", "b"], own, {"loss": own, "cosine": own / 10})
    result["metrics"] = all_reduce_metrics({"loss": loss, **parts})
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
