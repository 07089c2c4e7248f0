"""The weights a finished run hands its tracker (``logging.mlflow_weights``):
the trained teacher's backbone exported in a format other tools load (a
ViT: timm's safetensors file; another backbone: DINO's torch file), into
the run folder's ``export/``."""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..observe import RunFolder
from ..weights import export_weights

__all__ = ["tracked_weights"]


def tracked_weights(cfg: Config, checkpoint: str | Path, folder: RunFolder) -> Path:
    """Exports the teacher of the final ``checkpoint`` into ``folder``'s
    ``export/`` (replacing an earlier export) and returns the file."""
    vit = cfg.model.backbone.startswith("vit")
    fmt, name = (
        ("timm", "teacher_backbone.safetensors") if vit else ("dino", "teacher_backbone.pth")
    )
    folder.export.mkdir(exist_ok=True)
    return Path(export_weights(checkpoint, fmt, folder.export / name, force=True).path)
