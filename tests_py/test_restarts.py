"""The launcher's restarts (``dino-opt train --nproc 2``, gloo): a rank
killed with SIGKILL mid-run is restarted and the run ends bit for bit as an
uninterrupted one; out of restarts the job ends with one line (the command
that resumes it is the same again); two nodes (two launchers on 127.0.0.1)
train what one node with two processes trains, a restart through the
rendezvous included (the hang watchdog's exit restarted:
test_fault_tolerance.py). And the pieces: the failure records,
the restart rows, the progress file, the exit status of a child."""

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dino_opt.cli import main
from dino_opt.cli.train import resume_command
from dino_opt.config import load_config
from dino_opt.distributed.agent import (
    WORKER_PRELOAD,
    WorkerFailedError,
    _method_name,
    _peek_exit,
    run_agent,
    worker_start_method,
)
from dino_opt.job import describe_exit, first_failure, read_progress, read_restarts
from dino_opt.job.restarts import (
    ProgressFile,
    claim_restart,
    pending_failures,
    record_failure,
    rows_to_log,
)
from dino_opt.observe import RunFolder
from dino_opt.runtime import EXIT_HANG
from forked import CliProcess, run_cli
from tiny import TINY as TINY_BASE
from tiny import ranks_env, tiny_train_only
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import get_method_name
from workers.agent_workers import bad_input_then_abort, report_launch

TINY = [
    *TINY_BASE,
    "data.num_workers=1",
    "data.batch_size=4",  # 40 images, 2 ranks: 5 steps an epoch, 10 in all
    "logging.tensorboard=false",
    "logging.profile=false",
    "checkpoint.every_steps=2",
    "checkpoint.keep=20",
]
KILL = ["debug.inject_kill_at_step=7", "debug.inject_kill_rank=1"]  # after the checkpoint of 6


@pytest.fixture(scope="module")
def train_root(tmp_path_factory):
    return tiny_train_only(tmp_path_factory)


def _command(out: Path, train_root: Path, options: list[str], *overrides: str) -> list[str]:
    return [
        "train",
        "--output-dir",
        str(out),
        "--quiet",
        *options,
        f"data.root={train_root}",
        *TINY,
        *overrides,
    ]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return run_cli(args, ranks_env())


def _teacher(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    return torch.load(report["checkpoint"], weights_only=True)["teacher"]


def _assert_same_teacher(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(train_root, tmp_path_factory):
    """The final teacher of the run never interrupted: one node, 2 processes."""
    out = tmp_path_factory.mktemp("plain") / "run"
    done = _run(_command(out, train_root, ["--nproc", "2"]))
    assert done.returncode == 0, done.stderr[-3000:]
    return _teacher(out)


def test_a_killed_rank_is_restarted_and_the_run_ends_as_an_uninterrupted_one(
    train_root, tmp_path, uninterrupted
):
    out = tmp_path / "run"
    done = _run(_command(out, train_root, ["--nproc", "2"], *KILL))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "rank 1 was killed by SIGKILL after step 7; restarting every worker (restart 1 of 3)"
        in done.stderr
    )
    assert "Traceback" not in done.stderr
    _assert_same_teacher(_teacher(out), uninterrupted)
    report = json.loads((out / "report.json").read_text())
    (row,) = report["restarts"]
    assert (row["rank"], row["signal"], row["exitcode"]) == (1, "SIGKILL", -signal.SIGKILL)
    assert (row["at_step"], row["step"], row["restart"]) == (7, 6, 1)
    assert row["checkpoint"].endswith("s00000006.pth") and row["restart_seconds"] > 0
    assert read_restarts(RunFolder(out)) == report["restarts"]
    assert not list((out / "failures").iterdir())  # claimed
    rows = _rows(out)
    (at,) = [i for i, r in enumerate(rows) if r.get("event") == "restart"]
    assert rows[at - 1]["step"] == 6 and rows[at + 1]["step"] == 7
    assert [r["step"] for r in rows if "event" not in r] == list(range(1, 11))


def test_out_of_restarts_the_job_ends_with_one_line(train_root, tmp_path):
    out = tmp_path / "run"
    twice = [*KILL, "debug.inject_attempts=2", "distributed.max_restarts=1"]
    args = _command(out, train_root, ["--nproc", "2"], *twice)
    done = _run(args)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "dino-opt: rank 1 was killed by SIGKILL after step 7 (1 of 1 restarts "
        "used); last checkpoint: step 6 ("
    )
    assert shlex.split(last.split("; resume with: ", 1)[1]) == ["dino-opt", *args]
    (row,) = json.loads((out / "restarts.json").read_text())  # the first kill, restarted
    assert (row["rank"], row["at_step"], row["step"]) == (1, 7, 6)


