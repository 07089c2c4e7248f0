"""Distributed training on CPUs with gloo: 2 processes with batch b train the
same weights as 1 process with batch 2b; the lesson's DistributedDINOTrainer
reduces metrics in one call and writes checkpoints on rank 0 only."""

import json
import signal
from pathlib import Path

import pytest
import tiny
import torch
from dino_opt.distributed import launch_distributed_training
from dino_opt.runtime import all_reduce_metrics, launched_world, with_index
from gloo_ranks import launch_ranks, run_ranks
from tiny import TINY as TINY_BASE
from tiny import tiny_train_only

HERE = Path(__file__).parent

TINY = [
    *TINY_BASE,
    "data.num_workers=1",
    "model.drop_path_rate=0.0",
    "optim.freeze_last_layer=0",
    "logging.tensorboard=false",
    "logging.profile=false",
]


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


def _train(out: Path, train_root: Path, *extra: str, nproc: int | None = None) -> dict:
    return tiny.train(out, train_root, *TINY, *extra, ranks=nproc or 1)


def test_two_processes_equal_one_with_the_doubled_batch(train_root, tmp_path):
    one = _train(tmp_path / "one", train_root, "data.batch_size=8")
    two = _train(tmp_path / "two", train_root, "data.batch_size=4", nproc=2)
    assert two["report"]["steps"] == one["report"]["steps"] == 2 * 5  # 40 images / 8 per step
    assert two["state"]["world_size"] == 2 and len(two["state"]["loader"]) == 2
    assert [r["step"] for r in two["rows"]] == [r["step"] for r in one["rows"]]
    for a, b in zip(one["rows"], two["rows"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
    for key in ("student", "teacher", "loss"):
        for name, value in one["state"][key].items():
            torch.testing.assert_close(two["state"][key][name], value, rtol=1e-4, atol=1e-5)


def test_metrics_reduction_and_rank0_checkpoint(tmp_path):
    """Two gloo ranks of the lesson's DistributedDINOTrainer (see dist_metrics_worker.py)."""
    launch_ranks(
        HERE / "workers" / "dist_metrics_worker.py",
        2,
        lambda r: [str(tmp_path / "init"), str(tmp_path)],
        120,
    )
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for g in got:  # the mean over ranks, on every rank
        assert g["metrics"] == {"loss": pytest.approx(2.5), "images_per_second": 150.0}
    assert torch.load(tmp_path / "ckpt.pth")["written_by"] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".pth") == ["ckpt.pth"]


def test_a_state_sent_between_ranks_arrives_as_pickled(tmp_path):
    """runtime.send_state/recv_state: every kind of leaf (dtypes, a shared,
    an empty, a strided and a 0-d tensor, a Parameter, an OrderedDict's
    metadata) arrives as a pickle round trip gives it, each way and over a
    group of its own; the tensors received can be written."""
    for r in run_ranks(HERE / "workers" / "dist_transfer_worker.py", tmp_path):
        assert r == {
            "same": True,
            "metadata": True,
            "shared": True,
            "parameter": True,
            "writable": True,
        }, r


def test_alone_nothing_is_reduced(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert launched_world() is None
    assert all_reduce_metrics({"loss": torch.tensor(2.0), "n": 3, "tag": "x"}) == {
        "loss": 2.0,
        "n": 3.0,
    }
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK"):
        launched_world()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        launched_world()


def test_launch_counts_gpus_only_for_a_gpu_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="num_gpus=2 but this node has 1 GPUs"):
        launch_distributed_training(None, 2)
    with pytest.raises(ValueError, match="num_gpus must be an int >= 1"):
        launch_distributed_training(None, 0)


def test_launch_in_process_on_cpus_keeps_the_callers_signal_handlers(
    train_root, tmp_path, monkeypatch
):
    def handler(signum, frame):  # the caller's own, e.g. a notebook kernel's
        pass

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.signal(signal.SIGTERM, handler)
    overrides = [f"data.root={train_root}", *TINY, "data.batch_size=4", "hardware.device=cpu"]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        report = launch_distributed_training(
            None, 2, overrides=overrides, output_dir=str(tmp_path / "run")
        )
        assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
    finally:
        for sig, h in before.items():
            signal.signal(sig, h)
    assert report["steps"] == 10  # 40 images, 2 ranks x 4 per step


def test_a_cuda_device_gets_its_index(monkeypatch):
    # NCCL's group of one (fsdp on one GPU) refused torch.device("cuda") on the
    # first GPU run: "Please use a device_id with index".
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert with_index(torch.device("cuda")) == torch.device("cuda", 3)
    assert with_index(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert with_index(torch.device("cpu")) == torch.device("cpu")
