"""A student that is not a ViT, written for the library it comes from:

- a built-in ResNet (torchvision's network): ``dino`` and ``torchvision``
  write its state dict as it is, which torchvision's ``resnet18()`` and
  timm's ``resnet18`` both load (``fc`` apart); ``timm`` writes the same;
- a network of the user's own (``timm:NAME``, ``torchvision:NAME``,
  ``package.module:function``): its own state dict, as ``net.state_dict()``
  gives it, in ``dino`` (any of them), ``timm`` (a timm student) or
  ``torchvision`` (a torchvision student);
- a built-in ConvNeXt: ``dino`` (DINOv3's layout, which its hub loads).

Any other pair of student and format is refused in one line, naming the
formats that write it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import atomic_write, fsync_dir
from ..config import is_external

__all__ = ["CNN_FORMATS", "export_cnn"]

#: Formats only a non-ViT student is written in.
CNN_FORMATS = ("torchvision",)


def _formats(backbone: str) -> dict[str, str]:
    """The formats ``backbone`` is written in, each with how a target loads it."""
    load = "net.load_state_dict(torch.load(path))"
    if is_external(backbone):
        source, _, name = backbone.partition(":")
        build = {"timm": f"timm.create_model({name!r}, num_classes=0)",
                 "torchvision": f"torchvision.models.get_model({name!r})"}  # fmt: skip
        out = {"dino": f"net = {build.get(source, name + '()')}; {load}"}
        if source in build:
            out[source] = out["dino"]
        return out
    if backbone.startswith("resnet"):
        tv = f"net = torchvision.models.{backbone}(); net.fc = torch.nn.Identity(); {load}"
        timm = f"net = timm.create_model({backbone!r}, num_classes=0); {load}"
        return {"dino": tv, "torchvision": tv, "timm": timm}
    return {"dino": f"DINOv3's hub {backbone}: {load}"}


def export_cnn(fmt: str, sd: dict, backbone: str, output: Path,
               prepare: Callable[[], None]) -> tuple[str, list[str]]:  # fmt: skip
    """Writes the state dict ``sd`` of the student ``backbone`` (a
    dino_opt backbone's: a user's network under ``net.``) as ``fmt`` to
    ``output`` (a torch file), calling ``prepare`` (the output's checks)
    once ``fmt`` is known to fit; returns (how a target loads it, notes).
    ValueError naming the formats that write it for another ``fmt``."""
    formats = _formats(backbone)
    if fmt not in formats:
        raise ValueError(f"--format {fmt} does not write a {backbone} student; "
                         f"{' or '.join(formats)} write it")  # fmt: skip
    prepare()
    notes = []
    if is_external(backbone):
        sd = {k.removeprefix("net."): v for k, v in sd.items()}
        notes.append(f"{backbone}'s own state dict")
    atomic_write(output, lambda f: torch.save(sd, f))
    fsync_dir(output.parent)
    return formats[fmt], notes
