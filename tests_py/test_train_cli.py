"""`dino-opt train` end to end on a tiny configuration: a few steps on a
tiny built-in data set, then the run folder (report, metrics, plots, t-SNE
maps, profile) and `dino-opt knn` on its checkpoint."""

import contextlib
import io
import json
import math
import time
from pathlib import Path

import pytest
import torch
from dino_opt.cli import main
from dino_opt.config import load_config
from dino_opt.data import builtin_dataset
from dino_opt.eval import verdict
from dino_opt.job import PROFILE_PHASES
from dino_opt.observe import Profiler, profile_summary
from tiny import TINY as TINY_BASE
from tiny import knn_json

TINY = [*TINY_BASE, "data.num_workers=2"]
# The whole evaluation, at the end and after the first epoch.
EVAL = [
    "eval.linear=true",
    "eval.dense=true",
    "eval.pictures=4",
    "eval.every_epochs=1",
    "logging.curves=true",
    "logging.tsne=true",
]

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=2,
        val_per_class=1,
        test_per_class=1,
        image_size=40,
    )


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    """One tiny training run shared by the tests: (run folder, printed output)."""
    out = tmp_path_factory.mktemp("run") / "run"
    args = ["train", "--output-dir", str(out), "--quiet", f"data.root={tiny_data / 'train'}"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(args + TINY + EVAL) == 0
    return out, printed.getvalue()


def _knn_error(capsys, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["knn", *args])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_train_writes_a_complete_run_folder(run):
    out, printed = run
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 2 * (20 // 8)  # 10 classes x 2 images, batch 8, drop_last
    assert report["final_loss"] is not None and report["final_loss"] > 0
    assert 0 <= report["knn_top1_trained"] <= 100 and 0 <= report["knn_top1_random_init"] <= 100
    # the test split, never used for tuning, beside val
    assert 0 <= report["knn_test_top1_trained"] <= 100
    assert 0 <= report["knn_test_top1_random_init"] <= 100
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "event" not in r]
    assert [r["step"] for r in rows] == list(range(1, report["steps"] + 1))
    # eval.every_epochs=1: the teacher after the first epoch (not after the last)
    (evaluated,) = [r for r in lines if r.get("event") == "evaluation"]
    assert evaluated["epoch"] == 1 and evaluated["step"] == report["steps"] // 2
    assert 0 <= evaluated["knn_top1_teacher"] <= 100 and "linear_top1_teacher" in evaluated
    assert all(r["loss"] > 0 for r in rows)
    assert {"lr", "weight_decay", "momentum", "images_per_second"} <= rows[0].keys()
    assert (out / "config.yaml").exists()
    final = Path(report["checkpoint"])  # the final checkpoint, a milestone in checkpoints/
    assert final.parent == out / "checkpoints" and final.is_file()
    assert any((out / "tensorboard").iterdir())
    for name in ("training_curves.png", "tsne_random_init.png", "tsne_trained.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    text = printed[printed.index("{") :].rstrip("\n")
    lines = 2 if "verdict" in report else 1  # a warning when training made things worse
    body, summary, *warning = text.rsplit("\n", lines)
    assert json.loads(body)["steps"] == report["steps"]
    assert warning == ([f"dino-opt train: warning: {report['verdict']}"] if lines == 2 else [])
    # then one line for a person: trained vs random init on val and test, time, folder
    assert summary.startswith("dino-opt train: k-NN top-1 ")
    assert f"{report['knn_top1_trained']:.1f} % trained vs" in summary
    assert f"{report['knn_test_top1_trained']:.1f} % vs" in summary and "(test)" in summary
    assert summary.endswith(f"run folder {out}")
    assert f"linear top-1 {report['linear_top1_trained']:.1f} % vs" in summary
    assert f"dense mIoU {report['dense_miou_trained']:.1f} % vs" in summary
    # the evaluation's details and the pictures, before and after training
    evaluation = json.loads((out / "evaluation.json").read_text())
    assert len(evaluation["trained"]["linear"]["rows"]) == 52
    assert "miou" in evaluation["random_init"]["dense"]["val"]
    pictures = sorted(p.name for p in (out / "pictures").iterdir())
    assert len(pictures) == 4 * 2 * 2  # 4 val images x attention, pca x trained, random init
    assert all((out / "pictures" / p).read_bytes()[:8] == PNG for p in pictures)


def test_profile_json_times_each_phase(run):
    out, _ = run
    report = json.loads((out / "report.json").read_text())
    profile = json.loads((out / "profile.json").read_text())
    assert profile["clock"] == "host" and profile["steps"] == report["steps"]
    assert set(profile["phases"]) == set(PROFILE_PHASES)
    for name, phase in profile["phases"].items():
        assert phase["mean"] >= 0 and phase["median"] >= 0 and phase["p90"] >= phase["median"], name
        assert 0 <= phase["share_of_step"] <= 1, name
    assert profile["phases"]["forward_backward"]["mean"] > 0
    assert profile["images_per_second"] > 0
    shares = report["profile"]
    assert set(shares) == {*PROFILE_PHASES, "other"}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)


def test_profile_summary_sums_ranges_per_step():
    p = Profiler("cpu")
    p.clear()
    for _ in range(3):
        for name, seconds in (("data_wait", 0.002), ("forward_backward", 0.01)):
            with p.range(name):
                time.sleep(seconds)
        p.step(4)
    with p.range("data_wait"):  # the fetch that finds the loader exhausted: no step
        pass
    summary = profile_summary(p, ("data_wait", "forward_backward", "optimizer_step"))
    assert summary["steps"] == 3
    fb = summary["phases"]["forward_backward"]
    assert 0.01 <= fb["median"] < 0.5 and fb["total"] == pytest.approx(3 * fb["mean"])
    assert summary["phases"]["optimizer_step"]["total"] == 0.0
    shares = [v["share_of_step"] for v in summary["phases"].values()]
    assert sum(shares) + summary["other_share_of_step"] == pytest.approx(1.0)
    assert summary["images_per_second"] == pytest.approx(
        12 / summary["step_seconds"]["total"], rel=1e-6
    )


def test_knn_reproduces_the_report(run, tiny_data, capsys):
    out, _ = run
    report = json.loads((out / "report.json").read_text())
    teacher = knn_json(capsys, "--checkpoint", str(out), "--device", "cpu")  # the run folder
    assert teacher["top1"] == report["knn_top1_trained"]  # same features, same vote
    assert teacher["test_top1"] == report["knn_test_top1_trained"]
    assert teacher["which"] == "teacher" and teacher["image_size"] == 32
    assert (teacher["n_train"], teacher["n_val"], teacher["n_test"], teacher["k"]) == (
        20,
        10,
        10,
        20,
    )
    assert teacher["val"] == str(tiny_data / "val") and teacher["test"] == str(tiny_data / "test")
    student = knn_json(
        capsys,
        "--checkpoint",
        report["checkpoint"],
        "--data",
        str(tiny_data),
        "--which",
        "student",
        "--k",
        "5",
        "--image-size",
        "24",
        "--device",
        "cpu",
    )
    assert student["which"] == "student" and student["k"] == 5 and student["image_size"] == 24
    assert 0 <= student["top1"] <= student["top5"] <= 100


def test_knn_errors_name_the_path(run, tiny_data, tmp_path, capsys):
    out, _ = run
    ckpt = json.loads((out / "report.json").read_text())["checkpoint"]
    missing = tmp_path / "nope.pth"
    assert str(missing) in _knn_error(capsys, "--checkpoint", str(missing))
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"not a checkpoint")
    err = _knn_error(capsys, "--checkpoint", str(corrupt))
    assert "cannot be loaded" in err and str(corrupt) in err
    partial = tmp_path / "partial.pth"
    torch.save({"student": {}}, partial)
    err = _knn_error(capsys, "--checkpoint", str(partial))
    assert str(partial) in err and "'teacher'" in err and "'config'" in err
    no_data = tmp_path / "empty"
    no_data.mkdir()
    assert str(no_data / "train") in _knn_error(
        capsys, "--checkpoint", ckpt, "--data", str(no_data)
    )
    (no_data / "train").symlink_to(tiny_data / "train")
    assert str(no_data / "val") in _knn_error(capsys, "--checkpoint", ckpt, "--data", str(no_data))
    wrong = tmp_path / "wrong.pth"
    state = torch.load(ckpt, weights_only=True)
    state["config"]["model"]["hidden_dim"] = 48  # weights no longer fit the model
    torch.save(state, wrong)
    err = _knn_error(capsys, "--checkpoint", str(wrong), "--device", "cpu")
    assert str(wrong) in err and "do not fit" in err


def test_bad_override_names_the_key(tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--output-dir", str(tmp_path), "data.batchsize=8"])


class FakeWandb:
    """Records what the training job sends to Weights & Biases."""

    def __init__(self):
        self.inits, self.logged, self.finished, self.summary = [], [], 0, {}

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    id = "fake-run-1"

    def log(self, row, step):
        self.logged.append((step, row))

    def finish(self):
        self.finished += 1


def test_histograms_and_wandb(tiny_data, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fake = FakeWandb()
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), "--quiet", f"data.root={tiny_data / 'train'}"]
    extra = ["logging.histograms=true", "logging.wandb=true", "logging.tsne=false"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args + TINY + extra) == 0
    report = json.loads((out / "report.json").read_text())
    (init,) = fake.inits
    assert init["project"] == "dino_opt" and init["dir"] == str(out) and init["id"] is None
    assert init["config"]["model"]["out_dim"] == 64
    rows = [(s, r) for s, r in fake.logged if "loss" in r]
    assert [s for s, _ in rows] == list(range(1, report["steps"] + 1))
    assert all(r["loss"] > 0 and "lr" in r for _, r in rows)
    # then the evaluation's numbers at the last step, one call per network
    evaluated = [r for s, r in fake.logged if "loss" not in r]
    assert [sorted(r)[0].split("/")[0] for r in evaluated] == ["eval_trained", "eval_random_init"]
    assert evaluated[0]["eval_trained/knn_top1_trained"] == report["knn_top1_trained"]
    assert fake.finished == 1 and fake.summary["knn_top1_trained"] == report["knn_top1_trained"]
    assert (out / "wandb_id.txt").read_text().strip() == "fake-run-1"
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"histograms": 0})
    events.Reload()
    hist = events.Histograms("health/teacher_entropy_per_image")
    assert [h.step for h in hist] == list(range(1, report["steps"] + 1))
    assert all(0 <= h.histogram_value.min <= h.histogram_value.max <= math.log(64) for h in hist)
    assert "train/teacher_entropy" in events.Tags()["scalars"]


