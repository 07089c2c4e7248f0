"""FSDP2 (``distributed.strategy=fsdp``) on CPUs with gloo, 2 processes:
the same losses and weights as DDP; sharded asynchronous checkpoints that
resume bit for bit (after a SIGKILL too) and at another world size; the
sharded run read back whole by the tools; the refusals in one line."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dino_opt.checkpoint import CheckpointManager, read_sharded
from tiny import TINY as TINY_BASE
from tiny import tiny_train_only

TINY = [
    *TINY_BASE,
    "data.num_workers=1",
    "data.batch_size=4",
    "model.drop_path_rate=0.0",
    "optim.freeze_last_layer=0",
    "logging.tensorboard=false",
    "logging.profile=false",
]
FSDP = "distributed.strategy=fsdp"


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


def _command(out: Path, train_root: Path, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "dino_opt.cli", "train", "--output-dir", str(out), "--quiet"]
    return [*args, "--nproc", "2", f"data.root={train_root}", *TINY, *extra]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _train(out: Path, train_root: Path, *extra: str, ok: bool = True):
    done = subprocess.run(
        _command(out, train_root, *extra), capture_output=True, text=True, env=_env(), timeout=600
    )
    if not ok:
        return done
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    path = report["checkpoint"]
    state = read_sharded(path) if Path(path).is_dir() else torch.load(path)
    return {"report": report, "rows": rows, "state": state}


def _losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["rows"] if "loss" in r]


def test_fsdp_trains_as_ddp(train_root, tmp_path):
    four = "schedule.epochs=4"
    ddp = _train(tmp_path / "ddp", train_root, four)
    fsdp = _train(tmp_path / "fsdp", train_root, four, FSDP)
    assert fsdp["report"]["steps"] == ddp["report"]["steps"] == 20  # 4 epochs of 40 images / (2 x 4)
    assert Path(fsdp["report"]["checkpoint"]).name.endswith(".dcp")
    for a, b in zip(_losses(ddp), _losses(fsdp), strict=True):
        assert b == pytest.approx(a, rel=1e-4)
    for key in ("student", "teacher"):
        for name, value in ddp["state"][key].items():
            torch.testing.assert_close(fsdp["state"][key][name], value, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fsdp["state"]["loss"]["center"], ddp["state"]["loss"]["center"])
