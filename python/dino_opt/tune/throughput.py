"""Throughput tuning: the batch size that trains fastest, a first guess of it,
and a data loader configured for the machine.

- :class:`ThroughputOptimizer` (course Module 5, Lesson 4) searches the batch
  size by timing *real DINO training steps* (student and teacher forward, the
  DINO loss, backward, optimizer step, EMA update: exactly
  :class:`~dino_opt.train.MemoryOptimizedDINOTrainer`'s step) on a copy of
  the model, survives out-of-memory errors, and reports a table of its
  trials. The lesson timed forward passes of the student only, with
  ``time.time()``, and took ``allocated / max_allocated`` for a memory
  fraction.
- :func:`dynamic_batch_size` (LoRA module 6) is a closed-form first guess of
  the batch size from the GPU's memory and the ViT's shape.
- :class:`OptimizedDataLoader` (LoRA module 6) picks workers, pinning and
  prefetch for this machine and returns our native multi-crop loader for an
  image folder, or a ``DataLoader`` for a map-style multi-crop dataset.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..config import Config, effective_lr
from ..data import DataLoadingOptimizer, MultiCropLoader
from ..models import eval_mode
from ..observe import MemoryTracker
from ..observe.memory import GB
from ..ops import DINOLoss
from ..ops.native import _C
from ..train import DINOModel, MemoryOptimizedDINOTrainer, build_optimizer, trainer_options

__all__ = [
    "USABLE_MEMORY_FRACTION",
    "OptimizedDataLoader",
    "ThroughputOptimizer",
    "dynamic_batch_size",
]


# ---------------------------------------------------------------- out of memory


def _is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: CUDA's ``OutOfMemoryError``, a ``RuntimeError``
    saying "out of memory" (cuBLAS/cuDNN, older torch) or the CPU allocator's
    "can't allocate memory", or Python's ``MemoryError``."""
    if isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return "out of memory" in text or "can't allocate memory" in text
    return False


def _short(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS (glibc), so that the next trial's
    RSS growth is its own and not hidden by memory the last one left cached."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


# ---------------------------------------------------------------- batches


def _crops_of(batch: Any) -> list[torch.Tensor]:
    """The list of crops of one loader batch: a :class:`~dino_opt.data.Batch`
    (``.crops``), a dict with ``"crops"`` (``multicrop_collate``), a
    ``(crops, labels)`` pair, or a list of crop tensors."""
    if hasattr(batch, "crops"):
        crops = batch.crops
    elif isinstance(batch, dict):
        if "crops" not in batch:
            raise ValueError(
                f"a batch dict needs a 'crops' entry (multicrop_collate), got keys {list(batch)}"
            )
        crops = batch["crops"]
    elif isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], (list, tuple)):
        crops = batch[0]
    else:
        crops = batch
    if not isinstance(crops, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in crops):
        raise ValueError(
            "find_optimal_batch_size needs batches of multi-crop tensors (a list of "
            f"[B, 3, H, W] crops, global crops first), got {type(crops).__name__}"
        )
    if len(crops) < 2:
        raise ValueError(f"a DINO batch needs at least 2 crops, got {len(crops)}")
    sizes = {c.shape[0] for c in crops}
    if len(sizes) != 1 or any(c.ndim != 4 for c in crops):
        raise ValueError(
            "every crop of a batch must be [B, 3, H, W] with the same B, got shapes "
            f"{[tuple(c.shape) for c in crops]} (loaders with group_by_resolution=True "
            "are not supported)"
        )
    return list(crops)


def _first_batch(dataloader: Iterable) -> list[torch.Tensor]:
    """The crops of the loader's first batch, copied, leaving a
    :class:`~dino_opt.data.MultiCropLoader` where it was (its next batch is
    still the one it would have given)."""
    state = dataloader.state_dict() if isinstance(dataloader, MultiCropLoader) else None
    it = iter(dataloader)
    try:
        batch = next(it)
    except StopIteration:
        raise ValueError("the dataloader gave no batch") from None
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
        if state is not None:
            dataloader.load_state_dict(state)
    # Copies: the native loader reuses its pinned batch buffers.
    return [c.detach().clone() for c in _crops_of(batch)]


