"""DINOv3's dense linear probe: semantic segmentation from frozen patch features.

The head is DINOv3's linear segmentation head: the last layer's normalised
patch tokens of a frozen ViT, reshaped to a ``[B, D, h, w]`` map (class and
register tokens dropped), go through 2-D dropout (0.1, training only),
BatchNorm and a 1x1 convolution to ``[B, classes, h, w]`` logits, which are
upsampled bilinearly to the label's size. It is trained with cross-entropy
(pixels labelled 255 ignored) by AdamW (lr 1e-3, betas 0.9/0.999, weight
decay 1e-3, no gradient clipping) under DINOv3's warm-up-then-cosine
schedule (:func:`dense_lr_factor`), batch 16.

Scaled for small data and a CPU: DINOv3 trains 40,000 iterations (about 32
epochs of ADE20K) with 1,500 of warm-up; here the default is 32 epochs of the
training split with the same warm-up fraction (3.75 %). DINOv3 augments
every batch (random rescale 0.5-2x, 512 crops, flips) and runs the frozen
backbone on each; here the backbone's features are computed once per image,
without augmentation, at a fixed evaluation size (image resized bicubic,
mask nearest, both to ``image_size x image_size``), and the head trains on
those cached features. Nothing is chosen on val or test: the head after the
last iteration is evaluated on both.

Metrics (:func:`segmentation_metrics`) come from one confusion matrix summed
over a whole split, not averaged over images, with ignored pixels left out:
IoU of class c = TP / (TP + FP + FN), in percent; a class absent from both
the predictions and the truth of a split has IoU NaN and is left out of the
mean (mIoU); pixel accuracy is the share of counted pixels predicted right.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ..data.segmentation import IGNORE_INDEX, SegmentationSource, segmentation_splits
from ..models import eval_mode
from ..ops.library import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "DenseLinearHead",
    "confusion_matrix",
    "dense_lr_factor",
    "dense_probe",
    "dense_probe_root",
    "extract_dense_features",
    "patch_feature_map",
    "segmentation_metrics",
]


# ---------------------------------------------------------------- the head


class DenseLinearHead(nn.Module):
    """DINOv3's linear segmentation head: ``Dropout2d -> BatchNorm2d -> 1x1
    Conv2d`` over a ``[B, in_dim, h, w]`` feature map; the convolution's
    weights start normal (std 0.01), its bias zero. ``forward(x, size)``
    upsamples the logits bilinearly to ``size`` (H, W) when given."""

    def __init__(self, in_dim: int, num_classes: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.dropout = nn.Dropout2d(dropout)
        self.bn = nn.BatchNorm2d(in_dim)
        self.conv = nn.Conv2d(in_dim, num_classes, kernel_size=1)
        nn.init.normal_(self.conv.weight, mean=0.0, std=0.01)
        nn.init.zeros_(self.conv.bias)

    def forward(self, x: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
        logits = self.conv(self.bn(self.dropout(x)))
        if size is not None and tuple(logits.shape[-2:]) != tuple(size):
            logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
        return logits


def dense_lr_factor(step: int, total: int, warmup: int, warmup_ratio: float = 1e-6) -> float:
    """The learning rate of iteration ``step`` (0-based) of ``total``, as a
    fraction of the peak, in DINOv3's segmentation schedule (its
    ``WarmupOneCycleLR`` with a linear warm-up, ``pct_start`` 0 and an
    infinite final division): during the first ``warmup`` iterations a ramp
    from ``warmup_ratio`` to 1, times ``1 - step / total``; after it, a
    cosine from 1 down to 0 over the whole run, ``(1 + cos(pi (step + 1) /
    total)) / 2``."""
    if step < warmup:
        k = (1.0 - step / warmup) * (1.0 - warmup_ratio)
        return (1.0 - k) * (1.0 - step / total)
    return 0.5 * (1.0 + math.cos(math.pi * min(step + 1, total) / total))


# ---------------------------------------------------------------- metrics


def confusion_matrix(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """``[num_classes, num_classes]`` int64 counts, row = true class, column
    = predicted class, over the pixels whose target is not ``ignore_index``
    (predictions and targets of the same shape, integer class indices)."""
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    keep = target != ignore_index
    t, p = target[keep].long(), pred[keep].long()
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= num_classes):
        raise ValueError(f"target holds labels outside 0..{num_classes - 1} (and {ignore_index})")
    counts = torch.bincount(t * num_classes + p, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).cpu()


def segmentation_metrics(confusion: torch.Tensor, class_names: Sequence[str] | None = None) -> dict:
    """mIoU, per-class IoU and pixel accuracy (percent) of a confusion matrix
    (:func:`confusion_matrix`, summed over a split). A class with no pixel in
    truth or prediction has IoU NaN and is left out of the mean (mIoU NaN
    when every class is). Keys: ``miou``, ``per_class_iou`` (name: IoU),
    ``pixel_acc``, ``mean_acc`` (mean over classes present in the truth of
    TP / their pixels), ``n_pixels``."""
    c = confusion.to(torch.float64)
    tp = torch.diagonal(c)
    union = c.sum(0) + c.sum(1) - tp
    iou = torch.where(union > 0, tp / union.clamp(min=1), torch.full_like(tp, float("nan")))
    support = c.sum(1)
    acc = torch.where(support > 0, tp / support.clamp(min=1), torch.full_like(tp, float("nan")))
    names = list(class_names) if class_names is not None else [str(i) for i in range(len(tp))]
    total = float(c.sum())
    return {
        "miou": _nanmean_percent(iou),
        "per_class_iou": {name: 100.0 * float(v) for name, v in zip(names, iou, strict=True)},
        "pixel_acc": 100.0 * float(tp.sum()) / total if total else float("nan"),
        "mean_acc": _nanmean_percent(acc),
        "n_pixels": int(total),
    }


def _nanmean_percent(values: torch.Tensor) -> float:
    kept = values[~torch.isnan(values)]
    return 100.0 * float(kept.mean()) if kept.numel() else float("nan")


# ---------------------------------------------------------------- features


def vit_outputs(
    backbone: nn.Module, images: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """``(cls [B, D], patch tokens [B, n, D], (rows, cols))`` of ``images``
    [B, 3, H, W]: the last layer's normalised tokens (register tokens
    dropped) and the patch grid. ``backbone`` has DINOv2's
    ``forward_features`` (a dict with ``x_norm_clstoken`` and
    ``x_norm_patchtokens``) and a ``patch_size``."""
    if not callable(getattr(backbone, "forward_features", None)):
        raise ValueError(
            f"the backbone ({type(backbone).__name__}) has no forward_features; "
            "patch features need a ViT's patch tokens"
        )
    out = backbone.forward_features(images)
    if not isinstance(out, dict) or not {"x_norm_clstoken", "x_norm_patchtokens"} <= set(out):
        raise ValueError(
            f"{type(backbone).__name__}.forward_features must return a dict "
            "with 'x_norm_clstoken' and 'x_norm_patchtokens'"
        )
    tokens = out["x_norm_patchtokens"]
    p = getattr(backbone, "patch_size", None)
    p = p[0] if isinstance(p, (tuple, list)) else p
    h, w = images.shape[-2] // p, images.shape[-1] // p
    if tokens.dim() != 3 or tokens.shape[1] != h * w:
        raise ValueError(
            f"{tuple(tokens.shape)} patch tokens for images "
            f"{tuple(images.shape[-2:])} with patch {p}: expected {h * w} tokens"
        )
    return out["x_norm_clstoken"], tokens, (h, w)


def patch_feature_map(backbone: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The last layer's normalised patch tokens of ``images`` [B, 3, H, W]
    as a ``[B, D, H / p, W / p]`` map (:func:`vit_outputs`' tokens, p the
    patch size)."""
    _, tokens, grid = vit_outputs(backbone, images)
    return tokens_as_map(tokens, grid)


