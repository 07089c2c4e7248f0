"""The weighted k-NN top-1 of embedded features as they are, standardised
per channel, and whitened (ZCA) with eigenvalue floors: whether a network's
features hold more than their cosine neighbours show, and so whether a
distillation from it should whiten its tokens (``recipe.distill.whiten``).

    dino-opt embed RUN DATA/train -o train.npz   # and val.npz, test.npz
    python scripts/whitened_knn.py train.npz val.npz [test.npz ...]
        [--key cls] [--floors 1e-2 1e-3 1e-4] [--k 20] [--temperature 0.07]
        [--json OUT]

The labels are the images' class folders (the paths the files hold). The
first file gives the neighbours and every transform's statistics (the same
running-statistics whitener a distillation uses, fed it whole); each other
file is classified. Prints one row per transform, one column per file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from dino_opt.eval.knn import knn_classify
from dino_opt.train.distill import TokenWhitener


def read(path: Path, key: str) -> tuple[torch.Tensor, list[str]]:
    """The ``key`` features [N, D] (float64) of an embedding file and each
    image's class folder."""
    with np.load(path, allow_pickle=False) as data:
        if key not in data.files:
            raise SystemExit(f"{path}: no {key!r} features (it holds {', '.join(data.files)})")
        feats = torch.from_numpy(data[key]).double()
        names = [Path(str(p)).parent.name for p in data["paths"]]
    return feats, names


def transforms(train: torch.Tensor, floors: list[float]) -> dict:
    """Each transform, its statistics taken from ``train``."""
    mean, std = train.mean(0), train.std(0, correction=0).clamp_min(1e-12)
    out = {"as they are": lambda x: x, "standardised": lambda x: (x - mean) / std}
    for floor in floors:
        whitener = TokenWhitener(train.shape[1], floor)
        whitener.update(train)
        w, centre = whitener.matrix().double(), whitener.mean
        out[f"whitened, floor {floor:g}"] = lambda x, w=w, c=centre: (x - c) @ w
    return out


def table(files: list[Path], key: str, floors: list[float], k: int, temperature: float) -> dict:
    """``{transform: [top-1 of each file after the first]}``."""
    train, names = read(files[0], key)
    classes = sorted(set(names))
    labels = torch.tensor([classes.index(n) for n in names])
    others = []
    for path in files[1:]:
        feats, theirs = read(path, key)
        unknown = sorted(set(theirs) - set(classes))
        if unknown:
            raise SystemExit(f"{path}: classes not among {files[0]}'s: {', '.join(unknown[:5])}")
        others.append((feats, torch.tensor([classes.index(n) for n in theirs])))
    rows = {}
    for name, f in transforms(train, floors).items():
        rows[name] = [
            knn_classify(f(train).float(), labels, f(x).float(), y, k=k, temperature=temperature)[
                "top1"
            ]
            for x, y in others
        ]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="dino-opt embed files: neighbours first")
    p.add_argument("--key", default="cls", help="the features to read (cls, mean_patch)")
    p.add_argument("--floors", type=float, nargs="*", default=[1e-2, 1e-3, 1e-4])
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.07)
    p.add_argument("--json", type=Path, help="also write the table here")
    a = p.parse_args(argv)
    if len(a.files) < 2:
        p.error("give the neighbours' file and at least one file to classify")
    rows = table(a.files, a.key, a.floors, a.k, a.temperature)
    print(f"| {a.key} | " + " | ".join(f.stem for f in a.files[1:]) + " |")
    print("|---|" + "---:|" * (len(a.files) - 1))
    for name, tops in rows.items():
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in tops) + " |")
    if a.json:
        a.json.write_text(
            json.dumps({"key": a.key, "files": [str(f) for f in a.files], "top1": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
