"""A student that is not a ViT, written for the library it comes from:

- a built-in ResNet (torchvision's network): ``dino`` and ``torchvision``
  write its state dict as it is, which torchvision's ``resnet18()`` and
  timm's ``resnet18`` both load (``fc`` apart); ``timm`` writes the same;
- a network of the user's own (``timm:NAME``, ``torchvision:NAME``,
  ``package.module:function``): its own state dict, as ``net.state_dict()``
  gives it, in ``dino`` (any of them), ``timm`` (a timm student) or
  ``torchvision`` (a torchvision student);
- a built-in ConvNeXt: ``dino`` (DINOv3's layout, which its hub loads),
  ``timm`` (timm's ``convnext_*`` without its classifier) and ``hf`` (a
  folder of Hugging Face's ``ConvNextModel``: ``config.json`` and
  ``model.safetensors``).

Any other pair of student and format is refused in one line, naming the
formats that write it. A torch file gets the input its network was trained
at in a sidecar; a Hugging Face folder keeps it in its config and metadata.

Also here: the file writers every export uses (:func:`save_torch`,
:func:`save_safetensors`, :func:`write_hf_folder`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save

from ...checkpoint import write_file, write_folder
from ...config import is_external
from ...models.convnext import (
    hf_convnext_config,
    to_hf_convnext_state_dict,
    to_timm_convnext_state_dict,
)
from ..load.reading import TRAINING_KEY, write_training_sidecar

__all__ = ["CNN_FORMATS", "export_cnn", "save_safetensors", "save_torch", "write_hf_folder"]

#: Formats only a non-ViT student is written in.
CNN_FORMATS = ("torchvision",)


def _formats(backbone: str) -> dict[str, str]:
    """The formats ``backbone`` is written in, each with how a target loads it."""
    load = "net.load_state_dict(torch.load(path))"
    if is_external(backbone):
        source, _, name = backbone.partition(":")
        build = {
            "timm": f"timm.create_model({name!r}, num_classes=0)",
            "torchvision": f"torchvision.models.get_model({name!r})",
        }
        out = {"dino": f"net = {build.get(source, name + '()')}; {load}"}
        if source in build:
            out[source] = out["dino"]
        return out
    timm = f"net = timm.create_model({backbone!r}, num_classes=0); {load}"
    if backbone.startswith("resnet"):
        tv = f"net = torchvision.models.{backbone}(); net.fc = torch.nn.Identity(); {load}"
        return {"dino": tv, "torchvision": tv, "timm": timm}
    return {
        "dino": f"DINOv3's hub {backbone}: {load}",
        "timm": timm,
        "hf": "transformers.ConvNextModel.from_pretrained(path)",
    }


def save_torch(state: dict, path: Path) -> None:
    """``state`` as a torch file at ``path``, written atomically (replacing
    an earlier output once complete)."""
    write_file(path, lambda f: torch.save(state, f))


def save_safetensors(tensors: dict, path: Path, metadata: dict) -> None:
    """``tensors`` (made contiguous) and string ``metadata`` as a safetensors
    file at ``path``, written atomically."""
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    write_file(path, lambda f: f.write(data))


def write_hf_folder(output: Path, config: dict, tensors: dict, meta: dict) -> None:
    """A Hugging Face model folder: ``config.json`` (with the training input
    of ``meta``, which transformers keeps as it is) and ``model.safetensors``,
    filled beside ``output`` and swapped in whole."""
    if TRAINING_KEY in meta:
        config = config | {TRAINING_KEY: json.loads(meta[TRAINING_KEY])}
    text = (json.dumps(config, indent=2) + "\n").encode()

    def fill(folder: Path) -> None:
        (folder / "config.json").write_bytes(text)
        save_safetensors(tensors, folder / "model.safetensors", meta)

    write_folder(output, fill)


def export_cnn(
    fmt: str, sd: dict, backbone: str, output: Path, meta: dict, prepare: Callable[[], None]
) -> tuple[str, list[str]]:
    """Writes the state dict ``sd`` of the student ``backbone`` (a
    dino_opt backbone's: a user's network under ``net.``) as ``fmt`` to
    ``output`` (a torch file; a folder for ``hf``) with ``meta`` (the
    export's string metadata), calling ``prepare`` (the output's checks)
    once ``fmt`` is known to fit; returns (how a target loads it, notes).
    ValueError naming the formats that write it for another ``fmt``."""
    formats = _formats(backbone)
    if fmt not in formats:
        raise ValueError(
            f"--format {fmt} does not write a {backbone} student; {' or '.join(formats)} write it"
        )
    prepare()
    notes = []
    if is_external(backbone):
        sd = {k.removeprefix("net."): v for k, v in sd.items()}
        notes.append(f"{backbone}'s own state dict")
    elif backbone.startswith("convnext") and fmt == "timm":
        sd = to_timm_convnext_state_dict(sd)
    if fmt == "hf":
        write_hf_folder(output, hf_convnext_config(sd), to_hf_convnext_state_dict(sd), meta)
    else:
        save_torch(sd, output)
        if TRAINING_KEY in meta:
            write_training_sidecar(output, json.loads(meta[TRAINING_KEY]))
    return formats[fmt], notes
