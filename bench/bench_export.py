"""Exports of a training run, checked in the libraries that load them: the
teacher written as timm, Hugging Face and DINO files, loaded by timm,
transformers and a ViT in DINO's layout, and their CLS features on the run's
val images compared with dino_opt's (max and mean absolute difference, at the
run's crop size and at 224), with the time to export and to load; then the
k-NN of each export (``dino-opt knn --weights``) beside the run's own.

    python bench/bench_export.py RUN [--images 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import timm
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine, print_table, write_json  # noqa: E402
from dino_opt.config import Config  # noqa: E402
from dino_opt.eval import (
    EvalImageFolder,  # noqa: E402
    load_checkpoint,  # noqa: E402
)
from dino_opt.models import VisionTransformer  # noqa: E402
from dino_opt.train import build_models, data_roots  # noqa: E402
from dino_opt.weights import evaluate_weights, export_weights  # noqa: E402


def _timm(path: Path) -> torch.nn.Module:
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    model = timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"]))
    model.load_state_dict(load_file(path), strict=True)
    return model.eval()


def _hf(path: Path):
    model = transformers.ViTModel.from_pretrained(str(path), add_pooling_layer=False).eval()
    return lambda x: model(pixel_values=x).last_hidden_state[:, 0]


def _dino(path: Path, like: torch.nn.Module) -> torch.nn.Module:
    heads = like.blocks[0].attn.num_heads
    net = VisionTransformer(
        patch_size=like.patch_size,
        embed_dim=like.embed_dim,
        depth=len(like.blocks),
        num_heads=heads,
    )
    net.load_state_dict(torch.load(path, weights_only=True), strict=True)
    return net.eval()


def _images(root: Path, size: int, n: int) -> torch.Tensor:
    folder = EvalImageFolder(root, image_size=size)
    step = max(1, len(folder) // n)
    return torch.stack([folder[i][0] for i in range(0, len(folder), step)][:n])


def compare(run: Path, out: Path, size: int, n: int, teacher, val: Path) -> list[dict]:
    """One row per export format at input ``size``."""
    x = _images(val, size, n)
    with torch.no_grad():
        ours = teacher.backbone(x)
    rows = []
    for fmt, load in (("timm", _timm), ("hf", _hf), ("dino", None)):
        if fmt == "dino" and size != 224:
            continue  # DINO's file keeps the 224-pixel table; its code resizes it
        start = time.perf_counter()
        r = export_weights(run, fmt, out / f"{fmt}_{size}", image_size=size, force=True)
        exported = time.perf_counter() - start
        start = time.perf_counter()
        model = load(r.path) if load is not None else _dino(r.path, teacher.backbone)
        loaded = time.perf_counter() - start
        with torch.no_grad():
            theirs = model(x)
        diff = (theirs - ours).abs()
        rows.append(
            {
                "format": fmt,
                "image_size": size,
                "images": len(x),
                "max_abs_diff": diff.max().item(),
                "mean_abs_diff": diff.mean().item(),
                "feature_scale": ours.abs().mean().item(),
                "export_s": exported,
                "load_s": loaded,
                "path": str(r.path),
                "notes": r.notes,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a dino-opt train run folder (a ViT run)")
    parser.add_argument("--images", type=int, default=64, help="val images compared (default 64)")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "export_demo.json")
    args = parser.parse_args()
    ckpt = load_checkpoint(args.run)
    cfg = Config.from_dict(ckpt["config"])
    _, teacher = build_models(cfg)
    teacher.load_state_dict(ckpt["teacher"])
    teacher.eval()
    roots = data_roots(cfg)
    crop = cfg.augmentation.global_crop_size
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rows = [
            r
            for size in (crop, 224)
            for r in compare(args.run, out, size, args.images, teacher, roots.val)
        ]
        knn = [
            evaluate_weights(r["path"], roots.train.parent, device="cpu")
            for r in rows
            if r["image_size"] == crop
        ]
    report_path = args.run / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    print_table(
        f"exports of {args.run} ({cfg.model.backbone}/{cfg.model.patch_size}, teacher) vs "
        f"dino_opt's features on {rows[0]['images']} val images",
        ["format", "px", "max |diff|", "mean |diff|", "mean |feature|", "export s", "load s"],
        [
            [
                r["format"],
                r["image_size"],
                f"{r['max_abs_diff']:.2e}",
                f"{r['mean_abs_diff']:.2e}",
                f"{r['feature_scale']:.3f}",
                f"{r['export_s']:.2f}",
                f"{r['load_s']:.2f}",
            ]
            for r in rows
        ],
    )
    run_knn = [
        [
            "the run's report.json",
            report.get("knn_top1_trained"),
            report.get("knn_test_top1_trained"),
        ]
    ]
    print_table(
        f"k-NN of the exports at {crop} px (dino-opt knn --weights) beside the run's",
        ["weights", "val top-1", "test top-1"],
        [[k["format"], k["top1"], k.get("test_top1")] for k in knn] + run_knn,
    )
    write_json(
        args.json,
        {
            "machine": machine(),
            "run": str(args.run),
            "features": rows,
            "knn": knn,
            "run_knn": run_knn[0][1:],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
