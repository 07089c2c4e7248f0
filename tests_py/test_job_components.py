"""The job's components on their own, without a training run: the rollback's
decisions, its target and its state round trip (:class:`Rollback`), the
run's checkpoints read for a resume (:class:`RunCheckpoints`), and when the
evaluation between epochs runs (:class:`Evaluator`)."""

import contextlib
from types import SimpleNamespace

import pytest
from dino_opt.checkpoint import CheckpointManager
from dino_opt.config import HealthConfig, apply_overrides, default_config
from dino_opt.job import ResumeError
from dino_opt.job import evaluation as evaluation_module
from dino_opt.job.checkpoints import RunCheckpoints
from dino_opt.job.evaluation import Evaluator
from dino_opt.job.rollback import Rollback, RollbackSignal
from dino_opt.observe import CollapseError, HealthAlert, NonFiniteError
from dino_opt.runtime import HangWatchdog


def _checkpoints(tmp_path, steps=(0, 2, 4, 6)) -> RunCheckpoints:
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=None)
    for step in steps:
        manager.save({"step": step, "epoch": 0, "rollbacks": []}, epoch=0, step=step)
    return RunCheckpoints(manager, lead=True, sharded=False, asynchronous=False)


def _rollback(checkpoints, accumulation=1, collectives=None, **health) -> Rollback:
    def collective(name):
        if collectives is not None:
            collectives.append(name)
        return contextlib.nullcontext()

    return Rollback(HealthConfig(**health), accumulation, checkpoints, collective)


def _signal(rollback: Rollback, *args):
    """The signal to go back that ``rollback.on_nonfinite(*args)`` raises."""
    with pytest.raises(RollbackSignal) as e:
        rollback.on_nonfinite(*args)
    return e.value


def test_nonfinite_policies_skip_stop_or_raise_the_signal_with_the_failed_iterations(tmp_path):
    checkpoints = _checkpoints(tmp_path)
    seen = NonFiniteError(2, 5, 6, 1)
    assert _rollback(checkpoints, on_nonfinite="skip").on_nonfinite(seen, 6) is None
    stop = _rollback(checkpoints, on_nonfinite="stop", max_nonfinite_steps=1)
    assert stop.on_nonfinite(seen, 6) is seen
    other = stop.on_nonfinite(None, 6)  # another rank's streak
    assert isinstance(other, NonFiniteError) and other.consecutive == 2
    collectives = []
    r = _signal(_rollback(checkpoints, collectives=collectives), seen, 6)
    # step 6 ends micro-batch 5: iterations 4 and 5 failed
    assert (r.reason, r.iterations, r.detail) == (
        "nonfinite",
        (4, 5),
        "2 consecutive non-finite steps (steps 5-6)",
    )
    assert collectives == ["rollback"]
    r = _signal(_rollback(checkpoints, accumulation=2), seen, 6)
    assert r.iterations == (1, 2)  # micro-batches 2-5 of two each


def test_a_rollback_goes_back_before_the_failure_skips_it_and_its_state_round_trips(tmp_path):
    checkpoints = _checkpoints(tmp_path)
    rollback = _rollback(checkpoints, rollback_lr_scale=0.5)
    assert rollback.enabled and rollback.lr_scale == 1.0
    r = _signal(rollback, NonFiniteError(2, 5, 6, 1), 6)
    restored = []

    def restore(state):  # what the job's load_state_dict does with the rollback's part
        restored.append(state["step"])
        rollback.load_state_dict(state)

    record, earlier = rollback.roll_back(r, 6, restore)
    assert restored == [4] and earlier == []  # the newest checkpoint before iteration 4
    assert record["step"] == 4 and record["at_step"] == 6 and record["rollback"] == 1
    assert record["skipped_iterations"] == [4, 5] and record["lr_scale"] == 0.5
    assert record["checkpoint"] == checkpoints.manager.checkpoints()[2].path.name
    assert [rollback.skipped(s) for s in range(3, 8)] == [False, True, True, False, False]
    assert "rollback 1/3 at step 6" in rollback.describe(record, 4)
    again = _rollback(checkpoints, rollback_lr_scale=0.5)
    again.load_state_dict(rollback.state_dict())
    assert again.rollbacks == rollback.rollbacks and again.lr_scale == 0.5
    assert again.skipped(5) and not again.skipped(6)
    fresh = _rollback(checkpoints)
    fresh.load_state_dict({})  # a checkpoint written before any rollback
    assert fresh.rollbacks == [] and not fresh.skipped(5)


