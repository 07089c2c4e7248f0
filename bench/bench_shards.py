"""Data at scale: the native loader reading tar shards vs the same images as
files, the start-up time and index memory per image for millions of images,
and each rank's I/O pattern.

    python bench/bench_shards.py [--workers 2] [--count 2000] [--repeats 3]
        [--scale 1000000,14000000] [--json PATH]

1. Throughput: the synthetic ImageNet-like set of bench_loader.py (cached
   under build/bench-data), and the same JPEG bytes written into tar shards
   by `write_shards` (no re-encoding); the two loaders take the same crops
   (2 x 224^2 + 8 x 96^2), threads, batch size and seeds, and run round by
   round (bench_loader.py's windows: a fresh loader, warm-up batches, then
   the rest of the first epoch, timed; every batch checked), and the CPU
   time the process spent per image (all threads, warm-up included), which
   another job on the machine disturbs less than the wall time. The page
   cache holds both after the first round: this compares the loaders' own
   costs, not the disk's.
2. Start-up and index memory: shards of --entries-per-shard images whose
   index files are synthesised (the shard files are sparse, of the size and
   mtime the index records) for each --scale total; a fresh process opens
   them, builds the loader and computes its first epoch's order (start-up),
   and reports its resident memory growth and the sample table's bytes per
   image. Beside it: a file list of as many paths, and a list of paths in
   Python (what the ImageFolder path holds). Also the one-time cost of
   indexing real shards (--index-count tiny images).
3. I/O: each rank of --world ranks reads one epoch of the bench shards;
   the reads, bytes, mean read size and the share of sequential reads,
   beside reading the files.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_loader import GLOBAL_SIZE, LOCAL_SIZE, N_LOCAL, ours_stream, run_window  # noqa: E402
from common import RESULTS_DIR, machine, print_table, write_json  # noqa: E402
from dino_opt import _C  # noqa: E402
from dino_opt.data import MultiCropLoader, open_source, write_shards  # noqa: E402
from synthetic_images import DEFAULT_ROOT, ensure_synthetic_set  # noqa: E402


def bench_shards_of(ds, shard_mb: float) -> Path:
    """The synthetic set's images in tar shards (cached beside it)."""
    out = DEFAULT_ROOT / f"{ds.root.name}-shards-{shard_mb:g}mb"
    done = out / "done.json"
    if done.is_file() and json.loads(done.read_text()).get("images") == len(ds.samples):
        return out
    r = write_shards(ds.root, out, shard_size_mb=shard_mb, overwrite=True, progress=False)
    done.write_text(json.dumps({"images": r["written"], "shards": len(r["shards"])}))
    return out


def throughput(args, files: Path, shards: Path) -> dict:
    device = torch.device("cpu")
    makers = {
        "files": lambda seed: ours_stream(files, args, seed, "cpu", device),
        "shards": lambda seed: ours_stream(shards, args, seed, "cpu", device),
    }
    rates: dict[str, list[float]] = {k: [] for k in makers}
    warmups: dict[str, list[float]] = {k: [] for k in makers}
    stats = {}
    cpu: dict[str, list[float]] = {k: [] for k in makers}
    for r in range(args.repeats):
        for case, make in makers.items():
            t0 = time.process_time()  # CPU seconds of every thread of this process
            w = run_window(make, args, args.seed + r, device, n_classes=10)
            images = args.images + args.warmup * args.batch_size
            cpu[case].append((time.process_time() - t0) / images * 1e3)
            rates[case].append(w["rate"])
            warmups[case].append(w["warmup_s"])
            stats[case] = w["stats"]
            print(f"  round {r + 1} {case}: {w['rate']:.1f} images/s", flush=True)
    return {
        c: {
            "rates": v,
            "images_per_s": statistics.median(v),
            "stats": stats[c],
            "first_batches_s": statistics.median(warmups[c]),
            "cpu_ms_per_image": statistics.median(cpu[c]),
            "cpu_ms": cpu[c],
        }
        for c, v in rates.items()
    }


# ---------------------------------------------------------------- start-up


