"""Fault tolerance of `dino-opt train`: a run killed at random steps (SIGKILL)
and resumed ends with the same losses and weights, bit for bit, as a run that
never stopped; SIGTERM checkpoints and stops cleanly; a corrupt newest
checkpoint falls back to the previous one; a checkpoint of another config
is refused; repeated non-finite steps stop the run with a checkpoint."""

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from dino_opt.checkpoint import CheckpointManager
from dino_opt.cli import main
from dino_opt.observe import NonFiniteError
from dino_opt.ops import DINOLoss
from forked import CliProcess, run_cli, wait_for
from tiny import TINY as TINY_BASE
from tiny import checkpointed, final_state, kill_when, tiny_train_only, train_args

TINY = [
    *TINY_BASE,
    "data.num_workers=2",
    "model.drop_path_rate=0.1",  # the torch RNG matters: it must be restored too
    "schedule.epochs=3",
    "logging.tensorboard=false",
    "logging.profile=false",
    "checkpoint.every_steps=1",
]


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


def _args(out: Path, train_root: Path, *extra: str) -> list[str]:
    return train_args(out, train_root, *TINY, *extra)


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _spawn(out: Path, train_root: Path, *extra: str, before=None) -> CliProcess:
    return CliProcess(_args(out, train_root, *extra), _env(), before=before)


