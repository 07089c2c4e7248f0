"""The yardsticks of a trained run: k-NN, the linear probe (the 52-classifier
grid on cached features and with augmented crops, and the logistic
regression) and the dense probe, for a run's trained teacher beside the
same network at random initialisation; and what training the grid together
costs against training its classifiers one at a time.

    python bench/bench_probes.py [--run runs/demo] [--epochs 10] [--device cpu]
        [--augmented-epochs 10] [--json PATH]

The run folder is one `dino-opt train` wrote (`make demo` makes runs/demo).
The random initialisation is the run's architecture built from the run's
seed. The probes run on the run's data (train / val / test; the dense
probe on the built-in data set's masks). One-at-a-time: one classifier of
the grid trained alone with augmented crops for two epochs (the backbone
runs for it as for the grid); its time per epoch times 52 classifiers is the
cost of the grid trained the way DINO's eval_linear.py trains one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, device_slug, machine, print_table, write_json  # noqa: E402
from dino_opt.eval import ProbeData, evaluate_backbone, linear_probe  # noqa: E402
from dino_opt.runtime import resolve_device  # noqa: E402
from dino_opt.train import build_models, data_roots  # noqa: E402
from dino_opt.weights import open_backbone  # noqa: E402


def random_backbone(cfg):
    torch.manual_seed(cfg.hardware.seed)
    return build_models(cfg)[1].backbone.eval()


def evaluate(cfg, roots, net, device, augmented_epochs: int) -> dict:
    """Every probe of one backbone, with its timings."""
    result = evaluate_backbone(cfg, roots, net, device)
    splits = ProbeData(roots.knn_train or roots.train, roots.val, roots.test)
    size = cfg.augmentation.global_crop_size
    start = time.perf_counter()
    aug = linear_probe(
        net,
        splits,
        size,
        mode="augmented",
        epochs=augmented_epochs,
        device=device,
        seed=cfg.hardware.seed,
    )
    result["augmented"] = aug
    result["seconds"]["augmented"] = time.perf_counter() - start
    return result


def one_classifier_seconds_per_epoch(cfg, roots, net, device, epochs: int = 2) -> float:
    splits = ProbeData(roots.knn_train or roots.train, roots.val, roots.test)
    result = linear_probe(
        net,
        splits,
        cfg.augmentation.global_crop_size,
        mode="augmented",
        epochs=epochs,
        learning_rates=(1e-3,),
        n_last_blocks=(1,),
        device=device,
        seed=cfg.hardware.seed,
    )
    return result["seconds"]["grid"] / epochs


def rows_of(name: str, r: dict) -> list:
    lin, aug, dense = r["linear"], r["augmented"], r.get("dense", {})
    return [
        name,
        f"{r['knn']['val']['top1']:.1f} / {r['knn'].get('test', {}).get('top1', float('nan')):.1f}",
        f"{lin['best']['val_top1']:.1f} / {lin['best'].get('test_top1', float('nan')):.1f}",
        f"{lin['logreg']['val_top1']:.1f} / {lin['logreg'].get('test_top1', float('nan')):.1f}",
        f"{aug['best']['val_top1']:.1f} / {aug['best'].get('test_top1', float('nan')):.1f}",
        f"{dense.get('val', {}).get('miou', float('nan')):.1f} / "
        f"{dense.get('test', {}).get('miou', float('nan')):.1f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/demo")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--augmented-epochs", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = resolve_device(args.device)
    opened = open_backbone(args.run)
    if opened.config is None:
        raise SystemExit(f"{args.run}: not a dino-opt run folder")
    cfg, roots = opened.config, data_roots(opened.config)
    nets = {"trained": opened.net.to(device), "random init": random_backbone(cfg).to(device)}
    results = {
        name: evaluate(cfg, roots, net, device, args.augmented_epochs) for name, net in nets.items()
    }
    single = one_classifier_seconds_per_epoch(cfg, roots, nets["trained"], device)
    grid = results["trained"]["augmented"]
    grid_epoch = grid["seconds"]["grid"] / grid["epochs"]
    n, lin = grid["n_classifiers"], results["trained"]["linear"]
    columns = [
        "backbone",
        "k-NN val/test",
        "linear fast val/test",
        "logreg val/test",
        "linear augmented val/test",
        "dense mIoU val/test",
    ]
    print_table(
        f"Probes of {args.run} ({cfg.model.backbone}, {cfg.augmentation.global_crop_size}"
        f" px; top-1 %, mIoU %)",
        columns,
        [rows_of(name, r) for name, r in results.items()],
    )
    cost = [
        ["grid, together (augmented)", f"{grid_epoch:.2f}", n, "1.00x"],
        [
            f"{n} classifiers one at a time (1 measured x {n})",
            f"{single * n:.2f}",
            n,
            f"{single * n / grid_epoch:.1f}x",
        ],
        [
            f"fast: extract train/val/test once ({lin['n_train']} train images)",
            f"{results['trained']['seconds']['features_and_knn']:.2f}",
            "-",
            "-",
        ],
        [
            f"fast: the grid, {lin['epochs']} epochs on cached features",
            f"{lin['seconds']['grid']:.2f}",
            n,
            "-",
        ],
        ["fast: logistic regression sweep", f"{lin['seconds']['logreg']:.2f}", 1, "-"],
    ]
    print_table(
        "Cost of the linear probe (seconds; augmented: per epoch)",
        ["case", "seconds", "classifiers", "vs together"],
        cost,
    )
    for r in results.values():
        r.pop("val_features"), r.pop("val_labels")
    payload = {
        "machine": machine(),
        "run": args.run,
        "backbone": cfg.model.backbone,
        "image_size": cfg.augmentation.global_crop_size,
        "results": results,
        "grid_seconds_per_epoch": grid_epoch,
        "one_classifier_seconds_per_epoch": single,
        "classifiers": n,
    }
    write_json(args.json or RESULTS_DIR / f"probes_demo_{device_slug(device)}.json", payload)


if __name__ == "__main__":
    main()
