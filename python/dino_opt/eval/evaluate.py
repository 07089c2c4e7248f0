"""Evaluating what training made: k-NN accuracy of a checkpoint's backbone
(``dino-opt knn``), a checkpoint's state read back (:func:`load_checkpoint`),
and the evaluation of the training job (:func:`evaluate_run`: the trained
teacher beside the same network at random initialisation, on the held-out
val split and on the test split, by k-NN, the linear probe on cached
features and, where the data has masks, the dense probe; the attention and
PCA pictures of a few val images; :func:`verdict` says when training made
the features worse than random)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ..checkpoint import CheckpointManager
from ..config import Config, refuse_code
from ..data import segmentation_splits, source_exists
from ..models import eval_mode
from ..observe import RunFolder, RunLog
from ..runtime import resolve_device
from ..train import DataRoots, build_models, build_source, data_roots, loader_input
from .dense import dense_probe
from .features import EvalImageFolder, extract_features
from .knn import knn_classify, knn_evaluate_splits, tsne_plot
from .linear import (
    ProbeData,
    ProbeFeatures,
    input_columns,
    linear_probe,
    logistic_regression,
    probe_features,
)
from .pictures import PICTURE_KINDS, picture_arrays, safe_stem

__all__ = [
    "draw_pictures",
    "evaluate_backbone",
    "evaluate_checkpoint",
    "evaluate_run",
    "evaluate_teacher",
    "adapt_verdict",
    "load_checkpoint",
    "pixel_baseline",
    "report_keys",
    "verdict",
]


def load_checkpoint(
    path: str | os.PathLike, keys: Sequence[str] = ("student", "teacher", "config")
) -> dict:
    """The state dict of a checkpoint written by ``dino-opt train``, on the
    CPU (read with ``weights_only``). ``path`` is a checkpoint file, a run
    folder or its ``checkpoints/`` folder (then the newest checkpoint that
    verifies). A checkpoint whose recorded SHA-256 does not match is refused.
    A missing file raises ``FileNotFoundError``; an unreadable one, or one
    without ``keys``, ``ValueError``; both name the path."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        run = RunFolder(path)
        folder = run.checkpoints if run.checkpoints.is_dir() else path
        latest = CheckpointManager(folder).load_latest()
        if latest is None:
            raise FileNotFoundError(f"no checkpoint that verifies in {str(folder)!r}")
        ckpt, path = latest
    else:
        manager = CheckpointManager(path.parent)
        ckpt = manager.load(path, verify=manager.sidecar_path(path).exists())
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise ValueError(
            f"checkpoint {str(path)!r} lacks {', '.join(map(repr, missing))} "
            f"(it has {', '.join(map(repr, ckpt)) or 'nothing'}); dino-opt train writes "
            "'student', 'teacher' and 'config'"
        )
    return ckpt


