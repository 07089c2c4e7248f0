"""What a run's networks take in: the channels and normalisation of its data.

With ``data.image_mode: native`` the images keep their stored depth and
channels; :func:`resolve_input` reads the training data's layout once, when
the run starts (on the first process), and writes into the config what the
rest of the run and every later reader of its ``config.yaml`` needs:
``model.in_channels`` and the per-channel ``data.mean`` / ``data.std``
(measured on the data, or recorded beside it by ``prepare``). A model of
other channels than the data's is refused in one line.
"""

from __future__ import annotations

from ..config import Config, ConfigError, apply_overrides
from ..data import data_set_layout, normalisation
from .build import build_source, data_roots

__all__ = ["loader_input", "resolve_input"]


def resolve_input(cfg: Config) -> Config:
    """``cfg`` with ``model.in_channels`` and (native images) ``data.mean``
    and ``data.std`` filled in from the training data; ConfigError naming
    the keys and the first image where they do not fit it."""
    d, m = cfg.data, cfg.model
    if d.image_mode == "rgb":
        if m.in_channels not in (None, 3):
            raise ConfigError(
                f"model.in_channels={m.in_channels}, but data.image_mode: rgb gives 3-channel "
                "images (set data.image_mode: native for images of other channels)"
            )
        if (d.mean is None) != (d.std is None) or (d.mean is not None and len(d.mean) != 3):
            raise ConfigError("data.mean and data.std: both or neither, 3 values each for RGB")
        return cfg
    source = build_source(cfg, data_roots(cfg).train)
    try:
        layout = data_set_layout(source, tries=16 if d.on_error == "skip" else 1)
        mean, std = normalisation(source, layout, d.mean, d.std)
    except ValueError as e:
        raise ConfigError(f"data.image_mode: native: {e}") from None
    channels = 3 if layout.rgb8 else layout.channels
    if m.in_channels is not None and m.in_channels != layout.channels:
        raise ConfigError(
            f"model.in_channels={m.in_channels}, but the data are {layout.describe()} images "
            f"({layout.first}): set model.in_channels={layout.channels}"
        )
    overrides = [f"data.mean={mean}", f"data.std={std}"]
    if m.in_channels is None:
        overrides.append(f"model.in_channels={channels}")
    return apply_overrides(cfg, overrides)


def loader_input(cfg: Config) -> dict:
    """The evaluation loader's keywords for ``cfg``'s images: the image mode
    and the normalisation the run trained with (nothing for 8-bit RGB with
    ImageNet's)."""
    d = cfg.data
    out: dict = {}
    if d.image_mode != "rgb":
        out["image_mode"] = d.image_mode
    if d.mean is not None:
        out.update(mean=list(d.mean), std=list(d.std))
    return out
