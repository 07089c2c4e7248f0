"""ONNX export of any backbone the project reads (``dino-opt export --format
onnx``), checked with onnxruntime against PyTorch on real images.

The graph maps ``images`` ``[B, C, H, W]`` (C: 3, or the model's channels;
normalised as in training) to
``cls`` ``[B, D]`` and ``patch_tokens`` ``[B, n, D]`` (a ViT or ConvNeXt:
the last layer's normalised tokens) or to ``features`` ``[B, D]`` (a
ResNet). The batch is dynamic; so are the height and width where the
network allows them (DINOv3's RoPE ViT, ConvNeXts, ResNets: a multiple of
the patch size for the ViT). A ViT with a learned position table is
exported for one size (its table is resized in Python when the graph is
traced, so the graph holds one resized table): the size it was trained at,
or ``image_size``. The model's metadata records the input it was trained
at (``dino_opt_training``), as every export does. An export whose
onnxruntime outputs differ from PyTorch's by more than the tolerance
(``--onnx-tolerance``, 1e-3 by default) fails and writes nothing. onnx, onnxscript and
onnxruntime come with the ``onnx`` extra.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...checkpoint import check_output, replace_with
from ...data import builtin_dataset, source_exists
from ...eval import EvalLoader
from ...models import input_channels
from ...train import data_roots
from ..load.backbone import OpenedBackbone, open_backbone
from ..load.reading import TRAINING_KEY

__all__ = ["ONNX_TOLERANCE", "export_onnx"]

#: The largest difference between onnxruntime's outputs and PyTorch's that
#: an export accepts (``--onnx-tolerance``).
ONNX_TOLERANCE = 1e-3

_EXAMPLE_BATCH, _CHECK_BATCH = 2, 3  # the check's batch differs from the traced one
_LARGE = 1 << 30  # parameter bytes past which the weights go to an external data file


class _Graph(nn.Module):
    """What the ONNX graph computes: the class and patch tokens of a network
    with DINOv2's ``forward_features``, else the network's output."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.tokens = callable(getattr(net, "forward_features", None))

    @property
    def output_names(self) -> list[str]:
        return ["cls", "patch_tokens"] if self.tokens else ["features"]

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.tokens:
            out = self.net.forward_features(images)
            return out["x_norm_clstoken"], out["x_norm_patchtokens"]
        return (self.net(images),)


