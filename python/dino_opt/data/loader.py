"""DINO's multi-crop data pipeline on native threads.

``MultiCropLoader`` decodes (libjpeg-turbo, DCT-scaled where every crop
allows), crops and resizes (PIL's anti-aliased bicubic), augments (DINO's
photometric recipe with torchvision's semantics) and normalises in a pool of
C++ threads, writing whole batches straight into pinned memory. Each sample's
randomness derives from ``(seed, epoch, position)``, so the batches are the
same whatever the thread count, and a run resumes mid-epoch exactly.

``MultiCropDataset`` runs the same per-image pipeline as a ``torch`` Dataset
for users who keep ``torch.utils.data.DataLoader``;
``DataLoadingOptimizer.create_optimized_dataloader`` is the lesson's entry.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from ..ops.channel_photometric_torch import channel_photometric_torch
from ..ops.library import IMAGENET_MEAN, IMAGENET_STD, multicrop_photometric
from ..ops.native import _C
from .ahead import DeviceCopy, one_ahead
from .channels import RGB_ONLY_AUGMENT_KEYS, ImageLayout, data_set_layout, normalisation
from .masking import mask_options, mask_targets
from .sources import open_source

__all__ = [
    "AUGMENT_KEYS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Batch",
    "DataLoadingOptimizer",
    "ImageError",
    "LoaderError",
    "MultiCropDataset",
    "MultiCropLoader",
    "NativeLoaderHandle",
    "crop_size_pairs",
    "multicrop_collate",
]

#: A batch that holds an unreadable file (``on_error="raise"``), or a closed loader.
LoaderError = _C.LoaderError
#: An image that cannot be decoded or written (``dino-opt prepare``, the image helpers).
ImageError = _C.ImageError

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: The photometric options ``augment={...}`` takes (names as in the config's
#: ``augmentation`` section).
AUGMENT_KEYS = (
    "flip_p",
    "jitter_p",
    "brightness",
    "contrast",
    "saturation",
    "hue",
    "grayscale_p",
    "blur_sigma",
    "blur_p_global1",
    "blur_p_global2",
    "blur_p_local",
    "solarize_p_global2",
    "noise_p",
    "noise_std",
)
_DEFAULT_MAX_PIXELS = 178_956_970  # Pillow's decompression-bomb limit
# What must match for a loader state to resume this loader; and what must
# match when the state has it (states written before these keys existed).
_STATE_KEYS = ("seed", "num_samples", "batch_size", "rank", "world_size", "shuffle", "drop_last")
_STATE_KEYS_IF_GIVEN = ("format", "shuffle_buffer")


class _BatchTuple(NamedTuple):
    crops: list[torch.Tensor]
    labels: torch.Tensor
    indices: torch.Tensor


class Batch(_BatchTuple):
    """One batch: ``crops`` is ``[global_1, global_2, local_1, ..., local_n]``,
    each ``[B, 3, H, W]`` (or, with ``group_by_resolution=True``, one tensor per
    resolution: ``[2B, 3, G, G]`` and ``[n_local * B, 3, L, L]``, crop-major as
    ``torch.cat`` of the list would give); ``labels`` and ``indices`` (data set
    indices, after any ``on_error="skip"`` replacement) are int64 ``[B]``.

    ``masks`` (an attribute, not a tuple element, so that ``crops, labels,
    indices = batch`` keeps working) is None, or with the loader's ``masks``
    option bool ``[2B, gh, gw]``: row ``n`` masks the patches of global crop
    ``n`` of ``torch.cat(crops[:2])`` (rows ``:B`` global_1, ``B:`` global_2).
    """

    masks: torch.Tensor | None = None

    def __new__(cls, crops, labels, indices, masks: torch.Tensor | None = None):
        batch = super().__new__(cls, crops, labels, indices)
        batch.masks = masks
        return batch

    def __getnewargs__(self):
        return (*self, self.masks)

    def _replace(self, **fields) -> Batch:
        masks = fields.pop("masks", self.masks)
        return Batch(*super()._replace(**fields), masks=masks)

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, masks={self.masks!r})"


def _check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _pair(name: str, value: Sequence[float]) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of floats, got {value!r}") from None
    return lo, hi


def _sizes(name: str, value) -> list[int] | None:
    """``value`` as a list of sides when it is a sequence, None when it is one int."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be an int or a non-empty list of ints, got {value!r}")
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ValueError(f"{name} must be an int or a non-empty list of ints, got {value!r}")
    return list(value)


