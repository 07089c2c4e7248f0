"""Feature extraction for evaluation: dino_opt's native evaluation loader
(EvalLoader, C++ threads) vs torchvision's ImageFolder with DINO's evaluation
transform through torch's DataLoader, with the same number of workers/threads
and batch size; loading alone, and extraction with a ViT-T/16.

    python bench/bench_extract.py [--workers 2] [--batch-size 64] [--count 512]
        [--size 224] [--repeats 3] [--only load_native,load_tv,extract_native,extract_tv]
        [--device cpu|cuda] [--json PATH]

Data: the synthetic ImageNet-like JPEGs of bench/synthetic_images.py (sides
300..600 px, cached under build/bench-data). Both pipelines do the same work
per image: decode, resize the shorter side to round(S * 256 / 224) with
PIL's anti-aliased bicubic, centre-crop S x S, normalise.

Method: every case first runs once untimed (worker start-up, file cache),
then --repeats rounds, each case in turn per round (so that a change in the
machine's load falls on all cases alike); a round times one whole pass over
the data set, from creating the loader to the last batch (loading) or from
calling extract_features to its return (extraction: a randomly initialised
ViT-T/16, eval mode; bf16 autocast on CUDA, float32 on the CPU). The median
over the rounds is reported. Loading checks every batch's shape, labels and
value range, and the extraction cases check that both pipelines give the
same features (cosine > 0.99 per row), so a broken pipeline cannot report a
fast number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dino_opt  # noqa: E402
from common import RESULTS_DIR, device_slug, machine, print_table, write_json  # noqa: E402
from dino_opt.eval.features import EvalLoader, extract_features  # noqa: E402
from dino_opt.models import vit_tiny  # noqa: E402
from dino_opt.ops.library import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from synthetic_images import ensure_synthetic_set  # noqa: E402

CASES = ("load_native", "load_tv", "extract_native", "extract_tv")
LABELS = {
    "load_native": "load: EvalLoader (native threads)",
    "load_tv": "load: torchvision ImageFolder + DataLoader",
    "extract_native": "extract ViT-T/16: EvalLoader",
    "extract_tv": "extract ViT-T/16: torchvision + DataLoader",
}
VALUE_LO = (0.0 - max(IMAGENET_MEAN)) / min(IMAGENET_STD) - 0.5
VALUE_HI = (1.0 - min(IMAGENET_MEAN)) / min(IMAGENET_STD) + 0.5


def torchvision_folder(root: Path, size: int):
    """DINO's eval_knn.py data: ImageFolder with Resize, CenterCrop, ToTensor, Normalize."""
    from torchvision import datasets
    from torchvision import transforms as T

    transform = T.Compose(
        [
            T.Resize(round(size * 256 / 224), interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    return datasets.ImageFolder(str(root), transform=transform)


def torchvision_loader(root: Path, args, device: torch.device):
    return torch.utils.data.DataLoader(
        torchvision_folder(root, args.size),
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
    )


def check_batch(images: torch.Tensor, labels: torch.Tensor, args, n_classes: int) -> None:
    if images.shape[1:] != (3, args.size, args.size) or len(labels) != len(images):
        raise RuntimeError(f"bad batch: images {tuple(images.shape)}, labels {len(labels)}")
    if labels.min() < 0 or labels.max() >= n_classes:
        raise RuntimeError(f"labels outside [0, {n_classes})")
    lo, hi = images.min().item(), images.max().item()
    if not (VALUE_LO <= lo and hi <= VALUE_HI):
        raise RuntimeError(f"values outside the normalised range: {lo:.2f}..{hi:.2f}")


def load_pass(case: str, root: Path, args, device: torch.device, n_classes: int) -> int:
    """One pass over the data set, each batch on the device; returns the image count."""
    if case == "load_native":
        loader = EvalLoader(
            root,
            args.size,
            args.batch_size,
            num_threads=args.workers,
            pin_memory=device.type == "cuda",
        )
    else:
        loader = torchvision_loader(root, args, device)
    n = 0
    try:
        for batch in loader:
            images = batch[0].to(device, non_blocking=True)
            check_batch(images, batch[1], args, n_classes)
            n += len(images)
    finally:
        if case == "load_native":
            loader.close()
    return n


def extract_pass(case: str, root: Path, model, args, device: torch.device):
    common = dict(device=device, batch_size=args.batch_size, num_workers=args.workers)
    if case == "extract_native":
        return extract_features(model, root, image_size=args.size, **common)
    return extract_features(model, torchvision_folder(root, args.size), **common)


def run_case(case: str, root: Path, model, args, device, n_classes: int, outputs: dict) -> float:
    """Images/s of one timed pass."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    if case.startswith("load"):
        n = load_pass(case, root, args, device, n_classes)
    else:
        features, labels = extract_pass(case, root, model, args, device)
        outputs[case] = (features, labels)
        n = len(features)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return n / (time.perf_counter() - t0)


def check_same_features(outputs: dict) -> float | None:
    if not {"extract_native", "extract_tv"} <= outputs.keys():
        return None
    (a, ya), (b, yb) = outputs["extract_native"], outputs["extract_tv"]
    if ya.tolist() != yb.tolist():
        raise RuntimeError("the two pipelines give different labels or orders")
    cosine = (a * b).sum(dim=1).min().item()
    if cosine < 0.99:
        raise RuntimeError(f"the two pipelines give different features (min cosine {cosine:.4f})")
    return cosine


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers / threads")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--count", type=int, default=512, help="synthetic images")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="default docs/results/extract_<device>.json")
    args = parser.parse_args()
    args.cases = [c.strip() for c in args.only.split(",") if c.strip()]
    if set(args.cases) - set(CASES):
        parser.error(f"unknown cases; choose from {', '.join(CASES)}")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    data = ensure_synthetic_set(args.count, seed=0)
    root = Path(data.root)
    n_classes = len([p for p in root.iterdir() if p.is_dir()])
    sizes = [os.path.getsize(p) for p in root.rglob("*.jpg")]
    print(
        f"data: {len(sizes)} JPEGs in {root}, mean {sum(sizes) / len(sizes) / 1e3:.1f} KB; "
        f"{args.workers} workers/threads, batch {args.batch_size}, {args.size} px, {device}, "
        f"torch threads {torch.get_num_threads()}"
    )
    torch.manual_seed(0)
    model = vit_tiny(patch_size=16).to(device).eval()
    outputs: dict = {}
    for case in args.cases:  # warm-up: worker start-up, page cache, kernels
        run_case(case, root, model, args, device, n_classes, outputs)
    rates: dict[str, list[float]] = {case: [] for case in args.cases}
    for r in range(args.repeats):
        print(f"round {r + 1}/{args.repeats}", flush=True)
        for case in args.cases:
            rates[case].append(run_case(case, root, model, args, device, n_classes, outputs))
            print(f"  {case}: {rates[case][-1]:.1f} images/s", flush=True)
    cosine = check_same_features(outputs)

    median = {case: statistics.median(v) for case, v in rates.items()}
    rows = []
    for case in args.cases:
        base = median.get(case.replace("native", "tv"))
        ratio = f"{median[case] / base:.2f}x" if base else "n/a"
        rows.append([LABELS[case], median[case], min(rates[case]), max(rates[case]), ratio])
    columns = ["case", "images/s", "min", "max", "vs torchvision"]
    write_json(
        args.json or RESULTS_DIR / f"extract_{device_slug(device)}.json",
        {
            "bench": "extract",
            "device": device_slug(device),
            "machine": machine(),
            "build_info": dino_opt.build_info(),
            "data": {
                "source": str(root),
                "synthetic": True,
                "images": len(sizes),
                "mean_bytes": sum(sizes) / len(sizes),
                "classes": n_classes,
            },
            "workers": args.workers,
            "batch_size": args.batch_size,
            "image_size": args.size,
            "repeats": args.repeats,
            "model": "vit_tiny patch 16, random init, eval mode",
            "amp": "bf16" if device.type == "cuda" else "off",
            "min_feature_cosine_native_vs_torchvision": cosine,
            "results": [
                {"case": c, "label": LABELS[c], "rates": rates[c], "images_per_s": median[c]}
                for c in args.cases
            ],
            "table": {"columns": columns, "rows": rows},
        },
    )
    print_table(
        f"Evaluation feature extraction, {args.size} px centre crop, {args.workers} workers/"
        f"threads, batch {args.batch_size}, median of {args.repeats} passes over "
        f"{len(sizes)} images ({device})",
        columns,
        rows,
    )


if __name__ == "__main__":
    main()