def _run(out: Path, train_root: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(_args(out, train_root, *extra), _env(), timeout=300)


def _losses(out: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def _assert_same_state(a: dict, b: dict) -> None:
    for key in ("student", "teacher", "loss"):
        assert a[key].keys() == b[key].keys()
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name} differs"
    sa_all, sb_all = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa_all.keys() == sb_all.keys()
    for sa, sb in zip(sa_all.values(), sb_all.values(), strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), f"optimizer state {k} differs"
    assert (a["step"], a["epoch"], a["teacher_step"]) == (b["step"], b["epoch"], b["teacher_step"])


@pytest.fixture(scope="module")
def reference(train_root, tmp_path_factory):
    """The uninterrupted run (in a process of its own, as the interrupted ones)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    done = _run(out, train_root)
    assert done.returncode == 0, done.stderr
    return out


def test_sigkill_at_random_steps_then_resume_is_bit_exact(reference, train_root, tmp_path):
    out = tmp_path / "run"
    rng = random.Random()
    total = 15  # 3 epochs x 5 steps
    kills = 0
    for target in sorted(rng.sample(range(1, total - 2), 3)):
        # somewhere inside a step after the checkpoint of step `target`
        delay = rng.uniform(0.0, 0.05)
        kills += kill_when(_spawn(out, train_root), checkpointed(out, target), delay=delay)
    assert kills >= 1, "no run was killed before it finished; the test proved nothing"
    done = _run(out, train_root)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == total and "resumed_from" in report
    assert _losses(out) == _losses(reference)
    _assert_same_state(final_state(out), final_state(reference))


def _slow_writes() -> None:
    """In the training process: every checkpoint write pauses 0.4 s between
    its bytes and its rename (in the writer's thread), so that a write is in
    flight most of the time, its temporary file beside the checkpoints."""
    save = torch.save

    def slow_save(*args, **kwargs):
        save(*args, **kwargs)
        time.sleep(0.4)

    torch.save = slow_save


def test_sigkill_while_an_async_write_is_in_flight_loses_nothing(reference, train_root, tmp_path):
    out = tmp_path / "run"
    manager = CheckpointManager(out / "checkpoints")
    in_flight = 0
    for target in (3, 8):
        # a temporary file beside the checkpoints: a write has begun and is not done
        reached = checkpointed(out, target)
        in_flight += kill_when(
            _spawn(out, train_root, before=_slow_writes),
            lambda r=reached: (
                r() and any(f.name.endswith(".tmp") for f in (out / "checkpoints").iterdir())
            ),
        )
        for record in manager.checkpoints():  # what the index holds is complete
            assert manager.verify(record.path), record.path
    assert in_flight >= 1, "no run was killed with a write in flight; the test proved nothing"
    done = _run(out, train_root)
    assert done.returncode == 0, done.stderr
    assert _losses(out) == _losses(reference)
    _assert_same_state(final_state(out), final_state(reference))


def test_synchronous_checkpoints_train_the_same_weights(reference, train_root, tmp_path):
    out = tmp_path / "run"
    done = _run(out, train_root, "checkpoint.async=false")
    assert done.returncode == 0, done.stderr
    assert _losses(out) == _losses(reference)
    _assert_same_state(final_state(out), final_state(reference))


def test_sigterm_checkpoints_and_stops_then_resumes_exactly(reference, train_root, tmp_path):
    out = tmp_path / "run"
    # no periodic checkpoints: the only one before the end is the emergency one
    extra = ("checkpoint.every_steps=0", "checkpoint.every_epochs=0")
    p = _spawn(out, train_root, *extra)
    metrics = out / "metrics.jsonl"
    assert wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, p)
    p.send_signal(signal.SIGTERM)
    _, stderr = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, stderr
    report = json.loads((out / "report.json").read_text())
    assert report["stopped_by"] == "SIGTERM" and report["steps"] < 15
    state = torch.load(report["checkpoint"], weights_only=True)
    assert state["reason"] == "signal:SIGTERM" and state["step"] == report["steps"]
    done = _run(out, train_root, *extra)
    assert done.returncode == 0, done.stderr
    assert _losses(out) == _losses(reference)
    _assert_same_state(final_state(out), final_state(reference))


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(reference, train_root, tmp_path):
    out = tmp_path / "run"
    manager = CheckpointManager(out / "checkpoints")
    kill_when(_spawn(out, train_root), checkpointed(out, 7))
    records = manager.checkpoints()
    assert len(records) >= 2
    newest = records[-1].path
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated
    done = _run(out, train_root)
    err = done.stderr
    assert done.returncode == 0, err
    assert str(newest) in err or newest.name in err  # reported, then skipped
    assert f"resuming from {records[-2].path}" in err
    _assert_same_state(final_state(out), final_state(reference))


def _train_error(capsys, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(args))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_resume_refuses_another_config_and_fresh_start_refuses_a_used_folder(
    train_root, tmp_path, capsys
):
    out = tmp_path / "run"
    one = "schedule.epochs=1"
    assert main(_args(out, train_root, one)) == 0
    err = _train_error(capsys, *_args(out, train_root, one, "model.out_dim=32"))
    assert "model.out_dim: 64 in the checkpoint, 32 now" in err and str(out) in err
    err = _train_error(capsys, *_args(out, train_root, one, "checkpoint.resume=null"))
    assert "already holds checkpoints" in err and str(out) in err
    missing = tmp_path / "nope.pth"
    err = _train_error(
        capsys, *_args(tmp_path / "b", train_root, one, f"checkpoint.resume={missing}")
    )
    assert str(missing) in err
    # what does not change the computation may differ
    assert main(_args(out, train_root, one, "data.num_workers=1")) == 0


def test_repeated_nonfinite_steps_stop_with_a_checkpoint(train_root, tmp_path, monkeypatch):
    forward = DINOLoss.forward

    def nan_loss(self, *args, **kwargs):
        return forward(self, *args, **kwargs) * float("nan")

    monkeypatch.setattr(DINOLoss, "forward", nan_loss)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match="consecutive"):
        main(
            _args(
                out,
                train_root,
                "health.max_nonfinite_steps=2",
                "checkpoint.every_steps=0",
                "health.on_nonfinite=stop",
            )
        )
    records = CheckpointManager(out / "checkpoints").checkpoints()
    state = torch.load(records[-1].path, weights_only=True)
    assert state["reason"] == "nonfinite"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["nonfinite_streak"] >= 3
    # every step was skipped: the student is still its initialisation
    from dino_opt.config import Config, apply_overrides
    from dino_opt.train import build_models

    cfg = apply_overrides(Config.from_dict(state["config"]), [])
    torch.manual_seed(cfg.hardware.seed)
    student, _ = build_models(cfg)
    for name, value in student.state_dict().items():
        assert torch.equal(value, state["student"][name]), name
