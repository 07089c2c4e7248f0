"""The tiny training run the end-to-end tests share: ViT-T/8 at 32/16 px
(2 global + 2 local crops), head 32-16-64, batch 8, on the CPU, no progress
bar; a tiny built-in data set; `dino-opt knn` read as JSON. Tests add their own overrides."""

import json
from pathlib import Path

from dino_opt.cli import main
from dino_opt.data import builtin_dataset

TINY = [
    "data.batch_size=8",
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
    # the end of a run evaluates by k-NN only: test_train_cli turns the rest on
    "eval.linear=false",
    "eval.dense=false",
    "eval.pictures=0",
]


def tiny_train_only(tmp_path_factory) -> Path:
    """40 images (5 batches of 8 per epoch) in a `train` folder with no `val`
    beside it, so that a run ends without the k-NN evaluation."""
    root = builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin", train_per_class=4, val_per_class=1,
        test_per_class=0, image_size=40,
    )  # fmt: skip
    train = tmp_path_factory.mktemp("trainonly") / "train"
    train.symlink_to(root / "train")
    return train


def knn_json(capsys, *args: str) -> dict:
    """``dino-opt knn ARGS``: what it printed, as a dict."""
    capsys.readouterr()
    assert main(["knn", *args]) == 0
    return json.loads(capsys.readouterr().out)
