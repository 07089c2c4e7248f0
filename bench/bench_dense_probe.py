"""The dense linear probe (DINOv3's linear segmentation head on frozen patch
tokens) on the built-in data set's masks: the demo's trained teacher beside
the same network at random initialisation.

    python bench/bench_dense_probe.py [--run /tmp/demo_run] [--sizes 64,112]
        [--epochs 32] [--threads N] [--json PATH]

Data: the built-in data set at its defaults (2,000 train, 500 val, 500 test
images at 112 px, ``builtin_dataset()``), its masks (11 labels: background
and the ten classes). Networks: the teacher backbone of the newest
checkpoint of ``--run`` (a ``dino-opt train`` run folder; without one, only
the random network) and the network its config builds after
``torch.manual_seed(cfg.hardware.seed)``; without ``--run``, the demo
preset's ViT-T/16. Each size in ``--sizes`` is an evaluation size (images
bicubic, masks nearest, resized to it): 64 is the demo's global crop (a 4x4
grid of patch tokens), 112 the images' own size (7x7). The probe trains on
train and is evaluated on val and test with the same settings for every
row (``dense_probe`` defaults: 32 epochs, batch 16, AdamW 1e-3, seed 0);
nothing is chosen on val or test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_json  # noqa: E402
from dino_opt.config import DEMO_PRESET, Config  # noqa: E402
from dino_opt.data import builtin_dataset  # noqa: E402
from dino_opt.data.segmentation import segmentation_splits  # noqa: E402
from dino_opt.eval import load_checkpoint  # noqa: E402
from dino_opt.eval.dense import dense_probe  # noqa: E402
from dino_opt.train import build_models  # noqa: E402


def networks(run: Path | None) -> tuple[Config, dict[str, torch.nn.Module], str]:
    """The config and the backbones to probe: random init, and trained when
    the run folder has a checkpoint."""
    ckpt = None
    if run is not None and (run / "checkpoints").is_dir():
        ckpt = load_checkpoint(run, keys=("teacher", "config"))
        cfg = Config.from_dict(ckpt["config"])
    else:
        cfg = Config.from_dict(DEMO_PRESET)
    torch.manual_seed(cfg.hardware.seed)
    _, random_teacher = build_models(cfg)
    nets = {"random init": random_teacher.backbone}
    if ckpt is not None:
        _, teacher = build_models(cfg)
        teacher.load_state_dict(ckpt["teacher"])
        nets["trained teacher"] = teacher.backbone
    return cfg, nets, str(run) if ckpt is not None else "none (demo preset)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=Path("/tmp/demo_run"))
    ap.add_argument("--sizes", default="64,112")
    ap.add_argument("--epochs", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=Path("dense_probe_cpu.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, nets, source = networks(args.run)
    splits = segmentation_splits(builtin_dataset())
    rows, results = [], []
    for size in (int(s) for s in args.sizes.split(",")):
        for name, net in nets.items():
            t0 = time.perf_counter()
            r = dense_probe(
                net,
                splits["train"],
                splits["val"],
                splits["test"],
                image_size=size,
                epochs=args.epochs,
                seed=0,
            )
            wall = time.perf_counter() - t0
            grid = "x".join(map(str, r["feature_grid"]))
            rows.append(
                [
                    name,
                    f"{size} ({grid})",
                    r["val"]["miou"],
                    r["test"]["miou"],
                    r["val"]["pixel_acc"],
                    r["test"]["pixel_acc"],
                    r["final_loss"],
                    round(r["seconds"]["features"], 1),
                    round(r["seconds"]["train"], 1),
                    round(wall, 1),
                ]
            )
            results.append({"network": name, "wall_seconds": wall, **r})
    print_table(
        f"dense linear probe, built-in data set ({cfg.model.backbone}/{cfg.model.patch_size}, "
        f"checkpoint: {source}; mIoU and pixel accuracy in %, 11 labels)",
        [
            "network",
            "size (grid)",
            "val mIoU",
            "test mIoU",
            "val acc",
            "test acc",
            "final loss",
            "features s",
            "train s",
            "total s",
        ],
        rows,
    )
    write_json(
        args.json,
        {
            "machine": machine(),
            "checkpoint": source,
            "threads": torch.get_num_threads(),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
