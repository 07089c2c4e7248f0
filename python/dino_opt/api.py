"""The one-call Python API beside the command line, with its options:

    import dino_opt
    report = dino_opt.train("my_images/", model="dinov2_vits14", out="runs/mine",
                            schedule={"epochs": 20})
    emb = dino_opt.embed("runs/mine", "my_images/")    # names, cls [N, D], mean_patch
    net = dino_opt.load("dinov2_vits14")               # eval mode; net.transform(image)

:func:`train` builds its configuration the way ``dino-opt train`` does
(:func:`training_config`: the demo preset or a config file, ``--adapt``'s
keys, then ``section.key=value`` overrides), so a call and a command with
the same options run the same training. ``--adapt``'s keys live here, and
the command line takes them from here; the demo presets are
:data:`dino_opt.config.DEMO_PRESET` and :data:`dino_opt.train.DEMO_PRESETS`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from .config import Config, load_config
from .distributed import launch_distributed_training
from .eval import Embeddings, check_embeddings_output, write_embeddings
from .job import run_training
from .runtime import resolve_device
from .train import DEMO_PRESETS
from .weights import RELEASED, embeddings_of, is_weights_name, open_backbone

__all__ = [
    "ADAPT_OVERRIDES",
    "ImageTransform",
    "adapt_overrides",
    "embed",
    "load",
    "train",
    "training_config",
]

#: What ``dino-opt train --adapt WEIGHTS`` sets: both networks from the
#: weights, the backbone frozen for an epoch while the new heads warm up,
#: then a fifth of the learning rate with a layer-wise decay of 0.9.
ADAPT_OVERRIDES = (
    "model.init_from={weights}",
    "optim.freeze_backbone_epochs=1",
    "optim.backbone_lr_mult=0.2",
    "optim.layerwise_decay=0.9",
)


def _override(key: str, value) -> str:
    # the value as YAML (JSON is YAML): a path never cut at a '#', never '~' read as null
    return f"{key}={json.dumps(value)}"


def adapt_overrides(weights: str) -> list[str]:
    """The overrides of ``--adapt WEIGHTS``: :data:`ADAPT_OVERRIDES`, after
    the keys of the network a released name holds (``dinov2_vits14``:
    ``model.backbone=vit_small``, ``model.patch_size=14``, LayerScale, ...,
    and crops its patch divides)."""
    weights = str(weights)
    released = RELEASED.get(weights) if is_weights_name(weights) else None
    held = (
        [
            _override(f"{section}.{k}", v)
            for section, keys in (
                ("model", released.model),
                ("augmentation", released.augmentation),
            )
            for k, v in keys.items()
        ]
        if released
        else []
    )
    return held + [o.format(weights=json.dumps(weights)) for o in ADAPT_OVERRIDES]


def training_config(
    config: str | os.PathLike | None = None,
    demo: str | None = None,
    adapt: str | os.PathLike | None = None,
    trust_code: bool = False,
    overrides: Sequence[str] = (),
) -> Config:
    """The configuration of ``dino-opt train [--config CONFIG | --demo DEMO]
    [--adapt WEIGHTS] [--trust-code] key=value ...``: the config file (or a
    packaged config's name), else the demo of ``demo``'s recipe (default
    dino), then ``--adapt``'s keys, then the overrides."""
    if config is not None and demo is not None:
        raise ValueError("give --config or --demo, not both")
    if demo is not None and demo not in DEMO_PRESETS:
        raise ValueError(f"no demo of recipe {demo!r}: the recipes are {', '.join(DEMO_PRESETS)}")
    extra = adapt_overrides(str(adapt)) if adapt else []
    extra += ["model.trust_code=true"] if trust_code else []
    return load_config(config or DEMO_PRESETS[demo or "dino"], [*extra, *overrides])


def _keyword_overrides(options: Mapping) -> list[str]:
    """``section={"key": value}`` or ``**{"section.key": value}`` as ``section.key=value``."""
    out = []
    for name, value in options.items():
        if isinstance(value, Mapping):
            out += [_override(f"{name}.{key}", v) for key, v in value.items()]
        elif "." in name:
            out.append(_override(name, list(value) if isinstance(value, tuple) else value))
        else:
            raise ValueError(
                f"{name}={value!r}: give a section as a mapping ({name}={{'key': value}}) or a "
                f"key as '{name}.key'=value"
            )
    return out


def train(
    data: str | os.PathLike | None = None,
    *,
    model: str | os.PathLike | Mapping | None = None,
    recipe: str | None = None,
    out: str | os.PathLike | None = None,
    config: str | os.PathLike | None = None,
    trust_code: bool = False,
    quiet: bool = False,
    nproc: int = 1,
    **overrides,
) -> dict:
    """Trains as ``dino-opt train`` does and returns its report.

    ``data``: the images (``data.root``; None: the built-in data set).
    ``model``: a backbone (``vit_small``, ``timm:NAME``: ``model.backbone``)
    or weights to start from (a released name such as ``dinov2_vits14``,
    ``hf:ORG/NAME``, a file or run folder: ``--adapt``). ``recipe``: the
    recipe's demo preset to start from (dino, dinov2, dinov3, distill;
    without ``config``), or with ``config`` (a YAML file or a packaged
    config's name) its ``recipe.name``. ``out``: the run folder.
    ``model`` may also be the model section itself (``model={"backbone":
    "vit_tiny", "depth": 4}``). ``overrides``: any other key, as
    ``section={"key": value}`` or ``**{"section.key": value}`` (the data
    section's keys only dotted: ``data`` is the images). ``nproc``: the
    processes of this node, as ``dino-opt train --nproc`` starts them (one
    per GPU, or gloo processes on the CPU; a failed one restarts them all
    from the last checkpoint); the report is rank 0's."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be an int >= 1, got {nproc!r}")
    keys = [_override("data.root", str(data))] if data is not None else []
    adapt = None
    if isinstance(model, Mapping):  # the section, as the other sections are given
        overrides, model = {**overrides, "model": model}, None
    if model is not None:
        if is_weights_name(model) or Path(model).exists():
            adapt = model
        else:
            keys.append(_override("model.backbone", str(model)))
    if recipe is not None and config is not None:
        keys.append(_override("recipe.name", recipe))
    cfg = training_config(
        config,
        None if config is not None else recipe,
        adapt,
        trust_code,
        [*keys, *_keyword_overrides(overrides)],
    )
    if nproc > 1:
        return launch_distributed_training(cfg, nproc, output_dir=out)
    return run_training(cfg, output_dir=out, quiet=quiet)


def embed(
    weights: str | os.PathLike,
    data: str | os.PathLike,
    *,
    output: str | os.PathLike | None = None,
    which: str = "teacher",
    image_size: int | None = None,
    device: str = "auto",
    force: bool = False,
    **options,
) -> Embeddings:
    """The embeddings of every image of ``data`` under the backbone of
    ``weights`` (a run, a checkpoint, a weights file or a released name), as
    ``dino-opt embed`` computes them: :class:`~dino_opt.eval.Embeddings`
    (``names``: each image's path, ``cls`` and ``mean_patch`` ``[N, D]``,
    ``patches`` with ``patch_maps=True``, the ``failed`` images). With
    ``output``, also written there as the command writes it. ``options``:
    ``batch_size``, ``patch_maps``, ``amp``, ``num_threads``; an existing
    ``output`` is replaced only with ``force``."""
    if output is not None:
        check_embeddings_output(output, options.get("patch_maps", False), force, (weights, data))
    emb, meta = embeddings_of(
        weights, data, which=which, image_size=image_size, device=resolve_device(device), **options
    )
    if output is not None:
        write_embeddings(emb, output, meta)
    return emb


class ImageTransform:
    """What a network from :func:`load` takes: an image (a PIL image, a
    file path, or a uint8 ``(H, W, 3)`` array) as a normalised float tensor
    ``(3, size, size)``: the shorter side resized to ``size * 256 / 224``
    (bicubic), the centre ``size`` square, then ``mean`` and ``std``, as
    the evaluation's loader prepares images."""

    def __init__(self, size: int, mean: Sequence[float], std: Sequence[float]) -> None:
        self.size, self.mean, self.std = int(size), tuple(mean), tuple(std)

    def __repr__(self) -> str:
        return f"ImageTransform(size={self.size}, mean={self.mean}, std={self.std})"

    def __call__(self, image) -> torch.Tensor:
        if isinstance(image, (str, os.PathLike)):
            with Image.open(image) as im:
                image = im.convert("RGB")
        elif isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        image = image.convert("RGB")
        short = round(self.size * 256 / 224)
        scale = short / min(image.size)
        w, h = (
            max(self.size, round(image.width * scale)),
            max(self.size, round(image.height * scale)),
        )
        image = image.resize((w, h), Image.Resampling.BICUBIC)
        left, top = (w - self.size) // 2, (h - self.size) // 2
        image = image.crop((left, top, left + self.size, top + self.size))
        x = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255.0
        return (x - torch.tensor(self.mean).view(3, 1, 1)) / torch.tensor(self.std).view(3, 1, 1)


def load(weights: str | os.PathLike, which: str = "teacher") -> nn.Module:
    """The backbone of ``weights`` (a run, a checkpoint, a weights file in
    any format the project reads, or a released name) in eval mode, as
    ``dino-opt embed`` and ``eval`` open it; its ``transform`` is the
    :class:`ImageTransform` of the size and normalisation it was trained at."""
    opened = open_backbone(weights, which)
    net = opened.net.eval()
    net.transform = ImageTransform(opened.image_size, opened.mean, opened.std)
    return net
