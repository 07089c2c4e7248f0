"""k-NN evaluation of frozen features, as in DINO, and a t-SNE map of them.

``knn_classify`` is DINO's weighted k-nearest-neighbour classifier: features
are L2-normalised, each test row takes its ``k`` most cosine-similar training
rows, each neighbour votes for its class with weight ``exp(similarity / T)``,
and the class with the largest summed vote is the prediction. Top-1 and top-5
accuracy are in percent. ``extract_features`` (from ``features``, exported
here too) runs a backbone over an evaluation data set (resize, centre crop,
ImageNet normalisation, as DINO's ``eval_knn.py``), and ``knn_evaluate`` does
both for a train and a validation folder. ``tsne_plot`` draws a 2-D t-SNE embedding
(exact t-SNE written here in torch; sklearn is not needed) coloured by class.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..data import DataSource
from .features import EvalImageFolder, extract_features

__all__ = [
    "EvalImageFolder",
    "extract_features",
    "knn_classify",
    "knn_evaluate",
    "knn_evaluate_splits",
    "tsne",
    "tsne_plot",
]


# ---------------------------------------------------------------- k-NN


def _check_features(name: str, features: torch.Tensor, labels: torch.Tensor) -> None:
    if not isinstance(features, torch.Tensor) or features.dim() != 2:
        raise ValueError(f"{name}_features must be a 2-D tensor [N, D]")
    if not isinstance(labels, torch.Tensor) or labels.shape != features.shape[:1]:
        raise ValueError(
            f"{name}_labels must be a tensor of shape [{features.shape[0]}], "
            f"got {tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels)}"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"{name}_labels must be integers, got {labels.dtype}")
    if len(labels) and labels.min().item() < 0:
        raise ValueError(f"{name}_labels must be >= 0 (unlabelled samples cannot be scored)")


@torch.no_grad()
def knn_classify(
    train_features: torch.Tensor,
    train_labels: torch.Tensor,
    test_features: torch.Tensor,
    test_labels: torch.Tensor,
    k: int = 20,
    temperature: float = 0.07,
    num_classes: int | None = None,
    chunk: int | None = None,
) -> dict[str, float]:
    """DINO's weighted k-NN: ``{"top1": %, "top5": %}`` of the test rows.

    Features are L2-normalised here (so raw features work too) and compared
    by cosine similarity, on the device of ``train_features``. ``k`` is
    clamped to the number of training rows. The top-5 set is the
    ``min(5, num_classes)`` classes with the largest votes (ties to the lower
    class index); a class no neighbour voted for is never counted as found
    (DINO's code leaves that case to the sort order). A row's weights are
    computed as ``exp((sim - max sim) / T)`` in float64: the same vote
    ranking as ``exp(sim / T)``, without overflow at small T. Test rows are processed
    ``chunk`` at a time (default: about 2^24 similarities per chunk) to bound
    memory; the result does not depend on ``chunk``.
    """
    _check_features("train", train_features, train_labels)
    _check_features("test", test_features, test_labels)
    if train_features.shape[1] != test_features.shape[1]:
        raise ValueError(
            f"train and test features differ in dimension: {train_features.shape[1]} "
            f"vs {test_features.shape[1]}"
        )
    if len(train_features) == 0:
        raise ValueError("train_features is empty")
    if len(test_features) == 0:
        raise ValueError("test_features is empty")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    seen = max(train_labels.max().item(), test_labels.max().item()) + 1
    if num_classes is None:
        num_classes = seen
    elif num_classes < seen:
        raise ValueError(f"num_classes={num_classes} but a label is {seen - 1}")
    if chunk is None:
        chunk = max(1, (1 << 24) // len(train_features))
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk!r}")

    device = train_features.device
    train = F.normalize(train_features.float(), dim=1)
    train_labels = train_labels.to(device=device, dtype=torch.int64)
    test_labels = test_labels.to(device=device, dtype=torch.int64)
    k = min(k, len(train))
    top_n = min(5, num_classes)
    top1 = top5 = 0
    for start in range(0, len(test_features), chunk):
        test = F.normalize(test_features[start : start + chunk].to(device).float(), dim=1)
        target = test_labels[start : start + chunk]
        sim, idx = (test @ train.T).topk(k, dim=1)
        # exp(sim / T) overflows float32 for small T; scaling a row's weights
        # by exp(-max sim / T) leaves its vote ranking unchanged, and float64
        # keeps even far neighbours' weights from underflowing.
        weights = torch.exp((sim.double() - sim[:, :1].double()) / temperature)
        neighbours = train_labels[idx]
        votes = torch.zeros(len(test), num_classes, dtype=torch.float64, device=device)
        votes.scatter_add_(1, neighbours, weights)
        order = torch.sort(votes, dim=1, descending=True, stable=True).indices[:, :top_n]
        hit = order == target[:, None]
        top1 += hit[:, 0].sum().item()
        voted = (neighbours == target[:, None]).any(dim=1)
        top5 += (hit.any(dim=1) & voted).sum().item()
    n = len(test_features)
    return {"top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n}


def knn_evaluate_splits(
    backbone: torch.nn.Module,
    train_root: str | os.PathLike | DataSource,
    eval_roots: dict[str, str | os.PathLike | DataSource],
    image_size: int,
    device: str | torch.device = "cpu",
    k: int = 20,
    temperature: float = 0.07,
    batch_size: int = 128,
    num_workers: int = 0,
    amp: bool | torch.dtype | None = None,
    return_features: bool = False,
    distributed: bool = False,
    input: dict | None = None,
) -> dict[str, dict[str, Any]]:
    """k-NN of several held-out splits (``{"val": ..., "test": ...}``) on the
    features of one labelled training split, which are extracted once; each
    split is any data :class:`EvalImageFolder` reads. The features come from
    the native evaluation loader (:func:`extract_features` on the split's
    source; ``num_workers``: its threads, 0 for all cores), under bf16
    autocast on a GPU unless ``amp`` says otherwise. ``distributed``: every
    rank of the initialised process group calls this and extracts its shard
    (leave it False when only one rank evaluates). ``input``: the loader's
    image mode and normalisation (``image_mode``, ``mean``, ``std``).
    Per split: ``top1``, ``top5`` (percent), ``k``, ``temperature``,
    ``n_train``, ``n_eval``, ``classes``; with ``return_features`` also
    ``train_features``/``train_labels`` and ``eval_features``/``eval_labels``
    (normalised, on the CPU), for plots."""
    train_set = EvalImageFolder(train_root, image_size)
    eval_sets = {name: EvalImageFolder(root, image_size) for name, root in eval_roots.items()}
    num_classes = len(train_set.classes)
    for eval_set in eval_sets.values():
        if train_set.named and eval_set.named and train_set.classes != eval_set.classes:
            raise ValueError(
                f"the classes (class folders or names) of {train_set.source.spec!r} and "
                f"{eval_set.source.spec!r} "
                f"differ: {train_set.classes} vs {eval_set.classes}"
            )
        num_classes = max(num_classes, len(eval_set.classes))
    classes = train_set.classes + [str(i) for i in range(len(train_set.classes), num_classes)]
    device = torch.device(device)
    common = dict(
        device=device,
        batch_size=batch_size,
        amp=amp,
        num_workers=num_workers,
        image_size=image_size,
        distributed=distributed,
        **(input or {}),
    )
    train_f, train_y = extract_features(backbone, train_set.source, **common)
    results = {}
    for name, eval_set in eval_sets.items():
        eval_f, eval_y = extract_features(backbone, eval_set.source, **common)
        scores = knn_classify(
            train_f.to(device),
            train_y,
            eval_f,
            eval_y,
            k=k,
            temperature=temperature,
            num_classes=num_classes,
        )
        result: dict[str, Any] = {
            **scores,
            "k": k,
            "temperature": temperature,
            "n_train": len(train_set),
            "n_eval": len(eval_set),
            "classes": list(classes),
        }
        if return_features:
            result.update(
                train_features=train_f,
                train_labels=train_y,
                eval_features=eval_f,
                eval_labels=eval_y,
            )
        results[name] = result
    return results


def knn_evaluate(
    backbone: torch.nn.Module,
    train_root: str | os.PathLike,
    val_root: str | os.PathLike,
    image_size: int,
    device: str | torch.device = "cpu",
    k: int = 20,
    temperature: float = 0.07,
    batch_size: int = 128,
    num_workers: int = 0,
    amp: bool | torch.dtype | None = None,
    return_features: bool = False,
) -> dict[str, Any]:
    """Extract features of two ImageFolder trees and classify the second by
    k-NN on the first. Returns ``top1``, ``top5`` (percent), ``k``,
    ``temperature``, ``n_train``, ``n_val``, ``classes``; with
    ``return_features`` also ``train_features``/``train_labels`` and
    ``val_features``/``val_labels`` (normalised, on the CPU), for plots."""
    result = knn_evaluate_splits(
        backbone,
        train_root,
        {"val": val_root},
        image_size,
        device,
        k,
        temperature,
        batch_size,
        num_workers,
        amp,
        return_features,
    )["val"]
    result["n_val"] = result.pop("n_eval")
    if return_features:
        result["val_features"] = result.pop("eval_features")
        result["val_labels"] = result.pop("eval_labels")
    return result


# ---------------------------------------------------------------- t-SNE


def tsne_affinities(distances2: torch.Tensor, perplexity: float, tol: float = 1e-5) -> torch.Tensor:
    """Row-conditional affinities ``p_{j|i}`` [N, N] whose entropy is
    ``log(perplexity)`` in every row: a bisection on each row's precision
    ``beta`` in ``exp(-beta * d2)``, all rows at once (float64)."""
    n = len(distances2)
    d2 = distances2.double()
    eye = torch.eye(n, dtype=torch.bool, device=d2.device)
    target = math.log(perplexity)
    lo = torch.full((n, 1), -math.inf, dtype=torch.float64, device=d2.device)
    hi = torch.full((n, 1), math.inf, dtype=torch.float64, device=d2.device)
    # Distances relative to each row's nearest neighbour: exp never
    # underflows to an all-zero row, whatever the scale of the features.
    d2 = (d2 - d2.masked_fill(eye, math.inf).min(dim=1, keepdim=True).values).clamp_min(0)
    beta = torch.ones((n, 1), dtype=torch.float64, device=d2.device)
    beta = beta / d2.masked_fill(eye, 0).mean(dim=1, keepdim=True).clamp_min(1e-12)
    for _ in range(200):
        logits = (-beta * d2).masked_fill(eye, -math.inf)
        p = torch.softmax(logits, dim=1)
        entropy = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=1, keepdim=True)
        diff = entropy - target
        if diff.abs().max().item() < tol:
            break
        # Entropy falls as beta grows: too high -> raise beta. Double or
        # halve until the answer is bracketed, then bisect.
        up = diff > 0
        lo = torch.where(up, beta, lo)
        hi = torch.where(up, hi, beta)
        beta = torch.where(
            torch.isfinite(hi) & torch.isfinite(lo),
            (lo + hi) / 2,
            torch.where(up, beta * 2, beta / 2),
        )
    return p


def tsne(
    features: torch.Tensor,
    perplexity: float = 30.0,
    n_iter: int = 1000,
    seed: int = 0,
    pca_dim: int = 50,
    early_exaggeration: float = 12.0,
    learning_rate: float | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Exact t-SNE of ``features`` [N, D] into 2-D: a ``[N, 2]`` float32 tensor.

    The recipe of van der Maaten and Hinton (2008) with the usual
    optimisations: PCA to ``pca_dim`` dimensions first; Gaussian affinities
    calibrated to ``perplexity`` (clamped to ``(N - 1) / 3``) and
    symmetrised; Student-t similarities in the map; gradient descent with
    momentum 0.5 then 0.8, per-parameter gains, and early exaggeration for the
    first quarter of the iterations (at most 250); PCA initialisation scaled to
    a standard deviation of 1e-4 (deterministic for a given ``seed``, which
    only breaks ties between coincident points). O(N^2) memory and time per
    iteration: meant for up to a few thousand points.

    ``threads`` sets torch's intra-op threads for the call (restored after);
    by default 1 up to 2,048 points: each iteration is some twenty operations
    too small to gain from threads, and on a shared CPU threads lose badly
    (docs/evaluation.md).
    """
    x = torch.as_tensor(features).detach().double().cpu()
    if x.dim() != 2 or len(x) < 2:
        raise ValueError(f"features must be [N, D] with N >= 2, got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("features hold NaN or inf")
    n = len(x)
    if threads is None:
        threads = 1 if n <= 2048 else torch.get_num_threads()
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _tsne(x, perplexity, n_iter, seed, pca_dim, early_exaggeration, learning_rate)
    finally:
        torch.set_num_threads(saved)


def _tsne(
    x: torch.Tensor,
    perplexity: float,
    n_iter: int,
    seed: int,
    pca_dim: int,
    early_exaggeration: float,
    learning_rate: float | None,
) -> torch.Tensor:
    n = len(x)
    if n < 4:  # too few points for a neighbourhood: place them by PCA
        pcs = _pca(x, 2)
        return (pcs / pcs.std().clamp_min(1e-12)).float()
    perplexity = min(float(perplexity), (n - 1) / 3.0)
    x = x - x.mean(dim=0)
    if x.shape[1] > pca_dim:
        x = _pca(x, pca_dim)
    d2 = torch.cdist(x, x).square()
    p = tsne_affinities(d2, perplexity)
    p = (p + p.T) / (2 * n)
    p = p.clamp_min(1e-12)

    gen = torch.Generator().manual_seed(seed)
    y = _pca(x, 2)
    y = y + 1e-6 * y.std() * torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y = y / y[:, 0].std().clamp_min(1e-12) * 1e-4
    # The descent runs in float32 (as common implementations do): twice as fast.
    p, y = p.float(), y.float()
    lr = learning_rate if learning_rate is not None else max(n / early_exaggeration / 4, 50.0)
    exaggerate_until = min(250, n_iter // 4)
    update = torch.zeros_like(y)
    gains = torch.ones_like(y)
    p_exaggerated = p * early_exaggeration
    for it in range(n_iter):
        early = it < exaggerate_until
        momentum = 0.5 if early else 0.8
        # num_ij = 1 / (1 + |y_i - y_j|^2), from the Gram matrix: one matmul
        # instead of a pairwise-difference tensor.
        sq = (y * y).sum(dim=1)
        num = torch.addmm(sq[:, None] + sq[None, :], y, y.T, alpha=-2.0).clamp_min_(0.0)
        num.add_(1.0).reciprocal_().fill_diagonal_(0.0)
        inv_z = 1.0 / num.sum().item()
        # dC/dy_i = 4 sum_j (p_ij - q_ij) num_ij (y_i - y_j), q_ij = num_ij / Z
        w = torch.addcmul((p_exaggerated if early else p) * num, num, num, value=-inv_z)
        grad = 4.0 * (w.sum(dim=1, keepdim=True) * y - w @ y)
        same_sign = (grad > 0) == (update > 0)
        gains = torch.where(same_sign, gains * 0.8, gains + 0.2).clamp_min_(0.01)
        update = momentum * update - lr * gains * grad
        y = y + update
        y = y - y.mean(dim=0)
    return y.float()


def _pca(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Projection of centred ``x`` on its top ``dim`` principal axes, with a
    sign convention (largest loading positive) so the result is reproducible."""
    x = x - x.mean(dim=0)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    axes = vh[:dim]
    flip = torch.sign(axes.gather(1, axes.abs().argmax(dim=1, keepdim=True)))
    out = x @ (axes * flip).T
    if out.shape[1] < dim:  # fewer features than dim: pad with zeros
        out = F.pad(out, (0, dim - out.shape[1]))
    return out


def tsne_plot(
    features: torch.Tensor,
    labels: torch.Tensor | Sequence[int],
    class_names: Sequence[str],
    path: str | os.PathLike,
    title: str = "t-SNE of features",
    perplexity: float = 30.0,
    n_iter: int = 1000,
    seed: int = 0,
) -> Path:
    """Save a PNG scatter plot of the 2-D t-SNE of ``features`` coloured by
    ``labels`` (names from ``class_names``) to ``path``; returns the path.
    Uses matplotlib's object API and the Agg canvas (no pyplot state), so it
    works on machines without a display and leaves the caller's figures alone."""

    labels = torch.as_tensor(labels).reshape(-1).cpu()
    if len(labels) != len(features):
        raise ValueError(f"{len(labels)} labels for {len(features)} feature rows")
    if len(labels) and (labels.min() < 0 or labels.max() >= len(class_names)):
        raise ValueError(f"labels must lie in [0, {len(class_names)}) to be named")
    emb = tsne(features, perplexity=perplexity, n_iter=n_iter, seed=seed).numpy()
    labels = labels.numpy()

    fig = Figure(figsize=(7, 6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = colormaps["tab10" if len(class_names) <= 10 else "tab20"]
    for c, name in enumerate(class_names):
        sel = labels == c
        if sel.any():
            ax.scatter(emb[sel, 0], emb[sel, 1], s=9, color=cmap(c % cmap.N), label=name)
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, markerscale=1.5)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
