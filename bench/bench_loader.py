"""Multi-crop loader throughput: dino_opt's native MultiCropLoader (photometric
stage on the CPU, and in the photometric operator) vs the PIL pipeline of the
original DINO and the torchvision.transforms.v2 tensor pipeline, both through
torch's DataLoader, with the same number of workers/threads and batch size.

    python bench/bench_loader.py [--workers N] [--batch-size 64] [--images N]
        [--repeats 3] [--only pil,v2,ours_cpu,ours_op] [--data DIR | --count 2000]
        [--device cpu|cuda] [--json PATH]

Data: a synthetic ImageNet-like set (bench/synthetic_images.py, cached under
build/bench-data), or any ImageFolder directory with --data.

Method: --repeats rounds; in each round every case in turn starts a fresh
loader, consumes --warmup untimed batches (worker start-up, first decodes),
then times a window of --images images, and closes the loader. Batches flow as
one stream across epochs (an epoch boundary costs what it costs in training).
The median over the rounds is reported. Interleaving the cases round by round,
rather than running each case's repeats back to back, spreads any change in
the machine's load over all cases alike; a fresh loader per window means that
no case starts its window with batches prefetched during another's. On a CUDA
device every case ends with its crops on the GPU (copied there if the loader
produced host tensors) and the stream is synchronised per batch, so all cases
deliver the same thing: a batch ready for the model. Every batch's shapes,
dtypes and labels are checked, and a sample of its values (finite, in the
normalised range), so that a broken pipeline cannot report a fast number.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline_augment import (  # noqa: E402
    IMAGENET_MEAN,
    IMAGENET_STD,
    PILMultiCrop,
    V2MultiCrop,
    collate_multicrop,
    list_image_folder,
)
from common import (  # noqa: E402
    RESULTS_DIR,
    closer_for_dataloader,
    device_slug,
    machine,
    print_table,
    write_json,
)
from synthetic_images import ensure_synthetic_set  # noqa: E402

GLOBAL_SIZE, LOCAL_SIZE, N_LOCAL = 224, 96, 8
CASES = ("ours_cpu", "ours_op", "pil", "v2")
# Normalised values of a [0, 1] pixel lie in [(0 - max mean) / min std,
# (1 - min mean) / min std]; the margin allows bicubic overshoot before
# clamping and low-precision rounding.
VALUE_LO = (0.0 - max(IMAGENET_MEAN)) / min(IMAGENET_STD) - 0.5
VALUE_HI = (1.0 - min(IMAGENET_MEAN)) / min(IMAGENET_STD) + 0.5


class BrokenPipeline(RuntimeError):
    pass


class Unavailable(RuntimeError):
    """The case cannot run here (e.g. dino_opt.data is not built yet)."""


def check_batch(crops, labels, batch_size: int, n_classes: int, full: bool) -> None:
    """Shapes, dtypes and labels of every batch, and its values: all of them
    with ``full``, else a strided sample over the whole batch (1/49 of the
    pixels; cheap beside producing them)."""
    sizes = [GLOBAL_SIZE] * 2 + [LOCAL_SIZE] * N_LOCAL
    if len(crops) != len(sizes):
        raise BrokenPipeline(f"{len(crops)} crops, expected {len(sizes)}")
    for k, (c, s) in enumerate(zip(crops, sizes, strict=True)):
        if tuple(c.shape) != (batch_size, 3, s, s):
            raise BrokenPipeline(
                f"crop {k}: shape {tuple(c.shape)}, expected {(batch_size, 3, s, s)}"
            )
        if c.dtype != torch.float32:
            raise BrokenPipeline(f"crop {k}: dtype {c.dtype}")
        x = c if full else c[:, :, ::7, ::7]
        lo, hi = (float(v) for v in torch.aminmax(x))
        if not (VALUE_LO <= lo and hi <= VALUE_HI):  # NaN fails this too
            raise BrokenPipeline(f"crop {k}: values in [{lo:.3f}, {hi:.3f}], not normalised")
        # A batch of real crops has dark and bright pixels and is not constant
        # (this catches zeros, or a [0, 1] image that skipped normalisation).
        if batch_size >= 8 and (lo > -1.0 or hi < 1.0 or float(x.std()) < 0.1):
            raise BrokenPipeline(f"crop {k}: implausible values in [{lo:.3f}, {hi:.3f}]")
    labels = torch.as_tensor(labels)
    if labels.shape != (batch_size,) or int(labels.min()) < 0 or int(labels.max()) >= n_classes:
        raise BrokenPipeline(f"bad labels: shape {tuple(labels.shape)}")


def dataloader_stream(dataset, args, seed: int) -> tuple[Iterator, Callable[[], None], None]:
    """Batches of a torch DataLoader, epoch after epoch."""
    workers = args.workers
    extra = dict(persistent_workers=True, prefetch_factor=2) if workers > 0 else {}
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        drop_last=True,
        collate_fn=collate_multicrop,
        **extra,
    )

    def stream():
        while True:
            yield from loader

    gen = stream()
    return gen, closer_for_dataloader(gen, loader), None


def ours_stream(root: Path, args, seed: int, photometric: str, device: torch.device):
    """Batches of dino_opt's MultiCropLoader, epoch after epoch (set_epoch per epoch)."""
    try:
        from dino_opt.data import MultiCropLoader
    except Exception as e:  # not built yet, or built from older sources
        raise Unavailable(f"dino_opt.data is not importable ({type(e).__name__}: {e})") from e

    kwargs = dict(
        batch_size=args.batch_size,
        global_size=GLOBAL_SIZE,
        local_size=LOCAL_SIZE,
        n_local=N_LOCAL,
        num_threads=args.workers,
        seed=seed,
        shuffle=True,
        drop_last=True,
        dtype=torch.float32,
        photometric=photometric,
    )
    if photometric == "gpu":
        if "device" not in inspect.signature(MultiCropLoader).parameters:
            raise Unavailable("MultiCropLoader takes no device= argument")
        kwargs["device"] = str(device)
    loader = MultiCropLoader(str(root), **kwargs)

    def stream():
        epoch = 0
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    gen = stream()

    def close():
        gen.close()
        loader.close()

    return gen, close, loader.stats


