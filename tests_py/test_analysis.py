"""Post-training analysis (dino_opt.observe.analysis, `dino-opt report`): convergence
of synthetic losses with known answers, weight drift of hand-built
checkpoints with known distances, a corrupted checkpoint reported as skipped,
clear errors, and the reports of a real tiny training run."""

import json
import math
import warnings

import pytest
import torch
from dino_opt.checkpoint import CheckpointManager
from dino_opt.cli import main
from dino_opt.observe import DINOTrainingAnalyzer, format_report
from tiny import TINY as TINY_BASE
from tiny import tiny_train_only

PNG = b"\x89PNG\r\n\x1a\n"

TINY = [
    *TINY_BASE,
    "data.num_workers=2",
    "logging.tensorboard=false",
    "logging.profile=true",
    "checkpoint.every_steps=2",
    "checkpoint.keep=10",
]


# ------------------------------------------------------------ synthetic runs


def _metrics_run(tmp_path, rows, name="run"):
    run = tmp_path / name
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return run


def _rows(fn, steps=range(10, 1001, 10), **extra):
    return [{"step": s, "epoch": 0, "loss": fn(s), **extra} for s in steps]


def _convergence(tmp_path, rows, **kwargs):
    return DINOTrainingAnalyzer(_metrics_run(tmp_path, rows)).analyze_convergence(**kwargs)


def test_decreasing_loss(tmp_path):
    c = _convergence(tmp_path, _rows(lambda s: 20.0 - 0.01 * s))
    assert c["verdict"] == "decreasing"
    assert c["loss"]["points"] == 100
    assert c["loss"]["first"] == {"step": 10, "value": pytest.approx(19.9)}
    assert c["loss"]["last"] == {"step": 1000, "value": pytest.approx(10.0)}
    assert c["loss"]["min"] == {"step": 1000, "value": pytest.approx(10.0)}
    # least squares over the last half (steps 510..1000) of an exact line
    assert c["trend"]["per_1k_steps"] == pytest.approx(-10.0)
    assert (c["trend"]["from_step"], c["trend"]["to_step"]) == (510, 1000)
    # default window: a quarter of the points; the trailing mean keeps a line's slope
    p = c["plateau"]
    assert (p["window_points"], p["from_step"], p["to_step"]) == (25, 760, 1000)
    start = 20.0 - 0.01 * 760 + 0.01 * 20  # mean of steps 720..760
    assert p["relative_improvement"] == pytest.approx(0.01 * 240 / start)
    assert not p["detected"]
    assert c["nonfinite"]["seen"] is False
    assert c["alerts"] == {}


def test_flat_loss_is_a_plateau(tmp_path):
    c = _convergence(tmp_path, _rows(lambda s: 5.0))
    assert c["verdict"] == "plateau"
    assert c["plateau"]["detected"]
    assert c["plateau"]["relative_improvement"] == 0.0
    assert c["trend"]["per_1k_steps"] == pytest.approx(0.0)


def test_plateau_threshold_and_window_are_parameters(tmp_path):
    # 0.05 % improvement over the default window: a plateau at 1 %, not at 0.01 %
    run = _metrics_run(tmp_path, _rows(lambda s: 5.0 - 1e-5 * s))
    analyzer = DINOTrainingAnalyzer(run)
    assert analyzer.analyze_convergence()["verdict"] == "plateau"
    strict = analyzer.analyze_convergence(threshold=1e-4)
    assert strict["verdict"] == "decreasing"
    assert strict["plateau"]["threshold"] == 1e-4
    small = analyzer.analyze_convergence(window=4, smoothing=1)
    assert (small["plateau"]["window_points"], small["plateau"]["from_step"]) == (4, 970)
    assert small["plateau"]["relative_improvement"] == pytest.approx(3e-4 / (5.0 - 9.7e-3))


def test_increasing_loss_is_diverging(tmp_path):
    c = _convergence(tmp_path, _rows(lambda s: 1.0 + 0.01 * s))
    assert c["verdict"] == "diverging"
    assert c["trend"]["per_1k_steps"] == pytest.approx(10.0)
    assert c["plateau"]["relative_improvement"] < 0
    assert c["loss"]["min"] == {"step": 10, "value": pytest.approx(1.1)}


