"""One gloo rank of the state-transfer test: rank 1 sends rank 0 a state of
every kind of leaf (runtime.send_state), rank 0 sends one back on a group of
its own; each receiver writes how what it got compares with what a pickle
round trip (what torch's object send delivers) gives."""

import json
import pickle
import sys
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
from dino_opt.runtime import recv_state, send_state


def sample(seed: int) -> dict:
    """The same object on both ranks: shapes and dtypes of a training state
    and the odd cases (shared, empty, strided, 0-d, a Parameter, not tensors)."""
    g = torch.Generator().manual_seed(seed)
    weights = OrderedDict(w=torch.randn(7, 5, generator=g, dtype=torch.float64))
    weights._metadata = OrderedDict({"": {"version": 2}})  # as nn.Module.state_dict() has
    shared = torch.randn(3, generator=g)
    wide = torch.randn(6, 4, generator=g)
    return {
        "student": weights,
        "twice": [shared, shared],
        "strided": wide.t(),
        "sliced": wide[1:4, ::2],
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5, dtype=torch.bfloat16),
        "flags": torch.rand(9, generator=g) > 0.5,
        "ints": torch.randint(-100, 100, (11,), generator=g, dtype=torch.int8),
        "steps": torch.randint(0, 2**40, (2, 3), generator=g),
        "complex": torch.randn(4, generator=g, dtype=torch.complex64),
        "half": torch.randn(5, 3, generator=g).half(),
        "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "optimizer": {"state": {0: {"step": torch.tensor(4.0)}}, "param_groups": [{"lr": 0.1}]},
        "misc": ("text", 7, None, 2.5),
    }


def same(a, b) -> bool:
    """Equal structure, types, values, dtypes and shapes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def report(got: dict, sent: dict) -> dict:
    expected = pickle.loads(pickle.dumps(sent))
    return {
        "same": same(got, expected),
        "metadata": got["student"]._metadata == sent["student"]._metadata,
        "shared": got["twice"][0] is got["twice"][1],
        "parameter": isinstance(got["param"], torch.nn.Parameter),
        "writable": bool(got["strided"].add_(1).sum() > 0),
    }


def main(rank: int, world: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    back = dist.new_group([0, 1])
    result = {}
    if rank == 1:
        send_state(sample(1), 0)
        result = report(recv_state(0, group=back), sample(2))
    else:
        result = report(recv_state(1), sample(1))
        send_state(sample(2), 1, group=back)
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
