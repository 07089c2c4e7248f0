"""What a checkpoint holds besides tensors: every RNG's state (Python, NumPy,
torch CPU and CUDA) and the run's metadata (versions, git commit, host)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import random
import re
import socket
import subprocess
import sys
import warnings

import numpy as np
import torch

__all__ = ["capture_rng_state", "restore_rng_state", "run_metadata"]


# --------------------------------------------------------------------- RNG

_RNG_STATE_VERSION = 1


def _numpy_to_plain(obj):
    """NumPy's RNG state with arrays turned into lists (tagged with their
    dtype) so that torch.load(weights_only=True) accepts it."""
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": obj.dtype.str}
    if isinstance(obj, dict):
        return {k: _numpy_to_plain(v) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _plain_to_numpy(obj):
    if isinstance(obj, dict):
        if "__ndarray__" in obj:
            data = obj["__ndarray__"]
            if isinstance(data, torch.Tensor):
                data = data.tolist()
            return np.array(data, dtype=np.dtype(obj["dtype"]))
        return {k: _plain_to_numpy(v) for k, v in obj.items()}
    return obj


def capture_rng_state() -> dict:
    """The state of every RNG training draws from: Python ``random``, the
    NumPy global RNG, the torch CPU generator and, when CUDA is available,
    the generator of every CUDA device (``cuda``: a list, one ByteTensor per
    device; absent without CUDA). Holds only tensors, lists, tuples, dicts,
    ints, floats and strings, so it loads with ``torch.load(weights_only=True)``.
    """
    state = {
        "version": _RNG_STATE_VERSION,
        "python": random.getstate(),
        "numpy": _numpy_to_plain(np.random.get_state(legacy=False)),  # noqa: NPY002 (the global RNG)
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict, *, strict: bool = True) -> None:
    """Restore what :func:`capture_rng_state` returned.

    ``python``, ``numpy`` and ``torch`` must be present. CUDA: device ``i``
    gets saved state ``i``. When the state holds CUDA states for more devices
    than this process sees (including none, without CUDA), ``strict=True``
    (default) raises ValueError before anything is restored, because the
    random streams would silently differ from the saved run; ``strict=False``
    restores the devices present and warns. Devices beyond those saved keep
    their current state. A state without CUDA entries leaves CUDA untouched.
    """
    if not isinstance(state, dict):
        raise ValueError(f"RNG state must be a dict, got {type(state).__name__}")
    missing = [k for k in ("python", "numpy", "torch") if k not in state]
    if missing:
        raise ValueError(f"RNG state lacks {', '.join(missing)}")
    cuda_states = list(state.get("cuda") or [])
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda_states) > available:
        msg = (
            f"RNG state holds CUDA generator states for {len(cuda_states)} device(s), "
            f"but this process sees {available}"
        )
        if strict:
            raise ValueError(msg + " (pass strict=False to restore the devices present)")
        warnings.warn(msg + f"; restoring the first {available}", stacklevel=2)

    # Convert everything first, so a malformed state fails before any RNG changes.
    try:
        version, internal, gauss = state["python"]
        python_state = (int(version), tuple(int(x) for x in internal), gauss)
        numpy_state = _plain_to_numpy(state["numpy"])
        if not isinstance(numpy_state, (dict, tuple, list)):
            raise TypeError("numpy state is neither a dict nor a tuple")
        torch_state = torch.as_tensor(state["torch"]).cpu().to(torch.uint8)
        cuda = [torch.as_tensor(s).cpu().to(torch.uint8) for s in cuda_states[:available]]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"malformed RNG state: {e}") from e

    random.setstate(python_state)
    np.random.set_state(  # noqa: NPY002 (the global RNG is the legacy one)
        tuple(numpy_state) if isinstance(numpy_state, list) else numpy_state
    )
    torch.set_rng_state(torch_state)
    for i, s in enumerate(cuda):
        torch.cuda.set_rng_state(s, device=i)


# ---------------------------------------------------------------- metadata


def _git(args: list[str], cwd: str | os.PathLike, timeout: float) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):  # git missing, timeout
        return None
    return out.stdout if out.returncode == 0 else None


def _package_version() -> str | None:
    try:
        pkg = importlib.import_module(__package__ or "dino_opt")
        version = getattr(pkg, "__version__", None)
        if version is not None:
            return str(version)
    except ImportError:
        pass
    try:
        return importlib.metadata.version("dino_opt")
    except importlib.metadata.PackageNotFoundError:
        return None


def run_metadata(cwd: str | os.PathLike | None = None, *, git_timeout: float = 5.0) -> dict:
    """Where a checkpoint came from: ``dino_opt_version``, ``torch_version``,
    ``python_version``, ``hostname``, ``platform``, ``git_commit`` (HEAD of the
    git checkout holding ``cwd``, default the current directory; None outside
    a checkout, without git, or after ``git_timeout`` seconds) and
    ``git_dirty`` (tracked files modified; None when unknown)."""
    cwd = os.getcwd() if cwd is None else cwd
    head = _git(["rev-parse", "HEAD"], cwd, git_timeout)
    commit = (
        head.strip() if head and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", head.strip()) else None
    )
    dirty = None
    if commit is not None:
        status = _git(["status", "--porcelain", "--untracked-files=no"], cwd, git_timeout)
        dirty = None if status is None else bool(status.strip())
    return {
        "dino_opt_version": _package_version(),
        "torch_version": str(torch.__version__),  # a str subclass weights_only refuses
        "python_version": platform.python_version(),
        "hostname": socket.gethostname(),
        "platform": sys.platform,
        "git_commit": commit,
        "git_dirty": dirty,
    }
