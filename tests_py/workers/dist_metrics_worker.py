"""One gloo rank of the DistributedDINOTrainer test: reduce per-rank metrics,
write a checkpoint through save_checkpoint (rank 0 only), record the result."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.distributed import DistributedDINOTrainer


def main(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    trainer = DistributedDINOTrainer(rank, world, {"data": {"batch_size": 4}}, device="cpu")
    assert (trainer.rank, trainer.world_size, trainer.device.type) == (rank, world, "cpu")
    metrics = trainer.all_reduce_metrics(
        {"loss": torch.tensor(2.0 + rank), "images_per_second": 100.0 * (rank + 1)}
    )
    trainer.save_checkpoint({"written_by": rank}, Path(out) / "ckpt.pth")
    (Path(out) / f"rank{rank}.json").write_text(json.dumps({"metrics": metrics}))
    trainer.cleanup()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
