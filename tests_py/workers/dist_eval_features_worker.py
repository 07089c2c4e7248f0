"""One gloo rank of the sharded feature extraction test: extract the
features of a data source with the test's network, save what this rank got
(all features, labels, and the data set indices of its own shard)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.eval.features import EvalLoader, extract_features
from test_eval_features import TinyNet


def main(rank: int, world: int, init_file: str, out: str, spec: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    net = TinyNet()
    net.load_state_dict(torch.load(Path(out) / "net.pt"))
    features, labels = extract_features(net, spec, image_size=24, batch_size=4)
    with EvalLoader(spec, 24, rank=rank, world_size=world) as loader:
        shard = loader.indices
    torch.save(
        {"features": features, "labels": labels, "shard": shard}, Path(out) / f"rank{rank}.pt"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
