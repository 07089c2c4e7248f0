"""Probes of any weights: the backbone of a run, a checkpoint or weights in
any format :func:`~dino_opt.weights.read_weights` reads, with the data to
judge it on (``dino-opt eval linear|dense``, ``dino-opt show``).

:func:`open_backbone` builds the backbone the weights hold and loads them;
:func:`probe_data` finds the labelled splits (``--data ROOT`` with
``train/``, ``val/`` and ``test/``, or the data of a run's config);
:func:`run_linear_probe` and :func:`run_dense_probe` run the probes of
:mod:`dino_opt.eval` on them, :func:`show_weights` draws their pictures and
:func:`embed_weights` writes the embeddings of any images.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import check_output
from ..data import segmentation_splits, source_exists
from ..eval import (
    Embeddings,
    ProbeData,
    check_embeddings_output,
    dense_probe,
    embed_images,
    knn_evaluate_splits,
    linear_probe,
    show,
    write_embeddings,
)
from ..runtime import resolve_device
from ..train import data_roots
from .heads import (
    backbone_fingerprint,
    check_head_output,
    check_identity,
    head_model,
    load_head,
    save_head,
    write_classes,
    write_masks,
)
from .load.backbone import OpenedBackbone, evaluation_backbone, load_strict, open_backbone
from .load.reading import read_weights

__all__ = [
    "embed_weights",
    "embeddings_of",
    "evaluate_weights",
    "predict",
    "probe_data",
    "run_dense_probe",
    "run_linear_probe",
    "show_weights",
]


def probe_data(opened: OpenedBackbone, data: str | os.PathLike | None) -> tuple[Path, ...]:
    """``(train, val, test or None)``: ``data``'s ``train/``, ``val/`` (or
    ``validation/``) and ``test/``, else the data of the run's config."""
    if data is not None:
        root = Path(data)
        val = root / "val" if source_exists(root / "val") else root / "validation"
        test = root / "test"
        found = (root / "train", val, test if source_exists(test) else None)
    elif opened.config is not None:
        roots = data_roots(opened.config)
        found = (roots.knn_train or roots.train, roots.val, roots.test)
    else:
        raise ValueError("weights from outside dino_opt need --data ROOT (train/ and val/)")
    for split in found[:2]:
        if split is None or not source_exists(split):
            raise FileNotFoundError(f"data {str(split)!r} does not exist (need train/ and val/)")
    return found


def run_linear_probe(
    path: str | os.PathLike,
    data: str | os.PathLike | None = None,
    *,
    which: str = "teacher",
    image_size: int | None = None,
    device: str = "auto",
    head: str | os.PathLike | None = None,
    force: bool = False,
    **options,
) -> dict:
    """:func:`~dino_opt.eval.linear_probe` of the weights at ``path``; with
    ``head``, its best classifier saved there (:mod:`~dino_opt.weights.heads`;
    checked before the probe: an existing file only with ``force``)."""
    if head is not None:
        check_head_output(head, force, (path, data))
    opened = open_backbone(path, which)
    train, val, test = probe_data(opened, data)
    size = image_size or opened.image_size
    result = linear_probe(
        opened.net,
        ProbeData(train, val, test),
        size,
        device=resolve_device(device),
        keep_head=head is not None,
        input=_input(opened),
        **options,
    )
    result.update(
        weights=str(path),
        format=opened.format,
        backbone=opened.name,
        which=which,
        data={"train": str(train), "val": str(val), "test": str(test) if test else None},
    )
    if head is not None:
        best = result.pop("head")
        dim = len(best["weight"]) // (best["n_blocks"] + int(best["avgpool"]))
        top = result["best"]
        info = {
            "kind": "linear",
            "classes": result["classes"],
            "image_size": size,
            "dim": dim,
            "n_blocks": best["n_blocks"],
            "avgpool": best["avgpool"],
            "classifier": top["name"],
            "val_top1": top["val_top1"],
        }
        tensors = {"weight": best["weight"], "bias": best["bias"]}
        result["head"] = str(save_head(head, tensors, _record(info, opened, path, which)))
    return result


def _input(opened: OpenedBackbone) -> dict:
    """The evaluation loader's image mode and normalisation of ``opened``."""
    return {"image_mode": opened.image_mode, "mean": list(opened.mean), "std": list(opened.std)}


