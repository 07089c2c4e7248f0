"""`dino-opt train` end to end on a tiny configuration: a few steps on a
tiny built-in data set, then the run folder and the report."""

import json

import pytest
from dino_opt.cli import main
from dino_opt.datasets import builtin_dataset

TINY = [
    "data.batch_size=8",
    "data.num_workers=2",
    "augmentation.global_crop_size=32",
    "augmentation.local_crop_size=16",
    "augmentation.num_local_views=2",
    "model.backbone=vit_tiny",
    "model.patch_size=8",
    "model.out_dim=64",
    "model.hidden_dim=32",
    "model.bottleneck_dim=16",
    "schedule.epochs=2",
    "schedule.warmup_epochs=1",
    "logging.log_every=1",
    "logging.progress=false",
    "hardware.device=cpu",
]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=2,
        val_per_class=1,
        image_size=40,
    )


def test_train_writes_a_complete_run_folder(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), "--quiet", f"data.root={tiny_data / 'train'}"]
    assert main(args + TINY) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 2 * (20 // 8)  # 10 classes x 2 images, batch 8, drop_last
    assert report["final_loss"] is not None and report["final_loss"] > 0
    assert 0 <= report["knn_top1_trained"] <= 100 and 0 <= report["knn_top1_random_init"] <= 100
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, report["steps"] + 1))
    assert all(r["loss"] > 0 for r in rows)
    assert {"lr", "weight_decay", "momentum", "images_per_second"} <= rows[0].keys()
    assert (out / "config.yaml").exists() and (out / "checkpoint.pth").exists()
    assert any((out / "tensorboard").iterdir())
    printed = capsys.readouterr().out
    assert json.loads(printed[printed.index("{") :])["steps"] == report["steps"]


def test_bad_override_names_the_key(tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--output-dir", str(tmp_path), "data.batchsize=8"])