def test_a_sustained_collapse_raises_the_signal_and_one_that_cannot_roll_back_gives_up(tmp_path):
    checkpoints = _checkpoints(tmp_path)
    rollback = _rollback(
        checkpoints,
        on_nonfinite="stop",
        on_collapse="rollback",
        collapse_patience=2,
        rollback_lr_scale=0.5,
        max_rollbacks=0,
    )
    alert = HealthAlert("collapse_constant", "error", "constant features", 0.0, 1.0)
    rollback.on_collapse(True, [alert])
    assert rollback.collapse_pending
    rollback.on_collapse(False, [])  # the streak starts again
    assert not rollback.collapse_pending
    rollback.on_collapse(True, [alert])
    with pytest.raises(RollbackSignal) as e:
        rollback.on_collapse(True, [alert])
    assert e.value.reason == "collapse" and "collapse_constant" in e.value.detail
    with pytest.raises(CollapseError, match="max_rollbacks=0") as given_up:
        rollback.roll_back(e.value, 8, lambda state: None)
    assert given_up.value.alerts == ["collapse_constant"]
    assert str(checkpoints.manager.checkpoints()[-1].path) in str(given_up.value)
    late = _rollback(_checkpoints(tmp_path / "late", steps=(6,)))
    r = _signal(late, NonFiniteError(2, 5, 6, 1), 6)
    with pytest.raises(NonFiniteError, match="no checkpoint written before step 5 loads"):
        late.roll_back(r, 6, lambda state: None)
    assert not _rollback(checkpoints, on_nonfinite="stop").enabled


def test_run_checkpoints_resume_the_newest_and_refuse_a_used_folder_for_a_fresh_start(tmp_path):
    empty = RunCheckpoints(
        CheckpointManager(tmp_path / "empty"), lead=True, sharded=False, asynchronous=False
    )
    assert empty.to_resume(None, restarted=False, output_dir=tmp_path) is None
    checkpoints = _checkpoints(tmp_path)
    path = checkpoints.write(
        {"step": 8, "epoch": 1}, "step", epoch=1, step=8, end_of_epoch=False, wait=True
    )
    state, found = checkpoints.to_resume("auto", restarted=False, output_dir=tmp_path)
    assert found == path and state["step"] == 8
    state, found = checkpoints.to_resume(None, restarted=True, output_dir=tmp_path)
    assert found == path and "shards" not in state
    with pytest.raises(ResumeError, match="already holds checkpoints"):
        checkpoints.to_resume(None, restarted=False, output_dir=tmp_path)
    with pytest.raises(ResumeError, match="checkpoint.resume="):
        checkpoints.to_resume(str(tmp_path / "missing.pth"), restarted=False, output_dir=tmp_path)
    assert checkpoints.read(path)["step"] == 8


class _Watchdog(HangWatchdog):
    """Records when it is disarmed and armed again."""

    def __init__(self, calls):
        self.calls = calls

    def disarm(self):
        self.calls.append("disarm")

    def arm(self):
        self.calls.append("arm")


def test_the_evaluation_between_epochs_runs_every_eval_every_epochs_but_not_after_the_last(
    monkeypatch,
):
    cfg = apply_overrides(
        default_config(), ["eval.every_epochs=2", "schedule.epochs=6", "schedule.warmup_epochs=1"]
    )
    calls = []
    teacher = SimpleNamespace(backbone="ema backbone")
    monkeypatch.setattr(evaluation_module, "whole_teacher", lambda parts, lead: teacher)

    def evaluate_teacher(cfg, roots, backbone, device, log, step, done, *name):
        calls.append((backbone, step, done))

    monkeypatch.setattr(evaluation_module, "evaluate_teacher", evaluate_teacher)
    parts = SimpleNamespace(roots=SimpleNamespace(val="val"), groups=None)
    evaluator = Evaluator(
        cfg, parts, "cpu", world=1, lead=True, folder=None, watchdog=_Watchdog(calls)
    )
    for done in range(1, 7):  # not after the sixth, the last
        evaluator.between_epochs(done, 10 * done, log=None)
    assert calls == [
        "disarm",
        ("ema backbone", 20, 2),
        "arm",
        "disarm",
        ("ema backbone", 40, 4),
        "arm",
    ]
    parts.roots.val = None  # no val split: nothing to evaluate
    evaluator.between_epochs(2, 20, log=None)
    assert evaluator.at_end(50, log=None) == {} and len(calls) == 6
