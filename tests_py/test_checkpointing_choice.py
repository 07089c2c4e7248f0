"""``hardware.activation_checkpointing: auto``: the least recomputation
whose memory estimate fits the device, from the memory model's terms; none
on the CPU; a distillation refused with one line."""

import pytest
from dino_opt.config import ConfigError, apply_overrides, load_config
from dino_opt.tune import (
    USABLE_MEMORY_FRACTION,
    checkpointing_ladder,
    estimate_memory,
    resolve_checkpointing,
)

VIT_SMALL = [
    "model.backbone=vit_small",
    "data.batch_size=64",
    "hardware.precision=bf16",
    "hardware.activation_checkpointing=auto",
]


def _peak(cfg, policy, threshold):
    chosen = apply_overrides(
        cfg,
        [
            f"hardware.activation_checkpointing={policy}",
            f"hardware.recompute_threshold={threshold}",
        ],
    )
    return estimate_memory(chosen).peak


def test_the_ladder_recomputes_more_at_each_rung():
    cfg = load_config(None, VIT_SMALL)
    ladder = checkpointing_ladder(cfg)
    assert ladder[0] == ("none", 0.0) and ladder[-1] == ("full", 0.0)
    thresholds = [t for p, t in ladder if p == "selective"]
    # ViT-S/16 in bf16: local and global attention, the C-wide linear layers
    # (its fc2's output saves nothing: no LayerScale)
    assert thresholds == sorted(thresholds) and len(thresholds) == 3
    assert thresholds[2] == 384.0
    peaks = [_peak(cfg, p, t) for p, t in ladder]
    assert peaks == sorted(peaks, reverse=True)


def test_auto_takes_the_first_setting_that_fits():
    cfg = load_config(None, VIT_SMALL)
    ladder = checkpointing_ladder(cfg)
    peaks = [_peak(cfg, p, t) for p, t in ladder]
    for i in range(1, len(ladder)):
        # memory between this rung's peak and the one before's: this rung
        gib = (peaks[i] + peaks[i - 1]) / 2 / USABLE_MEMORY_FRACTION / 2**30
        resolved, choice = resolve_checkpointing(cfg, memory_gib=gib)
        policy, threshold = ladder[i]
        assert (choice.policy, choice.threshold, choice.peak) == (policy, threshold, peaks[i])
        h = resolved.hardware
        assert (h.activation_checkpointing, h.recompute_threshold) == (policy, threshold)
        assert "fits in 90% of" in choice.reason and f"{i} setting(s)" in choice.reason
    roomy = resolve_checkpointing(cfg, memory_gib=2 * peaks[0] / 2**30)[1]
    assert roomy.policy == "none"
    tight = resolve_checkpointing(cfg, memory_gib=peaks[-1] / 2 / 2**30)[1]
    assert tight.policy == "full" and "does not fit even so" in tight.reason


def test_auto_is_none_on_the_cpu_and_other_settings_stay():
    cfg = load_config(None, [*VIT_SMALL, "hardware.device=cpu"])
    resolved, choice = resolve_checkpointing(cfg)
    assert resolved.hardware.activation_checkpointing == "none"
    assert choice.reason == "activation checkpointing auto: none (on the CPU)"
    plain = load_config(None, ["hardware.activation_checkpointing=selective"])
    assert resolve_checkpointing(plain) == (plain, None)
    with pytest.raises(ValueError, match="'auto' is chosen when a run starts"):
        estimate_memory(cfg)


def test_bad_values_are_one_line():
    with pytest.raises(ConfigError, match="recompute_threshold"):
        load_config(None, ["hardware.recompute_threshold=-1"])
    distill = load_config(
        None,
        [
            "recipe.name=distill",
            "recipe.distill.teacher=dinov2_vits14",
            "hardware.activation_checkpointing=auto",
        ],
    )
    with pytest.raises(ConfigError, match="a distillation's memory depends on its teacher"):
        resolve_checkpointing(distill, memory_gib=80)