def run_window(make_stream, args, seed: int, device: torch.device, n_classes: int) -> dict:
    """A fresh loader: --warmup batches, then one timed window of --images images."""
    on_gpu = device.type == "cuda"
    t_start = time.perf_counter()
    gen, close, stats_fn = make_stream(seed)

    def consume(full: bool) -> None:
        batch = next(gen)
        crops, labels = batch[0], batch[1]
        if on_gpu:
            crops = [c.to(device, non_blocking=True) for c in crops]
            torch.cuda.synchronize(device)
        check_batch(crops, labels, args.batch_size, n_classes, full)

    try:
        for i in range(args.warmup):
            consume(full=i == 0)
        warmup_s = time.perf_counter() - t_start
        n, t0 = 0, time.perf_counter()
        while n < args.images:
            consume(full=False)
            n += args.batch_size
        rate = n / (time.perf_counter() - t0)
        stats = stats_fn() if stats_fn is not None else None
    finally:
        close()
        gc.collect()
    return {"rate": rate, "warmup_s": warmup_s, "stats": stats}


def dataset_info(args) -> tuple[Path, list[tuple[str, int]], dict]:
    if args.data is not None:
        from PIL import Image

        root = args.data
        samples = list_image_folder(root)
        if not samples:
            sys.exit(f"no images under {root}")
        nbytes = [os.path.getsize(p) for p, _ in samples]
        pixels = []
        for p, _ in samples:
            with Image.open(p) as im:  # reads the header only
                pixels.append(im.width * im.height)
        info = {"source": str(root), "synthetic": False}
    else:
        ds = ensure_synthetic_set(args.count, seed=args.data_seed)
        root, samples = ds.root, list_image_folder(ds.root)
        nbytes = [os.path.getsize(p) for p, _ in samples]
        pixels = [ds.mean_pixels]
        info = {"source": str(root), "synthetic": True, "seed": args.data_seed}
    info.update(
        images=len(samples),
        classes=len({label for _, label in samples}),
        mean_bytes=sum(nbytes) / len(nbytes),
        mean_pixels=sum(pixels) / len(pixels),
    )
    return Path(root), samples, info