def test_nonfinite_losses(tmp_path):
    rows = _rows(lambda s: 20.0 - 0.01 * s)
    rows[30]["loss"] = float("nan")  # step 310
    rows[31]["nonfinite_steps"] = 2.0  # step 320: steps the trainer skipped
    c = _convergence(tmp_path, rows)
    nf = c["nonfinite"]
    assert nf == {
        "seen": True,
        "first_step": 310,
        "rows_with_nonfinite_loss": 1,
        "nonfinite_steps": 2.0,
    }
    assert c["loss"]["points"] == 99  # the NaN is left out of the statistics
    assert c["verdict"] == "decreasing"  # it recovered

    rows[-1]["loss"] = float("inf")
    run2 = _metrics_run(tmp_path, rows, "run2")
    c2 = DINOTrainingAnalyzer(run2).analyze_convergence()
    assert c2["verdict"] == "diverging"
    assert c2["loss"]["last"]["step"] == 990  # the last finite one


def test_too_short_and_alerts(tmp_path):
    rows = [
        {"step": 1, "loss": 9.0},
        {"step": 2, "loss": 8.0, "alerts": ["entropy_collapse"]},
        {"step": 3, "loss": 7.0, "alerts": ["entropy_collapse", "gradient_explosion"]},
    ]
    c = _convergence(tmp_path, rows)
    assert c["verdict"] == "too short to tell"
    assert c["alerts"] == {
        "entropy_collapse": {"count": 2, "first_step": 2, "last_step": 3},
        "gradient_explosion": {"count": 1, "first_step": 3, "last_step": 3},
    }
    assert "entropy_collapse x2 (first at step 2)" in format_report(
        {"run_dir": None, "convergence": c}
    )


def test_bad_metrics_lines_are_skipped_with_a_warning(tmp_path):
    run = _metrics_run(tmp_path, _rows(lambda s: 10.0 - 0.001 * s, steps=range(1, 11)))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = '{"step": 3, "loss": 9.9'  # cut off
    lines.insert(5, "[1, 2]")
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning) as caught:
        c = DINOTrainingAnalyzer(run).analyze_convergence()
    messages = [str(w.message) for w in caught]
    assert any(f"{run / 'metrics.jsonl'}:3:" in m for m in messages)
    assert any(f"{run / 'metrics.jsonl'}:6:" in m for m in messages)
    assert c["rows"] == 9
    assert c["loss"]["first"]["step"] == 1


# ------------------------------------------------------ hand-built checkpoints


def _state(student, teacher, epoch, step):
    return {"student": student, "teacher": teacher, "epoch": epoch, "step": step}


def _weights(backbone, head):
    return {
        "backbone.w": torch.tensor(backbone, dtype=torch.float32),
        "head.w": torch.tensor(head, dtype=torch.float32),
        "head.num_batches_tracked": torch.tensor(7),  # an integer buffer: left out
    }


@pytest.fixture
def ck_run(tmp_path):
    """Three checkpoints with known weights: w, 2w, then only the head moved."""
    run = tmp_path / "ckrun"
    manager = CheckpointManager(run / "checkpoints", keep_last=None)
    w1 = _weights([3.0, 4.0], [12.0])  # |w| = 13
    w2 = _weights([6.0, 8.0], [24.0])  # 2w: |w| = 26
    w3 = _weights([6.0, 8.0], [34.0])
    manager.save(_state(w1, w1, 0, 10), epoch=0, step=10)
    manager.save(_state(w2, w1, 1, 20), epoch=1, step=20)
    manager.save(_state(w3, w2, 2, 30), epoch=2, step=30, milestone=True)
    return run, manager


