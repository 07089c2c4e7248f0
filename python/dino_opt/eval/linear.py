"""Linear probes of frozen features, as DINOv2 and DINOv3 evaluate them.

The grid (:class:`LinearProbeGrid`): linear classifiers over every
combination of a learning rate (13, from 1e-5 to 0.1, each scaled by
``batch * world / 256``), the class tokens of the last 1 or 4 blocks, with or
without the average of the last block's patch tokens: 52 classifiers trained
together by SGD (momentum 0.9, no weight decay, a cosine schedule to 0), so
one backbone forward per batch serves every one of them. The classifier with
the best val top-1 is the probe's answer, reported on test.

Two ways to feed it (:func:`linear_probe`):

- ``augmented``: the protocol as published: each step draws random-resized
  crops (scale 0.08 to 1, bicubic) with horizontal flips from the native
  loader and runs the frozen backbone on them;
- ``fast``: the backbone runs once over each split (centre crop, no
  augmentation; :func:`extract_features`), and every classifier, and
  DINOv2's L-BFGS logistic regression (:func:`logistic_regression`), train on
  those cached features in seconds.

All classifiers of one input kind are one ``[L, D, C]`` weight, and SGD with
momentum and no weight decay is linear in the learning rate, so scaling each
classifier's gradient by its own rate and stepping with the schedule's factor
alone gives exactly what one optimiser group per classifier gives (tested
against 52 separate ``nn.Linear`` in float64).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import DataSource, MultiCropLoader, open_source
from .features import extract_features

__all__ = [
    "EPOCHS",
    "LEARNING_RATES",
    "LOGREG_C",
    "N_LAST_BLOCKS",
    "LinearProbeGrid",
    "ProbeData",
    "ProbeFeatures",
    "ProbeSpec",
    "accuracy",
    "fit_grid",
    "input_columns",
    "linear_probe",
    "logistic_regression",
    "logreg_fit",
    "logreg_objective",
    "probe_features",
    "probe_table",
]

#: DINOv2's learning rates (before scaling by batch * world / 256).
LEARNING_RATES = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1)
#: Default epochs per mode: DINOv2's 10 with augmented crops; 100 on cached
#: features, where an epoch costs a few matrix products and 10 epochs of a
#: small data set are too few steps (the demo's teacher: val top-1 48.0 after
#: 10, 51.4 after 30, 53.6 after 100 epochs).
EPOCHS = {"fast": 100, "augmented": 10}
#: The numbers of last blocks whose class tokens feed a classifier.
N_LAST_BLOCKS = (1, 4)
#: The inverse regularisation strengths of the logistic regression (DINOv2's
#: 45 values from 1e-6 to 1e5, evenly spaced in log).
LOGREG_C = tuple(10.0 ** (-6 + 11 * i / 44) for i in range(45))


# ---------------------------------------------------------------- features


class ProbeFeatures(nn.Module):
    """A frozen backbone's probe inputs, one row per image: the normalised
    class tokens of its last ``n_blocks`` blocks (oldest first), then the
    mean of the last block's normalised patch tokens (register tokens left
    out), ``[B, (n_blocks + 1) * D]``. A backbone without tokens (a ResNet)
    gives its pooled features ``[B, D]`` and ``n_blocks`` is 1 with no patch
    average. ``layout`` says which: ``dim``, ``n_blocks``, ``avgpool``.
    ``n_blocks`` None: DINOv2's largest grid entry (4), or every block of a
    shallower ViT."""

    def __init__(self, backbone: nn.Module, n_blocks: int | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.tokens = hasattr(backbone, "get_intermediate_layers")
        depth = len(backbone.blocks) if self.tokens else 1
        n_blocks = min(max(N_LAST_BLOCKS), depth) if n_blocks is None else n_blocks
        if self.tokens and not 1 <= n_blocks <= depth:
            raise ValueError(f"n_blocks must be in [1, {depth}] for this ViT, got {n_blocks}")
        dim = getattr(backbone, "embed_dim", None) or getattr(backbone, "num_features", None)
        self.layout = {
            "dim": int(dim) if dim is not None else None,
            "n_blocks": n_blocks if self.tokens else 1,
            "avgpool": self.tokens,
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tokens:
            return self.backbone(x)
        layers = self.backbone.get_intermediate_layers(x, self.layout["n_blocks"])
        first_patch = 1 + getattr(self.backbone, "num_register_tokens", 0)
        parts = [t[:, 0] for t in layers] + [layers[-1][:, first_patch:].mean(dim=1)]
        return torch.cat(parts, dim=1)


@dataclass(frozen=True)
class ProbeSpec:
    """One classifier of the grid: its input (class tokens of the last
    ``n_blocks`` blocks, ``avgpool``: with the patch average) and its
    learning rate (``lr`` as given, ``scaled_lr`` after the batch scaling)."""

    n_blocks: int
    avgpool: bool
    lr: float
    scaled_lr: float

    @property
    def name(self) -> str:
        return f"blocks{self.n_blocks}_avgpool{int(self.avgpool)}_lr{self.lr:g}"


def input_columns(layout: dict, n_blocks: int, avgpool: bool) -> slice | list[int]:
    """The columns of a :class:`ProbeFeatures` row a classifier reads."""
    d, n_max = layout["dim"], layout["n_blocks"]
    cls = list(range((n_max - n_blocks) * d, n_max * d))
    return cls + list(range(n_max * d, (n_max + 1) * d)) if avgpool else cls


# ---------------------------------------------------------------- the grid


class LinearProbeGrid(nn.Module):
    """Every classifier of the grid, one ``[L, D_in, C]`` weight per input
    kind (``n_blocks``, ``avgpool``), initialised as DINOv2's (normal, std
    0.01; zero bias). ``forward`` maps probe features ``[B, F]`` to logits
    ``[K, B, C]`` of all K classifiers, in the order of ``specs``."""

    def __init__(
        self,
        layout: dict,
        num_classes: int,
        learning_rates: Sequence[float] = LEARNING_RATES,
        n_last_blocks: Sequence[int] = N_LAST_BLOCKS,
        batch_size: int = 128,
        world_size: int = 1,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"a linear probe needs at least 2 classes, got {num_classes}")
        if not learning_rates or any(not lr > 0 for lr in learning_rates):
            raise ValueError(f"learning_rates must be positive, got {list(learning_rates)}")
        kinds = [
            (n, pool)
            for n in sorted(set(n_last_blocks))
            if n <= layout["n_blocks"]
            for pool in ((False, True) if layout["avgpool"] else (False,))
        ]
        if not kinds:
            raise ValueError(f"n_last_blocks {list(n_last_blocks)}: none fits the features")
        scale = batch_size * world_size / 256.0
        self.specs = [
            ProbeSpec(n, pool, float(lr), float(lr) * scale)
            for n, pool in kinds
            for lr in learning_rates
        ]
        self.kinds = kinds
        self.columns = [input_columns(layout, n, pool) for n, pool in kinds]
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        n_lr = len(learning_rates)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(n_lr, len(cols), num_classes, generator=gen) * 0.01)
            for cols in self.columns
        )
        self.biases = nn.ParameterList(
            nn.Parameter(torch.zeros(n_lr, 1, num_classes)) for _ in self.columns
        )
        self.register_buffer(
            "lr_scale", torch.tensor([s.scaled_lr for s in self.specs]), persistent=False
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        outs = []
        for cols, w, b in zip(self.columns, self.weights, self.biases, strict=True):
            x = features[:, cols].to(w.dtype)
            outs.append(torch.baddbmm(b, x.unsqueeze(0).expand(len(w), -1, -1), w))
        return torch.cat(outs)

    def scale_gradients(self, factor: float = 1.0) -> None:
        """Multiplies each classifier's gradient by its own learning rate
        (times ``factor``), so one SGD step at the schedule's rate is each
        classifier's own step."""
        n_lr = len(self.weights[0])
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            rates = self.lr_scale[i * n_lr : (i + 1) * n_lr].to(w.dtype) * factor
            for p in (w, b):
                if p.grad is not None:
                    p.grad.mul_(rates.view(-1, 1, 1))