def test_rendezvous_events_are_named_as_torch_names_them():
    """The launcher's stand-in for torch's rendezvous event names (which
    read every frame's source) names the same function at each depth, and
    none past the stack's top."""

    def record(depth):  # as torch's rendezvous records: from a method, about its caller
        return _method_name(depth), get_method_name(depth)

    def next_rendezvous():
        return record(1), record(2), record(3), record(4), record(10_000)

    names = next_rendezvous()
    assert [ours for ours, _ in names] == [theirs for _, theirs in names]
    assert names[1][0] == "next_rendezvous" and names[-1][0] == "no_method_name"


def test_the_resume_command_names_the_run_folder_it_made():
    args = argparse.Namespace(argv=["train", "--nproc", "2", "x=1"], output_dir=None)
    cfg = load_config(None)
    command = resume_command(args, "runs/20250101-000000", cfg)
    assert command == "dino-opt train --output-dir runs/20250101-000000 --nproc 2 x=1"
    args.output_dir = "mine"
    assert resume_command(args, "mine", cfg) == "dino-opt train --nproc 2 x=1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_as_one_node_and_restart_together(train_root, tmp_path, uninterrupted):
    out, port = tmp_path / "run", _free_port()
    nodes = []
    for r in range(2):
        where = [
            "--nnodes",
            "2",
            "--node-rank",
            str(r),
            "--nproc",
            "1",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ]
        nodes.append(CliProcess(_command(out, train_root, where, *KILL), ranks_env()))
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    errs = "".join(err for _, err in outputs)
    assert "rank 1 was killed by SIGKILL after step 7; restarting every worker" in errs
    (row,) = json.loads((out / "report.json").read_text())["restarts"]
    assert (row["rank"], row["signal"], row["step"]) == (1, "SIGKILL", 6)
    _assert_same_teacher(_teacher(out), uninterrupted)


# ---------------------------------------------------------------- the pieces


def test_the_first_failure_is_the_killed_rank_then_the_hung_then_the_earliest():
    exits = [{"rank": 0, "exitcode": 1, "time": 1.0}, {"rank": 3, "exitcode": -9, "time": 2.0}]
    assert first_failure(exits)["rank"] == 3
    exits = [{"rank": 0, "exitcode": 1, "time": 1.0}, {"rank": 2, "exitcode": EXIT_HANG}]
    assert first_failure(exits)["rank"] == 2
    exits = [{"rank": 0, "exitcode": 1, "time": 2.0}, {"rank": 2, "exitcode": 1, "time": 1.0}]
    assert first_failure(exits)["rank"] == 2
    assert describe_exit(1, -9, 7) == "rank 1 was killed by SIGKILL after step 7"
    assert describe_exit(2, 1, None) == "rank 2 exited with status 1"
    assert "the hang watchdog ended the run" in describe_exit(0, EXIT_HANG, 3)


def test_failures_become_one_restart_row_which_the_history_gets_once(tmp_path):
    folder = RunFolder(tmp_path)
    record_failure(folder, [{"rank": 0, "exitcode": 1, "step": 7}], {0: 7, 1: 6}, 1)
    record_failure(folder, [{"rank": 2, "exitcode": -9, "step": 5}], {2: 5, 3: 7}, 1)
    pending = pending_failures(folder)
    assert len(pending) == 2
    checkpoint = tmp_path / "checkpoints" / "checkpoint-e0000-s00000004.pth"
    rows = claim_restart(folder, pending, step=4, epoch=0, checkpoint=checkpoint)
    (row,) = rows
    assert (row["rank"], row["signal"], row["at_step"], row["step"]) == (2, "SIGKILL", 5, 4)
    assert row["checkpoint"] == checkpoint.name and len(row["failures"]) == 2
    assert pending_failures(folder) == [] and read_restarts(folder) == rows
    # a hang: the stuck rank from hang.json when it is newer than the last restart
    record_failure(folder, [{"rank": 0, "exitcode": EXIT_HANG, "step": 9}], {0: 9, 1: 8}, 2)
    folder.hang.write_text(json.dumps({"stuck_ranks": [1], "time": time.time() + 1}))
    rows = claim_restart(folder, pending_failures(folder), step=8, epoch=1, checkpoint=None)
    assert (rows[-1]["restart"], rows[-1]["rank"], rows[-1]["at_step"]) == (2, 1, 8)
    assert rows[-1]["stuck_ranks"] == [1] and rows[-1]["checkpoint"] is None
    # a history resumed from step 4 has the first row (after its step), not the second
    history = [{"step": 4, "loss": 1.0}, rows[0]]
    assert rows_to_log(rows, history, 4) == []
    assert rows_to_log(rows, history[:1], 8) == rows