def _repeat_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows of ``x``: its rows repeated cyclically, or its first ``n``."""
    reps = -(-n // x.shape[0])
    return x.repeat(reps, *([1] * (x.ndim - 1)))[:n] if reps > 1 else x[:n]


def _trainer_config(config) -> dict:
    """The trainer's dict from a dict or a :class:`~dino_opt.config.Config`
    (:func:`~dino_opt.train.trainer_options`, the keys the training job passes)."""
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, Config):
        return trainer_options(config)
    raise TypeError(f"config must be a dict, a dino_opt Config or None, got {type(config)}")


# ---------------------------------------------------------------- the batch-size search


def _check_int(name: str, value, minimum: int) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) of
    at least ``minimum`` (1: a positive int, or 0)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value!r}")


def _check_search(
    max_batch_size: int, min_batch_size: int, steps: int, warmup: int, fraction: float
) -> None:
    """The arguments of :meth:`ThroughputOptimizer.find_optimal_batch_size`:
    ValueError naming the first that is wrong."""
    for name, value in (
        ("max_batch_size", max_batch_size),
        ("min_batch_size", min_batch_size),
        ("steps", steps),
    ):
        _check_int(name, value, 1)
    _check_int("warmup", warmup, 0)
    if min_batch_size > max_batch_size:
        raise ValueError(
            f"min_batch_size ({min_batch_size}) must be <= max_batch_size ({max_batch_size})"
        )
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"target_memory_fraction must be in (0, 1], got {fraction!r}")


class ThroughputOptimizer:
    """Finds the batch size with the most images per second (the lesson's
    ``ThroughputOptimizer``), timing real DINO training steps.

    Args:
        model: a :class:`~dino_opt.train.DINOModel` (or any module with
            ``student`` and ``teacher``), or a student network alone, in which
            case the teacher is a frozen copy of it. It is never trained: each
            trial works on a fresh deep copy of it (moved to ``device``).
        device: where the trials run.
        loss_fn: a :class:`~dino_opt.ops.DINOLoss` whose ``ncrops`` matches
            the loader's crops (copied per trial, so its center is left
            alone); default a DINOLoss of the student's output size, teacher
            temperature 0.04.
        optimizer_factory: ``factory(student) -> optimizer``, called per trial
            on the copy's student; default the optimizer ``dino-opt train``
            builds (:func:`~dino_opt.train.build_optimizer` of ``config``
            when it is a Config, else of the default config: AdamW over
            DINO's parameter groups, fused on CUDA) at the config's peak
            learning rate and first weight decay.
        config: the trainer's config: a dict of
            :class:`~dino_opt.train.MemoryOptimizedDINOTrainer` keys
            (``precision``, ``use_amp``, ``gradient_checkpointing``,
            ``crop_batch_size``, ``gradient_clip``, ``n_global``), or a
            :class:`~dino_opt.config.Config` (its precision, crop batching
            and clipping; its activation checkpointing and compilation are
            the model's, from :func:`~dino_opt.train.build_models`). The
            trials always use ``accumulation_steps=1`` (the
            search is over the micro-batch) and ``freeze_last_layer=0`` (the
            steady-state step, which also updates the last layer).

    When ``model`` already lives on a CUDA ``device``, its weights count in
    every trial's memory besides the copy's (a training run holds them once),
    so the search errs on the safe side by one set of student and teacher
    weights; pass the model on the CPU for the exact figure.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        loss_fn: nn.Module | None = None,
        optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
        config: dict | Any | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(model, DINOModel):
            if hasattr(model, "student") and hasattr(model, "teacher"):
                model = DINOModel(model.student, model.teacher)
            else:
                teacher = copy.deepcopy(model).requires_grad_(False)
                model = DINOModel(model, teacher)
        self.model = model
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} requested but CUDA is not available")
        self.loss_fn = loss_fn
        self.optimizer_factory = optimizer_factory
        self.config = _trainer_config(config)
        self._run_config = config if isinstance(config, Config) else None
        self.optimal_batch_size: int | None = None  # the lesson's result
        self.trials: list[dict] = []
        self._sample: list[torch.Tensor] | None = None
        self._out_dim: int | None = None
        self._tracker: MemoryTracker | None = None

    # ------------------------------------------------------------ public
    def find_optimal_batch_size(
        self,
        dataloader: Iterable,
        max_batch_size: int = 512,
        target_memory_fraction: float = 0.9,
        min_batch_size: int = 1,
        steps: int = 3,
        warmup: int = 1,
    ) -> dict:
        """Searches the batch size (per device) with the most images per second
        among those that fit.

        The crops come from the loader's first batch, repeated (or cut) to
        each trial's size, so the loader's own batch size does not bound the
        search (a :class:`~dino_opt.data.MultiCropLoader` is left at the
        batch it would have given next). A trial builds a fresh copy of the
        model, loss and optimizer, runs ``warmup`` training steps, then times
        ``steps`` more (CUDA events on a GPU, ``perf_counter`` on the CPU)
        and keeps their median.

        A size *fits* when its steps ran without running out of memory and
        its peak memory is at most ``target_memory_fraction`` of the
        device's: on a GPU the caching allocator's peak reserved bytes over
        the device's total memory; on the CPU the growth of the process's
        peak RSS over the trial (which includes the copy of the model, its
        gradients and optimizer state) over the total RAM. An out-of-memory
        error (``torch.cuda.OutOfMemoryError``, a ``RuntimeError`` saying
        "out of memory") is caught, the trial's objects are freed
        (``gc.collect``, ``torch.cuda.empty_cache``, peak statistics reset),
        and the size counts as not fitting; any other error propagates.

        The search doubles from ``min_batch_size`` until a size does not fit
        or ``max_batch_size`` is reached (the last step is cut to
        ``max_batch_size``), then bisects between the last size that fit and
        the first that did not.

        Returns a dict: ``batch_size`` (the fitting size with the most images
        per second; also ``self.optimal_batch_size``), ``images_per_second``
        (its throughput), ``largest_fitting_batch_size``, ``trials`` (one row
        per trial in the order run: ``batch_size``, ``fits``,
        ``images_per_second``, ``peak_memory_gb``, ``memory_fraction``,
        ``error``; also ``self.trials``), ``device``, ``memory_total_gb`` and
        ``target_memory_fraction``. Raises ``RuntimeError`` when not even
        ``min_batch_size`` fits.
        """
        _check_search(max_batch_size, min_batch_size, steps, warmup, target_memory_fraction)
        self._sample = _first_batch(dataloader)
        self._check_loss(len(self._sample))
        self._tracker = MemoryTracker(self.device)
        self.trials = []
        total = self._total_memory_bytes()
        self._release()  # each trial releases what it built on its way out
        try:
            self._search(min_batch_size, max_batch_size, target_memory_fraction, steps, warmup)
        finally:
            self._sample = None
            self._tracker = None
        fitting = [t for t in self.trials if t["fits"]]
        if not fitting:
            first = self.trials[0]
            why = first["error"] or (
                f"peak memory {first['peak_memory_gb']:.3f} GiB is "
                f"{first['memory_fraction']:.3f} of the device's, above "
                f"target_memory_fraction={target_memory_fraction}"
            )
            raise RuntimeError(
                f"find_optimal_batch_size: min_batch_size={min_batch_size} does not fit on "
                f"{self.device}: {why}"
            )
        best = max(fitting, key=lambda t: t["images_per_second"])
        self.optimal_batch_size = best["batch_size"]
        return {
            "batch_size": best["batch_size"],
            "images_per_second": best["images_per_second"],
            "largest_fitting_batch_size": max(t["batch_size"] for t in fitting),
            "trials": [dict(t) for t in self.trials],
            "device": str(self.device),
            "memory_total_gb": total / GB,
            "target_memory_fraction": target_memory_fraction,
        }

    # ------------------------------------------------------------ search
    def _search(self, lo_size: int, hi_size: int, target: float, steps: int, warmup: int) -> None:
        def fits(size: int) -> bool:
            row = self._trial(size, target, steps, warmup)
            self.trials.append(row)
            return row["fits"]

        good, bad = None, None
        size = lo_size
        while True:
            if not fits(size):
                bad = size
                break
            good = size
            if size >= hi_size:
                break
            size = min(2 * size, hi_size)
        if good is None or bad is None:
            return
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid

    def _trial(self, batch_size: int, target: float, steps: int, warmup: int) -> dict:
        """One row of the table. Everything the trial built is released
        before returning, also after an out-of-memory error."""
        row = {
            "batch_size": batch_size,
            "fits": False,
            "images_per_second": None,
            "peak_memory_gb": None,
            "memory_fraction": None,
            "error": None,
        }
        try:
            seconds, peak_bytes = self._measure(batch_size, steps, warmup)
        except Exception as e:
            if not _is_out_of_memory(e):
                raise
            # Only text is kept: the exception's traceback holds the trial's frames.
            row["error"] = _short(e)
        else:
            fraction = peak_bytes / self._total_memory_bytes()
            row.update(
                images_per_second=batch_size / seconds if seconds > 0 else math.inf,
                peak_memory_gb=peak_bytes / GB,
                memory_fraction=fraction,
                fits=fraction <= target,
            )
        finally:
            self._release()
        return row

    def _measure(self, batch_size: int, steps: int, warmup: int) -> tuple[float, int]:
        """Median seconds of one training step at ``batch_size``, and the
        trial's peak memory in bytes (see find_optimal_batch_size)."""
        tracker = self._tracker
        rss_before = 0
        if self.device.type != "cuda":
            rss_before = int(tracker.get_memory_stats()["host_rss_gb"] * GB)
        tracker.start_step()
        trainer = self._make_trainer()
        crops = self._create_test_batch(batch_size)
        for _ in range(warmup):
            self._train_step(trainer, crops)
        if self.device.type == "cuda":
            events = []
            for _ in range(steps):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                self._train_step(trainer, crops)
                end.record()
                events.append((start, end))
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) / 1e3 for s, e in events]
        else:
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                self._train_step(trainer, crops)
                times.append(time.perf_counter() - t0)
        peaks = tracker.end_step()
        if self.device.type == "cuda":
            peak = int(peaks["device_peak_reserved"])
        else:
            peak = max(0, int(peaks["host_peak_rss"]) - rss_before)
        return statistics.median(times), peak

    def _train_step(self, trainer, crops: Sequence[torch.Tensor]) -> None:
        """One DINO training step, as ``run_training`` runs it."""
        trainer.train_step_optimized(crops, 0)
        trainer.optimize_step()

    def _make_trainer(self):
        """A trainer over fresh copies of the model, loss and optimizer."""
        model = copy.deepcopy(self.model).to(self.device)
        model.teacher_step = 0
        if self.loss_fn is not None:
            loss_fn = copy.deepcopy(self.loss_fn).to(self.device)
        else:
            loss_fn = DINOLoss(self._output_dim(), len(self._sample), 0.04, 0.04, 0, 1)
            loss_fn = loss_fn.to(self.device)
        if self.optimizer_factory is not None:
            optimizer = self.optimizer_factory(model.student)
        else:  # the run's optimizer at its peak learning rate and first weight decay
            cfg = self._run_config or Config()
            optimizer = build_optimizer(
                cfg,
                model.student,
                self.device,
                lr=effective_lr(cfg),
                weight_decay=cfg.optim.weight_decay,
            )
        config = {**self.config, "accumulation_steps": 1, "freeze_last_layer": 0}
        return MemoryOptimizedDINOTrainer(model, loss_fn, optimizer, config, self.device)

    def _create_test_batch(self, batch_size: int) -> list[torch.Tensor]:
        """The sample crops with ``batch_size`` rows each, on the device."""
        return [_repeat_rows(c, batch_size).to(self.device) for c in self._sample]

    def _output_dim(self) -> int:
        """The student's output size, from one image through it (eval mode,
        no gradient: nothing of the model changes; its modes are restored)."""
        if self._out_dim is None:
            student = self.model.student
            param = next(student.parameters(), None)
            where = param.device if param is not None else torch.device("cpu")
            with eval_mode(student), torch.no_grad():
                out = student([self._sample[0][:1].to(where)])
            self._out_dim = int(out.shape[-1])
        return self._out_dim

    def _check_loss(self, n_crops: int) -> None:
        ncrops = getattr(self.loss_fn, "ncrops", None)
        if ncrops is not None and ncrops != n_crops:
            raise ValueError(
                f"loss_fn.ncrops is {ncrops} but the dataloader's batches have {n_crops} crops"
            )

    def _total_memory_bytes(self) -> int:
        """The device's memory: the GPU's total, or the host's RAM on the CPU."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[1]
        tracker = self._tracker or MemoryTracker("cpu")
        return int(tracker.get_memory_stats()["system_memory_total_gb"] * GB)

    def _release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _malloc_trim()


# ---------------------------------------------------------------- first guess

# Activation values kept for backward per token, per embedding channel, per
# transformer block of a ViT with MLP ratio 4, fused (SDPA) attention and no
# dropout: Korthikanti et al. 2022 ("Reducing Activation Recomputation in
# Large Transformer Models") count 34 bytes per token-channel at 16 bits with
# dropout masks and 5·heads·tokens/dim more for an unfused attention matrix;
# without either about 16 values remain (LayerNorm inputs, QKV, attention
# output, projection input, MLP input, 4x hidden before and after GELU).
_ACTIVATION_VALUES = 16
# Bytes per parameter held in training: the student's float32 weights,
# gradients and AdamW's two moments (16) and the teacher's weights (4).
_BYTES_PER_PARAMETER = 20
_CONTEXT_BYTES = 0.5 * GB  # CUDA context and workspace
#: The share of a GPU's memory a step's estimated peak may take: the rest for
#: the CUDA context and the caching allocator's fragmentation.
USABLE_MEMORY_FRACTION = 0.9
# DINO's head: hidden 2048, bottleneck 256, 65536 prototypes.
_HEAD_HIDDEN, _HEAD_BOTTLENECK, _HEAD_OUT = 2048, 256, 65536


def _round_batch(n: int) -> int:
    """1, 2 or 4 below 8 (the largest power of two <= n), else n rounded
    down to a multiple of 8; at least 1."""
    if n < 8:
        return 1 << (max(1, n).bit_length() - 1)
    return n - n % 8


def dynamic_batch_size(
    gpu_memory_gb: float,
    resolution: int,
    network_dim: int,
    *,
    patch_size: int = 16,
    depth: int = 12,
    n_local: int = 8,
    local_resolution: int = 96,
    bytes_per_value: int = 2,
) -> int:
    """A first guess of the DINO batch size per GPU (the LoRA module's
    ``dynamic_batch_size(gpu_memory_gb, resolution, network_dim)``, with a
    ViT memory model instead of the lesson's Stable-Diffusion constants).

    ``resolution`` is the global crop's side, ``network_dim`` the ViT's
    embedding dimension (384 for ViT-S, 768 for ViT-B); ``bytes_per_value``
    2 for bf16/fp16 autocast, 4 for float32. The estimate::

        tokens(r)  = (r // patch_size)**2 + 1                    # patches + CLS
        per_image  = depth * network_dim * bytes_per_value * 16
                     * (2 * tokens(resolution) + n_local * tokens(local_resolution))
        params     = 12 * depth * network_dim**2                 # ViT blocks
                     + 3 * patch_size**2 * network_dim           # patch embedding
                     + DINO head (network_dim->2048->2048->256->65536)
        fixed      = 20 * params + 0.5 GiB                       # student weights, grads,
                                                                 # AdamW moments (16 B),
                                                                 # teacher (4 B); CUDA context
        batch      = floor((0.9 * gpu_memory_gb GiB - fixed) / per_image)

    16 is the activation values a ViT block keeps per token and channel for
    backward with fused attention and no dropout (after Korthikanti et al.
    2022). Only the student's activations count: the teacher runs the two
    global crops under ``no_grad``. The result is rounded down to a multiple
    of 8 when it is at least 8, else to a power of two (1, 2 or 4), and is
    never below 1. It is a first guess: measure with
    :meth:`ThroughputOptimizer.find_optimal_batch_size`.
    """
    for name, value in (
        ("resolution", resolution),
        ("network_dim", network_dim),
        ("patch_size", patch_size),
        ("depth", depth),
        ("local_resolution", local_resolution),
        ("bytes_per_value", bytes_per_value),
    ):
        _check_int(name, value, 1)
    _check_int("n_local", n_local, 0)
    if not gpu_memory_gb > 0:
        raise ValueError(f"gpu_memory_gb must be > 0, got {gpu_memory_gb!r}")
    for name, side in (("resolution", resolution), ("local_resolution", local_resolution)):
        if side < patch_size:
            raise ValueError(f"{name} ({side}) is smaller than patch_size ({patch_size})")

    def tokens(side: int) -> int:
        return (side // patch_size) ** 2 + 1

    dim = network_dim
    per_image = (
        depth
        * dim
        * bytes_per_value
        * _ACTIVATION_VALUES
        * (2 * tokens(resolution) + n_local * tokens(local_resolution))
    )
    head = dim * _HEAD_HIDDEN + _HEAD_HIDDEN**2 + _HEAD_HIDDEN * _HEAD_BOTTLENECK
    head += _HEAD_BOTTLENECK * _HEAD_OUT
    params = 12 * depth * dim**2 + 3 * patch_size**2 * dim + head
    fixed = _BYTES_PER_PARAMETER * params + _CONTEXT_BYTES
    available = USABLE_MEMORY_FRACTION * gpu_memory_gb * GB - fixed
    return _round_batch(int(available // per_image) if available > 0 else 1)


# ---------------------------------------------------------------- data loading


def _is_image_source(dataset: Any) -> bool:
    """A folder (str or path), or a list of image file paths."""
    if isinstance(dataset, (str, os.PathLike)):
        return True
    return (
        isinstance(dataset, (list, tuple))
        and len(dataset) > 0
        and all(isinstance(p, (str, os.PathLike)) for p in dataset)
    )


class OptimizedDataLoader:
    """A multi-crop loader with settings chosen for this machine (the LoRA
    module's ``OptimizedDataLoader``).

    :meth:`create` returns, for

    - a folder (an ImageFolder root, or a folder of images; a ``str`` or a
      path) or a list of image paths: our native
      :class:`~dino_opt.data.MultiCropLoader` (``num_workers`` decoding
      threads, ``prefetch_factor`` batches prepared ahead, batches pinned);
      further keywords (``global_size``, ``local_size``, ``n_local``,
      ``seed``, ...) go to it;
    - a map-style multi-crop dataset (samples ``{"crops": [...]}``, e.g.
      :class:`~dino_opt.data.MultiCropDataset`):
      ``DataLoadingOptimizer.create_optimized_dataloader`` (a shuffled
      ``DataLoader`` with ``multicrop_collate``, persistent workers,
      ``prefetch_factor`` batches per worker, last partial batch dropped).

    Settings left ``None`` are chosen by :meth:`auto_settings`: workers the
    cores this process may use, at most 8; pinned memory only when CUDA is
    available (a ``True`` without CUDA is dropped as well); prefetch 2
    batches per worker for a ``DataLoader`` and 4 batches for the native
    loader (its default: its threads fill whole batches together). For the
    native loader ``num_workers=0`` means one thread.

    The lesson's form also works: ``OptimizedDataLoader(dataset, batch_size)``
    holds the loader in ``.loader`` and iterates it; ``prefetch_to_gpu``
    moves a batch to the GPU without blocking.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        **loader_kwargs: Any,
    ):
        self.loader = self.create(
            dataset, batch_size, num_workers, pin_memory, prefetch_factor, **loader_kwargs
        )

    def __iter__(self):
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    @staticmethod
    def auto_settings(
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        native: bool = False,
    ) -> dict:
        """The settings :meth:`create` uses: ``num_workers``, ``pin_memory``
        and ``prefetch_factor``, each the given value or its automatic choice
        (``native``: for the native loader)."""
        if num_workers is None:
            num_workers = min(8, max(1, _C.available_cores()))
        elif isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if prefetch_factor is None:
            prefetch_factor = 4 if native else 2
        elif (
            isinstance(prefetch_factor, bool)
            or not isinstance(prefetch_factor, int)
            or prefetch_factor < 1
        ):
            raise ValueError(f"prefetch_factor must be a positive int, got {prefetch_factor!r}")
        cuda = torch.cuda.is_available()
        pin = cuda if pin_memory is None else bool(pin_memory) and cuda
        return {"num_workers": num_workers, "pin_memory": pin, "prefetch_factor": prefetch_factor}

    @classmethod
    def create(
        cls,
        dataset: Any,
        batch_size: int,
        num_workers: int | None = None,
        pin_memory: bool | None = None,
        prefetch_factor: int | None = None,
        **loader_kwargs: Any,
    ):
        """The loader for ``dataset`` (see the class docstring)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if _is_image_source(dataset):
            s = cls.auto_settings(num_workers, pin_memory, prefetch_factor, native=True)
            return MultiCropLoader(
                dataset,
                batch_size,
                num_threads=max(1, s["num_workers"]),
                prefetch=s["prefetch_factor"],
                pin_memory=s["pin_memory"],
                **loader_kwargs,
            )
        if isinstance(dataset, torch.utils.data.IterableDataset) or not (
            hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
        ):
            raise TypeError(
                "OptimizedDataLoader.create needs a folder, a list of image paths or a "
                f"map-style multi-crop dataset, got {type(dataset).__name__}"
            )
        if loader_kwargs:
            raise TypeError(
                f"{sorted(loader_kwargs)} apply to the native loader (a folder) only; a "
                "dataset makes its own crops"
            )
        s = cls.auto_settings(num_workers, pin_memory, prefetch_factor)
        return DataLoadingOptimizer.create_optimized_dataloader(
            dataset,
            batch_size,
            num_workers=s["num_workers"],
            pin_memory=s["pin_memory"],
            prefetch_factor=s["prefetch_factor"],
        )

    @staticmethod
    def prefetch_to_gpu(batch: Any, device: torch.device | str | None = None) -> Any:
        """``batch`` (tensors in a Batch, dict, list or tuple) on ``device``
        (default CUDA when available, else the CPU), copied without blocking
        (asynchronous when the batch is pinned)."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)

        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple (Batch)
                moved = type(x)(*(move(v) for v in x))
                if getattr(x, "masks", None) is not None:  # Batch.masks, outside the tuple
                    moved.masks = move(x.masks)
                return moved
            if isinstance(x, (list, tuple)):
                return type(x)(move(v) for v in x)
            return x

        return move(batch)