def crop_size_pairs(
    global_size: int | Sequence[int],
    local_size: int | Sequence[int],
    crop_size_ratios: Sequence[float] | None = None,
) -> tuple[list[tuple[int, int]], list[float]]:
    """The (global, local) crop-size pairs and their probabilities that
    ``global_size``, ``local_size`` and ``crop_size_ratios`` describe: one
    pair with probability 1 for two ints; with lists, pair ``k`` is
    ``(global_size[k], local_size[k])`` (an int on one side stands for every
    pair), drawn with probability ``crop_size_ratios[k]`` (None: uniform).
    Raises ``ValueError`` in one line for lists of different lengths or
    ratios that are not probabilities summing to 1."""
    g, loc = _sizes("global_size", global_size), _sizes("local_size", local_size)
    n = len(g or loc or [0])
    if g is not None and loc is not None and len(g) != len(loc):
        raise ValueError(
            f"global_size has {len(g)} sizes but local_size has {len(loc)}: give one "
            "(global, local) pair per position"
        )
    pairs = list(zip(g or [int(global_size)] * n, loc or [int(local_size)] * n, strict=True))
    if crop_size_ratios is None:
        return pairs, [1.0 / n] * n
    try:
        ratios = [float(r) for r in crop_size_ratios]
    except (TypeError, ValueError):
        raise ValueError(
            f"crop_size_ratios must be a list of numbers, got {crop_size_ratios!r}"
        ) from None
    if len(ratios) != n:
        raise ValueError(f"crop_size_ratios has {len(ratios)} ratios for {n} crop-size pairs")
    if not all(math.isfinite(r) and r >= 0 for r in ratios) or abs(sum(ratios) - 1) > 1e-6:
        raise ValueError(
            f"crop_size_ratios must be probabilities (each >= 0) summing to 1, got {ratios}"
        )
    return pairs, ratios


def _split_copied(tensors: list, n_groups: int) -> tuple[list, list, torch.Tensor | None]:
    """(groups, params, masks) of a :class:`DeviceCopy` of ``[*groups, *params, masks]``."""
    return tensors[:n_groups], tensors[n_groups : 2 * n_groups], tensors[2 * n_groups]


def _augment_options(
    augment: dict | None,
    *,
    global_size: int | Sequence[int],
    local_size: int | Sequence[int],
    n_local: int,
    global_scale,
    local_scale,
    crop_size_ratios: Sequence[float] | None,
) -> tuple[dict, list, list]:
    """The native loader's ``augment`` options (known keys; the pairs
    checked) with the crops' first sizes and scales, and the crop-size
    pairs and their probabilities where lists give several (else empty)."""
    options = dict(augment or {})
    unknown = sorted(set(options) - set(AUGMENT_KEYS))
    if unknown:
        raise ValueError(f"unknown augment keys {unknown}; known: {', '.join(AUGMENT_KEYS)}")
    for key in ("blur_sigma", "noise_std"):
        if key in options:
            options[key] = _pair(f"augment[{key!r}]", options[key])
    pairs, ratios = crop_size_pairs(global_size, local_size, crop_size_ratios)
    several = _sizes("global_size", global_size) is not None
    several = several or _sizes("local_size", local_size) is not None
    options.update(
        global_size=pairs[0][0],
        local_size=pairs[0][1],
        n_local=int(n_local),
        global_scale=_pair("global_scale", global_scale),
        local_scale=_pair("local_scale", local_scale),
    )
    return options, (pairs if several else []), (ratios if several else [])