def cosine_factor(step: int, total: int) -> float:
    """The factor of torch's ``CosineAnnealingLR`` (to 0) at ``step`` of ``total``."""
    return 0.5 * (1.0 + math.cos(math.pi * step / total))


def fit_grid(
    grid: LinearProbeGrid,
    epochs: Callable[[int], Iterable[tuple[torch.Tensor, torch.Tensor]]],
    num_epochs: int,
    steps_per_epoch: int,
    device: torch.device,
) -> dict:
    """Trains every classifier of ``grid`` on the batches ``epochs(e)``
    gives for each epoch ``e`` (probe features ``[B, F]``, labels ``[B]``):
    SGD with momentum 0.9 and no weight decay, each classifier at its own
    rate times a cosine from 1 to 0 over ``num_epochs * steps_per_epoch``
    steps. Returns ``steps`` and the last step's mean loss per classifier."""
    opt = torch.optim.SGD(grid.parameters(), lr=1.0, momentum=0.9, weight_decay=0.0)
    total, step, last = num_epochs * steps_per_epoch, 0, None
    for epoch in range(num_epochs):
        for features, labels in epochs(epoch):
            if step >= total:
                break
            logits = grid(features.to(device))
            target = labels.to(device).expand(len(logits), -1)
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none")
            per_classifier = loss.view(len(logits), -1).mean(dim=1)
            opt.zero_grad(set_to_none=True)
            per_classifier.sum().backward()
            grid.scale_gradients()
            for group in opt.param_groups:
                group["lr"] = cosine_factor(step, total)
            opt.step()
            step, last = step + 1, per_classifier.detach()
    return {"steps": step, "loss": last.tolist() if last is not None else None}


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 and top-5 accuracy in percent of logits ``[K, N, C]`` (one
    row per classifier) against ``labels [N]``: two ``[K]`` tensors."""
    top = logits.topk(min(5, logits.shape[-1]), dim=-1).indices
    hit = top == labels.to(top.device).view(1, -1, 1)
    return 100.0 * hit[..., 0].double().mean(1), 100.0 * hit.any(-1).double().mean(1)


@torch.no_grad()
def grid_scores(
    grid: LinearProbeGrid, features: torch.Tensor, labels: torch.Tensor, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 and top-5 of every classifier of ``grid`` on probe features."""
    device = grid.lr_scale.device
    logits = torch.cat(
        [
            grid(features[i : i + chunk].to(device)).float().cpu()
            for i in range(0, len(features), chunk)
        ],
        dim=1,
    )
    return accuracy(logits, labels)