def tokens_as_map(tokens: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Patch tokens ``[B, rows * cols, D]`` as a ``[B, D, rows, cols]`` map."""
    return tokens.transpose(1, 2).reshape(len(tokens), -1, *grid)


class _Pairs(torch.utils.data.Dataset):
    """A source's pairs at ``size x size``: the normalised image (bicubic)
    and the int64 mask (nearest), checked against ``num_classes``."""

    def __init__(self, source: SegmentationSource, size: int, num_classes: int | None) -> None:
        self.source, self.size, self.num_classes = source, size, num_classes
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.source.read(index, self.num_classes)
        s = (self.size, self.size)
        image = image.resize(s, Image.Resampling.BICUBIC)
        mask = np.asarray(Image.fromarray(mask).resize(s, Image.Resampling.NEAREST))
        x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)
        x = (x.float() / 255.0 - self.mean) / self.std
        return x, torch.from_numpy(mask.astype(np.int64))


@torch.no_grad()
def extract_dense_features(
    backbone: nn.Module,
    source: SegmentationSource,
    image_size: int,
    device: str | torch.device = "cpu",
    batch_size: int = 64,
    num_classes: int | None = None,
    num_workers: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features [N, D, h, w] float32, masks [N, S, S] int64)`` of every
    pair of ``source`` at ``S = image_size``, on ``device``, in source order;
    the backbone runs in eval mode without gradients (its mode restored)."""
    device = torch.device(device)
    # A generator of its own: iterating a DataLoader draws a seed from the
    # global RNG otherwise, and the probe leaves that as it was.
    loader = torch.utils.data.DataLoader(
        _Pairs(source, image_size, num_classes),
        batch_size=batch_size,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(0),
    )
    feats, masks = [], []
    with eval_mode(backbone):
        for images, target in loader:
            feats.append(patch_feature_map(backbone, images.to(device)).float())
            masks.append(target.to(device))
    features = torch.cat(feats)
    if not torch.isfinite(features).all():
        raise ValueError(f"the backbone gave non-finite features for {source!r}")
    return features, torch.cat(masks)


# ---------------------------------------------------------------- training


def _train_head(
    features: torch.Tensor, masks: torch.Tensor, num_classes: int, opts: dict
) -> tuple[DenseLinearHead, list[float]]:
    """The head trained on cached features (see the module docstring);
    returns it in eval mode and the loss of every iteration."""
    n, size = len(features), tuple(masks.shape[-2:])
    head = DenseLinearHead(features.shape[1], num_classes, opts["dropout"]).to(features.device)
    optim = torch.optim.AdamW(
        head.parameters(), lr=opts["lr"], betas=(0.9, 0.999), weight_decay=opts["weight_decay"]
    )
    order = torch.Generator().manual_seed(opts["seed"])
    total, bs = opts["iterations"], opts["batch_size"]
    warmup = round(opts["warmup_fraction"] * total)
    perm, cursor, losses = torch.randperm(n, generator=order), 0, []
    head.train()
    for step in range(total):
        if cursor + bs > n:  # a new epoch: a new order, the last partial batch dropped
            perm, cursor = torch.randperm(n, generator=order), 0
        idx = perm[cursor : cursor + min(bs, n)].to(features.device)
        cursor += bs
        for group in optim.param_groups:
            group["lr"] = opts["lr"] * dense_lr_factor(step, total, warmup)
        logits = head(features[idx], size)
        loss = F.cross_entropy(logits, masks[idx], ignore_index=IGNORE_INDEX)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        losses.append(loss.detach())
    return head.eval(), torch.stack(losses).cpu().tolist()


@torch.no_grad()
def _evaluate(head: DenseLinearHead, features, masks, num_classes: int, batch_size: int):
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    for start in range(0, len(features), batch_size):
        f, m = features[start : start + batch_size], masks[start : start + batch_size]
        pred = head(f, tuple(m.shape[-2:])).argmax(1)
        confusion += confusion_matrix(pred, m, num_classes)
    return confusion


# ---------------------------------------------------------------- the probe


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _class_names(
    class_names: Sequence[str] | None, splits: dict[str, SegmentationSource]
) -> list[str] | None:
    """The explicit names, else those of the splits, which must agree."""
    named = [(split, s.classes) for split, s in splits.items() if s.classes is not None]
    for split, classes in named[1:]:
        if classes != named[0][1]:
            raise ValueError(
                f"classes differ between splits: {named[0][0]} has {named[0][1]}, "
                f"{split} has {classes}"
            )
    if class_names is not None:
        return [str(c) for c in class_names]
    return list(named[0][1]) if named else None


def _num_classes(num_classes: int | None, names: list[str] | None) -> int | None:
    if num_classes is not None:
        _positive_int("num_classes", num_classes, 2)
        if names is not None and len(names) != num_classes:
            raise ValueError(f"num_classes={num_classes} but {len(names)} class names")
        return num_classes
    return len(names) if names is not None else None


def _largest_label(masks: torch.Tensor) -> int:
    kept = masks[masks != IGNORE_INDEX]
    return int(kept.max()) if kept.numel() else 0


def _splits(train, val, test) -> dict[str, SegmentationSource]:
    """The probe's sources by split (no ``test`` when None), each checked."""
    splits = {"train": train, "val": val, **({"test": test} if test is not None else {})}
    for name, source in splits.items():
        if not isinstance(source, SegmentationSource):
            raise ValueError(f"{name} must be a SegmentationSource, got {type(source).__name__}")
    return splits


def _head_options(
    batch_size, iterations, epochs, n_train, lr, weight_decay, warmup_fraction, dropout, seed
) -> dict:
    """The head's training settings, checked: ``iterations`` when given, else
    ``epochs`` passes over the ``n_train`` images."""
    batch_size = _positive_int("batch_size", batch_size)
    if iterations is not None:
        iterations = _positive_int("iterations", iterations)
    else:
        iterations = _positive_int("epochs", epochs) * math.ceil(n_train / batch_size)
    return {
        "batch_size": batch_size,
        "iterations": iterations,
        "lr": float(lr),
        "weight_decay": float(weight_decay),
        "warmup_fraction": float(warmup_fraction),
        "dropout": float(dropout),
        "seed": _positive_int("seed", seed, 0),
    }


def dense_probe(
    backbone: nn.Module,
    train: SegmentationSource,
    val: SegmentationSource,
    test: SegmentationSource | None = None,
    *,
    image_size: int,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    epochs: int = 32,
    iterations: int | None = None,
    lr: float = 1e-3,
    weight_decay: float = 1e-3,
    warmup_fraction: float = 0.0375,
    dropout: float = 0.1,
    seed: int = 0,
    feature_batch_size: int = 64,
    num_workers: int = 0,
    keep_head: bool = False,
) -> dict:
    """DINOv3's linear segmentation probe of a frozen ViT ``backbone``
    (module docstring): patch features of ``train``, ``val`` and ``test``
    computed once at ``image_size``, the head trained on ``train`` for
    ``iterations`` (default ``epochs`` passes of ``batch_size``), then
    evaluated on ``val`` and ``test``. Classes: ``class_names``, else the
    sources' (which must agree), else ``num_classes`` labels, else the
    largest label found plus one. Seeded by ``seed`` (head, dropout, batch
    order; the global RNG is left as it was); deterministic on the CPU.

    Returns a JSON-serialisable dict (NaN for absent classes): ``miou``,
    ``per_class_iou``, ``pixel_acc`` of val, then ``val`` and ``test``
    (each :func:`segmentation_metrics` plus ``n_images``), ``classes``,
    the settings, ``final_loss`` (mean of the last 20 iterations) and
    ``seconds`` (features, train, eval); with ``keep_head``, ``head``: the
    trained :class:`DenseLinearHead`'s state dict (CPU tensors, not JSON)."""
    splits = _splits(train, val, test)
    _positive_int("image_size", image_size, 1)
    names = _class_names(class_names, splits)
    num = _num_classes(num_classes, names)
    device = torch.device(device)
    t0 = time.perf_counter()
    cached = {
        split: extract_dense_features(
            backbone, source, image_size, device, feature_batch_size, num, num_workers
        )
        for split, source in splits.items()
    }
    if num is None:
        num = max(_largest_label(masks) for _, masks in cached.values()) + 1
    names = names if names is not None else [str(i) for i in range(num)]
    n_train = len(train)
    opts = _head_options(
        batch_size, iterations, epochs, n_train, lr, weight_decay, warmup_fraction, dropout, seed
    )
    t1 = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        head, losses = _train_head(*cached["train"], num, opts)
    t2 = time.perf_counter()
    results = {
        split: {
            **segmentation_metrics(_evaluate(head, *cached[split], num, feature_batch_size), names),
            "n_images": len(splits[split]),
        }
        for split in ("val", "test")
        if split in cached
    }
    t3 = time.perf_counter()
    features = cached["train"][0]
    return {
        "miou": results["val"]["miou"],
        "per_class_iou": results["val"]["per_class_iou"],
        "pixel_acc": results["val"]["pixel_acc"],
        **results,
        "classes": names,
        "num_classes": num,
        "image_size": image_size,
        "feature_grid": list(features.shape[-2:]),
        "embed_dim": int(features.shape[1]),
        "n_train": n_train,
        **opts,
        "final_loss": float(np.mean(losses[-20:])),
        "device": str(device),
        "seconds": {"features": t1 - t0, "train": t2 - t1, "eval": t3 - t2},
        **(
            {"head": {k: v.detach().cpu() for k, v in head.state_dict().items()}}
            if keep_head
            else {}
        ),
    }


def dense_probe_root(backbone: nn.Module, root: str | os.PathLike, **kwargs) -> dict | None:
    """:func:`dense_probe` on the splits of a data root that has masks
    (:func:`~dino_opt.data.segmentation.segmentation_splits`: ``train`` and
    ``val``, ``test`` where there is one), or None where it has none or no
    ``val`` split; ``kwargs`` go to :func:`dense_probe` (``image_size``
    among them)."""
    splits = segmentation_splits(root)
    if splits is None or "val" not in splits:
        return None
    return dense_probe(backbone, splits["train"], splits["val"], splits.get("test"), **kwargs)
