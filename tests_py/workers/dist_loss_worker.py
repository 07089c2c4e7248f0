"""One rank of the distributed DINOLoss test: joins a gloo group through a
file, runs DINOLoss over its shard of a fixed global batch for a few steps and
saves its losses and final center."""

import sys

import dino_opt
import torch
import torch.distributed as dist


def main(rank: int, world: int, init_file: str, data_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    data = torch.load(data_file)
    ncrops, views, batch = data["ncrops"], data["teacher_views"], data["batch"]
    shard = batch // world
    loss_fn = dino_opt.DINOLoss(data["out_dim"], ncrops, 0.04, 0.07, 2, 5)
    losses = []
    for step, (student, teacher) in enumerate(zip(data["students"], data["teachers"], strict=True)):
        # Rows are view-major: take this rank's samples from every view.
        s = student.view(ncrops, batch, -1)[:, rank * shard : (rank + 1) * shard].reshape(
            -1, student.shape[1]
        )
        t = teacher.view(views, batch, -1)[:, rank * shard : (rank + 1) * shard].reshape(
            -1, teacher.shape[1]
        )
        losses.append(loss_fn(s, t, epoch=step % 5).item())
    torch.save({"losses": losses, "center": loss_fn.state_dict()["center"]}, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