def test_wandb_offline_run(tiny_data, tmp_path, monkeypatch):
    """With the real wandb package (the `wandb` extra) in offline mode: no network."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), "--quiet", f"data.root={tiny_data / 'train'}"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args + TINY + ["logging.wandb=true", "logging.tsne=false"]) == 0
    run_id = (out / "wandb_id.txt").read_text().strip()
    (run_dir,) = (out / "wandb").glob(f"offline-run-*-{run_id}")
    assert any(run_dir.glob("*.wandb"))  # the offline log, to `wandb sync` later


def test_a_hardware_preset_is_resolved_once_when_training_starts(tiny_data, tmp_path, capsys):
    # The TINY keys are the config's own: the cpu row sets only what they leave
    # (no checkpointing; precision is TINY's fp32). The run folder's config is
    # resolved (preset off), so it reloads to the same values on any machine.
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), "--quiet", f"data.root={tiny_data / 'train'}"]
    assert (
        main([*args, *TINY, "hardware.preset=cpu", "schedule.epochs=1", "logging.tsne=false"]) == 0
    )
    capsys.readouterr()
    report = json.loads((out / "report.json").read_text())
    assert report["hardware_preset"].startswith("preset cpu (named")
    saved = load_config(out / "config.yaml")
    assert saved.hardware.preset == "off" and saved.hardware.precision == "fp32"
    assert (saved.model.backbone, saved.data.batch_size) == ("vit_tiny", 8)  # TINY's, not the row's


def test_eval_and_show_commands(run, tiny_data, tmp_path, capsys):
    """`dino-opt eval linear|dense` and `dino-opt show` on the run's teacher."""
    out, _ = run
    capsys.readouterr()
    linear = tmp_path / "linear.json"
    assert (
        main(
            [
                "eval",
                "linear",
                str(out),
                "--device",
                "cpu",
                "--epochs",
                "2",
                "--output",
                str(linear),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    result = json.loads(linear.read_text())
    assert len(result["rows"]) == 52 and result["epochs"] == 2 and result["image_size"] == 32
    assert result["data"]["val"] == str(tiny_data / "val") and result["format"] == "dino_opt"
    assert f"val top-1 {result['best']['val_top1']:.2f} %" in printed
    assert "logistic regression (C=" in printed
    dense = tmp_path / "dense.json"
    assert (
        main(
            ["eval", "dense", str(out), "--device", "cpu", "--epochs", "2", "--output", str(dense)]
        )
        == 0
    )
    assert 0 <= json.loads(dense.read_text())["val"]["miou"] <= 100
    images = sorted((tiny_data / "val" / "star").iterdir())[:1] + [tiny_data / "val" / "ring"]
    images = [images[0], next(images[1].iterdir())]
    pictures = tmp_path / "pictures"
    for kind in ("attention", "pca"):
        assert (
            main(
                [
                    "show",
                    kind,
                    str(out),
                    *map(str, images),
                    "--output-dir",
                    str(pictures),
                    "--image-size",
                    "48",
                ]
            )
            == 0
        )
    names = sorted(p.name for p in pictures.iterdir())
    assert names == sorted(f"{p.stem}_{k}.png" for p in images for k in ("attention", "pca"))
    # dino-opt report shows the evaluation and the run's pictures
    capsys.readouterr()
    assert main(["report", str(out), "--output-dir", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert f"linear probe top-1 (val): {report['linear_top1_trained']:.1f} % trained" in printed
    assert "dense mIoU (test):" in printed and f"pictures: 16 in {out / 'pictures'}" in printed


def test_eval_errors_in_one_line(run, tmp_path, capsys):
    out, _ = run
    unknown = tmp_path / "unknown.pt"
    torch.save({"foo": torch.zeros(3)}, unknown)
    for args, needle in (
        (["eval", "linear", str(unknown), "--data", str(tmp_path)], str(unknown)),
        (["eval", "dense", str(out), "--data", str(tmp_path)], "has no masks"),
        (
            [
                "show",
                "attention",
                str(out),
                str(tmp_path / "missing.png"),
                "--output-dir",
                str(tmp_path),
            ],
            "missing.png",
        ),
    ):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_verdict_names_what_to_try():
    cfg = load_config(None)
    worse = {
        "knn_top1_trained": 54.5,
        "knn_top1_random_init": 64.1,
        "linear_top1_trained": 70.0,
        "linear_top1_random_init": 60.0,
    }
    message = verdict(worse, cfg)
    assert "knn 54.5 % vs 64.1 %" in message and "linear" not in message.split("on val")[0]
    for key in ("schedule.epochs", "schedule.momentum_teacher", "global_crops_scale"):
        assert key in message
    assert verdict({"knn_top1_trained": 64.1, "knn_top1_random_init": 64.1}, cfg) is None
