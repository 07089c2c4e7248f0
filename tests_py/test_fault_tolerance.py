"""Fault tolerance beyond resume: asynchronous checkpoint writes, rollback
to the last good checkpoint on non-finite steps or a collapse (with the
failing batches skipped, deterministically), and the hang watchdog (two
gloo ranks, one of which stops before a collective)."""

import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest
import tiny
import torch
from dino_opt.checkpoint import AsyncCheckpointWriter, CheckpointManager, CheckpointWriteError
from dino_opt.cli import main
from dino_opt.job import HangReporter
from dino_opt.observe import CollapseError, NonFiniteError
from dino_opt.runtime import EXIT_HANG, HangWatchdog, describe_hang
from forked import run_cli
from tiny import TINY as TINY_BASE
from tiny import ranks_env, tiny_train_only, train_args

TINY = [
    *TINY_BASE,
    "data.num_workers=1",
    "schedule.epochs=3",
    "logging.tensorboard=false",
    "logging.profile=false",
    "checkpoint.every_steps=1",
    "checkpoint.keep=20",
]


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


# ---------------------------------------------------------------- async writes


class _GatedManager(CheckpointManager):
    """A manager whose writes wait for ``gate``."""

    def __init__(self, directory):
        super().__init__(directory, keep_last=None)
        self.gate = threading.Event()
        self.started = threading.Event()

    def save(self, state, **kwargs):
        self.started.set()
        assert self.gate.wait(30)
        return super().save(state, **kwargs)


def test_async_write_holds_the_state_of_the_save_not_of_later_steps(tmp_path):
    manager = _GatedManager(tmp_path / "ck")
    writer = AsyncCheckpointWriter(manager)
    weights = torch.randn(64, 32)
    state = {"model": {"w": weights}, "history": [{"loss": 1.0}], "step": 3}
    expected = weights.clone()
    path = writer.save(state, epoch=0, step=3)
    assert manager.started.wait(30) and writer.in_flight
    weights.add_(1.0)  # the next optimizer step, while the write is in flight
    state["history"].append({"loss": 0.5})
    assert not manager.checkpoints()  # nothing is recorded before the write is complete
    manager.gate.set()
    assert writer.wait() == path and not writer.in_flight
    loaded = manager.load(path)
    assert torch.equal(loaded["model"]["w"], expected)
    assert loaded["history"] == [{"loss": 1.0}] and loaded["step"] == 3
    assert [r.path for r in manager.checkpoints()] == [path]


def test_async_writes_equal_synchronous_ones(tmp_path):
    state = {"a": torch.randn(10, 3), "b": [torch.arange(5), (1, "x")], "c": {"d": 2.5}}
    sync_path = CheckpointManager(tmp_path / "sync").save(state, epoch=1, step=2)
    manager = CheckpointManager(tmp_path / "async")
    writer = AsyncCheckpointWriter(manager)
    writer.save(state, epoch=1, step=2)
    path = writer.wait()
    a, b = manager.load(path), torch.load(sync_path, weights_only=True)
    assert torch.equal(a["a"], b["a"]) and torch.equal(a["b"][0], b["b"][0])
    assert a["b"][1] == b["b"][1] and a["c"] == b["c"]
    assert manager.verify(path)


def test_one_write_in_flight_the_next_save_waits(tmp_path):
    manager = _GatedManager(tmp_path / "ck")
    writer = AsyncCheckpointWriter(manager)
    writer.save({"x": torch.zeros(3)}, epoch=0, step=1)
    assert manager.started.wait(30)
    second = threading.Thread(
        target=writer.save, args=({"x": torch.ones(3)},), kwargs={"epoch": 0, "step": 2}
    )
    second.start()
    second.join(0.3)
    assert second.is_alive()  # waiting for the first write
    manager.gate.set()
    second.join(30)
    assert not second.is_alive()
    writer.wait()
    assert [r.step for r in manager.checkpoints()] == [1, 2]


