"""make bench-check: each piece's bench in a quick mode, ours and its baseline
timed side by side in one process, in the default environment (no
THP_MEM_ALLOC_ENABLE, whatever the caller's shell holds), and every ratio
(baseline time / ours, or our throughput / the baseline's) held against its
floor in bench/floors.json. A ratio under its floor runs that piece once more
and fails only if the second run is under it too (a busy machine slows a run;
a regression slows both); the exit status is 1 and the failing pieces are
named.

    python bench/bench_check.py [--only loss,ema,...] [--json PATH] [--floors PATH]

--print-floors prints the floors from measured ratios (the ratio / margin,
rounded down), to paste into bench/floors.json after a deliberate change.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLOORS = HERE / "floors.json"


@dataclass(frozen=True)
class Piece:
    script: str
    args: tuple[str, ...]
    ratios: Callable[[dict], dict[str, float]]


def _loss_ratios(d: dict) -> dict[str, float]:
    dino, ibot = d["results"][0], d["ibot"]["results"][0]
    return {
        "loss.dino_vs_reference_loop": dino["reference_loop_ms"] / dino["dino_opt_ms"],
        "loss.ibot_vs_dinov2_form": ibot["dinov2_form_ms"] / ibot["dino_opt_ms"],
    }


def _ema_ratios(d: dict) -> dict[str, float]:
    r = next(r for r in d["results"] if r["model"] == "ViT-S/16")
    return {"ema.vs_foreach_lerp": r["foreach_lerp_ms"] / r["dino_opt_ms"]}


def _loader_ratios(d: dict) -> dict[str, float]:
    rate = {r["case"]: r["images_per_s"] for r in d["results"]}
    return {"loader.vs_pil": rate["ours_cpu"] / rate["pil"]}


def _photometric_ratios(d: dict) -> dict[str, float]:
    r = next(r for r in d["results"] if r["case"] == "batch" and r["dtype"] == "float32")
    return {"photometric.vs_torchvision": r["baseline_ms"] / r["ours_ms"]}


def _checkpoint_ratios(d: dict) -> dict[str, float]:
    return {"checkpoint.async_vs_sync": d["quick"][0]["sync_vs_async"]}


def _head_ratios(d: dict) -> dict[str, float]:
    r = d["results"][0]
    return {"head.frozen_vs_published": r["published_ms"] / r["dino_opt_ms"]}


# The quick mode of each bench: its own options, sized to a few seconds here.
PIECES = {
    "loss": Piece("bench_loss.py", ("--quick",), _loss_ratios),
    "ema": Piece("bench_ema.py", ("--repeats", "9"), _ema_ratios),
    "loader": Piece(
        "bench_loader.py",
        (
            "--only",
            "ours_cpu,pil",
            "--count",
            "192",
            "--images",
            "96",
            "--repeats",
            "3",
            "--warmup",
            "1",
            "--batch-size",
            "32",
        ),
        _loader_ratios,
    ),
    "photometric": Piece(
        "bench_photometric.py",
        ("--images", "4", "--repeats", "5", "--threads", "1"),
        _photometric_ratios,
    ),
    "checkpoint": Piece(
        "bench_checkpoint.py",
        ("--quick", "--models", "demo", "--repeats", "5"),
        _checkpoint_ratios,
    ),
    "head": Piece("bench_head.py", ("--rows", "40", "--repeats", "5"), _head_ratios),
}
MARGIN = 1.5  # --print-floors: a floor is the measured ratio over this


def default_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # as a plain script runs: the allocator's default
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU figures, on any machine
    return env


def run_piece(name: str, piece: Piece, tmp: Path) -> tuple[dict[str, float], float]:
    out = tmp / f"{name}.json"
    cmd = [sys.executable, str(HERE / piece.script), *piece.args, "--json", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=default_env(), capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise RuntimeError(f"bench-check: {name}: `{' '.join(cmd)}` exited {proc.returncode}")
    return piece.ratios(json.loads(out.read_text())), seconds


def check(names: list[str], floors: dict[str, float], tmp: Path) -> tuple[list[dict], list[str]]:
    rows, failed = [], []
    for name in names:
        ratios, seconds = run_piece(name, PIECES[name], tmp)
        tries = {k: [v] for k, v in ratios.items()}
        if any(v < floors.get(k, -math.inf) for k, v in ratios.items()):
            print(f"{name}: under a floor, running it again", flush=True)
            again, more = run_piece(name, PIECES[name], tmp)
            seconds += more
            for k, v in again.items():
                tries[k].append(v)
        for k, vs in tries.items():
            best = max(vs)
            ok = k not in floors or best >= floors[k]
            rows.append(
                {
                    "piece": name,
                    "ratio": k,
                    "tries": vs,
                    "best": best,
                    "floor": floors.get(k),
                    "ok": ok,
                    "seconds": seconds,
                }
            )
            if not ok:
                failed.append(f"{name} ({k} {best:.2f} < floor {floors[k]:.2f})")
            if k not in floors:
                failed.append(f"{name} ({k} has no floor in {FLOORS.name})")
        print(
            f"{name}: "
            + ", ".join(f"{k} {max(v):.2f}" for k, v in tries.items())
            + f" ({seconds:.0f} s)",
            flush=True,
        )
    return rows, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PIECES), help="comma-separated pieces")
    parser.add_argument("--floors", type=Path, default=FLOORS)
    parser.add_argument("--json", type=Path, help="write the measured ratios here")
    parser.add_argument("--print-floors", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(PIECES)
    if unknown:
        parser.error(f"unknown pieces {sorted(unknown)}; choose from {', '.join(PIECES)}")
    floors = json.loads(args.floors.read_text())["floors"]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_check.") as tmp:
        rows, failed = check(names, floors, Path(tmp))
    print(f"\n{'ratio':32} {'tries':>16} {'floor':>6}")
    for r in rows:
        tries = "/".join(f"{v:.2f}" for v in r["tries"])
        floor = "-" if r["floor"] is None else f"{r['floor']:.2f}"
        print(f"{r['ratio']:32} {tries:>16} {floor:>6} {'ok' if r['ok'] else 'UNDER'}")
    print(f"bench-check: {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    if args.print_floors:
        print(
            json.dumps(
                {r["ratio"]: math.floor(r["best"] / MARGIN * 10) / 10 for r in rows}, indent=2
            )
        )
    if failed:
        sys.exit("bench-check: under the floor: " + "; ".join(failed))


if __name__ == "__main__":
    main()
