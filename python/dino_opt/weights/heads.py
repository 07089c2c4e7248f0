"""Probe heads kept and applied: the best classifier of a linear probe, or
the trained head of a dense probe, saved with the identity of the backbone
it was trained on (``dino-opt eval linear|dense ... --head FILE``), and
applied to any images (``dino-opt predict WEIGHTS HEAD DATA -o OUT``,
:func:`~dino_opt.weights.predict`): here the file, the networks that apply
a head and the files they write.

A head file is a safetensors file whose metadata ``dino_opt_head`` says its
``kind`` (``linear`` or ``dense``), its ``classes``, the ``image_size`` and
normalisation its features were taken at, the probe's input (linear:
``n_blocks``, ``avgpool``; dense: ``in_dim``, ``num_classes``), its
validation score, and the backbone's identity: the weights' path, format,
name, ``which`` and a ``fingerprint`` (SHA-256 of its parameters), which
``predict`` checks against the weights it is given.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from ..checkpoint import check_output, write_file, write_folder
from ..eval import DenseLinearHead, ProbeFeatures
from ..eval.dense import patch_feature_map
from ..eval.linear import input_columns

__all__ = [
    "HEAD_KEY",
    "backbone_fingerprint",
    "check_head_output",
    "check_identity",
    "head_model",
    "load_head",
    "save_head",
    "write_classes",
    "write_masks",
]

#: The safetensors metadata key of a head file.
HEAD_KEY = "dino_opt_head"


def backbone_fingerprint(net: nn.Module) -> str:
    """SHA-256 of a network's state (names, shapes, dtypes and bytes, in order)."""
    digest = hashlib.sha256()
    for name, value in net.state_dict().items():
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype}".encode())
        digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_head_output(path: str | os.PathLike, force: bool, sources=()) -> Path:
    """Checks, before a probe is trained, that its head can be saved at
    ``path``: a ``.safetensors`` name, and no file there unless ``force``
    (never one that is or holds a source: :func:`~dino_opt.checkpoint.check_output`)."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"head file {str(path)!r}: the name must end in .safetensors")
    return check_output(path, force, sources, what="head file")


def save_head(path: str | os.PathLike, tensors: dict, record: dict) -> Path:
    """Writes a probe's head (``tensors``) and its ``record`` (see the module
    docstring) as a safetensors file, atomically."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"head file {str(path)!r}: the name must end in .safetensors")
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    data = save(tensors, metadata={HEAD_KEY: json.dumps(record)})
    return write_file(path, lambda f: f.write(data))


