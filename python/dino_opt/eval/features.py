"""Features of a frozen network over a labelled data set, for evaluation.

The evaluation transform (DINO's ``eval_knn.py``): the shorter side resized
to ``round(S * 256 / 224)`` with PIL's anti-aliased bicubic, the central
``S x S`` square, ImageNet normalisation; no flip, no colour change.
``EvalImageFolder`` runs it with PIL as a torch Dataset; ``EvalLoader`` runs
it on the native loader's C++ threads (the same resampler, one crop per
image, the data set in order, each DDP rank a shard without duplicates).
``extract_features`` maps a network over either and, under
``torch.distributed``, gives every rank the features of the whole data set.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

from ..data import DataSource, LoaderError, NativeLoaderHandle, open_source
from ..models import eval_mode
from ..ops.library import IMAGENET_MEAN, IMAGENET_STD
from ..ops.native import _C

__all__ = [
    "EvalImageFolder",
    "EvalLoader",
    "amp_dtype_of",
    "extract_features",
    "gather_rows",
    "shard_of",
]

_DEFAULT_MAX_PIXELS = 178_956_970  # Pillow's decompression-bomb limit, as the loader's


def _labels_of(source: DataSource, labelled: bool = True) -> torch.Tensor:
    labels = source.labels()
    if labelled and len(labels) and int(labels.min()) < 0:
        raise ValueError(
            f"{source.spec!r} has images without a label (no class folders, .cls members or "
            "label column); k-NN and linear evaluation need labelled data"
        )
    return labels


def _check_size(image_size: int) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")


def _class_names(source: DataSource, labels: torch.Tensor) -> list[str]:
    if source.classes:
        return list(source.classes)
    return [str(i) for i in range(int(labels.max()) + 1 if len(labels) else 0)]


# ---------------------------------------------------------------- PIL


class EvalImageFolder(torch.utils.data.Dataset):
    """Labelled images for evaluation: ``(image [3, S, S] float32, label)``.

    ``root`` is any data :func:`~dino_opt.data.open_source` opens (an
    ImageFolder tree, a file list with labels, tar shards with ``.cls``
    members, a Hugging Face data set with a label column) or a
    :class:`~dino_opt.data.DataSource`. Each image is decoded with PIL from
    its bytes, converted to RGB, resized (bicubic, anti-aliased) so that its
    shorter side is ``round(S * 256 / 224)``, centre-cropped to ``S x S`` and
    normalised with the ImageNet mean and std, the evaluation transform of
    DINO's k-NN. ``classes`` are the class names (the sorted class folders;
    ``"0"``, ``"1"``, ... for integer labels without names, up to the largest);
    ``named`` says which; ``targets`` the label of each image; ``samples``
    the ``(name, label)`` pairs (a file's path, ``shard: member``, ...).
    """

    def __init__(
        self,
        root: str | os.PathLike | DataSource,
        image_size: int = 224,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
    ) -> None:
        _check_size(image_size)
        self.source = open_source(root)
        labels = _labels_of(self.source)
        self.root = root if isinstance(root, DataSource) else Path(root)
        self.image_size = image_size
        self.resize_to = int(round(image_size * 256 / 224))
        self.named = bool(self.source.classes)
        self.classes = _class_names(self.source, labels)
        self.targets = labels.tolist()
        self._mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.targets)

    @property
    def samples(self) -> list[tuple[str, int]]:
        return [(self.source.describe(i), t) for i, t in enumerate(self.targets)]

    def load(self, image: str | os.PathLike | bytes) -> Image.Image:
        """The resized, centre-cropped RGB image (before normalisation) of a
        file or of encoded bytes."""
        opened = Image.open(io.BytesIO(image) if isinstance(image, bytes) else image)
        with opened as im:
            im = im.convert("RGB")
        w, h = im.size
        # Shorter side to resize_to, the longer one in proportion (truncated,
        # as torchvision's Resize(int) does).
        if w <= h:
            nw, nh = self.resize_to, int(self.resize_to * h / w)
        else:
            nw, nh = int(self.resize_to * w / h), self.resize_to
        im = im.resize((nw, nh), Image.Resampling.BICUBIC)  # PIL filters with antialias
        s = self.image_size
        left, top = int(round((nw - s) / 2.0)), int(round((nh - s) / 2.0))
        return im.crop((left, top, left + s, top + s))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data = self.source.read(index)  # its errors name the sample
        try:
            im = self.load(data)
        except (OSError, ValueError) as e:  # PIL's
            raise type(e)(f"cannot read image {self.source.describe(index)!r}: {e}") from e
        x = torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1)
        x = x.to(torch.float32).div_(255.0)
        return (x - self._mean) / self._std, self.targets[index]


# ---------------------------------------------------------------- native


class EvalLoader(NativeLoaderHandle):
    """The evaluation transform on the native loader's threads.

    ``source``: what :func:`~dino_opt.data.open_source` opens (folders, file
    lists, tar shards, Hugging Face data sets) or a
    :class:`~dino_opt.data.DataSource`; every image needs a label unless
    ``labelled`` is False. Each image
    is decoded (libjpeg-turbo; PNG and others through OpenCV), resized and
    centre-cropped in one pass of PIL's anti-aliased bicubic (the crop's box in
    the full image, filtered as resizing the whole image first does), and
    normalised, into ``[B, 3, S, S]`` batches of ``dtype``. ``resize_size``:
    the shorter side before the crop (default ``round(S * 256 / 224)``).
    ``dct_scaling``: decode large JPEGs at 1/2, 1/4 or 1/8 size when the crop
    still has ``S`` pixels (faster, no longer PIL's exact arithmetic).

    The data set is read in order. ``rank`` and ``world_size`` take a shard
    without duplicates or padding: with ``n`` images the first
    ``n % world_size`` ranks take ``n // world_size + 1``, the others one
    fewer (a file source's rank ``r`` takes images ``r, r + world, ...``,
    a shard source's ranks contiguous runs); ``indices`` are this rank's.
    Iterating yields ``(images, labels, indices)`` (labels and data set
    indices int64 ``[B]``; -1 for an image without one when not
    ``labelled``); an unreadable image raises ``ValueError`` naming it, or
    with ``on_error="skip"`` is replaced by another image (with that image's
    index) and listed in ``stats()["skipped_files"]``. ``close()`` (or
    ``with``) stops the threads.
    """

    def __init__(
        self,
        source: str | os.PathLike | DataSource,
        image_size: int = 224,
        batch_size: int = 128,
        *,
        resize_size: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        num_threads: int | None = None,
        prefetch: int = 4,
        dtype: torch.dtype = torch.float32,
        pin_memory: bool | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        dct_scaling: bool = False,
        max_pixels: int = _DEFAULT_MAX_PIXELS,
        labelled: bool = True,
        on_error: str = "raise",
        image_mode: str = "rgb",
    ) -> None:
        self._native = None
        _check_size(image_size)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.source = open_source(source)
        self.targets = _labels_of(self.source, labelled)
        self.named = bool(self.source.classes)
        self.classes = _class_names(self.source, self.targets)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self._native = _C.MultiCropLoader(
            self.source.native,
            **_native_options(
                image_size,
                batch_size,
                resize_size,
                rank,
                world_size,
                num_threads,
                prefetch,
                dtype,
                pin_memory,
                mean,
                std,
                dct_scaling,
                max_pixels,
            ),
            skip_errors=on_error == "skip",
            image_mode=image_mode,
        )
        self.image_size, self.batch_size = image_size, batch_size
        self.rank, self.world_size = int(rank), int(world_size)

    @property
    def indices(self) -> list[int]:
        """This rank's data set indices, in the order its batches hold them."""
        return self._native.epoch_indices(0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        native = self._native
        native.start_epoch(0, 0)
        while True:
            try:
                raw = native.next()
            except LoaderError as e:
                raise ValueError(f"cannot read an image of {self.source.spec!r}: {e}") from None
            if raw is None:
                return
            groups, _, labels, indices, _, _ = raw
            yield groups[0], labels, indices

    def stats(self) -> dict:
        """The native loader's counters (images, thread-seconds per stage, ...)."""
        return self._native.stats()


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _native_options(
    image_size,
    batch_size,
    resize_size,
    rank,
    world_size,
    num_threads,
    prefetch,
    dtype,
    pin_memory,
    mean,
    std,
    dct_scaling,
    max_pixels,
) -> dict:
    """The keyword arguments of ``_C.MultiCropLoader`` in evaluation mode;
    the native side checks the ranges and names the argument at fault."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be torch.float32, bfloat16 or float16, got {dtype}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if len(mean) != len(std):
        raise ValueError(f"mean and std need one value per channel, got {len(mean)} and {len(std)}")
    augment = {"center_crop": True, "global_size": image_size, "n_local": 0}
    if resize_size is not None:
        augment["resize_size"] = int(resize_size)
    return dict(
        batch_size=batch_size,
        augment=augment,
        num_threads=0 if num_threads is None else int(num_threads),
        prefetch=int(prefetch),
        seed=0,
        rank=int(rank),
        world_size=int(world_size),
        shuffle=False,
        drop_last=False,
        pad_shards=False,
        exact_shards=True,
        dtype=_DTYPE_NAMES[dtype],
        channels_last=False,
        photometric=True,
        pin_memory=bool(pin_memory),
        max_pixels=int(max_pixels),
        mean=[float(v) for v in mean],
        std=[float(v) for v in std],
        dct_scaling=bool(dct_scaling),
        shuffle_buffer=1,
    )


# ---------------------------------------------------------------- extraction


def amp_dtype_of(amp: bool | torch.dtype | None, device: torch.device) -> torch.dtype | None:
    if amp is None:  # the default: bf16 on a GPU, full precision elsewhere
        amp = device.type == "cuda"
    if amp is False:
        return None
    if isinstance(amp, torch.dtype):
        return amp
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16


def shard_of(distributed: bool | None) -> tuple[int, int]:
    """(rank, world) to shard over: (0, 1) unless ``distributed`` (None: when
    a process group of more than one rank is initialised)."""
    ready = dist.is_available() and dist.is_initialized()
    if distributed and not ready:
        raise ValueError("distributed=True needs an initialised torch.distributed process group")
    if distributed is False or not ready:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _forward(model, images: torch.Tensor, device, amp_dtype, normalize: bool) -> torch.Tensor:
    images = images.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        out = model(images)
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != len(images):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"the model must map [B, 3, H, W] to [B, D] features; got {shape} "
            f"for a batch of {len(images)}"
        )
    out = out.float()
    return F.normalize(out, dim=1) if normalize else out


def _run(model, batches: Iterable, device, amp_dtype, normalize, with_indices: bool = False):
    """Features, labels and (``with_indices``: the third element of each
    batch) data set indices of every batch, as lists of CPU tensors."""
    feats: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    indices: list[torch.Tensor] = []
    with eval_mode(model):
        for batch in batches:
            if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                raise ValueError("each batch must be (images, labels)")
            feats.append(_forward(model, batch[0], device, amp_dtype, normalize).cpu())
            labels.append(torch.as_tensor(batch[1], dtype=torch.int64).reshape(-1).cpu())
            if with_indices:
                indices.append(torch.as_tensor(batch[2], dtype=torch.int64).reshape(-1))
    return feats, labels, indices


def gather_rows(features: torch.Tensor, indices: torch.Tensor, n: int, device) -> torch.Tensor:
    """Every rank's rows (padded to the longest shard for all_gather, then
    trimmed) put at their data set indices: ``[n, D]`` on every rank, zero
    where no rank holds a row (an image no rank could read)."""
    comm = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    comm = comm or torch.device("cpu")
    world = dist.get_world_size()
    shape = torch.tensor([len(features), features.shape[1]], device=comm)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    longest, dim = (max(int(s[k]) for s in shapes) for k in (0, 1))
    rows = torch.zeros(longest, dim, device=comm)
    rows[: len(features)] = features.to(comm)
    where = torch.full((longest,), -1, dtype=torch.int64, device=comm)
    where[: len(indices)] = indices.to(comm)
    all_rows = [torch.empty_like(rows) for _ in range(world)]
    all_where = [torch.empty_like(where) for _ in range(world)]
    dist.all_gather(all_rows, rows)
    dist.all_gather(all_where, where)
    out = torch.zeros(n, dim)  # rows no rank holds stay zero
    for r, w, s in zip(all_rows, all_where, shapes, strict=True):
        count = int(s[0])
        out[w[:count].cpu()] = r[:count].cpu()
    return out


def _native_features(model, source, device, batch_size, normalize, amp_dtype, options):
    rank, world = shard_of(options.pop("distributed"))
    with EvalLoader(
        source,
        batch_size=batch_size,
        rank=rank,
        world_size=world,
        pin_memory=device.type == "cuda",
        **options,
    ) as loader:
        feats, _, indices = _run(model, loader, device, amp_dtype, normalize, True)
        labels = loader.targets.clone()
        n = loader.num_samples
    dim = feats[0].shape[1] if feats else 0
    mine = torch.cat(feats) if feats else torch.empty(0, dim)
    mine_at = torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64)
    if world == 1:
        out = torch.zeros(n, dim)  # rows no rank holds stay zero
        out[mine_at] = mine
        return out, labels
    return gather_rows(mine, mine_at, n, device), labels


@torch.no_grad()
def extract_features(
    model: torch.nn.Module,
    loader_or_dataset: torch.utils.data.Dataset | Iterable | str | os.PathLike | DataSource,
    device: str | torch.device = "cpu",
    batch_size: int = 128,
    normalize: bool = True,
    amp: bool | torch.dtype | None = None,
    num_workers: int = 0,
    *,
    image_size: int = 224,
    distributed: bool | None = None,
    **native: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [N, D] float32, labels [N] int64)``, on the CPU, in data set order.

    ``loader_or_dataset`` is a data source (a path or what
    :func:`~dino_opt.data.open_source` opens, or a
    :class:`~dino_opt.data.DataSource`): the images go through
    :class:`EvalLoader` at ``image_size`` with ``num_workers`` threads
    (default: the cores this process may use) and the other ``native``
    keywords of :class:`EvalLoader` (``resize_size``, ``dct_scaling``,
    ``mean``, ``std``, ...). With ``distributed`` (default None: when
    ``torch.distributed`` is initialised with more than one process; pass
    False where only some ranks call this) each rank extracts its own shard and
    every rank gets the whole data set's features (``all_gather``; gloo on
    CPU tensors, NCCL on the current GPU). Or a Dataset of ``(image, label)`` samples (batched here
    with ``batch_size`` and ``num_workers`` processes, on this process only),
    or any iterable of ``(images, labels)`` batches, such as a DataLoader.

    ``model`` maps ``[B, 3, H, W]`` to ``[B, D]`` (a backbone's CLS feature,
    or any module: concatenated tokens for a linear probe); it runs in eval
    mode without gradients (its training mode is restored after), under
    autocast when ``amp`` is True (bf16; fp16 on GPUs without bf16) or a
    dtype; ``None`` (default) is bf16 on a CUDA device and off elsewhere.
    With ``normalize`` the rows are L2-normalised. Non-finite features raise
    ``ValueError``.
    """
    device = torch.device(device)
    amp_dtype = amp_dtype_of(amp, device)
    if isinstance(loader_or_dataset, (str, os.PathLike, DataSource)):
        if num_workers:
            native.setdefault("num_threads", num_workers)
        features, labels = _native_features(
            model,
            loader_or_dataset,
            device,
            batch_size,
            normalize,
            amp_dtype,
            dict(image_size=image_size, distributed=distributed, **native),
        )
        return _checked(features), labels
    if native or distributed:
        extra = sorted(native) + (["distributed"] if distributed else [])
        raise ValueError(f"{extra} apply to a data source only, not to a Dataset or batches")
    batches = _batches(loader_or_dataset, device, batch_size, num_workers)
    feats, labels, _ = _run(model, batches, device, amp_dtype, normalize)
    if not feats:
        raise ValueError("the data set is empty: no features to extract")
    return _checked(torch.cat(feats)), torch.cat(labels)


def _batches(data, device: torch.device, batch_size, num_workers) -> Iterable:
    if not isinstance(data, torch.utils.data.Dataset):
        return data
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return torch.utils.data.DataLoader(
        data,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )


def _checked(features: torch.Tensor) -> torch.Tensor:
    bad = (~torch.isfinite(features).all(dim=1)).sum().item()
    if bad:
        raise ValueError(f"{bad} of {len(features)} feature rows are not finite (NaN or inf)")
    return features