def test_evolution_distances(ck_run):
    run, manager = ck_run
    rows = DINOTrainingAnalyzer(run / "checkpoints").analyze_model_evolution()
    assert [(r["epoch"], r["step"], r["skipped"]) for r in rows] == [
        (0, 10, False),
        (1, 20, False),
        (2, 30, False),
    ]
    r1, r2, r3 = rows
    assert r1["student_norm"] == pytest.approx(13.0)
    assert r1["drift_from_previous"] is None
    assert r1["drift_from_first"] == 0.0
    assert r1["teacher_student_distance"] == 0.0

    assert r2["student_norm"] == pytest.approx(26.0)
    assert r2["drift_from_previous"] == pytest.approx(1.0)
    assert r2["drift_from_first"] == pytest.approx(1.0)
    assert r2["teacher_student_distance"] == pytest.approx(1.0)  # |2w - w| / |w|
    assert r2["previous_step"] == 10
    assert r2["modules"]["backbone"] == {
        "norm": pytest.approx(10.0),
        "drift_from_previous": pytest.approx(1.0),
        "drift_from_first": pytest.approx(1.0),
        "teacher_student_distance": pytest.approx(1.0),
    }

    # only the head moved, by 10
    assert r3["drift_from_previous"] == pytest.approx(10.0 / 26.0)
    assert r3["modules"]["backbone"]["drift_from_previous"] == 0.0
    assert r3["modules"]["head"]["drift_from_previous"] == pytest.approx(10.0 / 24.0)
    assert r3["drift_from_first"] == pytest.approx(math.sqrt(3**2 + 4**2 + 22**2) / 13.0)
    assert r3["teacher_student_distance"] == pytest.approx(10.0 / 26.0)
    assert r3["milestone"] is True


def test_corrupted_checkpoint_is_skipped(ck_run, tmp_path):
    run, manager = ck_run
    middle = manager.checkpoints()[1].path
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0xFF
    middle.write_bytes(bytes(data))

    analyzer = DINOTrainingAnalyzer(manager)  # a CheckpointManager works as well
    rows = analyzer.analyze_model_evolution()
    assert rows[1]["skipped"] is True
    assert rows[1]["verified"] is False
    assert "SHA-256 mismatch" in rows[1]["reason"]
    assert "student_norm" not in rows[1]
    # the next one is compared with the last checkpoint that loaded
    assert rows[2]["previous_step"] == 10
    assert rows[2]["drift_from_previous"] == pytest.approx(math.sqrt(3**2 + 4**2 + 22**2) / 13.0)

    out = tmp_path / "out"
    report = analyzer.generate_checkpoint_report(out)
    assert [c["verified"] for c in report["checkpoints"]] == [True, False, True]
    assert "SHA-256 mismatch" in report["checkpoints"][1]["reason"]
    assert report["summary"]["skipped"] == 1
    assert report["summary"]["milestones"] == 1
    assert report["checkpoints"][0]["size"] == manager.checkpoints()[0].path.stat().st_size
    saved = json.loads((out / "checkpoint_report.json").read_text())
    assert saved["evolution"][1]["skipped"] is True
    assert (out / "model_evolution.png").read_bytes()[:8] == PNG
    text = format_report(report)
    assert "skipped" in text and "SHA-256 mismatch" in text


def test_unrecorded_checkpoint_is_skipped(ck_run):
    run, manager = ck_run
    stray = manager.path_for(3, 40)
    stray.write_bytes(manager.checkpoints()[0].path.read_bytes())  # no sidecar, no index entry
    rows = DINOTrainingAnalyzer(run).analyze_model_evolution()
    assert rows[-1]["step"] == 40
    assert rows[-1]["skipped"] is True
    assert "no checksum record" in rows[-1]["reason"]


def test_metrics_from_checkpoint_history(tmp_path):
    """A checkpoints folder with no metrics.jsonl beside it: the rows come
    from the newest checkpoint's history; reports go into that folder."""
    manager = CheckpointManager(tmp_path / "ckpts", keep_last=None)
    w = _weights([1.0], [1.0])
    history = [{"step": s, "loss": 3.0, "images_per_second": 10.0 * s} for s in (1, 2, 3, 4)]
    manager.save({**_state(w, w, 1, 4), "history": history}, epoch=1, step=4)
    analyzer = DINOTrainingAnalyzer(tmp_path / "ckpts")
    assert analyzer.run_dir is None
    perf = analyzer.generate_performance_report()
    assert perf["rows"] == 4
    assert "(history)" in perf["metrics"]
    # the first row (10 images/s) is the warm-up: 20, 30, 40 remain
    assert perf["throughput"]["median"] == pytest.approx(30.0)
    assert perf["throughput"]["rows"] == 3
    assert (tmp_path / "ckpts" / "performance_report.json").is_file()


