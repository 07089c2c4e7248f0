"""scripts/whitened_knn.py: the k-NN of embedded features as they are,
standardised and whitened, read from dino-opt embed's files."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import whitened_knn  # noqa: E402


def _embedding(path: Path, n: int, gen: torch.Generator) -> None:
    """Two classes told apart only along a direction 1,000 times smaller
    than a class-blind one that a cosine sees alone (a partly collapsed
    teacher), mixed over all channels; written as dino-opt embed does."""
    labels = torch.arange(n) % 2
    x = torch.randn(n, 8, generator=gen, dtype=torch.float64) * 1e-3
    x[:, 0] = torch.randn(n, generator=gen, dtype=torch.float64) * 10  # class-blind
    x[:, 1] += (labels * 2 - 1) * 3e-2  # the classes, 3e-2 apart on 1e-3 noise
    mix = torch.linalg.qr(
        torch.randn(8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    )[0]
    feats = (x @ mix.T + 1.0).float().numpy()
    paths = np.array([f"/data/{'ab'[int(y)]}/{i}.png" for i, y in enumerate(labels)])
    np.savez(path, cls=feats, paths=paths)


def test_whitening_finds_the_classes_the_cosine_misses(tmp_path, capsys):
    gen = torch.Generator().manual_seed(0)
    for name, n in (("train", 400), ("val", 200)):
        _embedding(tmp_path / f"{name}.npz", n, gen)
    out = tmp_path / "table.json"
    files = [str(tmp_path / "train.npz"), str(tmp_path / "val.npz")]
    assert whitened_knn.main([*files, "--floors", "1e-2", "1e-6", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["top1"]
    assert rows["as they are"][0] < 75  # the class-blind direction decides the neighbours
    assert rows["whitened, floor 1e-06"][0] > 95
    assert set(rows) == {
        "as they are",
        "standardised",
        "whitened, floor 0.01",
        "whitened, floor 1e-06",
    }
    printed = capsys.readouterr().out
    assert "| whitened, floor 1e-06 |" in printed and "| cls | val |" in printed


def test_bad_files_are_one_line(tmp_path):
    gen = torch.Generator().manual_seed(1)
    _embedding(tmp_path / "train.npz", 20, gen)
    np.savez(
        tmp_path / "other.npz",
        cls=np.zeros((2, 8), np.float32),
        paths=np.array(["/d/zebra/1.png", "/d/a/2.png"]),
    )
    with pytest.raises(SystemExit, match="no 'mean_patch' features"):
        whitened_knn.main(
            [str(tmp_path / "train.npz"), str(tmp_path / "other.npz"), "--key", "mean_patch"]
        )
    with pytest.raises(SystemExit, match="classes not among .*zebra"):
        whitened_knn.main([str(tmp_path / "train.npz"), str(tmp_path / "other.npz")])