def load_head(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(tensors, record)`` of a head file written by :func:`save_head`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"head file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            record = json.loads((f.metadata() or {})[HEAD_KEY])
    except (KeyError, ValueError, OSError) as e:
        raise ValueError(f"{path}: not a dino_opt head file ({e})") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own errors: one line naming the file
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    _check_record(record, tensors, path)
    return tensors, record


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# The keys of a head's record, by kind, with the type of each.
_RECORD_KEYS = {"classes": list, "image_size": int, "mean": list, "std": list, "backbone": dict}
_KIND_KEYS = {
    "linear": {"n_blocks": int, "avgpool": bool, "dim": int},
    "dense": {"in_dim": int, "num_classes": int},
}


def _check_record(record, tensors: dict, path: Path) -> None:
    """ValueError naming ``path`` unless its record and tensors are a head
    of the kind it says: every key of its kind with its type, positive
    sizes, finite normalisation, the backbone's identity, tensors of the
    shapes the record gives."""

    def bad(what: str) -> ValueError:
        return ValueError(f"{path}: its {HEAD_KEY} record {what}")

    if not isinstance(record, dict):
        raise bad(f"is a {type(record).__name__}, not a JSON object")
    kind = record.get("kind")
    if kind not in _KIND_KEYS:
        raise bad(f"has kind {kind!r}, not linear or dense")
    for key, type_ in {**_RECORD_KEYS, **_KIND_KEYS[kind]}.items():
        value = record.get(key)
        if not isinstance(value, type_) or (type_ is int and isinstance(value, bool)):
            raise bad(f"has {key}={value!r}, not a {type_.__name__}")
        if type_ is int and value < 1:
            raise bad(f"has {key}={value}")
    norm = record["mean"] + record["std"]
    same = len(record["mean"]) == len(record["std"]) >= 1
    if not same or not all(map(_is_number, norm)) or min(record["std"]) <= 0:
        raise bad(
            f"has mean {record['mean']!r} and std {record['std']!r}, not one finite number "
            "per channel each"
        )
    if record.get("image_mode", "rgb") not in ("rgb", "native"):
        raise bad(f"has image_mode={record['image_mode']!r}, not rgb or native")
    identity = record["backbone"]
    if not all(
        isinstance(identity.get(k), str) for k in ("fingerprint", "backbone", "which", "weights")
    ):
        raise bad("does not name its backbone (fingerprint, backbone, which, weights)")
    classes = len(record["classes"])
    if kind == "linear":
        width = record["dim"] * (record["n_blocks"] + int(record["avgpool"]))
        shapes = {"weight": (width, classes), "bias": (classes,)}
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != shapes:
            raise bad(f"says tensors {shapes}; the file holds {got}")
        return
    if record["num_classes"] != classes:
        raise bad(f"has {record['num_classes']} classes and names {classes}")
    try:
        DenseLinearHead(record["in_dim"], record["num_classes"]).load_state_dict(tensors)
    except RuntimeError as e:
        raise bad(f"does not fit its tensors ({' '.join(str(e).split())})") from None


class _Classifier(nn.Module):
    """Images to the saved linear head's logits."""

    def __init__(self, net: nn.Module, tensors: dict, record: dict) -> None:
        super().__init__()
        self.probe = ProbeFeatures(net, record["n_blocks"])
        self.columns = input_columns(
            self.probe.layout | {"dim": record["dim"]}, record["n_blocks"], record["avgpool"]
        )
        self.weight, self.bias = tensors["weight"], tensors["bias"]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.probe(images)[:, self.columns].float()
        return x @ self.weight.to(x.device) + self.bias.to(x.device)


class _Segmenter(nn.Module):
    """Images to the saved dense head's class of every pixel, ``[B, S * S]``."""

    def __init__(self, net: nn.Module, tensors: dict, record: dict) -> None:
        super().__init__()
        self.net = net
        self.head = DenseLinearHead(record["in_dim"], record["num_classes"])
        self.head.load_state_dict(tensors)
        self.head.eval()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.head(patch_feature_map(self.net, images).float(), images.shape[-2:])
        return logits.argmax(dim=1).flatten(1).float()


def head_model(net: nn.Module, tensors: dict, record: dict) -> nn.Module:
    """The network that applies a saved head over ``net``: images to the
    linear head's logits ``[B, C]``, or to the dense head's class of every
    pixel ``[B, S * S]``."""
    return (_Classifier if record["kind"] == "linear" else _Segmenter)(net, tensors, record)


def check_identity(net: nn.Module, record: dict, weights, head) -> None:
    """Refuses a backbone ``net`` (from ``weights``) other than the one the
    head file ``head`` was trained on."""
    saved = record["backbone"]
    if backbone_fingerprint(net) != saved["fingerprint"]:
        raise ValueError(
            f"{head} was trained on {saved['backbone']}'s {saved['which']} of "
            f"{saved['weights']}; {weights} holds other weights (their fingerprints differ)"
        )


def write_classes(path: Path, names: list[str], logits: torch.Tensor, classes: list) -> None:
    """A CSV row per image: its path, class, that class's probability and every class's."""
    scores = torch.softmax(logits, dim=1)
    best = scores.argmax(dim=1).tolist()
    text = io.StringIO(newline="")
    out = csv.writer(text)
    out.writerow(["path", "class", "score", *classes])
    for name, k, row in zip(names, best, scores.tolist(), strict=True):
        out.writerow([name, classes[k], f"{row[k]:.6f}", *(f"{v:.6f}" for v in row)])
    data = text.getvalue().encode()
    write_file(path, lambda f: f.write(data))


def write_masks(folder: Path, names: list[str], masks: torch.Tensor, size: int) -> list[Path]:
    """One PNG per image in ``folder`` (named by the image's stem; a repeated
    stem gets the image's index), each pixel its class index; the folder is
    filled beside ``folder`` and swapped in whole (replacing an earlier one)."""
    stems, used = [], set()
    for i, name in enumerate(names):
        stem = Path(name.split(": ")[-1]).stem
        stem = stem if stem not in used else f"{stem}_{i}"
        used.add(stem)
        stems.append(stem)

    def fill(into: Path) -> None:
        for i, stem in enumerate(stems):
            pixels = masks[i].reshape(size, size).to(torch.int64).numpy()
            if pixels.max(initial=0) < 256:
                image = Image.fromarray(pixels.astype(np.uint8), "L")
            else:
                image = Image.fromarray(pixels.astype(np.int32), "I")
            image.save(into / f"{stem}.png")

    write_folder(folder, fill)
    return [folder / f"{stem}.png" for stem in stems]
