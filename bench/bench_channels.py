"""Images that are not 8-bit RGB: the native loader's images/s at 1, 3 and
13 channels (uint16 ``.npy`` arrays, ``image_mode="native"``, DINO's 2 x
224^2 + 8 x 96^2 crops; the crops alone, and with the per-channel
photometric recipe) against a NumPy Dataset through torch's DataLoader with
the same workers (np.load, then torchvision's RandomResizedCrop, flip and
per-channel normalisation on float32 tensors, no photometric change: the
DataLoader route such data takes without dino_opt).

    python bench/bench_channels.py [--workers 2] [--count 256] [--side 256]
        [--images 256] [--channels 1,3,13] [--json PATH]

Every batch is checked (shapes, finite values). Rates are per round: a fresh
loader, 1 warm-up batch, then --images images timed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.v2 as T

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, machine, print_table, write_json  # noqa: E402
from dino_opt.data import MultiCropLoader  # noqa: E402
from synthetic_images import DEFAULT_ROOT  # noqa: E402

GLOBAL, LOCAL, N_LOCAL = 224, 96, 8


def make_set(channels: int, count: int, side: int) -> Path:
    """``count`` uint16 arrays (side, side, channels) of smooth fields and noise (cached)."""
    root = DEFAULT_ROOT / f"channels-{channels}-{count}-{side}"
    done = root / "done"
    if done.is_file():
        return root
    (root / "x").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(channels)
    y, x = np.mgrid[0:side, 0:side] / side
    for i in range(count):
        f = rng.uniform(1, 6, (channels, 2))
        field = 0.5 + 0.3 * np.sin(f[:, :1, None] * 6.3 * x + f[:, 1:, None] * 6.3 * y)
        field += rng.normal(0, 0.05, field.shape)
        a = np.clip(field * 40000 + 10000, 0, 65535).astype(np.uint16).transpose(1, 2, 0)
        np.save(root / "x" / f"{i:05d}.npy", a)
    done.write_text("ok")
    return root


class NumpyMultiCrop(torch.utils.data.Dataset):
    """The DataLoader route: np.load, then torchvision's crops on float32 tensors."""

    def __init__(self, root: Path, mean, std):
        self.files = sorted((root / "x").glob("*.npy"))
        norm = T.Normalize(mean, std)
        self.global_t = T.Compose(
            [
                T.RandomResizedCrop(GLOBAL, (0.4, 1.0), antialias=True),
                T.RandomHorizontalFlip(),
                norm,
            ]
        )
        self.local_t = T.Compose(
            [
                T.RandomResizedCrop(LOCAL, (0.05, 0.4), antialias=True),
                T.RandomHorizontalFlip(),
                norm,
            ]
        )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        a = np.load(self.files[i]).astype(np.float32) / 65535.0
        x = torch.from_numpy(a).permute(2, 0, 1)
        crops = [self.global_t(x) for _ in range(2)] + [self.local_t(x) for _ in range(N_LOCAL)]
        return crops, 0


def collate(samples):
    crops = [torch.stack([s[0][c] for s in samples]) for c in range(len(samples[0][0]))]
    return crops, torch.zeros(len(samples), dtype=torch.long)


def check(crops, batch: int, channels: int) -> None:
    if len(crops) != 2 + N_LOCAL or crops[0].shape != (batch, channels, GLOBAL, GLOBAL):
        raise RuntimeError(f"bad batch: {[tuple(c.shape) for c in crops]}")
    if not all(torch.isfinite(c).all() for c in crops[:1]):
        raise RuntimeError("non-finite crops")


def rate(batches, batch: int, images: int, channels: int) -> float:
    it = iter(batches)
    check(next(it)[0], batch, channels)  # warm-up
    n, t0 = 0, time.perf_counter()
    while n < images:
        crops = next(it)[0]
        check(crops, batch, channels)
        n += batch
    return n / (time.perf_counter() - t0)


# Ours twice: the crops alone (the work the DataLoader route does here: crop,
# resize, flip, normalise), and with DINO's per-channel photometric recipe.
RECIPES = (
    (
        "crops",
        dict(jitter_p=0.0, blur_p_global1=0.0, blur_p_global2=0.0, blur_p_local=0.0, noise_p=0.0),
    ),
    ("recipe", {}),
)


def ours_rate(root: Path, args, channels: int, kw: dict, augment: dict) -> float:
    loader = MultiCropLoader(
        root,
        args.batch_size,
        num_threads=args.workers,
        pin_memory=False,
        image_mode="native",
        augment=augment,
        **kw,
    )

    def epochs():
        for epoch in range(1000):
            loader.set_epoch(epoch)
            yield from loader

    try:
        return rate(epochs(), args.batch_size, args.images, channels)
    finally:
        loader.close()
        gc.collect()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--side", type=int, default=256)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--channels", default="1,3,13")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "loader_channels_cpu.json")
    args = p.parse_args()
    rows, results = [], []
    for channels in (int(c) for c in args.channels.split(",")):
        root = make_set(channels, args.count, args.side)
        mean, std = [0.5] * channels, [0.25] * channels
        kw = dict(global_size=GLOBAL, local_size=LOCAL, n_local=N_LOCAL, mean=mean, std=std)
        ours = {name: ours_rate(root, args, channels, kw, augment) for name, augment in RECIPES}
        gc.collect()
        loader_dl = torch.utils.data.DataLoader(
            NumpyMultiCrop(root, mean, std),
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            drop_last=True,
            collate_fn=collate,
            persistent_workers=args.workers > 0,
        )

        def dl_epochs(dl=loader_dl):
            while True:
                yield from dl

        theirs = rate(dl_epochs(), args.batch_size, args.images, channels)
        del loader_dl
        gc.collect()
        rows.append((channels, ours["crops"], ours["recipe"], theirs, ours["crops"] / theirs))
        results.append(
            {
                "channels": channels,
                "ours_crops_images_per_s": ours["crops"],
                "ours_recipe_images_per_s": ours["recipe"],
                "numpy_dataloader_images_per_s": theirs,
            }
        )
    title = f"images/s, {args.workers} workers, batch {args.batch_size}, uint16 {args.side}^2"
    columns = ["channels", "ours, crops", "ours, recipe", "NumPy + DataLoader", "crops x"]
    print_table(title, columns, rows)
    write_json(
        args.json,
        {
            "machine": machine(),
            "args": {k: str(v) for k, v in vars(args).items() if k != "json"},
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
