"""What ``torch.compile`` has cost this process so far: the graphs it made
and the seconds it spent making them (forward and backward), as torch's own
compile-time accounting counts them."""

from __future__ import annotations

import torch._dynamo.utils as dynamo_utils

__all__ = ["compile_totals"]


def compile_totals() -> tuple[int, float]:
    """(graphs compiled, seconds spent compiling) in this process: dynamo's
    count of unique graphs and the wall time of its frame and backward
    compilations."""
    graphs = int(dynamo_utils.counters["stats"]["unique_graphs"])
    seconds = float(dynamo_utils.calculate_time_spent().get("total_wall_time", 0.0))
    return graphs, seconds
