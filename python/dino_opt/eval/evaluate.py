"""Evaluating what training made: k-NN accuracy of a checkpoint's backbone
(``dino-opt knn``), a checkpoint's state read back (:func:`load_checkpoint`),
and the end-of-run evaluation of the training job (:func:`evaluate_run`: the
trained teacher beside the same network at random initialisation, on the
held-out val split and on the test split)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import CheckpointManager
from ..config import Config
from ..data import source_exists
from ..observe import RunFolder
from ..runtime import resolve_device
from ..train import DataRoots, build_models, build_source, data_roots
from .knn import knn_evaluate_splits, tsne_plot

__all__ = ["evaluate_checkpoint", "evaluate_run", "load_checkpoint"]


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
) -> dict:
    """k-NN top-1/top-5 of the backbone of a training checkpoint (``which``:
    its teacher or student) on ``data/train`` vs ``data/val``, and vs
    ``data/test`` too where that exists (``test_top1``, ``test_top5``).

    Defaults come from the checkpoint's config, as the training job used
    them: the data of :func:`~dino_opt.train.data_roots`, ``image_size`` the
    global crop size, ``k`` and ``temperature`` its ``eval`` section; so the
    teacher's top-1 equals the run's ``knn_top1_trained`` on the same device."""
    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    ckpt = load_checkpoint(path, keys=(which, "config"))
    try:
        cfg = Config.from_dict(ckpt["config"])
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: its config is not valid: {e}") from e
    roots = _eval_roots(cfg, data)
    student, teacher = build_models(cfg)
    model = teacher if which == "teacher" else student
    try:
        model.load_state_dict(ckpt[which])
    except (RuntimeError, TypeError, AttributeError) as e:
        raise ValueError(
            f"checkpoint {str(path)!r}: its {which} weights do not fit the model of its "
            f"config ({cfg.model.backbone}): {e}"
        ) from e
    dev = resolve_device(device)
    size = image_size if image_size is not None else cfg.augmentation.global_crop_size
    train, splits = _opened(cfg, roots)
    results = knn_evaluate_splits(
        model.backbone.to(dev), train, splits, size, dev,
        k=k if k is not None else cfg.eval.knn_k,
        temperature=temperature if temperature is not None else cfg.eval.knn_temperature,
    )  # fmt: skip
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
        out.update(test=str(roots.test), test_top1=results["test"]["top1"],
                   test_top5=results["test"]["top5"], n_test=results["test"]["n_eval"])  # fmt: skip
    return out


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


def evaluate_run(
    cfg: Config,
    roots: DataRoots,
    trained: nn.Module,
    random_init: nn.Module,
    device: torch.device,
    folder: RunFolder,
) -> dict:
    """The end of a training run: k-NN top-1 of the trained teacher's backbone
    beside the same network at random initialisation, on the held-out
    ``val`` split and, where there is one, the ``test`` split (never used to
    tune anything); with ``logging.tsne``, a t-SNE map of each one's val
    features in the run folder. Returns the report's keys
    (``knn_top1_trained``, ``knn_top1_random_init``, and with a test split
    ``knn_test_top1_trained``, ``knn_test_top1_random_init``)."""
    train, splits = _opened(cfg, roots)
    ev, tsne = cfg.eval, cfg.logging.tsne
    report = {}
    for name, net, label in (
        ("trained", trained, "trained teacher"),
        ("random_init", random_init, "teacher at random initialisation"),
    ):
        results = knn_evaluate_splits(
            net.to(device), train, splits, cfg.augmentation.global_crop_size, device,
            k=ev.knn_k, temperature=ev.knn_temperature, return_features=tsne,
        )  # fmt: skip
        report[f"knn_top1_{name}"] = results["val"]["top1"]
        if "test" in results:
            report[f"knn_test_top1_{name}"] = results["test"]["top1"]
        if tsne:
            val = results["val"]
            tsne_plot(
                val["eval_features"], val["eval_labels"], val["classes"], folder.tsne(name),
                title=f"t-SNE of val features: {label} (k-NN top-1 {val['top1']:.1f}%)",
                seed=cfg.hardware.seed,
            )  # fmt: skip
    return report