def test_progress_survives_a_sigkill(tmp_path):
    folder = RunFolder(tmp_path)
    code = (
        "import os, signal, sys\n"
        "from dino_opt.job.restarts import ProgressFile\n"
        "from dino_opt.observe import RunFolder\n"
        "p = ProgressFile(RunFolder(sys.argv[1]), 3, 5)\n"
        "for step in range(6, 12): p.update(step)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", code, str(tmp_path)])
    assert child.returncode == -signal.SIGKILL
    assert read_progress(folder, 3) == 11 and read_progress(folder, 0) is None
    p = ProgressFile(folder, 0, 120)
    p.update(7)  # shorter than before: the record is padded, not truncated
    p.close()
    assert read_progress(folder, 0) == 7


def test_the_exit_status_of_a_child_is_read_without_collecting_it():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _peek_exit(child.pid) is None  # still running
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _peek_exit(child.pid) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _peek_exit(child.pid) == -signal.SIGKILL
    finally:
        child.kill()
        assert child.wait(30) == -signal.SIGKILL  # its owner still collects it
    assert _peek_exit(os.getpid()) is None  # not a child


def test_several_nodes_need_a_rank_an_address_and_a_run_folder(tmp_path, capsys, monkeypatch):
    for name in ("SLURM_NODEID", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit):
        main(["train", "--nnodes", "2", "--output-dir", str(tmp_path)])
    assert "--nnodes 2 needs --node-rank" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1"])
    assert "several nodes need the run folder (--output-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(
            [
                "train",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--master-addr",
                "h",
                "--output-dir",
                str(tmp_path),
            ]
        )
    assert "node_rank must be in [0, nnodes=2), got 2" in capsys.readouterr().err


@pytest.mark.parametrize("said", [True, False])
def test_a_rank_that_said_no_restart_ends_the_job_even_if_it_crashes_on_exit(tmp_path, capfd, said):
    # Seen in CI: a rank's bad-input exit (status 3) lost behind a SIGABRT in
    # a process's teardown, and the job restarted to fail the same way.
    folder = RunFolder(tmp_path)
    with pytest.raises(WorkerFailedError) as failed:
        run_agent(bad_input_then_abort, (said,), folder=folder, nproc=2, max_restarts=1)
    err = capfd.readouterr().err
    if said:
        assert "restarting" not in err
        assert "rank 1 exited with status 3" in str(failed.value)
        assert "model.widht" in err
    else:  # a crash alone is restarted
        assert "SIGABRT; restarting every worker (restart 1 of 1)" in err
        assert "SIGABRT" in str(failed.value)


def test_two_launches_from_one_process_give_each_worker_its_own_launch(
    tmp_path, capfd, monkeypatch
):
    # The workers are forks of one server that outlives a launch (started by
    # the first, with its environment, folder and output): the second launch's
    # workers must see the second launch's, not the first's.
    seen = {}
    for mark, threads in (("first", "1"), ("second", "2")):
        folder = tmp_path / mark
        folder.mkdir()
        monkeypatch.chdir(folder)
        monkeypatch.setenv("DINO_OPT_TEST_MARK", mark)
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
        capfd.readouterr()
        assert run_agent(report_launch, (str(folder),), folder=RunFolder(folder), nproc=2) == {
            0: 0,
            1: 1,
        }
        seen[mark] = capfd.readouterr().err
        for rank in (0, 1):
            got = json.loads((folder / f"rank{rank}.json").read_text())
            assert got == {
                "mark": mark,
                "rank": rank,
                "cwd": str(folder),
                "threads": int(threads),
                "world": "2",
            }
    for mark, err in seen.items():  # each launch's workers wrote to that launch's stderr
        assert {f"report_launch rank {r} mark {mark}" for r in (0, 1)} <= set(err.splitlines())
    assert "mark first" not in seen["second"]


def test_the_workers_server_imports_without_touching_cuda():
    # A server that had called into CUDA would hand each forked worker a
    # CUDA state it cannot use: its imports must not.
    code = (
        "import torch\n"
        "def boom(*a, **k):\n"
        "    raise SystemExit('CUDA touched while importing the server')\n"
        "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device'):\n"
        "    setattr(torch.cuda, name, boom)\n"
        "torch._C._cuda_getDeviceCount = boom\n"
        "import importlib\n"
        f"for module in {WORKER_PRELOAD!r} + ('dino_opt.cli',):\n"
        "    importlib.import_module(module)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert worker_start_method() == "forkserver"  # on Linux
