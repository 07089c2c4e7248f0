"""FSDP2 (``distributed.strategy=fsdp``) on CPUs with gloo, 2 processes:
the same losses and weights as DDP; sharded asynchronous checkpoints that
resume bit for bit (after a SIGKILL too) and at another world size; the
sharded run read back whole by the tools; the refusals in one line."""

import json
from pathlib import Path

import pytest
import tiny
import torch
from dino_opt.checkpoint import CheckpointManager, read_sharded
from dino_opt.cli import main
from dino_opt.job.sharding import resharded_loader_state
from forked import CliProcess, run_cli
from safetensors.torch import load_file
from tiny import TINY as TINY_BASE
from tiny import (
    checkpointed,
    kill_when,
    knn_json,
    ranks_env,
    tiny_train_only,
    train_args,
)

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


def _command(out: Path, train_root: Path, *extra: str, nproc: int = 2) -> list[str]:
    return train_args(out, train_root, *TINY, *extra, nproc=nproc)


def _train(out: Path, train_root: Path, *extra: str) -> dict:
    return tiny.train(out, train_root, *TINY, *extra, ranks=2)


def _failed(out: Path, train_root: Path, *extra: str):
    """A launch expected to fail: its completed process."""
    return run_cli(_command(out, train_root, *extra), ranks_env())


def _losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["rows"] if "loss" in r]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_fsdp_trains_as_ddp(train_root, tmp_path):
    # 20 micro-batches of 2 images per rank, 2 per optimizer step (the first
    # of each neither reduces nor reshards); the last layer frozen in the
    # first epoch (FSDP computes no gradient for it, DDP discards it)
    steps = (
        "schedule.epochs=2",
        "optim.accumulation_steps=2",
        "data.batch_size=2",
        "optim.freeze_last_layer=1",
    )
    ddp = _train(tmp_path / "ddp", train_root, *steps)
    fsdp = _train(tmp_path / "fsdp", train_root, *steps, FSDP)
    assert fsdp["report"]["steps"] == ddp["report"]["steps"] == 20  # 2 x 40 images / (2 x 2)
    assert Path(fsdp["report"]["checkpoint"]).name.endswith(".dcp")
    for a, b in zip(_losses(ddp), _losses(fsdp), strict=True):
        assert b == pytest.approx(a, rel=1e-4)
    for key in ("student", "teacher"):
        for name, value in ddp["state"][key].items():
            torch.testing.assert_close(fsdp["state"][key][name], value, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fsdp["state"]["loss"]["center"], ddp["state"]["loss"]["center"])


# ------------------------------------------------------------ kill -9, resume

KILLABLE = (FSDP, "model.drop_path_rate=0.1", "checkpoint.every_steps=1")


