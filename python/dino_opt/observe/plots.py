"""Training curves of a run: loss, learning rate, weight decay, teacher
momentum, throughput and memory over the steps, from the rows that
``run_training`` writes to ``metrics.jsonl``.

matplotlib is imported only when a figure is drawn, and only its object API
and the Agg canvas are used (no pyplot state), so plotting works without a
display and leaves the caller's figures and backend alone.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
from matplotlib.ticker import MaxNLocator

__all__ = ["MEMORY_KEYS", "plot_training_curves", "read_metrics"]

# Memory keys of MemoryTracker.get_memory_stats() drawn in the memory panel
# (GiB), with their legend labels. On a CPU run only the host ones exist; on a
# GPU run the allocator's ones come first.
MEMORY_KEYS: dict[str, str] = {
    "gpu_memory_current_gb": "GPU allocated",
    "gpu_memory_peak_gb": "GPU peak allocated",
    "gpu_memory_reserved_gb": "GPU reserved",
    "host_rss_gb": "host RSS",
    "host_peak_rss_gb": "host peak RSS",
}

# (panel title, [(key, label)], y label)
_PANELS: list[tuple[str, list[tuple[str, str]], str]] = [
    ("Loss", [("loss", "loss")], "DINO loss"),
    ("Learning rate", [("lr", "lr")], "lr"),
    ("Weight decay", [("weight_decay", "weight decay")], "weight decay"),
    ("Teacher momentum", [("momentum", "momentum")], "EMA momentum"),
    ("Throughput", [("images_per_second", "images/s")], "images / s"),
    ("Memory", list(MEMORY_KEYS.items()), "GiB"),
]


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` file (blank lines skipped; a line that
    is not JSON raises ``ValueError`` naming the file and line)."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}:{n}: not a JSON line: {e}") from e
    return rows


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the rows that hold a finite number under ``key``; a
    row without a step counts as its position (1-based)."""
    xs, ys = [], []
    for i, row in enumerate(rows):
        y = _number(row.get(key))
        if y is None:
            continue
        x = _number(row.get("step"))
        xs.append(x if x is not None else float(i + 1))
        ys.append(y)
    return xs, ys


def style_step_panel(ax, title: str, ylabel: str, drawn: int, *, legend: bool) -> bool:
    """Title, labels and grid of one panel over training steps; "no data"
    written in it when no series was drawn. Returns whether one was."""

    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return False
    if legend:
        ax.legend(fontsize=8)
    return True


def plot_training_curves(
    rows: Iterable[Mapping[str, Any]],
    path: str | os.PathLike,
    title: str | None = None,
) -> Path:
    """Saves a PNG of the training curves of ``rows`` (the dicts of
    ``metrics.jsonl``) to ``path``; returns the path.

    One panel each for the loss, the learning rate, the weight decay, the
    teacher momentum, the throughput (images/s) and memory (GiB: the GPU
    allocator's allocated, peak and reserved memory on a GPU run, the
    process's resident set on any run), over the steps. A key missing from
    some rows is drawn where present; a panel with no data says so; a single
    row is drawn as points.
    """

    rows = [r for r in rows if isinstance(r, Mapping)]
    fig = Figure(figsize=(15, 8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 3).ravel()
    for ax, (name, keys, ylabel) in zip(axes, _PANELS, strict=True):
        drawn = 0
        for key, label in keys:
            xs, ys = _series(rows, key)
            if not xs:
                continue
            style = {"marker": "o", "markersize": 3} if len(xs) < 20 else {}
            ax.plot(xs, ys, label=label, linewidth=1.2, **style)
            drawn += 1
        if not style_step_panel(ax, name, ylabel, drawn, legend=len(keys) > 1):
            continue
        # lr and weight decay span orders of magnitude in small numbers.
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    fig.suptitle(title or f"Training curves ({len(rows)} logged steps)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
