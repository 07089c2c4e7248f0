"""One rank of the distributed test of the DINOv2 losses: joins a gloo group
through a file, runs Sinkhorn-Knopp and the center updates over its shard of
fixed inputs (shards given by row counts per rank) and saves what it got."""

import sys

import torch
import torch.distributed as dist
from dino_opt.ops.dinov2_loss import DINOLoss, iBOTPatchLoss, sinkhorn_knopp


def shard(tensor: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
    start = sum(counts[:rank])
    return tensor[start : start + counts[rank]]


def centers(data: dict, rank: int) -> dict:
    """Softmax-centered teacher rows over steps, then the state dict with an
    update pending; a loaded state dict drops a pending update."""
    out_dim = data["dino_teachers"][0].shape[1]
    dino, ibot = DINOLoss(out_dim, center_momentum=0.8), iBOTPatchLoss(out_dim)
    probs, patch_probs = [], []
    for counts, teacher, tokens in zip(
        data["dino_counts"], data["dino_teachers"], data["ibot_tokens"], strict=True
    ):
        mine = shard(teacher, counts, rank)
        probs.append(dino.softmax_center_teacher(mine, 0.07))
        dino.update_center(mine)
        tokens = shard(tokens, data["ibot_counts"], rank)
        patch_probs.append(ibot.softmax_center_teacher(tokens, 0.05))
        ibot.update_center(tokens)
    pending = (dino.updated, ibot.updated)
    loaded = DINOLoss(out_dim)
    loaded.update_center(shard(data["dino_teachers"][0], data["dino_counts"][0], rank))
    loaded.load_state_dict({"center": torch.ones(1, out_dim)})
    return {
        "dino_probs": probs,
        "ibot_probs": patch_probs,
        "updated_before_state_dict": pending,
        "dino_center": dino.state_dict()["center"],
        "ibot_center": ibot.state_dict()["center"],
        "updated_after_state_dict": (dino.updated, ibot.updated),
        "loaded_center": loaded.center,
        "loaded_updated": loaded.updated,
    }


def main(rank: int, world: int, init_file: str, data_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    data = torch.load(data_file)
    logits = shard(data["sk_logits"], data["sk_counts"], rank)
    n_masked = torch.tensor([data["sk_counts"][rank]])
    out = {
        "sk": sinkhorn_knopp(logits, 0.05, 3),
        "sk_ibot": iBOTPatchLoss(logits.shape[1]).sinkhorn_knopp_teacher(logits, 0.05, n_masked),
        "n_masked_after": n_masked,
        **centers(data, rank),
    }
    torch.save(out, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
