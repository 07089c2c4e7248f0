"""The device a run trains on and its autocast precision."""

from __future__ import annotations

import torch

__all__ = ["resolve_device", "resolve_precision"]


def resolve_device(name: str) -> torch.device:
    """'auto' is the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"hardware.device={name} but CUDA is not available")
    return device


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` ('auto', 'bf16', 'fp16', 'fp32'),
    None for float32. 'auto' is bfloat16 on a GPU that supports it, float32
    elsewhere (bfloat16 autocast on a CPU is slower than float32 for most models)."""
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
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
