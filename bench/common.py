"""Shared benchmark helpers: timing (CUDA events on a GPU, a steady clock on
the CPU), bandwidth floors, the machine description, the printed table and
the JSON file every bench script writes."""

from __future__ import annotations

import ctypes
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from dino_opt.runtime import resolve_precision

RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "results"


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
        )
    return info


def device_slug(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).lower().replace("nvidia ", "").replace(" ", "-")
    return "cpu"


def time_ms(
    fn: Callable[[int], object], device: torch.device, *, warmup: int, repeats: int
) -> float:
    """Median time of ``fn(i)`` in milliseconds; ``i`` counts calls so that the
    caller can rotate through several input sets (cold caches). On a GPU each
    call is timed with CUDA events on the current stream."""
    for i in range(warmup):
        fn(i)
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(warmup + i)
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) for start, end in events]
    else:
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(warmup + i)
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def cpu_matmul_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """The matrix rate ``torch.mm`` reaches on this CPU at ``dtype`` (FLOP/s,
    best of ``repeats`` products of two n x n matrices, the default threads):
    the CPU's MFU denominator, measured in the same run as the steps."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


#: Dense bfloat16/float16 matrix rate by datasheet, TFLOP/s, by the device
#: name's model (SXM parts): the denominator of MFU (``--peak-tflops`` overrides).
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


def device_peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """The device's dense 16-bit matrix rate in FLOP/s (None: not known); on
    the CPU, :func:`cpu_matmul_rate` at the default step's dtype."""
    if override:
        return override * 1e12
    if device.type == "cpu":
        return cpu_matmul_rate(resolve_precision("auto", device) or torch.float32)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for model, t in PEAK_TFLOPS.items() if model in name), None)


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Measured memory bandwidth of a large copy, in GB/s of memory traffic:
    the roof that streaming kernels are compared with.

    A GPU copy moves 2 bytes per byte copied (read source, write destination).
    On a CPU, write-allocate caches first read each destination line for
    ownership, so a memcpy moves 3 bytes per byte copied; counting only 2
    would understate the roof by a third.
    """
    n = nbytes // 4
    src = torch.ones(n, device=device)
    dst = torch.zeros(n, device=device)
    ms = time_ms(lambda i: dst.copy_(src), device, warmup=3, repeats=20)
    traffic = (2 if device.type == "cuda" else 3) * nbytes
    return traffic / (ms * 1e-3) / 1e9


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in columns]] + [
        [f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    line = "-+-".join("-" * w for w in widths)
    print(f"\n{title}")
    print(" | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)))
    print(line)
    for r in cells[1:]:
        print(
            " | ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")


def pin_host_mmap_threshold() -> None:
    """Makes glibc mmap every block of 64 KiB or more and return it on free, so
    that the resident set size follows live CPU memory (by default glibc raises
    the threshold as blocks are freed and keeps them in its heap). Call it after
    the timings: it changes allocation costs."""
    M_MMAP_THRESHOLD = -3
    if ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 65536) != 1:
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_extra_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak memory that ``fn()`` allocates above what is live before it: the
    CUDA caching allocator's peak on a GPU; on the CPU the resident set's
    high-water mark (reset through /proc/self/clear_refs; see
    :func:`pin_host_mmap_threshold`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap pages would hide new allocations
    Path("/proc/self/clear_refs").write_text("5")
    base = _proc_status_kib("VmRSS")
    fn()
    return (_proc_status_kib("VmHWM") - base) * 1024


def closer_for_dataloader(gen, loader) -> Callable[[], None]:
    """A ``close()`` for a generator over a torch DataLoader: stops the
    generator and shuts the loader's workers down now (persistent workers
    would otherwise linger until garbage collection)."""

    def close() -> None:
        gen.close()
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    return close