def _record(info: dict, opened: OpenedBackbone, path, which: str) -> dict:
    """A head's record: ``info``, the normalisation and the backbone's identity."""
    identity = {
        "weights": str(path),
        "format": opened.format,
        "backbone": opened.name,
        "which": which,
        "fingerprint": backbone_fingerprint(opened.net),
    }
    norm = {"mean": list(opened.mean), "std": list(opened.std), "image_mode": opened.image_mode}
    return {**info, **norm, "backbone": identity}


def run_dense_probe(
    path: str | os.PathLike,
    data: str | os.PathLike | None = None,
    *,
    which: str = "teacher",
    image_size: int | None = None,
    device: str = "auto",
    head: str | os.PathLike | None = None,
    force: bool = False,
    **options,
) -> dict:
    """:func:`~dino_opt.eval.dense.dense_probe` of the weights at ``path`` on
    the segmentation splits of ``data`` (image/mask pairs; the built-in data
    set has them), else of the run's data; with ``head``, the trained head
    saved there (:mod:`~dino_opt.weights.heads`; checked before the probe:
    an existing file only with ``force``)."""
    if head is not None:
        check_head_output(head, force, (path, data))
    opened = open_backbone(path, which)
    root = Path(data) if data is not None else _data_root(opened)
    splits = segmentation_splits(root)
    if splits is None:
        raise ValueError(f"{str(root)!r} has no masks (image/mask pairs) for a dense probe")
    size = image_size or opened.image_size
    result = dense_probe(
        opened.net,
        splits["train"],
        splits["val"],
        splits.get("test"),
        image_size=size,
        device=resolve_device(device),
        keep_head=head is not None,
        **options,
    )
    result.update(
        weights=str(path), format=opened.format, backbone=opened.name, which=which, data=str(root)
    )
    if head is not None:
        info = {
            "kind": "dense",
            "classes": result["classes"],
            "image_size": size,
            "in_dim": result["embed_dim"],
            "num_classes": result["num_classes"],
            "val_miou": result["miou"],
        }
        tensors = result.pop("head")
        result["head"] = str(save_head(head, tensors, _record(info, opened, path, which)))
    return result


def _data_root(opened: OpenedBackbone) -> Path:
    if opened.config is None:
        raise ValueError("weights from outside dino_opt need --data ROOT")
    return data_roots(opened.config).train.parent


def show_weights(
    path: str | os.PathLike,
    images,
    kind: str = "attention",
    output_dir: str | os.PathLike = ".",
    *,
    which: str = "teacher",
    image_size: int | None = None,
    **options,
) -> list[Path]:
    """:func:`~dino_opt.eval.show` of the backbone of the weights at
    ``path``: one PNG per image file of ``images``, in ``output_dir``.
    Images keep their aspect; their longer side becomes ``image_size``
    (default 448 px, in whole patches)."""
    return show(open_backbone(path, which).net, images, kind, output_dir, image_size, **options)


def embeddings_of(
    path: str | os.PathLike,
    data,
    *,
    which: str = "teacher",
    image_size: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
    **options,
) -> tuple[Embeddings, dict]:
    """:func:`~dino_opt.eval.embed_images` of every image of ``data`` under
    the ``which`` backbone of the weights at ``path``, at the size and
    normalisation it was trained at (``image_size`` overrides the size),
    and the record written beside them (weights, format, size, mean, std,
    data, counts). ``options``: ``batch_size``, ``patch_maps``, ``amp``,
    ``num_threads``."""
    opened = open_backbone(path, which)
    size = image_size or opened.image_size
    emb = embed_images(
        opened.net.to(device),
        data,
        size,
        device=device,
        mean=opened.mean,
        std=opened.std,
        progress=progress,
        image_mode=opened.image_mode,
        **options,
    )
    meta = {
        "weights": str(path),
        "format": opened.format,
        "backbone": opened.name,
        "which": which,
        "image_size": size,
        "mean": list(opened.mean),
        "std": list(opened.std),
        "data": str(data),
        "images": len(emb.names),
        "failed": len(emb.failed),
        "image_mode": opened.image_mode,
    }
    return emb, meta