# ------------------------------------------------------------------ errors


def test_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        DINOTrainingAnalyzer(missing)


def test_empty_folder(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no metrics.jsonl and no checkpoints") as e:
        DINOTrainingAnalyzer(empty)
    assert str(empty) in str(e.value)


def test_a_file_is_not_a_run_folder(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("")
    with pytest.raises(ValueError, match="is not a folder") as e:
        DINOTrainingAnalyzer(f)
    assert str(f) in str(e.value)


def test_cli_error_names_the_path(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as e:
        main(["report", str(missing)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "dino-opt report: error:" in err and str(missing) in err


# --------------------------------------------------------- a real tiny run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """2 epochs of 5 steps, a checkpoint every 2 steps, train split only (no k-NN)."""
    train = tiny_train_only(tmp_path_factory)
    run = tmp_path_factory.mktemp("real") / "run"
    # One intra-op thread: on a machine whose cores are busy, torch's thread
    # pool made this run ~15x slower (125 s against 9 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = main(["train", "--output-dir", str(run), "--quiet", f"data.root={train}", *TINY])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    return run


def test_real_run_reports(real_run, tmp_path, capsys):
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["report", str(real_run), "--output-dir", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("checkpoint_report.json", "performance_report.json"):
        assert (out / name).is_file()
    for name in ("model_evolution.png", "training_curves.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert "Convergence (10 logged rows" in text
    assert "verdict" in text
    assert "forward_backward" in text
    assert "backbone drift first" in text and "head drift first" in text

    ck = json.loads((out / "checkpoint_report.json").read_text())
    records = CheckpointManager(real_run / "checkpoints").checkpoints()
    assert len(ck["checkpoints"]) == len(records) >= 4
    assert all(c["verified"] for c in ck["checkpoints"])
    steps = [r["step"] for r in ck["evolution"]]
    assert steps == sorted(steps) and steps[-1] == 10
    first, *rest = ck["evolution"]
    assert first["drift_from_first"] == 0.0
    for prev, row in zip(ck["evolution"], rest, strict=False):
        assert row["previous_step"] == prev["step"]
        assert row["drift_from_previous"] >= 0.0
    assert rest[-1]["drift_from_first"] > 0.0  # training moved the weights
    assert rest[-1]["teacher_student_distance"] > 0.0  # the EMA teacher lags
    assert set(first["modules"]) == {"backbone", "head"}

    perf = json.loads((out / "performance_report.json").read_text())
    assert perf["rows"] == 10
    assert perf["throughput"]["rows"] == 9 and perf["throughput"]["warmup_excluded"]
    t = perf["throughput"]
    assert t["p10"] <= t["median"] <= t["p90"]
    assert perf["peak_memory_gb"]["host_rss_gb"] > 0
    assert set(perf["profile"]["phases"]) >= {"data_wait", "forward_backward", "optimizer_step"}
    assert perf["convergence"]["verdict"] in (
        "decreasing",
        "plateau",
        "diverging",
        "too short to tell",
    )
    assert perf["convergence"]["loss"]["points"] == 10
    assert perf["run_report"]["steps"] == 10


def test_real_run_json_and_default_output(real_run, capsys, tmp_path):
    """--json prints the dict; from the checkpoints folder the reports go to the run folder."""
    capsys.readouterr()
    assert main(["report", str(real_run / "checkpoints"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run_dir"] == str(real_run)
    assert report["checkpoints"]["report"] == str(real_run / "checkpoint_report.json")
    assert (real_run / "performance_report.json").is_file()
    assert report["performance"]["convergence"]["rows"] == 10