@pytest.fixture(scope="module")
def reference(train_root, tmp_path_factory):
    """An uninterrupted sharded run (2 epochs of 5 steps, a checkpoint every step)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    _train(out, train_root, *KILLABLE)
    return out


def _kill_after(
    out: Path, train_root: Path, step: int, *extra: str, nproc: int = 2, delay: float = 0.0
) -> bool:
    """Trains on ``nproc`` ranks and SIGKILLs the launcher and every rank (a
    node lost) once a checkpoint of ``step`` or later is listed; whether
    that came before the run ended."""
    p = CliProcess(_command(out, train_root, *extra, nproc=nproc), ranks_env(), new_session=True)
    return kill_when(p, checkpointed(out, step), delay=delay, group=True)


def _final_state(out: Path) -> dict:
    return read_sharded(json.loads((out / "report.json").read_text())["checkpoint"])


def _assert_equal_states(a: dict, b: dict) -> None:
    for key in ("student", "teacher", "loss"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name} differs"
    for name, value in a["optimizer"]["state"].items():
        for k, v in value.items():
            assert torch.equal(v, b["optimizer"]["state"][name][k]), f"optimizer {name}.{k}"
    assert (a["step"], a["teacher_step"]) == (b["step"], b["teacher_step"])


def test_sigkill_of_every_rank_then_resume_is_bit_exact(reference, train_root, tmp_path):
    out = tmp_path / "run"
    manager = CheckpointManager(out / "checkpoints")
    kills = 0
    for target, delay in ((3, 0.0), (6, 0.05)):
        kills += _kill_after(out, train_root, target, *KILLABLE, delay=delay)
        for record in manager.checkpoints():  # whatever is listed is complete
            assert manager.verify(record.path), record.path
    assert kills >= 1, "the runs ended before they were killed; the test proved nothing"
    _train(out, train_root, *KILLABLE)
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 10 and "resumed_from" in report
    steps_and_losses = [
        [(r["step"], r["loss"]) for r in _rows(o) if "loss" in r][-3:] for o in (out, reference)
    ]
    assert steps_and_losses[0] == steps_and_losses[1]
    _assert_equal_states(_final_state(out), _final_state(reference))
    assert not any(p.name.endswith(".partial") for p in (out / "checkpoints").iterdir())


def test_a_killed_rank_restarts_the_sharded_job_bit_exact(reference, train_root, tmp_path):
    """Rank 1 SIGKILLs itself after step 7: the launcher restarts both ranks
    from the newest sharded checkpoint and the run ends as the uninterrupted one."""
    out = tmp_path / "run"
    kill = ("debug.inject_kill_at_step=7", "debug.inject_kill_rank=1")
    run = _train(out, train_root, *KILLABLE, *kill)
    (restart,) = run["report"]["restarts"]
    assert (restart["rank"], restart["signal"], restart["at_step"]) == (1, "SIGKILL", 7)
    # Saved after every step, asynchronously with one write in flight: the
    # kill after step 7 comes before step 7's save, while step 6's may still
    # be writing; step 5's was published before step 6's began.
    assert restart["checkpoint"].endswith(".dcp") and restart["step"] in (5, 6)
    assert run["report"]["steps"] == 10
    _assert_equal_states(_final_state(out), _final_state(reference))


def test_resume_at_another_world_size_reshards(train_root, tmp_path):
    """2 ranks, then 1 (the shards of two read by one), then 2 again; with
    the dinov2 recipe (its separate iBOT head sharded too)."""
    out = tmp_path / "run"
    extra = (
        FSDP,
        "schedule.epochs=3",
        "checkpoint.every_steps=1",
        "recipe.name=dinov2",
        "recipe.ibot.separate_head=true",
        "recipe.ibot.out_dim=64",
    )
    assert _kill_after(out, train_root, 3, *extra)
    assert _kill_after(out, train_root, 12, *extra, nproc=1)  # 10 steps/epoch alone
    run = _train(out, train_root, *extra)
    report = run["report"]
    assert report["steps"] == 15 and "resumed_from" in report  # 3 epochs of 5 steps at 2 ranks
    steps = [r["step"] for r in run["rows"] if "loss" in r]
    assert steps[-1] == 15 and all(torch.isfinite(torch.tensor(_losses(run))))
    state = run["state"]
    assert state["world_size"] == 2 and state["epoch"] == 3
    for key in ("student", "teacher"):
        assert all(torch.isfinite(v).all() for v in state[key].values())


def test_the_tools_read_a_sharded_run(reference, train_root, tmp_path, capsys):
    assert main(["report", str(reference), "--json"]) == 0
    checkpoints = json.loads(capsys.readouterr().out)["checkpoints"]
    assert checkpoints["summary"]["verified"] == checkpoints["summary"]["count"] >= 2
    newest = checkpoints["checkpoints"][-1]
    assert newest["file"].endswith(".dcp") and newest["size"] > 1_000_000
    out = tmp_path / "exported.safetensors"
    assert main(["export", str(reference), "--format", "timm", "--output", str(out)]) == 0
    weights = load_file(out)
    teacher = _final_state(reference)["teacher"]
    torch.testing.assert_close(weights["cls_token"], teacher["backbone.cls_token"])
    # k-NN of the sharded run's teacher equals that of the weights it exports
    root = train_root.resolve().parent  # the built-in set's train/ and val/
    knn = [
        knn_json(capsys, *source, "--data", str(root), "--device", "cpu", "--image-size", "32")
        for source in (("--checkpoint", str(reference)), ("--weights", str(out)))
    ]
    assert knn[0]["which"] == "teacher" and knn[0]["n_train"] == 40 and knn[0]["n_val"] == 10
    assert knn[0]["top1"] == knn[1]["top1"] and knn[0]["top5"] == knn[1]["top5"]


def test_rollback_and_hang_watchdog_under_fsdp(train_root, tmp_path):
    inject = ("debug.inject_nonfinite_at_step=4", "health.max_nonfinite_steps=0")
    run = _train(tmp_path / "rollback", train_root, FSDP, *inject)
    (rollback,) = run["report"]["rollbacks"]
    assert rollback["skipped_iterations"] == [3, 3] and rollback["checkpoint"].endswith(".dcp")
    assert run["report"]["steps"] == 10 and all(torch.isfinite(torch.tensor(_losses(run))))
    out = tmp_path / "hang"
    hang = (
        "debug.inject_hang_at_step=4",
        "debug.inject_hang_rank=1",
        "distributed.max_restarts=0",
        "distributed.hang_timeout_s=15",
        "checkpoint.every_steps=1",
    )
    done = _failed(out, train_root, FSDP, *hang)
    assert done.returncode == 75, done.stderr[-3000:]
    # Whichever rank's watchdog fires first writes hang.json (the launcher then
    # stops the other); both name rank 1 and a checkpoint that verifies.
    report = json.loads((out / "hang.json").read_text())
    assert report["stuck_ranks"] == [1] and report["world_size"] == 2
    manager = CheckpointManager(out / "checkpoints")
    last = manager.checkpoints()[-1]
    assert last.step >= 3 and manager.verify(last.path)
    assert report["checkpoint_step"] <= last.step
    resumed = _train(out, train_root, FSDP, "checkpoint.every_steps=1")
    assert resumed["report"]["resumed_from"] == str(last.path)
    assert resumed["report"]["steps"] == 10


def test_unsupported_combinations_are_one_line(train_root, tmp_path):
    for extra, words in (
        (("hardware.precision=fp16",), "not fp16"),
        (("model.backbone=resnet18",), "use distributed.strategy=ddp"),
    ):
        done = _failed(tmp_path / "x", train_root, FSDP, *extra)
        assert done.returncode != 0 and words in done.stderr
        assert "Traceback" not in done.stderr
    done = _failed(tmp_path / "y", train_root, FSDP, "checkpoint.resume=/nowhere.pth")
    assert done.returncode != 0 and "checkpoint.resume='/nowhere.pth'" in done.stderr
    assert "restarting" not in done.stderr, done.stderr  # a restart would refuse it again


def _checkpoint_of_step(out: Path, step: int) -> str:
    records = CheckpointManager(out / "checkpoints").checkpoints()
    (found,) = [r.path for r in records if r.step == step]
    return str(found)


def test_a_run_resumes_under_the_other_strategy(train_root, tmp_path):
    """ddp's step 5 resumed by fsdp, whose step 7 is resumed by ddp: the
    weights and optimizer state go across both ways, and each run ends as the
    ddp run that was never switched (fsdp equals ddp to float32 tolerance)."""
    every = ("checkpoint.every_steps=1", "checkpoint.keep=20")
    ddp = _train(tmp_path / "ddp", train_root, *every)
    resume = f"checkpoint.resume={_checkpoint_of_step(tmp_path / 'ddp', 5)}"
    fsdp = _train(tmp_path / "fsdp", train_root, *every, FSDP, resume)
    resume = f"checkpoint.resume={_checkpoint_of_step(tmp_path / 'fsdp', 7)}"
    back = _train(tmp_path / "back", train_root, *every, resume)
    assert Path(fsdp["report"]["checkpoint"]).name.endswith(".dcp")
    assert not Path(back["report"]["checkpoint"]).name.endswith(".dcp")
    for run in (fsdp, back):
        assert run["report"]["steps"] == 10 and "resumed_from" in run["report"]
        assert _losses(run)[-1] == pytest.approx(_losses(ddp)[-1], rel=1e-4)
        for key in ("student", "teacher"):
            for name, value in ddp["state"][key].items():
                torch.testing.assert_close(run["state"][key][name], value, rtol=1e-4, atol=1e-5)
    moments, carried = (r["state"]["optimizer"]["state"] for r in (ddp, back))
    assert moments.keys() == carried.keys()
    for i, m in moments.items():
        assert int(carried[i]["step"]) == int(m["step"]) == 10
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(carried[i][k], m[k], rtol=1e-3, atol=1e-7)


def test_resharded_loader_state_goes_on_after_the_images_seen():
    fields = {"epoch": 1, "next_batch": 3, "batch_size": 4, "world_size": 2, "seed": 0}
    old = [{**fields, "rank": r, "num_samples": 40, "shuffle": True} for r in (0, 1)]
    one = resharded_loader_state(old, 0, 1)  # 24 images seen: 6 batches of 4 alone
    assert (one["epoch"], one["next_batch"], one["world_size"], one["rank"]) == (1, 6, 1, 0)
    four = resharded_loader_state(old, 3, 4)  # 16 per global batch: 1 whole batch, 8 seen twice
    assert (four["next_batch"], four["world_size"], four["rank"]) == (1, 4, 3)