def test_a_failed_async_write_is_raised_by_the_next_save_and_by_wait(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    writer = AsyncCheckpointWriter(CheckpointManager(blocker / "ck"))
    writer.save({"x": torch.zeros(2)}, epoch=0, step=1)  # returns: the write fails later
    with pytest.raises(CheckpointWriteError, match="ck"):
        writer.save({"x": torch.zeros(2)}, epoch=0, step=2)  # not started
    assert writer.wait() is None  # the error is raised once
    writer.save({"x": torch.zeros(2)}, epoch=0, step=3)
    with pytest.raises(CheckpointWriteError, match="s00000003"):
        writer.wait()


@pytest.mark.cuda
def test_async_write_of_gpu_tensors_goes_through_reused_pinned_buffers(tmp_path):
    manager = CheckpointManager(tmp_path / "ck", keep_last=None)
    writer = AsyncCheckpointWriter(manager)
    weights = torch.randn(1 << 20, device="cuda")
    expected = weights.cpu()
    writer.save({"w": weights, "step": torch.tensor(1)}, epoch=0, step=1)
    weights.mul_(2)  # queued after the copy on the same stream: the snapshot keeps the old values
    first = writer.wait()
    writer.save({"w": weights, "step": torch.tensor(2)}, epoch=0, step=2)
    second = writer.wait()
    assert torch.equal(manager.load(first)["w"], expected)
    assert torch.equal(manager.load(second)["w"], expected * 2)
    assert manager.load(second)["w"].device.type == "cpu"


# ---------------------------------------------------------------- the watchdog


def test_describe_hang_names_the_rank_that_is_not_in_the_collective():
    waiting = {"step": 12, "phase": "collective: metrics", "stalled_s": 31.0, "beats": 9}
    computing = {"step": 12, "phase": "training step 13", "stalled_s": 31.0, "beats": 9}
    stuck, message = describe_hang(0, 31.0, {0: waiting, 1: computing, 2: dict(waiting)})
    assert stuck == [1]
    assert "stuck: rank 1" in message and "last completed step 12" in message
    behind = dict(waiting, step=10)
    assert describe_hang(0, 5.0, {0: waiting, 1: behind})[0] == [1]
    dead = dict(waiting, alive=False)
    stuck, message = describe_hang(0, 5.0, {0: waiting, 1: dead, 2: None})
    assert stuck == [1, 2] and "no heartbeat" in message and "never reported" in message
    assert describe_hang(0, 5.0, {0: waiting, 1: dict(waiting)})[0] == [0, 1]  # all alike


def test_watchdog_ends_a_process_without_progress_and_spares_one_with_it():
    exits, hangs = [], []
    watchdog = HangWatchdog(
        0.6,
        exit=exits.append,
        interval_s=0.05,
        on_hang=lambda m, s: hangs.append((m, s)) or "the checkpoint note",
    )
    with watchdog:
        watchdog.arm()
        for step in range(1, 15):  # progress every 0.1 s: no alarm
            time.sleep(0.1)
            watchdog.progress(step)
        assert not exits
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    assert exits == [EXIT_HANG]
    message, stuck = hangs[0]
    assert stuck == [0] and "last completed step 14" in message
    assert "the checkpoint note" in watchdog.fired_message


def test_watchdog_is_quiet_until_armed():
    exits = []
    with HangWatchdog(0.2, exit=exits.append, interval_s=0.05):
        time.sleep(0.6)
    assert not exits


# ---------------------------------------------------------------- rollback


def _train(out: Path, train_root: Path, *extra: str) -> dict:
    return tiny.train(out, train_root, *TINY, *extra)["report"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _final(report: dict) -> dict:
    return torch.load(report["checkpoint"], weights_only=True)


def _assert_same(a: dict, b: dict) -> None:
    for key in ("student", "teacher", "loss"):
        for name, value in a[key].items():
            assert torch.equal(value, b[key][name]), f"{key}.{name}"


INJECT = ("debug.inject_nonfinite_at_step=7", "health.max_nonfinite_steps=0")


def test_injected_nan_rolls_back_skips_the_batch_and_finishes_finite(train_root, tmp_path):
    report = _train(tmp_path / "a", train_root, *INJECT)
    (rollback,) = report["rollbacks"]
    # step 7 trains micro-batch 6 (0-based); the checkpoint of step 6 is the last good one
    assert rollback["reason"] == "nonfinite" and rollback["skipped_iterations"] == [6, 6]
    assert rollback["step"] == 6 and rollback["checkpoint"].endswith("s00000006.pth")
    assert report["steps"] == 15 and math.isfinite(report["final_loss"])
    state = _final(report)
    for key in ("student", "teacher", "loss"):
        for name, value in state[key].items():
            assert torch.isfinite(value).all(), f"{key}.{name}"
    rows = _rows(tmp_path / "a")
    events = [r for r in rows if r.get("event") == "rollback"]
    assert len(events) == 1 and events[0]["at_step"] == 7
    steps = [r["step"] for r in rows if "event" not in r]
    assert steps == [1, 2, 3, 4, 5, 6, *range(8, 16)]  # the failed rows rewound, step 7 skipped
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    # the same run again ends bit-identical
    again = _train(tmp_path / "b", train_root, *INJECT)
    assert again["rollbacks"] == report["rollbacks"]
    _assert_same(_final(again), state)
    # resumed after the rollback (from the checkpoint of step 9), it makes the same choice
    resumed = tmp_path / "c"
    shutil.copytree(tmp_path / "a", resumed)
    manager = CheckpointManager(resumed / "checkpoints")
    for record in manager.checkpoints():
        if record.step > 9:
            record.path.unlink()
    (resumed / "report.json").unlink()
    result = _train(resumed, train_root, *INJECT)
    assert result["resumed_from"].endswith("s00000009.pth")
    assert result["rollbacks"] == report["rollbacks"]
    _assert_same(_final(result), state)


def test_rollbacks_are_limited_then_the_run_stops_with_its_checkpoints(train_root, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError, match="max_rollbacks=0") as e:
        _train(out, train_root, *INJECT, "health.max_rollbacks=0")
    records = CheckpointManager(out / "checkpoints").checkpoints()
    assert str(records[-1].path) in str(e.value) and records[-1].step == 6


def test_skip_policy_goes_on_and_stop_policy_stops(train_root, tmp_path):
    report = _train(tmp_path / "skip", train_root, *INJECT, "health.on_nonfinite=skip")
    assert report["rollbacks"] == [] and report["steps"] == 15
    rows = _rows(tmp_path / "skip")
    assert rows[-1]["nonfinite_streak"] >= 8  # the center stayed NaN: every later step failed
    with pytest.raises(NonFiniteError, match="steps 7-7"):
        _train(tmp_path / "stop", train_root, *INJECT, "health.on_nonfinite=stop")


def test_sustained_collapse_rolls_back_at_a_lower_learning_rate_then_stops(train_root, tmp_path):
    out = tmp_path / "run"
    collapse = (
        "health.feature_std_min=1e9",
        "health.on_collapse=rollback",
        "health.collapse_patience=2",
        "health.rollback_lr_scale=0.5",
        "health.max_rollbacks=2",
    )
    with pytest.raises(CollapseError, match="max_rollbacks=2") as e:
        _train(out, train_root, *collapse)
    assert "collapse_constant" in e.value.alerts
    events = [r for r in _rows(out) if r.get("event") == "rollback"]
    assert [(r["reason"], r["step"], r["lr_scale"]) for r in events] == [
        ("collapse", 0, 0.5),
        ("collapse", 0, 0.25),
    ]
    rows = [r for r in _rows(out) if "lr" in r]  # the last attempt's, after two rollbacks
    plain = {r["step"]: r["lr"] for r in _rows_of_plain_run(train_root, tmp_path)}
    assert [r["step"] for r in rows] == [1, 2] and plain[2] > 0
    for r in rows:
        assert r["lr"] == pytest.approx(0.25 * plain[r["step"]], rel=1e-12, abs=0)
    # collapse alerts held every later checkpoint back: only the one of step 0 exists
    assert [r.step for r in CheckpointManager(out / "checkpoints").checkpoints()] == [0]


def _rows_of_plain_run(train_root: Path, tmp_path: Path) -> list[dict]:
    out = tmp_path / "plain"
    _train(out, train_root, "schedule.epochs=3", "health.enabled=false")
    return _rows(out)


def test_rollback_configuration_is_checked(train_root, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "train",
                "--output-dir",
                str(tmp_path / "x"),
                f"data.root={train_root}",
                *TINY,
                "health.on_collapse=rollback",
            ]
        )
    assert "rollback_lr_scale < 1" in capsys.readouterr().err


# ---------------------------------------------------------------- hangs


def test_a_stuck_rank_ends_the_job_naming_it_then_the_restarted_run_finishes(train_root, tmp_path):
    # 12 s, not less: on 2 cores shared with another test's ranks a step that
    # also writes a checkpoint took over 3 s, and a 3 s watchdog fired on it
    out = tmp_path / "run"
    args = train_args(
        out,
        train_root,
        *TINY,
        "data.batch_size=4",
        "schedule.epochs=2",
        "debug.inject_hang_rank=1",
        "distributed.hang_timeout_s=12",
        nproc=2,
    )
    start = time.monotonic()
    done = run_cli(
        [*args, "debug.inject_hang_at_step=4", "distributed.max_restarts=0"],
        ranks_env(),
        timeout=300,
    )
    took = time.monotonic() - start
    assert done.returncode == EXIT_HANG, done.stderr[-3000:]
    assert "stuck: rank 1" in done.stderr and "last completed step 3" in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "dino-opt: rank 1 made no progress after step 3: the hang "
        "watchdog ended the run (exit status 75) "
        "(distributed.max_restarts=0)"
    )
    assert "; resume with: dino-opt train --output-dir" in last and took < 120
    assert "Traceback" not in done.stderr
    found = json.loads((out / "hang.json").read_text())
    assert found["stuck_ranks"] == [1] and found["checkpoint_step"] == 3
    assert CheckpointManager(out / "checkpoints").verify(found["checkpoint"])
    # resumed with restarts on and a hang at step 6 (the watchdog is armed by
    # a resumed run's first step): restarted from the checkpoint of step 5,
    # the run goes past the hang to its end
    done = run_cli([*args, "debug.inject_hang_at_step=6"], ranks_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the hang watchdog ended the run (exit status 75); restarting" in done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["resumed_from"].endswith("s00000005.pth") and report["steps"] == 10
    (row,) = report["restarts"]
    assert (row["exitcode"], row["stuck_ranks"], row["at_step"], row["step"]) == (
        EXIT_HANG,
        [1],
        5,
        5,
    )


def test_the_first_hang_diagnosis_stands_while_its_checkpoint_write_finishes(tmp_path):
    """Rank 1's watchdog fires while rank 0's waits for its checkpoint write
    (rank 0's heartbeat is gone by then, so rank 1 blames it): hang.json keeps
    rank 0's diagnosis, made while every rank was there."""
    manager = CheckpointManager(tmp_path / "checkpoints")
    hang_file = tmp_path / "hang.json"

    class SlowWriter:
        in_flight = True

        def wait(self, timeout):
            # the other rank's watchdog fires meanwhile
            HangReporter(hang_file, manager, None, 2, since=0.0).report("rank 1's view", [0])
            return "checkpoint-x.pth"

    reporter = HangReporter(hang_file, manager, SlowWriter(), 2, since=0.0)
    notes = reporter.report("rank 0's view", [1])
    hang = json.loads(hang_file.read_text())
    assert hang["stuck_ranks"] == [1] and hang["message"] == "rank 0's view"
    assert "the checkpoint write in flight finished: checkpoint-x.pth" in notes


class _LateHeartbeat:
    """A heartbeat store in which rank 1 waits in the metrics collective and
    its heartbeat moves only from the ``late``-th read of it on (None: never):
    a live rank whose thread a busy machine starves, or a dead one. Reads
    count, not seconds."""

    def __init__(self, late: int | None):
        self.values, self.reads, self.late = {}, 0, late

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values or k.endswith("/1") for k in keys)

    def get(self, key: str) -> bytes:
        if not key.endswith("/1"):
            return self.values[key].encode()
        self.reads += 1
        beats = 1 + (self.late is not None and self.reads >= self.late)
        waiting = {"step": 4, "phase": "collective: metrics", "stalled_s": 1.0, "beats": beats}
        return json.dumps(waiting).encode()


@pytest.mark.parametrize(("late", "stuck"), [(4, [0]), (None, [1])])
def test_a_late_heartbeat_is_alive_and_a_still_one_is_not(late, stuck):
    # Rank 0 stops in step 5 while rank 1 waits in the collective: rank 0 is
    # stuck, however late rank 1's heartbeat moves, unless it never does.
    exits, hangs, store = [], [], _LateHeartbeat(late)
    watchdog = HangWatchdog(
        1.0,
        world_size=2,
        store=store,
        exit=exits.append,
        interval_s=0.02,
        on_hang=lambda m, s: hangs.append((m, s)),
    )
    with watchdog:
        watchdog.arm()
        watchdog.progress(4)
        deadline = time.monotonic() + 60  # a bound for a broken watchdog, not the test's clock
        while not exits and time.monotonic() < deadline:
            time.sleep(0.02)
    assert exits == [EXIT_HANG] and hangs[0][1] == stuck, hangs
    assert ("no heartbeat" in hangs[0][0]) == (late is None)
    assert store.reads >= (late or 2)