def evaluate_checkpoint(
    path: str | os.PathLike,
    data: str | os.PathLike | None = None,
    image_size: int | None = None,
    k: int | None = None,
    temperature: float | None = None,
    device: str = "auto",
    which: str = "teacher",
    trust_code: bool = False,
) -> dict:
    """k-NN top-1/top-5 of the backbone of a training checkpoint (``which``:
    its teacher or student) on ``data/train`` vs ``data/val``, and vs
    ``data/test`` too where that exists (``test_top1``, ``test_top5``).

    Defaults come from the checkpoint's config, as the training job used
    them: the data of :func:`~dino_opt.train.data_roots`, ``image_size`` the
    global crop size, ``k`` and ``temperature`` its ``eval`` section; so the
    teacher's top-1 equals the run's ``knn_top1_trained`` on the same device.
    A network the checkpoint's config names as ``package.module:function``
    is built (its code imported and called) only with ``trust_code``."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    ckpt = load_checkpoint(path, keys=(which, "config"))
    try:
        cfg = Config.from_dict(ckpt["config"])
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: its config is not valid: {e}") from e
    refuse_code(cfg, f"checkpoint {str(path)!r}", trust_code)
    roots = _eval_roots(cfg, data)
    student, teacher = build_models(cfg)
    model = teacher if which == "teacher" else student
    try:
        model.load_state_dict(ckpt[which])
    except (RuntimeError, TypeError, AttributeError) as e:
        raise ValueError(
            f"checkpoint {str(path)!r}: its {which} weights do not fit the model of its "
            f"config ({cfg.model.backbone}): {' '.join(str(e).split())}"
        ) from e
    dev = resolve_device(device)
    size = image_size if image_size is not None else _train_size(cfg)
    train, splits = _opened(cfg, roots)
    results = knn_evaluate_splits(
        model.backbone.to(dev),
        train,
        splits,
        size,
        dev,
        k=k if k is not None else cfg.eval.knn_k,
        temperature=temperature if temperature is not None else cfg.eval.knn_temperature,
        input=loader_input(cfg),
    )
    val = results["val"]
    out = {
        "checkpoint": str(path),
        "which": which,
        "train": str(roots.knn_train or roots.train),
        "val": str(roots.val),
        "image_size": size,
        "device": str(dev),
        **{key: value for key, value in val.items() if key != "n_eval"},
        "n_val": val["n_eval"],
    }
    if "test" in results:
        out.update(
            test=str(roots.test),
            test_top1=results["test"]["top1"],
            test_top5=results["test"]["top5"],
            n_test=results["test"]["n_eval"],
        )
    return out


def _train_size(cfg: Config) -> int:
    """The side of the training's global crops the evaluation resizes to
    (with crop-size pairs, the first pair's)."""
    return cfg.augmentation.crop_size_pairs[0][0]


def _opened(cfg: Config, roots: DataRoots) -> tuple:
    """The k-NN's training data and its held-out splits, opened with the
    config's data options."""
    train = build_source(cfg, roots.knn_train or roots.train)
    splits = {"val": roots.val, **({"test": roots.test} if roots.test is not None else {})}
    return train, {name: build_source(cfg, root) for name, root in splits.items()}


def _eval_roots(cfg: Config, data: str | os.PathLike | None) -> DataRoots:
    """The data ``evaluate_checkpoint`` uses: ``data``'s train/val/test (val:
    ``val`` or ``validation``), else the config's; val must exist."""
    if data is not None:
        root = Path(data)
        val = root / "val" if source_exists(root / "val") else root / "validation"
        test = root / "test"
        roots = DataRoots(root / "train", val, test if source_exists(test) else None)
    else:
        roots = data_roots(cfg)
        if roots.val is None:
            raise FileNotFoundError(
                f"no held-out split beside {str(roots.train)!r} (no "
                f"{str(roots.train.parent / 'val')!r}); pass --data ROOT with ROOT/train "
                "and ROOT/val"
            )
    for split in (roots.knn_train or roots.train, roots.val):
        if not source_exists(split):
            raise FileNotFoundError(f"data {str(split)!r} does not exist")
    return roots


def _splits(roots: DataRoots) -> dict:
    """The labelled splits of a run's evaluation: train (the k-NN's
    neighbours and the probes' training data), val and test."""
    splits = {"train": roots.knn_train or roots.train, "val": roots.val}
    return splits | ({"test": roots.test} if roots.test is not None else {})


def _knn(cfg: Config, feats: dict, layout: dict) -> dict:
    """k-NN top-1/top-5 of val and test on the final class token (the
    columns of the probe features the backbone's output is)."""
    cols = input_columns(layout, 1, False)
    train_x, train_y = feats["train"]
    out = {}
    for split in ("val", "test"):
        if split in feats:
            x, y = feats[split]
            out[split] = knn_classify(
                F.normalize(train_x[:, cols], dim=1),
                train_y,
                F.normalize(x[:, cols], dim=1),
                y,
                k=cfg.eval.knn_k,
                temperature=cfg.eval.knn_temperature,
            )
    return out


def evaluate_backbone(
    cfg: Config,
    roots: DataRoots,
    net: nn.Module,
    device: torch.device,
    *,
    linear: bool = True,
    dense: bool = True,
) -> dict:
    """One backbone's evaluation on a run's data: ``knn`` (val, test),
    ``linear`` (the grid and the logistic regression on features extracted
    once; ``cfg.eval.linear``), ``dense`` (where the data has masks and
    is read as RGB; ``cfg.eval.dense``), and the val ``features``/``labels``
    for plots."""
    size, splits = _train_size(cfg), _splits(roots)
    probe = ProbeFeatures(net).to(device).eval()
    start = time.perf_counter()
    sources = ProbeData(**splits).opened()
    amp = device.type == "cuda"
    feats = probe_features(probe, sources, size, device, amp=amp, input=loader_input(cfg))
    if probe.layout["dim"] is None:
        probe.layout["dim"] = feats["train"][0].shape[1]
    out: dict[str, Any] = {"knn": _knn(cfg, feats, probe.layout)}
    out["seconds"] = {"features_and_knn": time.perf_counter() - start}
    if linear and cfg.eval.linear:
        out["linear"] = linear_probe(
            net,
            ProbeData(**splits),
            size,
            epochs=cfg.eval.linear_epochs,
            device=device,
            cached=feats,
            seed=cfg.hardware.seed,
            input=loader_input(cfg),
        )
    # the dense probe reads its images and masks through PIL, as 8-bit RGB
    rgb = cfg.data.image_mode == "rgb"
    wanted = dense and cfg.eval.dense and rgb
    masks = segmentation_splits(Path(roots.train).parent) if wanted else None
    if masks is not None and "val" in masks and probe.tokens:
        out["dense"] = dense_probe(
            net,
            masks["train"],
            masks["val"],
            masks.get("test"),
            image_size=size,
            device=device,
            epochs=cfg.eval.dense_epochs,
            seed=cfg.hardware.seed,
        )
    cols = input_columns(probe.layout, 1, False)
    out["val_features"] = F.normalize(feats["val"][0][:, cols], dim=1)
    out["val_labels"] = feats["val"][1]
    out["classes"] = out.get("linear", {}).get("classes") or EvalImageFolder(roots.val).classes
    return out


def report_keys(name: str, result: dict) -> dict:
    """The report's numbers of one backbone (``name``: trained, random_init)."""
    keys = {}
    for split, prefix in (("val", ""), ("test", "test_")):
        if split in result["knn"]:
            keys[f"knn_{prefix}top1_{name}"] = result["knn"][split]["top1"]
        linear = result.get("linear")
        if linear and f"{split}_top1" in linear["best"]:
            keys[f"linear_{prefix}top1_{name}"] = linear["best"][f"{split}_top1"]
        if linear and f"{split}_top1" in linear.get("logreg", {}):
            keys[f"logreg_{prefix}top1_{name}"] = linear["logreg"][f"{split}_top1"]
        dense = result.get("dense")
        if dense and split in dense:
            keys[f"dense_{prefix}miou_{name}"] = dense[split]["miou"]
    return keys


def _summary(result: dict) -> dict:
    """What ``evaluation.json`` keeps of one backbone's evaluation."""
    keep = {k: v for k, v in result.items() if k in ("knn", "dense", "seconds")}
    if "linear" in result:
        keep["linear"] = {k: v for k, v in result["linear"].items() if k != "classes"}
    return keep


def draw_pictures(
    cfg: Config,
    roots: DataRoots,
    nets: dict,
    folder: RunFolder,
    log: RunLog | None = None,
    step: int = 0,
) -> list[Path]:
    """The attention and PCA pictures of ``cfg.eval.pictures`` val images
    (spread over the split) for each backbone of ``nets`` (name -> ViT), at
    twice the training crop size, each image's PCA its own, in ``folder.pictures``
    (``<image>_<kind>_<name>.png``) and in TensorBoard."""
    count = cfg.eval.pictures if cfg.data.image_mode == "rgb" else 0  # PIL reads 8-bit RGB
    if not count or not all(hasattr(n, "get_intermediate_layers") for n in nets.values()):
        return []
    val = EvalImageFolder(roots.val, 2 * _train_size(cfg))
    picks = sorted({i * len(val) // count for i in range(min(count, len(val)))})
    images = [val[i][0] for i in picks]
    names = [safe_stem(Path(val.source.describe(i)).stem) for i in picks]
    folder.pictures.mkdir(parents=True, exist_ok=True)
    written = []
    for name, net in nets.items():
        for kind in PICTURE_KINDS:
            # One image at a time: a PCA fitted over unlike images (a texture
            # and a shape) spends its first component telling them apart.
            for image, stem in zip(images, names, strict=True):
                (picture,) = picture_arrays(net, [image], kind, [stem])
                path = folder.pictures / f"{stem}_{kind}_{name}.png"
                Image.fromarray(picture).save(path)
                written.append(path)
                if log is not None:
                    log.image(f"pictures/{kind}_{name}/{stem}", picture, step)
    return written


def evaluate_teacher(
    cfg: Config,
    roots: DataRoots,
    teacher: nn.Module,
    device: torch.device,
    log: RunLog,
    step: int,
    epoch: int,
    name: str = "teacher",
) -> dict:
    """The teacher during training (``eval.every_epochs``): k-NN and the
    linear probe, as an ``evaluation`` row of the metrics (``epoch``: the
    epochs done; keys such as ``knn_top1_<name>``) and TensorBoard scalars
    ``eval_<name>/*``; returns the row."""
    with eval_mode(teacher):
        keys = report_keys(name, evaluate_backbone(cfg, roots, teacher, device, dense=False))
    row = {"step": step, "epoch": epoch, "event": "evaluation", **keys}
    log.event(row)
    log.scalars(f"eval_{name}", keys, step)
    return row


def evaluate_run(
    cfg: Config,
    roots: DataRoots,
    trained: nn.Module,
    random_init: nn.Module,
    device: torch.device,
    folder: RunFolder,
    log: RunLog | None = None,
    step: int = 0,
    start: nn.Module | None = None,
) -> dict:
    """The end of a training run: the trained teacher's backbone beside the
    same network at random initialisation (and, for a run that started from
    weights, beside ``start``, those weights, and beside raw pixels:
    :func:`pixel_baseline`), on the held-out ``val`` split
    and, where there is one, the ``test`` split (never used to tune
    anything): k-NN, the linear probe (``eval.linear``) and the dense probe
    (``eval.dense``, where the data has masks); the whole of it in
    ``evaluation.json``, every classifier's row included; the pictures of a
    few val images (``eval.pictures``); with ``logging.tsne``, a t-SNE map
    of each one's val features. Returns the report's keys:
    ``knn_top1_trained``, ``knn_top1_random_init``, ``linear_top1_*``,
    ``logreg_top1_*``, ``dense_miou_*`` and their ``test`` twins (``*_start``
    and ``pixels_*`` with ``start``), ``verdict`` when training made the
    features worse than random initialisation, and ``adapt_verdict``
    (:func:`adapt_verdict`) with ``start``."""
    nets = {"trained": trained.to(device), "random_init": random_init.to(device)}
    labels = {
        "trained": "trained teacher",
        "random_init": "teacher at random initialisation",
        "start": "teacher at the weights it started from",
    }
    if start is not None:
        nets["start"] = start.to(device)
    report, details = {}, {}
    for name, net in nets.items():
        result = evaluate_backbone(cfg, roots, net, device)
        report.update(report_keys(name, result))
        details[name] = _summary(result)
        if log is not None:
            log.scalars(f"eval_{name}", report_keys(name, result), step)
        if cfg.logging.tsne:
            top1 = result["knn"]["val"]["top1"]
            tsne_plot(
                result["val_features"],
                result["val_labels"],
                result["classes"],
                folder.tsne(name),
                title=f"t-SNE of val features: {labels[name]} (k-NN top-1 {top1:.1f}%)",
                seed=cfg.hardware.seed,
            )
    pictures = draw_pictures(cfg, roots, nets, folder, log, step)
    if pictures:
        report["pictures"] = str(folder.pictures)
    if start is not None:
        details["pixels"] = pixel_baseline(cfg, roots)
        report.update({f"pixels_{k}": v for k, v in details["pixels"].items() if "top1" in k})
        report["adapt_verdict"] = adapt_verdict(report)
    folder.evaluation.write_text(json.dumps(details, indent=2) + "\n")
    message = verdict(report, cfg)
    if message:
        report["verdict"] = message
    return report


#: The side of the downscaled images of :func:`pixel_baseline`.
PIXEL_SIZE = 16


def pixel_baseline(cfg: Config, roots: DataRoots) -> dict:
    """The floor any features must beat: DINOv2's logistic regression on
    the raw pixels of each image (centre crop, downscaled to
    :data:`PIXEL_SIZE` pixels a side, normalised), on the run's splits;
    ``val_top1`` (``test_top1``) and ``best_c``."""
    sources = ProbeData(**_splits(roots)).opened()
    feats = {
        name: extract_features(
            nn.Flatten(), src, image_size=PIXEL_SIZE, normalize=False, distributed=False
        )
        for name, src in sources.items()
    }
    result = logistic_regression(feats["train"], feats["val"], feats.get("test"))
    return {k: v for k, v in result.items() if k != "rows"}


def adapt_verdict(report: dict) -> str:
    """The verdict of a run that started from weights: better or worse than
    where it started, by how much (k-NN, the linear probe, the dense probe;
    val), with raw pixels' figure."""
    kinds = [
        (k, m)
        for k, m in (("knn", "top1"), ("linear", "top1"), ("dense", "miou"))
        if f"{k}_{m}_start" in report and f"{k}_{m}_trained" in report
    ]
    diffs = {k: report[f"{k}_{m}_trained"] - report[f"{k}_{m}_start"] for k, m in kinds}
    total = sum(diffs.values())
    word = "better" if total > 0 else "worse" if total < 0 else "no better"
    scores = ", ".join(
        f"{k} {report[f'{k}_{m}_trained']:.1f} % vs "
        f"{report[f'{k}_{m}_start']:.1f} % ({diffs[k]:+.1f})"
        for k, m in kinds
    )
    pixels = report.get("pixels_val_top1")
    floor = f"; raw pixels {pixels:.1f} %" if pixels is not None else ""
    return f"adapting made the features {word} than where they started ({scores} on val){floor}"


def verdict(report: dict, cfg: Config) -> str | None:
    """A warning when the trained teacher scores below its random
    initialisation on val (k-NN or the linear probe), with what to try;
    None when it does not."""

    def below(kind: str) -> bool:
        return report.get(f"{kind}_top1_trained", 0) < report.get(f"{kind}_top1_random_init", 0)

    worse = [kind for kind in ("knn", "linear") if below(kind)]
    if not worse:
        return None
    sched, aug = cfg.schedule, cfg.augmentation
    scores = ", ".join(
        f"{k} {report[f'{k}_top1_trained']:.1f} % vs {report[f'{k}_top1_random_init']:.1f} %"
        for k in worse
    )
    return (
        f"training made the features worse than random initialisation ({scores} on val). "
        f"Try: more epochs (schedule.epochs={sched.epochs}); a teacher momentum that lets "
        f"the teacher move in a run this short (schedule.momentum_teacher="
        f"{sched.momentum_teacher}: the teacher averages about "
        f"{1 / max(1e-9, 1 - sched.momentum_teacher):.0f} steps; 0.99 or lower for a few "
        f"thousand steps); crop scales that keep the object in the crops "
        f"(augmentation.global_crops_scale={list(aug.global_crops_scale)}, "
        f"local_crops_scale={list(aug.local_crops_scale)})"
    )