def _native_loader(
    source,
    labels,
    batch_size: int,
    *,
    global_size: int | Sequence[int],
    local_size: int | Sequence[int],
    n_local: int,
    global_scale,
    local_scale,
    num_threads: int | None,
    prefetch: int,
    seed: int,
    rank: int,
    world_size: int,
    shuffle: bool,
    drop_last: bool,
    pad_shards: bool,
    dtype: torch.dtype,
    channels_last: bool,
    photometric: str,
    pin_memory: bool,
    on_error: str,
    max_pixels: int,
    mean,
    std,
    augment: dict | None,
    dct_scaling: bool,
    masks: dict | None,
    shuffle_buffer: int,
    crop_size_ratios: Sequence[float] | None = None,
    image_mode: str = "rgb",
):
    """Checks the Python-side arguments, opens the source, then builds the
    native loader (which checks the ranges and raises ValueError naming the
    argument). Returns the native loader, the :class:`DataSource` and the
    mean and std it normalises with."""
    _check_choice("photometric", photometric, ("cpu", "gpu"))
    _check_choice("on_error", on_error, ("raise", "skip"))
    if dtype not in _DTYPES:
        raise ValueError(
            f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    options, pairs, ratios = _augment_options(
        augment,
        global_size=global_size,
        local_size=local_size,
        n_local=n_local,
        global_scale=global_scale,
        local_scale=local_scale,
        crop_size_ratios=crop_size_ratios,
    )
    if not isinstance(shuffle_buffer, int) or shuffle_buffer < 1:
        raise ValueError(f"shuffle_buffer must be a positive int, got {shuffle_buffer!r}")
    _check_choice("image_mode", image_mode, ("rgb", "native"))
    data = open_source(source, labels=labels)
    layout = None
    if image_mode == "native":
        layout = data_set_layout(data, max_pixels, tries=16 if on_error == "skip" else 1)
        _refuse_rgb_only(options, layout)
    mean, std = normalisation(data, layout, mean, std)
    native = _C.MultiCropLoader(
        data.native,
        batch_size=batch_size,
        augment=options,
        num_threads=0 if num_threads is None else int(num_threads),
        prefetch=int(prefetch),
        seed=int(seed),
        rank=int(rank),
        world_size=int(world_size),
        shuffle=bool(shuffle),
        drop_last=bool(drop_last),
        pad_shards=bool(pad_shards),
        dtype=_DTYPES[dtype],
        channels_last=bool(channels_last),
        photometric=photometric == "cpu",
        pin_memory=bool(pin_memory),
        skip_errors=on_error == "skip",
        max_pixels=int(max_pixels),
        mean=[float(v) for v in mean],
        std=[float(v) for v in std],
        dct_scaling=bool(dct_scaling),
        masks=mask_options(masks),
        shuffle_buffer=shuffle_buffer,
        size_pairs=pairs,
        size_probs=ratios,
        image_mode=image_mode,
    )
    return native, data, mean, std


def _refuse_rgb_only(options: dict, layout: ImageLayout) -> None:
    """ValueError naming the RGB-only photometric options asked for (nonzero)
    for images that are not 8-bit RGB."""
    asked = [k for k in RGB_ONLY_AUGMENT_KEYS if options.get(k)]
    if asked and not layout.rgb8:
        raise ValueError(
            f"augment {asked} are RGB colour operations; {layout.describe()} images "
            f"({layout.first}) take per-channel brightness and contrast, blur and noise "
            "(docs/loader.md)"
        )


class NativeLoaderHandle:
    """A native loader held as ``_native``: its batches per epoch
    (``len``), its samples, and its lifetime: ``close()`` stops and joins
    its threads (promptly, mid-epoch too; idempotent), and the object is a
    context manager that closes it."""

    _native = None

    def __len__(self) -> int:
        """Batches of this rank in an epoch."""
        return self._native.num_batches

    @property
    def num_samples(self) -> int:
        """Samples in the data set (all ranks)."""
        return self._native.num_samples

    def close(self) -> None:
        if self._native is not None:
            self._native.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class MultiCropLoader(NativeLoaderHandle):
    """Multi-crop batches for DINO from native threads.

    Args:
        source: what :func:`~dino_opt.data.open_source` opens: an ImageFolder
            directory, a directory of images, a list of paths (``labels``
            goes with it), a file list, tar shards, a Hugging Face data set;
            or a :class:`~dino_opt.data.DataSource` it opened (for its
            options).
        batch_size: samples per batch (per rank).
        global_size, local_size, n_local, global_scale, local_scale: the crops
            (DINO: 2 global 224² with scale (0.4, 1), 8 local 96² with (0.05, 0.4)).
            Lists of sides (high-resolution adaptation): pair ``k`` is
            ``(global_size[k], local_size[k])`` (an int on one side stands
            for every pair), and each batch makes all of its crops at one
            pair, drawn with ``crop_size_ratios`` (:func:`crop_size_pairs`)
            from ``(seed, epoch, batch index)`` alone: every rank draws the
            same pair for the same batch, a resumed epoch the same pairs
            (:meth:`crop_sizes`).
        crop_size_ratios: the probability of each pair (None: uniform);
            they must sum to 1.
        num_threads: decoding threads (default: the cores this process may use).
        prefetch: batches prepared ahead of the consumer.
        seed: the seed of every random choice; ``set_epoch`` reshuffles.
        rank, world_size: this process's shard, as ``DistributedSampler``
            makes them; ``pad_shards`` pads the shards to equal length by
            wrapping around (True) or drops the tail (False).
        shuffle, drop_last: as ``DataLoader`` (drop_last: this rank's last
            partial batch).
        dtype, channels_last: the crops' dtype (float32, bfloat16, float16)
            and memory format.
        photometric: ``"cpu"``: the threads augment and normalise; ``"gpu"``:
            the threads write uint8 crops and their sampled parameters and the
            operator ``dino_opt.ops.multicrop_photometric`` augments on
            ``device`` (default ``"cuda"``; ``"cpu"`` runs its CPU kernel) —
            4x fewer bytes to copy and less CPU work.
        on_error: ``"raise"``: a batch holding an unreadable file raises
            :class:`LoaderError` naming the path and cause (the loader stays
            usable and closable); ``"skip"``: the sample is replaced by another
            drawn deterministically, and counted in ``stats()``.
        pin_memory: batches in pinned memory (default: when CUDA is available).
        group_by_resolution: yield one tensor per resolution instead of one per crop.
        max_pixels: images with more pixels are refused from their header.
        mean, std: normalisation.
        augment: overrides of the photometric probabilities and strengths
            (keys ``flip_p``, ``jitter_p``, ``brightness``, ``contrast``,
            ``saturation``, ``hue``, ``grayscale_p``, ``blur_sigma``,
            ``blur_p_global1``, ``blur_p_global2``, ``blur_p_local``,
            ``solarize_p_global2``).
        dct_scaling: decode JPEGs at 1/2, 1/4 or 1/8 size when every crop
            still has at least its output resolution.
        shuffle_buffer: tar shards: the samples shuffled together (a window
            of this rank's stream of shards, several read at once); other
            sources shuffle the whole data set.
        masks: DINOv2's block masks of the global crops, drawn by the threads
            with the crops (``Batch.masks``, bool ``[2B, gh, gw]``; None: off):
            a dict with ``patch_size`` (the model's; it must divide
            ``global_size``) and optionally ``ratio`` (0.1, 0.5),
            ``probability`` 0.5, ``min_num_patches`` 4, ``max_num_patches``
            (None: half the grid), ``min_aspect`` 0.3, ``max_aspect`` (None:
            1 / min_aspect); see :data:`~dino_opt.data.masking.MASK_KEYS` and
            :meth:`mask_targets`.

    Iterating yields :class:`Batch` ``(crops, labels, indices)`` for the
    current epoch, from its next unseen batch (the position ``state_dict()``
    saves; an epoch iterated to its end starts again from its first batch).
    Call ``set_epoch`` before each epoch (as with ``DistributedSampler``),
    ``close()`` at the end (or use ``with``).
    """

    def __init__(
        self,
        source,
        batch_size: int,
        global_size: int = 224,
        local_size: int = 96,
        n_local: int = 8,
        global_scale: Sequence[float] = (0.4, 1.0),
        local_scale: Sequence[float] = (0.05, 0.4),
        num_threads: int | None = None,
        prefetch: int = 4,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = True,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        photometric: str = "cpu",
        on_error: str = "raise",
        *,
        labels: Sequence[int] | None = None,
        device: str | torch.device | None = None,
        pin_memory: bool | None = None,
        pad_shards: bool = True,
        group_by_resolution: bool = False,
        max_pixels: int = _DEFAULT_MAX_PIXELS,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        augment: dict | None = None,
        dct_scaling: bool = True,
        masks: dict | None = None,
        shuffle_buffer: int = 1024,
        crop_size_ratios: Sequence[float] | None = None,
        image_mode: str = "rgb",
    ):
        self._native = None  # so that close() in __del__ works if a check below fails
        if photometric == "gpu":
            device = torch.device(device if device is not None else "cuda")
            if device.type == "cuda" and not torch.cuda.is_available():
                raise RuntimeError(
                    "photometric='gpu' needs CUDA; pass device='cpu' to run the operator there"
                )
        elif device is not None:
            raise ValueError("device applies to photometric='gpu' only")
        self.device = device
        if pin_memory is None:
            pin_memory = torch.cuda.is_available() and (device is None or device.type == "cuda")
        self._native, self.source, mean, std = _native_loader(
            source,
            labels,
            batch_size,
            global_size=global_size,
            local_size=local_size,
            n_local=n_local,
            global_scale=global_scale,
            local_scale=local_scale,
            num_threads=num_threads,
            prefetch=prefetch,
            seed=seed,
            rank=rank,
            world_size=world_size,
            shuffle=shuffle,
            drop_last=drop_last,
            pad_shards=pad_shards,
            dtype=dtype,
            channels_last=channels_last,
            photometric=photometric,
            pin_memory=pin_memory,
            on_error=on_error,
            max_pixels=max_pixels,
            mean=mean,
            std=std,
            augment=augment,
            dct_scaling=dct_scaling,
            masks=masks,
            shuffle_buffer=shuffle_buffer,
            crop_size_ratios=crop_size_ratios,
            image_mode=image_mode,
        )
        self.classes = self.source.classes
        self.image_mode = image_mode
        layout = self._native.layout
        #: image_mode="native": the data set's :class:`ImageLayout`; None for 8-bit RGB.
        self.layout = ImageLayout(*layout) if layout is not None else None
        self.shuffle_buffer = shuffle_buffer
        native = self._native
        #: The (global, local) crop-size pairs the batches are drawn from (one without lists).
        self.crop_size_pairs = [tuple(native.size_pair(k)) for k in range(native.num_size_pairs)]
        self.masks = mask_options(masks) or None
        self.batch_size = batch_size
        self.n_local = int(n_local)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.dtype, self.channels_last = dtype, bool(channels_last)
        self.photometric = photometric
        self.group_by_resolution = bool(group_by_resolution)
        self.mean, self.std = [float(v) for v in mean], [float(v) for v in std]
        self.pin_memory = bool(pin_memory)
        self._epoch = 0
        self._next_batch = 0  # within the epoch: where iteration (or a resume) starts

    # ------------------------------------------------------------ iteration
    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch's shuffle and augmentation; iteration starts at its first batch."""
        self._epoch = int(epoch)
        self._next_batch = 0

    def epoch_indices(self, epoch: int | None = None) -> list[int]:
        """This rank's data set indices for ``epoch``, in iteration order."""
        return self._native.epoch_indices(self._epoch if epoch is None else int(epoch))

    def crop_sizes(self, batch: int, epoch: int | None = None) -> tuple[int, int]:
        """The (global, local) crop sides of batch ``batch`` (from 0) of
        ``epoch`` (default: the current one): its drawn pair, the same on
        every rank."""
        native = self._require_open()
        epoch = self._epoch if epoch is None else int(epoch)
        return tuple(native.size_pair(native.size_pair_of(epoch, int(batch))))

    @property
    def copies_ahead(self) -> bool:
        """Whether a batch's uint8 crops go to the GPU a batch ahead, on a
        stream of their own (:mod:`dino_opt.data.ahead`): with the
        photometric stage on a CUDA device, from pinned memory."""
        return self.photometric == "gpu" and self.device.type == "cuda" and self.pin_memory

    def __iter__(self) -> Iterator[Batch]:
        native = self._require_open()
        native.start_epoch(self._epoch, self._next_batch)
        raws = iter(native.next, None)
        if self.copies_ahead:
            stream = torch.cuda.Stream(self.device)
            for raw, copy in one_ahead(raws, lambda raw: self._copy(raw, stream)):
                groups, params, masks = _split_copied(copy.wait(), len(raw[0]))
                self._next_batch = raw[4] + 1  # the batch yielded, not the one copied ahead
                yield self._finish(groups, params, raw[2], raw[3], masks)
        else:
            for groups, params, labels, indices, batch_index, masks in raws:
                self._next_batch = batch_index + 1
                yield self._finish(groups, params, labels, indices, masks)
        self._next_batch = 0

    def _copy(self, raw: tuple, stream: torch.cuda.Stream) -> DeviceCopy:
        """The copy to the device of a raw batch's crops, parameters and masks."""
        groups, params, masks = raw[0], raw[1], raw[5]
        return DeviceCopy([*groups, *params, masks], self.device, stream)

    def _finish(self, groups, params, labels, indices, masks) -> Batch:
        if self.photometric == "gpu":  # (tensors already on the device: no copy)
            non_blocking = self.pin_memory and self.device.type == "cuda"
            if masks is not None:
                masks = masks.to(self.device, non_blocking=non_blocking)
            channel_stage = self.layout is not None and not self.layout.rgb8
            stage = channel_photometric_torch if channel_stage else multicrop_photometric
            groups = [
                stage(
                    g.to(self.device, non_blocking=non_blocking),
                    p.to(self.device, non_blocking=non_blocking),
                    mean=self.mean,
                    std=self.std,
                    dtype=self.dtype,
                    channels_last=self.channels_last,
                )
                for g, p in zip(groups, params, strict=True)
            ]
        if self.group_by_resolution:
            return Batch(list(groups), labels, indices, masks)
        b = labels.shape[0]
        crops = [groups[0][:b], groups[0][b:]]
        if len(groups) > 1:
            crops += list(groups[1].split(b))
        return Batch(crops, labels, indices, masks)

    def mask_targets(self, masks: torch.Tensor) -> dict:
        """DINOv2's collate outputs for ``masks`` (a batch's ``Batch.masks``),
        on their device, with this loader's ratio and probability: see
        :func:`~dino_opt.data.masking.mask_targets`."""
        if self.masks is None:
            raise ValueError("this loader draws no masks: pass masks=dict(patch_size=...)")
        return mask_targets(masks, self.masks["ratio"], self.masks["probability"])

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Where iteration stands: the next unseen batch of the current epoch."""
        return {
            "epoch": self._epoch,
            "next_batch": self._next_batch,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "format": self.source.format,
            "shuffle_buffer": self.shuffle_buffer,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resumes at ``state``'s next unseen batch: the next ``iter()`` yields
        exactly the batches an uninterrupted run would have. Raises
        ``ValueError`` when the data set or the sharding differ."""
        mine_state = self.state_dict()
        for key in _STATE_KEYS + _STATE_KEYS_IF_GIVEN:
            if key not in state:
                if key in _STATE_KEYS_IF_GIVEN:
                    continue
                raise ValueError(f"loader state lacks {key!r}")
            mine = mine_state[key]
            if state[key] != mine:
                raise ValueError(
                    f"loader state has {key}={state[key]!r} but this loader has {mine!r}"
                )
        next_batch = int(state["next_batch"])
        if not 0 <= next_batch <= len(self):
            raise ValueError(f"loader state next_batch={next_batch} is outside 0..{len(self)}")
        self._epoch = int(state["epoch"])
        self._next_batch = next_batch

    def stats(self) -> dict:
        """Throughput and where the time goes.

        ``images_per_second`` (produced, over the time the threads were
        producing), ``decode_seconds``, ``crop_seconds``, ``augment_seconds``
        (thread-seconds per stage), ``wait_seconds`` (the consumer blocked on an
        unfinished batch: starvation), ``starvation`` (that wait over the
        elapsed time), ``images``, ``batches``, ``skipped`` and
        ``skipped_files`` (``"path: cause"``, the first 100), ``num_threads``;
        ``io``: the source's file-system reads (``reads``, ``bytes``,
        ``sequential``: reads that began where the previous read of that file
        ended, ``opens``) and ``table_bytes``, the memory of its sample table.
        """
        s = self._require_open().stats()
        s["io"] = self.source.native.read_stats()
        s["table_bytes"] = self.source.native.table_bytes
        elapsed = s["elapsed_seconds"]
        s["images_per_second"] = s["images"] / elapsed if elapsed > 0 else 0.0
        s["starvation"] = s["wait_seconds"] / elapsed if elapsed > 0 else 0.0
        return s

    # ------------------------------------------------------------ lifetime
    def _require_open(self):
        if self._native is None:
            raise LoaderError("the loader was not constructed")
        return self._native


class MultiCropDataset(torch.utils.data.Dataset):
    """The loader's per-image pipeline as a map-style Dataset.

    ``dataset[i]`` is ``{"crops": [global_1, global_2, local_1, ...],
    "label": int, "index": int}`` with each crop ``[3, H, W]``; its randomness
    derives from ``(seed, epoch, i)`` (``set_epoch`` selects the epoch; with
    ``persistent_workers`` the workers keep the epoch they were started with).
    Arguments as :class:`MultiCropLoader`; ``photometric`` is always ``"cpu"``.

    With ``masks``, an item also has ``"masks"``: bool ``[2, gh, gw]``, the
    two global crops' masks under a plan of their own (a batch of one, so
    ``int(2 * probability)`` of them masked, their shares drawn over the whole
    ratio range). For DINOv2's plan over a whole batch, leave ``masks`` off
    and collate with :func:`~dino_opt.data.masking.collate_data_and_cast`,
    which takes these items.
    """

    def __init__(
        self,
        source,
        global_size: int = 224,
        local_size: int = 96,
        n_local: int = 8,
        global_scale: Sequence[float] = (0.4, 1.0),
        local_scale: Sequence[float] = (0.05, 0.4),
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        on_error: str = "raise",
        *,
        labels: Sequence[int] | None = None,
        max_pixels: int = _DEFAULT_MAX_PIXELS,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        augment: dict | None = None,
        dct_scaling: bool = True,
        masks: dict | None = None,
        image_mode: str = "rgb",
    ):
        if _sizes("global_size", global_size) or _sizes("local_size", local_size):
            raise ValueError(
                "MultiCropDataset takes one global_size and one local_size: crop-size pairs "
                "are drawn per batch, by MultiCropLoader"
            )
        self._args = dict(
            source=source,
            labels=labels,
            batch_size=1,
            global_size=global_size,
            local_size=local_size,
            n_local=n_local,
            global_scale=global_scale,
            local_scale=local_scale,
            num_threads=1,
            prefetch=1,
            seed=seed,
            rank=0,
            world_size=1,
            shuffle=False,
            drop_last=False,
            pad_shards=True,
            dtype=dtype,
            channels_last=False,
            photometric="cpu",
            pin_memory=False,
            on_error=on_error,
            max_pixels=max_pixels,
            mean=mean,
            std=std,
            augment=augment,
            dct_scaling=dct_scaling,
            masks=masks,
            shuffle_buffer=1024,
            image_mode=image_mode,
        )
        self.epoch = 0
        self._build()

    def _build(self) -> None:
        args = dict(self._args)
        self._native, self.source, mean, std = _native_loader(
            args.pop("source"), args.pop("labels"), args.pop("batch_size"), **args
        )
        # Measured statistics are kept, so that workers rebuilding it do not measure again.
        self._args.update(mean=mean, std=std)
        self.classes = self.source.classes

    def __getstate__(self) -> dict:
        # The native object does not pickle; spawned DataLoader workers rebuild it.
        return {"_args": self._args, "epoch": self.epoch}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._build()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self._native.num_samples

    def __getitem__(self, index: int) -> dict:
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} is outside the data set of {len(self)} samples")
        index = index % len(self)
        groups, _, labels, indices, _, masks = self._native.load_sample(index, self.epoch)
        crops = list(groups[0].unbind(0))
        if len(groups) > 1:
            crops += list(groups[1].unbind(0))
        item = {"crops": crops, "label": int(labels[0]), "index": int(indices[0])}
        if masks is not None:
            item["masks"] = masks
        return item