def synthesise_index(folder: Path, total: int, per_shard: int) -> dict:
    """Sparse shards and their index files for `total` images of ~10 KB."""
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n_shards = (total + per_shard - 1) // per_shard
    member = 10_240 + 1_536  # image data, its header, a .cls member
    for s in range(n_shards):
        count = min(per_shard, total - s * per_shard)
        path = folder / f"shard-{s:06d}.tar"
        size = count * member + 1024
        with open(path, "wb") as f:
            f.truncate(size)
        os.utime(path, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        st = path.stat()
        offsets = [k * member + 512 for k in range(count)]
        _C.write_shard_index(
            str(path) + ".idx",
            size,
            st.st_mtime_ns,
            offsets,
            [10_240] * count,
            [(s * per_shard + k) % 1000 for k in range(count)],
            [f"{s * per_shard + k:09d}.jpg" for k in range(count)],
        )
    return {"shards": n_shards, "seconds": time.perf_counter() - t0}


_PROBE = r"""
import gc, json, os, sys, time
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
import torch
from dino_opt.data import MultiCropLoader, open_source
kind, spec, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
gc.collect(); before = rss(); t0 = time.perf_counter()
if kind == "pylist":
    spec = [f"/data/imagenet/train/n{i // 1300:08d}/n{i // 1300:08d}_{i:06d}.JPEG"
            for i in range(n)]
loader = MultiCropLoader(open_source(spec), 64, num_threads=1, rank=0, world_size=8)
order = loader.epoch_indices(0)
seconds = time.perf_counter() - t0
gc.collect()
print(json.dumps({"seconds": seconds, "rss_bytes": rss() - before, "images": loader.num_samples,
                  "table_bytes": loader.source.native.table_bytes, "order_len": len(order)}))
"""


def probe(kind: str, spec: str, n: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, kind, spec, str(n)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def startup(args, workdir: Path) -> list[dict]:
    rows = []
    for total in args.scale:
        folder = workdir / f"index-{total}"
        made = synthesise_index(folder, total, args.entries_per_shard)
        print(
            f"  synthesised {made['shards']} shards' indexes for {total} images "
            f"in {made['seconds']:.1f} s",
            flush=True,
        )
        run = probe("shards", str(folder), total)
        rows.append(
            {
                "case": "shards, from their index files",
                "images": total,
                "shards": made["shards"],
                "run": run,
            }
        )
        listing = workdir / f"list-{total}.txt"
        with open(listing, "w") as f:
            for i in range(total):
                f.write(f"n{i // 1300:08d}/n{i // 1300:08d}_{i:06d}.JPEG {i // 1300}\n")
        rows.append(
            {"case": "file list (.txt)", "images": total, "run": probe("list", str(listing), total)}
        )
        if total <= 2_000_000:  # the Python list of paths: 14 M would hold gigabytes
            rows.append(
                {
                    "case": "paths in a Python list (the list included)",
                    "images": total,
                    "run": probe("pylist", "", total),
                }
            )
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
        listing.unlink()
    return rows


def index_build(args, workdir: Path) -> dict:
    """The one-time scan: real shards of tiny JPEGs, indexed from scratch."""
    from PIL import Image

    tiny = workdir / "tiny"
    (tiny / "a").mkdir(parents=True)
    Image.new("RGB", (8, 8), (90, 20, 200)).save(tiny / "a" / "x.jpg", quality=90)
    data = (tiny / "a" / "x.jpg").read_bytes()
    import io
    import tarfile

    shards = workdir / "tiny-shards"
    shards.mkdir()
    per = args.entries_per_shard
    for s in range((args.index_count + per - 1) // per):
        with tarfile.open(shards / f"s-{s:05d}.tar", "w") as t:
            for k in range(min(per, args.index_count - s * per)):
                for name, payload in (
                    (f"{s * per + k:09d}.jpg", data),
                    (f"{s * per + k:09d}.cls", b"0"),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    t.addfile(info, io.BytesIO(payload))
    t0 = time.perf_counter()
    source = open_source(shards)
    built = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = open_source(shards)
    loaded = time.perf_counter() - t0
    assert len(source) == len(again) == args.index_count
    return {
        "images": args.index_count,
        "shards": source.native.num_shards,
        "build_seconds": built,
        "load_seconds": loaded,
        "report": source.native.index_report()["built"],
    }


# ---------------------------------------------------------------- I/O


def io_pattern(args, files: Path, shards: Path) -> list[dict]:
    rows = []
    for case, spec in (("files", files), ("shards", shards)):
        for rank in range(args.world):
            with MultiCropLoader(
                str(spec),
                args.batch_size,
                global_size=GLOBAL_SIZE,
                local_size=LOCAL_SIZE,
                n_local=N_LOCAL,
                num_threads=args.workers,
                rank=rank,
                world_size=args.world,
            ) as loader:
                n = sum(b.labels.numel() for b in loader)
                io = loader.stats()["io"]
            rows.append(
                {
                    "case": case,
                    "rank": rank,
                    "images": n,
                    **io,
                    "mean_read_kb": io["bytes"] / max(io["reads"], 1) / 1e3,
                    "sequential_share": io["sequential"] / max(io["reads"], 1),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="loader threads (default 2)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--count", type=int, default=2000, help="synthetic images")
    parser.add_argument("--shard-mb", type=float, default=32.0, help="MB per bench shard")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--images", type=int, help="images per timed window (default: the first epoch's rest)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scale", default="1000000,14000000", help="images for the start-up rows")
    parser.add_argument("--entries-per-shard", type=int, default=1000)
    parser.add_argument("--index-count", type=int, default=100_000, help="tiny images to index")
    parser.add_argument("--world", type=int, default=2, help="ranks for the I/O rows")
    parser.add_argument("--skip", default="", help="comma-separated: throughput,startup,index,io")
    parser.add_argument("--json", type=Path, default=RESULTS_DIR / "loader_shards_cpu.json")
    parser.add_argument("--report", action="store_true", help="print the tables of --json only")
    args = parser.parse_args()
    if args.report:
        report(json.loads(args.json.read_text()))
        return
    args.scale = [int(v) for v in args.scale.split(",") if v]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    ds = ensure_synthetic_set(args.count)
    shards = bench_shards_of(ds, args.shard_mb)
    # The timed window stays inside the first epoch (after the warm-up batches),
    # so both cases are measured in their steady state.
    per_epoch = len(ds.samples) // args.batch_size * args.batch_size
    args.images = args.images or per_epoch - args.warmup * args.batch_size
    result = {
        "bench": "loader_shards",
        "machine": machine(),
        "workers": args.workers,
        "batch_size": args.batch_size,
        "images": len(ds.samples),
        "mean_bytes": ds.mean_bytes,
        "shard_mb": args.shard_mb,
        "crops": {"global": [2, GLOBAL_SIZE], "local": [N_LOCAL, LOCAL_SIZE]},
    }
    if "throughput" not in skip:
        print("throughput", flush=True)
        result["throughput"] = throughput(args, ds.root, shards)
    with tempfile.TemporaryDirectory(dir=DEFAULT_ROOT) as tmp:
        if "index" not in skip:
            print("index build", flush=True)
            result["index_build"] = index_build(args, Path(tmp))
        if "startup" not in skip:
            print("start-up", flush=True)
            result["startup"] = startup(args, Path(tmp))
    if "io" not in skip:
        print("I/O", flush=True)
        result["io"] = io_pattern(args, ds.root, shards)
    if skip and args.json.is_file():  # keep the sections not measured this time
        result = {**json.loads(args.json.read_text()), **result}
    write_json(args.json, result)
    report(result)


def report(r: dict) -> None:
    if "throughput" in r:
        t = r["throughput"]
        files = t["files"]["images_per_s"]
        rounds = len(t["files"]["rates"])
        print_table(
            f"images/s, {r['workers']} threads, batch {r['batch_size']}, {r['images']} JPEGs "
            f"(mean {r['mean_bytes'] / 1e3:.1f} KB), same crops; median of {rounds}",
            ["source", "images/s", "vs files", "CPU ms/image", "first 3 batches s"],
            [
                [
                    c,
                    v["images_per_s"],
                    v["images_per_s"] / files,
                    v["cpu_ms_per_image"],
                    v["first_batches_s"],
                ]
                for c, v in t.items()
            ],
        )
    if "startup" in r:
        rows = []
        for s in r["startup"]:
            m, n = s["run"], s["images"]
            rows.append([s["case"], n, m["seconds"], m["rss_bytes"] / n, m["table_bytes"] / n])
        print_table(
            "start-up (open, loader, first epoch's order; rank 0 of 8)",
            ["case", "images", "seconds", "RSS bytes/image", "table bytes/image"],
            rows,
        )
    if "index_build" in r:
        b = r["index_build"]
        print_table(
            "indexing real shards once",
            ["images", "shards", "build s", "load s"],
            [[b["images"], b["shards"], b["build_seconds"], b["load_seconds"]]],
        )
    if "io" in r:
        columns = ["source", "rank", "images", "reads", "MB", "mean read KB", "sequential", "opens"]
        rows = [
            [
                x["case"],
                x["rank"],
                x["images"],
                x["reads"],
                x["bytes"] / 1e6,
                x["mean_read_kb"],
                x["sequential_share"],
                x["opens"],
            ]
            for x in r["io"]
        ]
        print_table("I/O per rank, one epoch", columns, rows)


if __name__ == "__main__":
    main()
