"""One rank of the test of the distillation's whitener over a gloo group:
joins it through a file, feeds its own share of the tokens saved in
TOKENS ([steps, world, N, D]) to a TokenWhitener step by step, and writes
the running statistics it ends with to OUT/rank{rank}.json."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.train.distill import TokenWhitener


def main(rank: int, world: int, init_file: str, out: str, tokens_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    tokens = torch.load(tokens_file)
    whitener = TokenWhitener(tokens.shape[-1], 1e-3)
    for step in tokens:
        whitener(step[rank].float())
    result = {
        "mean": whitener.mean.tolist(),
        "cov": whitener.cov.tolist(),
        "batches": int(whitener.batches),
    }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])
