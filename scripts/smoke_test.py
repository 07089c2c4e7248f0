"""Smoke test of an installed dino_opt (``make wheel-smoke`` runs it in a fresh
environment holding only the wheel and its requirements): the import, the
torch pin in the wheel's metadata, one operator of each kind (EMA, loss
forward and backward, photometric), one batch of the multi-crop loader, and a
training run of one step. Prints one line per check; exits non-zero on the
first failure."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import time
from pathlib import Path

import dino_opt
import torch
from dino_opt import ops
from dino_opt.config import apply_overrides, default_config
from dino_opt.data import MultiCropLoader, builtin_dataset
from dino_opt.job import run_training


def check_install(expect_under: str | None) -> str:
    where = Path(dino_opt.__file__).resolve()
    if expect_under is not None and not where.is_relative_to(Path(expect_under).resolve()):
        raise AssertionError(f"dino_opt was imported from {where}, not from {expect_under}")
    pins = [r for r in importlib.metadata.requires("dino_opt") or [] if r.startswith("torch")]
    series = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if pins != [f"torch=={series}.*"]:
        raise AssertionError(f"the wheel's torch requirement is {pins}, expected torch=={series}.*")
    info = dino_opt.build_info()
    return f"{where.parent} ({pins[0]}, built against torch {info['torch_version_built']})"


def check_ops() -> str:
    teacher, student = torch.zeros(1000, dtype=torch.float64), torch.ones(1000, dtype=torch.float64)
    ops.ema_update_([teacher], [student], 0.9)
    assert torch.allclose(teacher, torch.full_like(teacher, 0.1)), "EMA update"
    s = torch.randn(4 * 3, 32, requires_grad=True)
    loss = ops.dino_loss(s, torch.randn(2 * 3, 32), torch.zeros(1, 32), 0.1, 0.04, 4)
    loss.backward()
    assert torch.isfinite(loss) and s.grad is not None and torch.isfinite(s.grad).all(), "loss"
    params = torch.zeros(2, len(ops.PHOTOMETRIC_PARAM_COLUMNS))
    params[:, 2:5] = 1.0  # identity brightness, contrast, saturation
    params[:, 6:10] = torch.arange(4.0)
    images = torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8)
    out = ops.multicrop_photometric(images, params)
    assert out.shape == (2, 3, 16, 16) and torch.isfinite(out).all(), "photometric"
    return f"ema, loss {loss.item():.4f} (forward and backward), photometric {tuple(out.shape)}"


def check_loader(root: Path) -> str:
    loader = MultiCropLoader(
        root / "train",
        batch_size=4,
        global_size=32,
        local_size=16,
        n_local=2,
        photometric="gpu",
        device="cpu",
    )
    try:
        crops, labels, _ = next(iter(loader))
    finally:
        loader.close()
    assert len(crops) == 4 and crops[0].shape == (4, 3, 32, 32) and labels.shape == (4,)
    return f"{len(crops)} crops per image, global {tuple(crops[0].shape)}"


def check_training(root: Path, out: Path) -> str:
    """One epoch of one step (10 images, batch 8); a train folder without a
    val folder beside it, so no evaluation follows."""
    train = out / "data" / "train"
    train.parent.mkdir(parents=True)
    train.symlink_to(root / "train")
    overrides = [
        "data.batch_size=8",
        "augmentation.global_crop_size=32",
        "augmentation.local_crop_size=16",
        "augmentation.num_local_views=2",
        "model.backbone=vit_tiny",
        "model.patch_size=8",
        "model.out_dim=64",
        "model.hidden_dim=32",
        "model.bottleneck_dim=16",
        "schedule.epochs=1",
        "schedule.warmup_epochs=0",
        "logging.progress=false",
        "hardware.device=cpu",
        f"data.root={train}",
    ]
    report = run_training(
        apply_overrides(default_config(), overrides), output_dir=out / "run", quiet=True
    )
    assert report["steps"] == 1 and torch.isfinite(torch.tensor(report["final_loss"]))
    return f"{report['steps']} step, loss {report['final_loss']:.4f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-under", help="the folder dino_opt must be imported from")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = builtin_dataset(
            Path(tmp) / "data", train_per_class=1, val_per_class=1, test_per_class=0, image_size=40
        )
        checks = [
            ("install", lambda: check_install(args.expect_under)),
            ("ops", check_ops),
            ("loader", lambda: check_loader(root)),
            ("training", lambda: check_training(root, Path(tmp) / "job")),
        ]
        for name, check in checks:
            start = time.perf_counter()
            try:
                detail = check()
            except Exception as e:  # noqa: BLE001 - report which check failed, then stop
                print(f"smoke {name}: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
                return 1
            print(f"smoke {name}: ok in {time.perf_counter() - start:.1f} s: {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
