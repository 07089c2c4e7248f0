"""The device a run trains on and its autocast precision."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["computes_bf16", "cpu_computes_bf16", "resolve_device", "resolve_precision"]

#: /proc/cpuinfo flags of x86 CPUs whose vector units compute bfloat16 dot
#: products (Zen 4 and later, Cooper Lake and later; AMX on Sapphire Rapids
#: and later): oneDNN runs bfloat16 matrix products natively on them.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def resolve_device(name: str) -> torch.device:
    """'auto' is the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"hardware.device={name} but CUDA is not available")
    return device


@functools.cache
def cpu_computes_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 matrix products natively (one of
    :data:`BF16_CPU_FLAGS` in the flags Linux reports). Elsewhere bfloat16
    is emulated and far slower than float32 (about 100x for a matrix product
    on an AVX2-only EPYC); False where the flags cannot be read."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return any(f in flags for f in BF16_CPU_FLAGS)
    return False


def computes_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 natively: a GPU that supports it,
    or a CPU with :func:`cpu_computes_bf16`."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_computes_bf16()


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` ('auto', 'bf16', 'fp16', 'fp32'),
    None for float32. 'auto' is bfloat16 on a GPU that supports it and on a
    CPU that computes it natively (:func:`cpu_computes_bf16`), float32
    elsewhere; the losses and the EMA stay in float32 either way."""
    if precision == "auto":
        return torch.bfloat16 if computes_bf16(device) else None
    choices = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
    if precision not in choices:
        raise ValueError(f"precision must be one of auto, bf16, fp16, fp32, got {precision!r}")
    return choices[precision]


def with_index(dev: torch.device) -> torch.device:
    """A CUDA device with its index (the current device's where none is
    given): NCCL's process group is bound to one device and refuses
    ``cuda`` alone ("Please use a device_id with index")."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev
