"""``hardware.activation_checkpointing: auto``: the least recomputation
whose memory estimate fits the device.

The settings are ranked from the least recomputed to the most: ``none``;
``selective`` at each rising ``recompute_threshold``, which keeps the
outputs the backward reads that save at least that many FLOPs per byte
(the first rung all of them; then attention over a local crop's few keys
goes, then over a global crop's, then the linear layers of input width C;
with LayerScale the feed-forward network's last, of input width 4C,
last); ``full`` last. The
first whose peak (:func:`~dino_opt.tune.estimate_memory`, at the run's
strategy and world size) is within :data:`USABLE_MEMORY_FRACTION` of the GPU's
memory is chosen. On the CPU, where the memory model is not calibrated and
memory rarely binds, ``auto`` is ``none``.
"""

from __future__ import annotations

from typing import NamedTuple

from ..config import Config, ConfigError, apply_overrides
from ..train import recipe_of
from .hardware import detect_device_memory
from .memory import (
    activation_bytes,
    count_model,
    estimate_memory,
    selective_outputs,
    sequence_lengths,
)
from .throughput import USABLE_MEMORY_FRACTION

__all__ = [
    "CheckpointingChoice",
    "checkpointing_ladder",
    "resolve_checkpointing",
]


class CheckpointingChoice(NamedTuple):
    """What ``auto`` chose: the policy, selective's threshold, the estimated
    peak in bytes and the ``reason`` (one line)."""

    policy: str
    threshold: float
    peak: int
    reason: str


def checkpointing_ladder(cfg: Config) -> list[tuple[str, float]]:
    """(policy, recompute_threshold) from the least recomputation to the
    most, at ``cfg``'s shapes and precision; every selective step drops
    at least one kind of output."""
    counts = count_model(cfg)
    a = activation_bytes(cfg)
    costs = {
        cost
        for tokens in sequence_lengths(cfg, counts)
        for _, cost in selective_outputs(counts, a, tokens).values()
    }
    costs.discard(0.0)  # an output that saves nothing is never kept above 0
    return [("none", 0.0), *(("selective", cost) for cost in sorted(costs)), ("full", 0.0)]


def resolve_checkpointing(
    cfg: Config, world_size: int = 1, memory_gib: float | None = None
) -> tuple[Config, CheckpointingChoice | None]:
    """The config with ``activation_checkpointing: auto`` replaced by its
    choice (and ``recompute_threshold`` set), and the choice; other configs
    as they are, with None. ``memory_gib``: the device's memory (default:
    the device's own, found by :func:`~dino_opt.tune.detect_device_memory`)."""
    h = cfg.hardware
    if h.activation_checkpointing != "auto":
        return cfg, None
    if memory_gib is None:
        _, memory_gib, _ = detect_device_memory(h.device)
    vit = cfg.model.backbone.startswith("vit")
    if memory_gib is None or not vit:
        why = "on the CPU" if vit else f"{cfg.model.backbone} has no ViT blocks"
        resolved = apply_overrides(cfg, ["hardware.activation_checkpointing=none"])
        return resolved, CheckpointingChoice(
            "none", 0.0, 0, f"activation checkpointing auto: none ({why})"
        )
    if recipe_of(cfg).external_teacher:
        raise ConfigError(
            "hardware.activation_checkpointing=auto: a distillation's memory depends on its "
            "teacher; choose none, selective or full (dino-opt memory estimates each)"
        )
    budget = USABLE_MEMORY_FRACTION * memory_gib * 2**30
    strategy = cfg.distributed.strategy
    ladder = checkpointing_ladder(cfg)
    for policy, threshold in ladder:
        candidate = apply_overrides(
            cfg,
            [
                f"hardware.activation_checkpointing={policy}",
                f"hardware.recompute_threshold={threshold!r}",
            ],
        )
        peak = estimate_memory(candidate, strategy=strategy, world_size=world_size).peak
        if peak <= budget:
            break
    rejected = ladder.index((policy, threshold))  # the rungs before: they did not fit
    setting = policy if policy != "selective" else f"selective, recompute_threshold {threshold:g}"
    fits = "fits" if peak <= budget else "does not fit even so"
    reason = (
        f"activation checkpointing auto: {setting} (estimated peak {peak / 2**30:.1f} GiB "
        f"{fits} in {USABLE_MEMORY_FRACTION:.0%} of {memory_gib:.1f} GiB; "
        f"{rejected} setting(s) with less recomputation did not)"
    )
    return candidate, CheckpointingChoice(policy, threshold, peak, reason)
