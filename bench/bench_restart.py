"""What a dead rank costs a run: ``dino-opt train --nproc 2`` on the demo
recipe (one epoch of the built-in data, a checkpoint every ``--every``
steps), with rank 1 killed by SIGKILL after step ``--kill-at``
(``debug.inject_kill_at_step``), the launcher restarting every worker from
the last checkpoint, against the same kill with ``distributed.max_restarts=0``
and the same command run again at once (the best a person or a script
watching the job does), and against the run never killed. Each row: the
wall time of the whole job, the time lost to the failure (against the
uninterrupted run), the restart (from the kill to the job resumed from its
checkpoint, as the processes print them; for the baseline the first run's
end and the second's start are back to back), and the steps trained twice.

    python bench/bench_restart.py [--every 5] [--kill-at 8] [--epochs 1] [--repeats 2]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine, print_table, write_json  # noqa: E402
from dino_opt.data import builtin_dataset, default_root  # noqa: E402
from dino_opt.observe import RunFolder  # noqa: E402


def _train(out: Path, data: Path, args: argparse.Namespace, *extra: str) -> dict:
    """One ``dino-opt train --nproc 2``: its wall seconds, exit status and
    stderr, and when (seconds from its start) the kill and the resume were
    printed and it ended."""
    command = [
        sys.executable,
        "-m",
        "dino_opt.cli",
        "train",
        "--nproc",
        "2",
        "--quiet",
        "--output-dir",
        str(out),
        f"data.root={data}",
        "hardware.device=cpu",
        f"schedule.epochs={args.epochs}",
        f"schedule.warmup_epochs={min(2, args.epochs)}",
        f"checkpoint.every_steps={args.every}",
        "checkpoint.async=false",
        "logging.tensorboard=false",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    seen, lines = {}, []
    with subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    ) as run:
        for line in run.stderr:
            lines.append(line)
            for mark in ("SIGKILL", "resuming from"):
                if mark in line and mark not in seen:
                    seen[mark] = time.perf_counter() - start
    wall = time.perf_counter() - start
    return {
        "wall": wall,
        "code": run.returncode,
        "stderr": "".join(lines),
        "killed": seen.get("SIGKILL"),
        "resumed": seen.get("resuming from"),
    }


def _step_seconds(out: Path) -> float:
    """The median step time of a run (its metrics' images/s per rank)."""
    rows = [json.loads(line) for line in RunFolder(out).metrics.read_text().splitlines()]
    batch = 64  # the demo's, per rank
    times = sorted(batch / r["images_per_second"] for r in rows if r.get("images_per_second"))
    return times[len(times) // 2]


def _round(tmp: Path, data: Path, args: argparse.Namespace) -> dict:
    """One run of each case in ``tmp``: wall and restart seconds, the step time."""
    kill = [f"debug.inject_kill_at_step={args.kill_at}", "debug.inject_kill_rank=1"]
    resumed_at = args.kill_at // args.every * args.every
    plain = _train(tmp / "plain", data, args)
    assert plain["code"] == 0, plain["stderr"][-3000:]
    auto = _train(tmp / "auto", data, args, *kill)
    assert auto["code"] == 0, auto["stderr"][-3000:]
    (row,) = json.loads(RunFolder(tmp / "auto").report.read_text())["restarts"]
    assert row["step"] == resumed_at, row
    first = _train(tmp / "byhand", data, args, *kill, "distributed.max_restarts=0")
    assert first["code"] == 1 and "resume with:" in first["stderr"], first["stderr"][-3000:]
    again = _train(tmp / "byhand", data, args)  # at once, in the same run folder
    assert again["code"] == 0, again["stderr"][-3000:]
    report = json.loads(RunFolder(tmp / "byhand").report.read_text())
    assert report["resumed_from"].endswith(f"s{resumed_at:08d}.pth"), report["resumed_from"]
    return {
        "steps": report["steps"],
        "step_s": _step_seconds(tmp / "plain"),
        "plain": plain["wall"],
        "auto": auto["wall"],
        "auto_restart": auto["resumed"] - auto["killed"],
        "byhand": first["wall"] + again["wall"],
        "byhand_restart": first["wall"] - first["killed"] + again["resumed"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=5, help="checkpoint.every_steps")
    parser.add_argument("--kill-at", type=int, default=8, help="the step after which rank 1 dies")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the three cases")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = builtin_dataset(default_root())
    tmp = Path(tempfile.mkdtemp(prefix="bench_restart."))
    data = tmp / "data" / "train"  # the train split alone: no k-NN evaluation at the end
    data.parent.mkdir()
    data.symlink_to(root / "train")
    rounds = []
    try:
        for r in range(args.repeats):
            rounds.append(_round(tmp / f"round{r}", data, args))
            print(
                f"round {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[-1].items()),
                flush=True,
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    redone = args.kill_at - args.kill_at // args.every * args.every
    rows = [
        {
            "case": "never killed",
            "wall_s": m["plain"],
            "lost_s": 0.0,
            "restart_s": None,
            "redone_steps": 0,
        },
        {
            "case": "killed, restarted by the launcher",
            "wall_s": m["auto"],
            "lost_s": m["auto"] - m["plain"],
            "restart_s": m["auto_restart"],
            "redone_steps": redone,
        },
        {
            "case": "killed, the same command again",
            "wall_s": m["byhand"],
            "lost_s": m["byhand"] - m["plain"],
            "restart_s": m["byhand_restart"],
            "redone_steps": redone,
        },
    ]
    print_table(
        f"A dead rank, dino-opt train --nproc 2 (demo recipe, {m['steps']:.0f} steps of "
        f"{m['step_s']:.2f} s, checkpoint every {args.every}, rank 1 killed after step "
        f"{args.kill_at}; medians of {args.repeats} rounds)",
        ["case", "wall s", "lost s", "restart s", "steps redone"],
        [
            [
                r["case"],
                round(r["wall_s"], 1),
                round(r["lost_s"], 1),
                "-" if r["restart_s"] is None else round(r["restart_s"], 1),
                r["redone_steps"],
            ]
            for r in rows
        ],
    )
    path = args.json or RESULTS_DIR / "restart_cpu.json"
    write_json(
        path,
        {
            "machine": machine(),
            "every_steps": args.every,
            "kill_at": args.kill_at,
            "step_s": m["step_s"],
            "steps": m["steps"],
            "rounds": rounds,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