def _onnx_modules():
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  (torch's exporter needs it)
    except ImportError as e:
        raise ImportError(
            f"ONNX export needs onnx, onnxscript and onnxruntime ({e.name} is missing): "
            "pip install 'dino_opt[onnx]'"
        ) from e
    return onnx, onnxruntime


def _patch(net: nn.Module) -> int:
    p = getattr(net, "patch_size", 32)  # ConvNeXts and ResNets: a stride-32 grid
    return int(p[0] if isinstance(p, (tuple, list)) else p)


def _check_data(opened: OpenedBackbone, data, folder: Path) -> Path:
    """The images the export is checked on: ``data``, else the run's
    validation (or training) images, else a few of the built-in data set's."""
    if data is not None:
        if not source_exists(Path(data)):
            raise FileNotFoundError(f"check data {str(data)!r} does not exist")
        return Path(data)
    if opened.config is not None:
        roots = data_roots(opened.config)
        found = [r for r in (roots.val, roots.train) if r is not None and source_exists(r)]
        if found:
            return found[0]
    return builtin_dataset(folder / "builtin", train_per_class=1, val_per_class=0) / "train"


def _images(opened: OpenedBackbone, data: Path, size: int) -> torch.Tensor:
    with EvalLoader(
        data,
        size,
        _CHECK_BATCH,
        labelled=False,
        mean=opened.mean,
        std=opened.std,
        pin_memory=False,
        image_mode=opened.image_mode,
    ) as loader:
        return next(iter(loader))[0]


def _largest_difference(session, graph: _Graph, images: torch.Tensor) -> float:
    got = session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        want = graph(images)
    return max(float(np.abs(g - w.numpy()).max()) for g, w in zip(got, want, strict=True))


def _trace(graph: _Graph, output: Path, size: int, dynamic_size: bool, big: bool) -> None:
    dim = torch.export.Dim.DYNAMIC
    axes = {0: dim, 2: dim, 3: dim} if dynamic_size else {0: dim}
    example = torch.zeros(_EXAMPLE_BATCH, input_channels(graph), size, size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on decompositions
        torch.onnx.export(
            graph,
            (example,),
            str(output),
            input_names=["images"],
            output_names=graph.output_names,
            dynamic_shapes={"images": axes},
            dynamo=True,
            external_data=big,
            verbose=False,
        )


def _record(onnx, output: Path, meta: dict) -> None:
    model = onnx.load(str(output), load_external_data=False)
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(output))


def _opened(source, which: str, image_size: int | None) -> OpenedBackbone:
    if not isinstance(source, nn.Module):
        return open_backbone(source, which)
    return OpenedBackbone(source.eval(), image_size or 224, "module", type(source).__name__, None)


def _metadata(opened: OpenedBackbone, source, which: str) -> dict[str, str]:
    """The graph's metadata: how the backbone was trained (its image size,
    normalisation and image mode, under :data:`TRAINING_KEY`) and where it came from."""
    training = {
        "image_size": opened.image_size,
        "mean": list(opened.mean),
        "std": list(opened.std),
    }
    if opened.image_mode != "rgb":
        training["image_mode"] = opened.image_mode
    return {
        TRAINING_KEY: json.dumps(training),
        "dino_opt_source": str(source),
        "dino_opt_backbone": opened.name,
        "dino_opt_which": which,
    }


def _place(staged: Path, output: Path) -> None:
    """The files of the export traced and checked in the folder ``staged``
    (the graph, named as ``output``, and its external data file if any)
    renamed into ``output``'s folder; an external data file of an earlier
    export there that this one has not is removed."""
    names = []
    for file in sorted(staged.iterdir()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        replace_with(file, output.with_name(file.name))
        names.append(file.name)
    stale = output.with_name(output.name + ".data")
    if stale.name not in names:
        stale.unlink(missing_ok=True)


def export_onnx(
    source: str | os.PathLike | nn.Module,
    output: str | os.PathLike,
    *,
    which: str = "teacher",
    image_size: int | None = None,
    data=None,
    force: bool = False,
    tolerance: float = ONNX_TOLERANCE,
) -> dict:
    """Writes the ``which`` backbone of the weights at ``source`` (a run,
    a checkpoint or weights in any format the project reads; or a backbone
    module, normalised as ImageNet, 224 px by default) as an ONNX
    model at ``output`` (see the module docstring), traced at ``image_size``
    (default: the size it was trained at), and runs it with onnxruntime on
    real images (``data``, else the run's, else the built-in data set's)
    beside PyTorch. The graph is traced and checked beside ``output`` and
    put in place only when the largest difference is at most ``tolerance``
    (ValueError otherwise, an earlier ``output`` left as it was). Returns the
    export's ``path``, ``backbone``, ``image_size``, ``dynamic`` axes,
    ``outputs``, ``max_abs_diff`` (the largest difference to PyTorch over
    every output and checked size), the ``tolerance`` and ``checked_on``."""
    if not tolerance >= 0:
        raise ValueError(f"--onnx-tolerance must be >= 0, got {tolerance}")
    output = Path(output)
    sources = () if isinstance(source, nn.Module) else (source,)
    check_output(output, force, sources)
    if data is not None and not source_exists(Path(data)):
        raise FileNotFoundError(f"check data {str(data)!r} does not exist")
    onnx, onnxruntime = _onnx_modules()
    opened = _opened(source, which, image_size)
    graph, size = _Graph(opened.net.float().eval()), image_size or opened.image_size
    if size % _patch(opened.net):
        raise ValueError(
            f"image_size {size} is not a multiple of the patch size {_patch(opened.net)}"
        )
    # a learned position table is resized in Python: the traced graph holds one size's
    dynamic_size = getattr(opened.net, "pos_embed", None) is None
    big = sum(p.numel() * p.element_size() for p in graph.parameters()) > _LARGE
    with tempfile.TemporaryDirectory(prefix=f".{output.name}.", dir=output.parent) as staging:
        staged = Path(staging) / "graph" / output.name
        staged.parent.mkdir()
        try:
            _trace(graph, staged, size, dynamic_size, big)
        except Exception as e:  # noqa: BLE001 - the exporter's many errors: one line naming it
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(
                f"{source}: {opened.name} could not be exported to ONNX: {first}"
            ) from e
        _record(onnx, staged, _metadata(opened, source, which))
        session = onnxruntime.InferenceSession(str(staged), providers=["CPUExecutionProvider"])
        images = _check_data(opened, data, Path(staging))
        sizes = [size, size + 2 * _patch(opened.net)] if dynamic_size else [size]
        diff = max(_largest_difference(session, graph, _images(opened, images, s)) for s in sizes)
        if not diff <= tolerance:
            raise ValueError(
                f"{output}: onnxruntime's outputs differ from PyTorch's by up to {diff:.3g}, more "
                f"than --onnx-tolerance {tolerance:g}: not written"
            )
        del session
        _place(staged.parent, output)
    axes = ["batch", "height", "width"] if dynamic_size else ["batch"]
    return {
        "path": str(output),
        "format": "onnx",
        "which": which,
        "backbone": opened.name,
        "image_size": size,
        "dynamic": axes,
        "outputs": graph.output_names,
        "max_abs_diff": diff,
        "tolerance": tolerance,
        "checked_on": str(images),
        "checked_sizes": sizes,
    }