LABELS = {
    "ours_cpu": "ours, photometric on CPU threads",
    "ours_op": "ours, photometric in the operator",
    "pil": "PIL DataAugmentationDINO + DataLoader",
    "v2": "transforms.v2 tensors + DataLoader",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="DataLoader workers and loader threads (default: usable cores)",
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--images", type=int, help="images per timed window (default: the data set once)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--data", type=Path, help="an ImageFolder directory instead of synthetic")
    parser.add_argument("--count", type=int, default=2000, help="synthetic images")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="augmentation/shuffle seed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--json", type=Path, help="output file (default docs/results/loader_<device>.json)"
    )
    args = parser.parse_args()
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    device = torch.device(args.device)

    root, samples, data = dataset_info(args)
    per_epoch = len(samples) // args.batch_size * args.batch_size
    if per_epoch == 0:
        sys.exit(f"{len(samples)} images: fewer than one batch of {args.batch_size}")
    if args.images is None:
        args.images = per_epoch
    n_classes = data["classes"]
    print(
        f"data: {data['images']} images in {root}, mean {data['mean_bytes'] / 1e3:.1f} KB, "
        f"mean {data['mean_pixels'] / 1e3:.0f} kpixels; {args.workers} workers, "
        f"batch {args.batch_size}, {args.images} images x {args.repeats} rounds, {device}"
    )

    labels = dict(LABELS)
    if device.type != "cuda":
        # On the CPU the operator's CPU kernel runs in the consumer thread.
        labels["ours_op"] = "ours, photometric op (CPU kernel, consumer thread)"
    makers = {
        "pil": lambda seed: dataloader_stream(PILMultiCrop(samples), args, seed),
        "v2": lambda seed: dataloader_stream(V2MultiCrop(samples), args, seed),
        "ours_cpu": lambda seed: ours_stream(root, args, seed, "cpu", device),
        "ours_op": lambda seed: ours_stream(root, args, seed, "gpu", device),
    }
    windows = {case: [] for case in cases}
    skipped = {}
    for r in range(args.repeats):
        print(f"round {r + 1}/{args.repeats}", flush=True)
        for case in [c for c in cases if c not in skipped]:
            try:
                w = run_window(makers[case], args, args.seed + r, device, n_classes)
            except (Unavailable, ImportError) as e:  # ImportError: a part not built yet
                skipped[case] = f"{type(e).__name__}: {e}"
                print(f"  {case}: skipped: {skipped[case]}")
                continue
            windows[case].append(w)
            print(f"  {case}: {w['rate']:.1f} images/s (warm-up {w['warmup_s']:.1f} s)", flush=True)
    results = {}
    for case, ws in windows.items():
        if case in skipped:
            continue
        rates = [w["rate"] for w in ws]
        results[case] = {
            "case": case,
            "rates": rates,
            "images_per_s": statistics.median(rates),
            "warmup_s": [w["warmup_s"] for w in ws],
            "stats": ws[-1]["stats"],  # of the last window's loader
        }

    pil = results.get("pil", {}).get("images_per_s")
    rows = []
    for case, r in results.items():
        ips = r["images_per_s"]
        rows.append([labels[case], ips, ips / max(args.workers, 1), ips / pil if pil else "n/a"])
    out = args.json or RESULTS_DIR / f"loader_{device_slug(device)}.json"
    try:
        import dino_opt

        build_info = dino_opt.build_info()
    except Exception:  # the baselines run without the extension
        build_info = None
    columns = ["case", "images/s", "images/s per worker", "vs PIL"]
    write_json(
        out,
        {
            "bench": "loader",
            "device": device_slug(device),
            "machine": machine(),
            "build_info": build_info,
            "data": data,
            "workers": args.workers,
            "batch_size": args.batch_size,
            "images_per_window": args.images,
            "repeats": args.repeats,
            "warmup_batches": args.warmup,
            "seed": args.seed,
            "crops": {"global": [2, GLOBAL_SIZE], "local": [N_LOCAL, LOCAL_SIZE]},
            "results": [{**r, "label": labels[c]} for c, r in results.items()],
            "skipped": skipped,
            "table": {"columns": columns, "rows": rows},
        },
    )
    print_table(
        f"DINO multi-crop loading (2x{GLOBAL_SIZE}^2 + {N_LOCAL}x{LOCAL_SIZE}^2), "
        f"{device_slug(device)}, {args.workers} workers, batch {args.batch_size}; "
        f"{data['images']} JPEGs, mean {data['mean_bytes'] / 1e3:.1f} KB, "
        f"{data['mean_pixels'] / 1e3:.0f} kpixels (median of {args.repeats} x "
        f"{args.images} images)",
        columns,
        rows,
    )


if __name__ == "__main__":
    main()