def embed_weights(
    path: str | os.PathLike,
    data,
    output: str | os.PathLike,
    *,
    which: str = "teacher",
    image_size: int | None = None,
    device: str | torch.device = "cpu",
    progress: bool = False,
    force: bool = False,
    **options,
) -> dict:
    """:func:`~dino_opt.eval.embed_images` of every image of ``data`` under
    the ``which`` backbone of the weights at ``path``, at the size and
    normalisation it was trained at (``image_size`` overrides the size),
    written to ``output`` (:func:`~dino_opt.eval.write_embeddings`; by rank 0
    only when a process group shards the work). ``options``: ``batch_size``,
    ``patch_maps``, ``amp``, ``num_threads``. Returns what was done:
    ``images`` embedded, ``failed`` (``"name: cause"``), ``files`` written.
    The output is checked first (:func:`~dino_opt.eval.check_embeddings_output`:
    an existing one replaced only with ``force``)."""
    check_embeddings_output(output, options.get("patch_maps", False), force, (path, data))
    emb, meta = embeddings_of(
        path, data, which=which, image_size=image_size, device=device, progress=progress, **options
    )
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    files = write_embeddings(emb, output, meta) if first else []
    return {**meta, "failed": emb.failed, "files": [str(f) for f in files], "dim": emb.cls.shape[1]}


def predict(
    weights: str | os.PathLike,
    head: str | os.PathLike,
    data,
    output: str | os.PathLike,
    *,
    which: str = "teacher",
    device: str | torch.device = "cpu",
    batch_size: int = 64,
    force: bool = False,
) -> dict:
    """Applies the head file ``head`` over the ``which`` backbone of
    ``weights`` (refused unless they are the weights it was trained on) to
    every image of ``data``, at the size and normalisation it was trained
    at: a linear head writes ``output`` as CSV (``path``, ``class``,
    ``score``, then each class's probability), a dense head one PNG per
    image into the folder ``output`` (each pixel its class index; the
    image's centre square, resized to the probe's size). Returns
    the ``kind``, the ``images`` done, the ``failed`` ones (``"name:
    cause"``) and the ``output``, written atomically: an existing one
    replaced only with ``force``, never the weights, the head or the data."""
    check_output(output, force, (weights, head, data))
    tensors, record = load_head(head)
    opened = open_backbone(weights, which)
    check_identity(opened.net, record, weights, head)
    try:
        model = head_model(opened.net, tensors, record).to(device)
    except (IndexError, KeyError, RuntimeError) as e:  # a record this backbone cannot take
        raise ValueError(f"{head}: its head does not fit {weights}'s backbone ({e})") from None
    size = record["image_size"]
    # the dense probe's images are resized whole to size x size (a square image: exactly so)
    resize = size if record["kind"] == "dense" else None
    out = embed_images(
        model,
        data,
        size,
        device=device,
        batch_size=batch_size,
        mean=record["mean"],
        std=record["std"],
        resize_size=resize,
        image_mode=record.get("image_mode", "rgb"),
    )
    if record["kind"] == "linear":
        write_classes(Path(output), out.names, out.cls, record["classes"])
    else:
        write_masks(Path(output), out.names, out.cls, size)
    return {
        "kind": record["kind"],
        "images": len(out.names),
        "failed": out.failed,
        "output": str(output),
    }


def evaluate_weights(
    path: str | os.PathLike,
    data: str | os.PathLike,
    image_size: int | None = None,
    k: int = 20,
    temperature: float = 0.07,
    device: str = "auto",
    which: str = "teacher",
) -> dict:
    """k-NN top-1/top-5 of the backbone of the weights at ``path`` (any
    format :func:`read_weights` reads) on ``data/train`` vs ``data/val``,
    and ``data/test`` where it exists. ``image_size`` defaults to the size
    the network was trained at where the weights say it (a dino_opt run or
    export), else to the size a ViT's position table was made for (224 for
    a ResNet)."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    weights = read_weights(path)
    sd = (weights.teacher if which == "teacher" else weights.student)["backbone"]
    net, native = evaluation_backbone(weights, sd)
    image_size = image_size or (weights.training or {}).get("image_size") or native
    load_strict(net, sd, "backbone", weights.path)
    root = Path(data)
    splits = {s: root / s for s in ("val", "test") if (root / s).is_dir()}
    if "val" not in splits or not (root / "train").is_dir():
        raise FileNotFoundError(f"data folder {str(root)!r} needs train/ and val/ folders")
    dev = resolve_device(device)
    results = knn_evaluate_splits(
        net.to(dev), root / "train", splits, image_size, dev, k=k, temperature=temperature
    )
    out = {
        "weights": str(path),
        "format": weights.format,
        "backbone": weights.backbone,
        "which": which,
        "image_size": image_size,
        "device": str(dev),
    }
    for split, r in results.items():
        prefix = "" if split == "val" else f"{split}_"
        out |= {f"{prefix}top1": r["top1"], f"{prefix}top5": r["top5"]}
    return out