def multicrop_collate(samples: Sequence[dict]) -> dict:
    """Stacks the samples of :class:`MultiCropDataset` crop-wise:
    ``{"crops": [[B, 3, H, W], ...], "labels": [B], "indices": [B]}``, and
    with masks ``"masks"``: ``[2B, gh, gw]``, view-major as ``Batch.masks``."""
    n_crops = len(samples[0]["crops"])
    out = {
        "crops": [torch.stack([s["crops"][c] for s in samples]) for c in range(n_crops)],
        "labels": torch.tensor([s.get("label", -1) for s in samples], dtype=torch.long),
        "indices": torch.tensor([s.get("index", -1) for s in samples], dtype=torch.long),
    }
    if "masks" in samples[0]:
        out["masks"] = torch.stack([s["masks"][v] for v in range(2) for s in samples])
    return out


class DataLoadingOptimizer:
    """The lesson's data-loading helper."""

    @staticmethod
    def create_optimized_dataloader(
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        num_workers: int | None = None,
        pin_memory: bool = True,
        prefetch_factor: int = 2,
    ) -> torch.utils.data.DataLoader:
        """A DataLoader for a multi-crop dataset (samples ``{"crops": [...], ...}``,
        e.g. :class:`MultiCropDataset`): shuffled, last partial batch dropped,
        crops stacked crop-wise by :func:`multicrop_collate`, persistent
        workers. ``num_workers`` defaults to the cores this process may use
        (at most 8); ``pin_memory`` applies only when CUDA is available."""
        if num_workers is None:
            num_workers = min(8, _C.available_cores())
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        workers = num_workers > 0
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=True,
            num_workers=num_workers,
            pin_memory=pin_memory and torch.cuda.is_available(),
            prefetch_factor=prefetch_factor if workers else None,
            persistent_workers=workers,
            collate_fn=multicrop_collate,
            drop_last=True,
        )
