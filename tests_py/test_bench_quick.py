"""The benches of `make bench-check` run with each of their options, in their
quick modes at tiny sizes (the loss's and the checkpoint's; the others' quick
modes are their ordinary options, run by `make bench-check` itself);
bench_check.py reads their JSON and fails naming a piece under its floor;
the tables in the README and docs match the committed JSON
(scripts/bench_tables.py)."""

import json
import os
import sys
from pathlib import Path

import pytest
from forked import run_script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))
import bench_check  # noqa: E402
import bench_tables  # noqa: E402

TINY_LOSS = ("--quick", "--dim", "4096", "--batch", "2", "--repeats", "1")


def run_bench(script: str, *args: str, out: Path) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = run_script(ROOT / "bench" / script, [*args, "--json", str(out)], env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("only", [None, "dino", "ibot"])
def test_bench_loss_quick_with_each_table(tmp_path, only):
    args = TINY_LOSS + (("--only", only) if only else ())
    d = run_bench("bench_loss.py", *args, out=tmp_path / "loss.json")
    assert ("results" in d) == (only != "ibot")
    assert ("ibot" in d) == (only != "dino")
    if only is None:
        ratios = bench_check.PIECES["loss"].ratios(d)
        assert set(ratios) == {"loss.dino_vs_reference_loop", "loss.ibot_vs_dinov2_form"}
        assert d["environment"]["THP_MEM_ALLOC_ENABLE"] is None


def test_bench_checkpoint_quick(tmp_path):
    d = run_bench(
        "bench_checkpoint.py",
        "--quick",
        "--models",
        "demo",
        "--repeats",
        "1",
        "--batch-size",
        "2",
        out=tmp_path / "ckpt.json",
    )
    assert bench_check.PIECES["checkpoint"].ratios(d)["checkpoint.async_vs_sync"] > 0


def tiny_loss_piece(monkeypatch):
    piece = bench_check.Piece("bench_loss.py", TINY_LOSS, bench_check.PIECES["loss"].ratios)
    monkeypatch.setitem(bench_check.PIECES, "loss", piece)


def test_bench_check_passes_over_its_floors_and_names_the_piece_under(tmp_path, monkeypatch):
    tiny_loss_piece(monkeypatch)
    floors = {"loss.dino_vs_reference_loop": 0.0, "loss.ibot_vs_dinov2_form": 0.0}
    rows, failed = bench_check.check(["loss"], floors, tmp_path)
    assert failed == [] and all(r["ok"] and len(r["tries"]) == 1 for r in rows)
    floors["loss.ibot_vs_dinov2_form"] = 1e9
    rows, failed = bench_check.check(["loss"], floors, tmp_path)
    assert len(failed) == 1 and failed[0].startswith("loss (loss.ibot_vs_dinov2_form")
    assert all(len(r["tries"]) == 2 for r in rows)  # run once more before failing


def test_every_ratio_has_a_floor_and_every_floor_a_ratio():
    floors = json.loads(bench_check.FLOORS.read_text())["floors"]
    names = {
        "loss": {"loss.dino_vs_reference_loop", "loss.ibot_vs_dinov2_form"},
        "ema": {"ema.vs_foreach_lerp"},
        "loader": {"loader.vs_pil"},
        "photometric": {"photometric.vs_torchvision"},
        "checkpoint": {"checkpoint.async_vs_sync"},
        "head": {"head.frozen_vs_published"},
    }
    assert set(names) == set(bench_check.PIECES)
    assert set(floors) == set().union(*names.values())
    assert all(v > 0 for v in floors.values())


def test_the_docs_tables_match_the_json():
    assert bench_tables.stale() == []