# ---------------------------------------------------------------- logistic regression


def logreg_fit(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    c: float,
    init: torch.Tensor | None,
    max_iter: int,
) -> torch.Tensor:
    """Minimises ``sum_i CE_i + ||W||^2 / (2 C)`` (bias not penalised) by
    L-BFGS; returns ``[D + 1, C]`` (last row: the bias)."""
    theta = torch.zeros(x.shape[1] + 1, num_classes, dtype=x.dtype) if init is None else init
    theta = theta.clone().requires_grad_(True)
    xb = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    opt = torch.optim.LBFGS(
        [theta],
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=1e-9,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = logreg_objective(theta, xb, y, c)
        loss.backward()
        return loss

    opt.step(closure)
    return theta.detach()


def logreg_objective(theta: torch.Tensor, xb: torch.Tensor, y: torch.Tensor, c: float):
    """The regularised multinomial logistic loss of ``theta [D + 1, C]`` on
    inputs with a column of ones ``xb [N, D + 1]``, scaled by ``1 / N``."""
    data = F.cross_entropy(xb @ theta, y, reduction="sum")
    return (data + theta[:-1].square().sum() / (2.0 * c)) / len(xb)


def logistic_regression(
    train: tuple[torch.Tensor, torch.Tensor],
    val: tuple[torch.Tensor, torch.Tensor],
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    cs: Sequence[float] = LOGREG_C,
    max_iter: int = 100,
    coarse: int = 4,
    threads: int = 1,
) -> dict:
    """DINOv2's logistic regression: L2-normalised features, multinomial
    logistic regression with an L2 penalty ``||W||^2 / (2C)`` fitted by
    L-BFGS (float64) for values C of ``cs``, C chosen by val top-1 and
    reported on test. The sweep is coarse to fine: every ``coarse``-th C
    first (ascending, each fit warm-started from the last), then the Cs
    around the best of those (``coarse=1``: every C). Returns ``best_c``,
    ``val_top1``, ``val_top5``, (``test_top1``, ``test_top5``) and ``rows``
    (C, val top-1) of the Cs fitted.

    ``threads``: torch's intra-op threads during the fits (restored after);
    one by default, since each L-BFGS step is a few small operations that
    lose to threading (docs/evaluation.md)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _logistic_regression(train, val, test, cs, max_iter, coarse)
    finally:
        torch.set_num_threads(saved)


def _logistic_regression(train, val, test, cs, max_iter: int, coarse: int) -> dict:
    xt, yt = _normalised(train)
    xv, yv = _normalised(val)
    num_classes = int(max(yt.max(), yv.max(), test[1].max() if test else 0)) + 1
    cs = sorted(cs)
    fits: dict[int, tuple[float, float, torch.Tensor]] = {}

    def sweep(indices: Iterable[int], theta: torch.Tensor | None) -> None:
        for i in indices:
            theta = logreg_fit(xt, yt, num_classes, cs[i], theta, max_iter)
            top1, top5 = (v.item() for v in accuracy(_logits(theta, xv)[None], yv))
            fits[i] = (top1, top5, theta)

    step = max(1, int(coarse))
    sweep(range(0, len(cs), step), None)
    best = max(fits, key=lambda i: (fits[i][0], -i))
    near = [i for i in range(max(0, best - step + 1), min(len(cs), best + step)) if i not in fits]
    sweep([i for i in near if i < best][::-1], fits[best][2])  # down from the best
    sweep([i for i in near if i > best], fits[best][2])
    best = max(fits, key=lambda i: (fits[i][0], -i))
    top1, top5, theta = fits[best]
    rows = [{"C": cs[i], "val_top1": fits[i][0]} for i in sorted(fits)]
    out = {"best_c": cs[best], "val_top1": top1, "val_top5": top5, "rows": rows}
    if test is not None:
        xs, ys = _normalised(test)
        t1, t5 = accuracy(_logits(theta, xs)[None], ys)
        out.update(test_top1=t1.item(), test_top5=t5.item())
    return out


def _normalised(split: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return F.normalize(split[0].double(), dim=1), split[1].long()


def _logits(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x @ theta[:-1] + theta[-1]


# ---------------------------------------------------------------- the probe


@dataclass
class ProbeData:
    """Labelled splits of a probe: ``train`` and ``val`` (required) and
    ``test`` (optional), each any source the loader opens."""

    train: Any
    val: Any
    test: Any | None = None

    def opened(self) -> dict[str, DataSource]:
        splits = {"train": self.train, "val": self.val, "test": self.test}
        sources = {k: open_source(v) for k, v in splits.items() if v is not None}
        for name, src in sources.items():
            if int(src.labels().min()) < 0:
                raise ValueError(
                    f"{name} data {src.spec!r} has unlabelled images; a "
                    "linear probe needs a class for every image"
                )
        names = {k: list(s.classes) for k, s in sources.items() if s.classes}
        if len({tuple(v) for v in names.values()}) > 1:
            detail = "; ".join(f"{k}: {v}" for k, v in names.items())
            raise ValueError(f"the classes differ between the splits ({detail})")
        return sources


def _num_classes(sources: dict[str, DataSource]) -> tuple[int, list[str]]:
    n = max(int(s.labels().max()) + 1 for s in sources.values())
    named = next((list(s.classes) for s in sources.values() if s.classes), [])
    return max(n, len(named)), named or [str(i) for i in range(n)]


def _cached_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int):
    """Shuffled batches of cached features, reshuffled each epoch (seeded)."""

    def epoch(e: int):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + e))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]

    return epoch


def _augmented_batches(
    probe: ProbeFeatures,
    source: DataSource,
    image_size: int,
    batch_size: int,
    seed: int,
    device: torch.device,
    amp: bool,
    input: dict | None = None,
):
    """Random-resized crops (scale 0.08-1) with flips from the native loader
    (two crops per image per epoch), through the frozen backbone; ``input``:
    the loader's image mode and normalisation, as for the features of val
    and test (:func:`probe_features`), so that images that are not 8-bit RGB
    are read as the training loader read them."""
    loader = MultiCropLoader(
        source,
        batch_size=max(1, batch_size // 2),
        global_size=image_size,
        local_size=image_size,
        n_local=0,
        global_scale=(0.08, 1.0),
        seed=seed,
        augment=AUGMENT_FLIP_ONLY,
        group_by_resolution=True,
        **(input or {}),
    )
    dtype = torch.bfloat16 if amp else None

    @torch.no_grad()
    def epoch(e: int):
        loader.set_epoch(e)
        for batch in loader:
            images = batch.crops[0].to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                feats = probe(images).float()
            yield feats, batch.labels.repeat(2)

    return epoch, len(loader), loader


#: The loader's photometric options for the probe's training crops: flips
#: only (no noise either, for images that are not 8-bit RGB).
AUGMENT_FLIP_ONLY = {
    "flip_p": 0.5,
    "jitter_p": 0.0,
    "grayscale_p": 0.0,
    "blur_p_global1": 0.0,
    "blur_p_global2": 0.0,
    "blur_p_local": 0.0,
    "solarize_p_global2": 0.0,
    "noise_p": 0.0,
}


def linear_probe(
    backbone: nn.Module,
    data: ProbeData,
    image_size: int,
    *,
    mode: str = "fast",
    epochs: int | None = None,
    batch_size: int = 128,
    learning_rates: Sequence[float] = LEARNING_RATES,
    n_last_blocks: Sequence[int] = N_LAST_BLOCKS,
    logreg: bool = True,
    logreg_c: Sequence[float] = LOGREG_C,
    device: str | torch.device = "cpu",
    amp: bool | None = None,
    seed: int = 0,
    cached: dict | None = None,
    keep_head: bool = False,
    input: dict | None = None,
) -> dict:
    """The linear probe of a frozen ``backbone`` on ``data``: every classifier
    of the grid trained for ``epochs`` (default: :data:`EPOCHS` of the mode)
    on train (``mode``: ``fast`` on cached centre-crop features,
    ``augmented`` on random-resized, flipped crops through the backbone
    each step), the best on val top-1 reported on val
    and test; with ``logreg`` (fast mode) DINOv2's logistic regression too.
    Returns a JSON-ready dict: ``best`` (name, val and test top-1/top-5),
    ``rows`` (every classifier), ``logreg``, ``seconds`` and the settings.
    ``cached`` (``{"train": (x, y), ...}``) reuses extracted probe features.
    ``keep_head``: ``head`` holds the best classifier (:func:`best_classifier`;
    tensors, not JSON). ``input``: the loader's image mode and normalisation
    (:func:`probe_features`), for the features and the augmented crops alike."""
    if mode not in ("fast", "augmented"):
        raise ValueError(f"mode must be 'fast' or 'augmented', got {mode!r}")
    epochs = EPOCHS[mode] if epochs is None and mode in EPOCHS else epochs
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive integer, got {epochs!r}")
    device = torch.device(device)
    amp = device.type == "cuda" if amp is None else amp
    sources = data.opened()
    num_classes, classes = _num_classes(sources)
    probe = ProbeFeatures(backbone).to(device).eval()
    start = time.perf_counter()
    feats = cached or probe_features(probe, sources, image_size, device, amp, batch_size, input)
    extracted = time.perf_counter()
    if probe.layout["dim"] is None:
        probe.layout["dim"] = feats["train"][0].shape[1]
    x, y = feats["train"]
    batch_size = min(batch_size, len(x))  # a small data set: one batch of all of it
    gen = torch.Generator().manual_seed(seed)
    grid = LinearProbeGrid(
        probe.layout, num_classes, learning_rates, n_last_blocks, batch_size, 1, gen
    ).to(device)
    if mode == "fast":
        fit = fit_grid(
            grid, _cached_batches(x, y, batch_size, seed), epochs, len(x) // batch_size, device
        )
    else:
        batches, steps, loader = _augmented_batches(
            probe, sources["train"], image_size, batch_size, seed, device, amp, input
        )
        with loader:
            fit = fit_grid(grid, batches, epochs, steps, device)
    trained = time.perf_counter()
    result = _grid_result(grid, feats)
    result.update(
        mode=mode,
        epochs=epochs,
        batch_size=batch_size,
        steps=fit["steps"],
        image_size=image_size,
        classes=classes,
        n_classifiers=len(grid.specs),
        n_train=len(x),
        seconds={"features": extracted - start, "grid": trained - extracted},
    )
    if logreg and mode == "fast":
        result["logreg"] = _logreg_result(probe.layout, feats, logreg_c)
        result["seconds"]["logreg"] = time.perf_counter() - trained
    if keep_head:
        result["head"] = best_classifier(grid, result["best"]["name"])
    return result


def best_classifier(grid: LinearProbeGrid, name: str) -> dict:
    """The classifier ``name`` of ``grid`` on its own: ``weight`` ``[D_in,
    C]`` and ``bias`` ``[C]`` (CPU float32) over the probe-feature columns of
    its ``n_blocks`` and ``avgpool`` (:func:`input_columns`)."""
    k = next(i for i, spec in enumerate(grid.specs) if spec.name == name)
    spec, n_lr = grid.specs[k], len(grid.weights[0])
    kind = grid.kinds.index((spec.n_blocks, spec.avgpool))
    weight = grid.weights[kind][k % n_lr].detach().float().cpu().contiguous()
    bias = grid.biases[kind][k % n_lr, 0].detach().float().cpu().contiguous()
    return {"weight": weight, "bias": bias, "n_blocks": spec.n_blocks, "avgpool": spec.avgpool}


def probe_features(
    probe: ProbeFeatures,
    sources: dict[str, DataSource],
    image_size: int,
    device: torch.device,
    amp: bool,
    batch_size: int = 128,
    input: dict | None = None,
) -> dict:
    """``{split: (features, labels)}``: each split's probe features, centre
    crop, extracted once (on the CPU), by this process alone; ``input``: the
    loader's image mode and normalisation (``image_mode``, ``mean``, ``std``)."""
    return {
        name: extract_features(
            probe,
            src,
            device=device,
            batch_size=batch_size,
            normalize=False,
            amp=amp,
            image_size=image_size,
            distributed=False,
            **(input or {}),
        )
        for name, src in sources.items()
    }


def _grid_result(grid: LinearProbeGrid, feats: dict) -> dict:
    scores = {name: grid_scores(grid, *feats[name]) for name in ("val", "test") if name in feats}
    rows = []
    for k, spec in enumerate(grid.specs):
        row = {
            "name": spec.name,
            "n_blocks": spec.n_blocks,
            "avgpool": spec.avgpool,
            "lr": spec.lr,
            "scaled_lr": spec.scaled_lr,
        }
        for name, (top1, top5) in scores.items():
            row.update({f"{name}_top1": top1[k].item(), f"{name}_top5": top5[k].item()})
        rows.append(row)
    best = max(range(len(rows)), key=lambda k: (rows[k]["val_top1"], -k))
    return {"best": rows[best], "rows": rows}


def _logreg_result(layout: dict, feats: dict, cs: Sequence[float]) -> dict:
    """The logistic regression on the final class token (DINOv2's input)."""
    cols = input_columns(layout, 1, False)
    split = {k: (v[0][:, cols], v[1]) for k, v in feats.items()}
    return logistic_regression(split["train"], split["val"], split.get("test"), cs)


def probe_table(result: dict, top: int | None = None) -> str:
    """The grid's rows as a text table, best val top-1 first."""
    rows = sorted(result["rows"], key=lambda r: -r["val_top1"])[:top]
    test = "test_top1" in rows[0]
    head = f"{'classifier':<28} | {'val top-1':>9} | {'val top-5':>9}"
    head += f" | {'test top-1':>10} | {'test top-5':>10}" if test else ""
    lines = [head, "-" * len(head)]
    for r in rows:
        line = f"{r['name']:<28} | {r['val_top1']:9.2f} | {r['val_top5']:9.2f}"
        line += f" | {r['test_top1']:10.2f} | {r['test_top5']:10.2f}" if test else ""
        lines.append(line)
    return "\n".join(lines)
