"""Continued pretraining from weights (`dino-opt train --adapt WEIGHTS`):
the backbone frozen while the new heads warm up, then a lower learning rate
with layer-wise decay; the result judged beside the weights it started from
and beside raw pixels, in a last line that says better or worse and by how
much; a killed adaptation resumes bit for bit."""

import json

import pytest
import torch
from dino_opt.api import ADAPT_OVERRIDES
from dino_opt.checkpoint import CheckpointManager
from dino_opt.config import apply_overrides, default_config
from dino_opt.data import builtin_dataset
from dino_opt.train import build_models, build_optimizer
from tiny import (
    RESUMABLE,
    TINY,
    assert_same_states,
    final_state,
    run_cli_ok,
    run_killed_and_resumed,
    train_args,
)

ADAPT = [*TINY, *RESUMABLE, "checkpoint.keep=20", "schedule.epochs=2", "schedule.warmup_epochs=0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=4,
        val_per_class=1,
        test_per_class=1,
        image_size=40,
    )


@pytest.fixture(scope="module")
def start(data, tmp_path_factory):
    """The weights an adaptation starts from: a tiny run of one epoch."""
    out = tmp_path_factory.mktemp("start") / "run"
    run_cli_ok(
        train_args(out, data / "train", *TINY, "schedule.epochs=1", "schedule.warmup_epochs=0")
    )
    return out


def _backbone(state: dict, net: str = "student") -> dict:
    return {k: v for k, v in state[net].items() if k.startswith("backbone.")}


def test_adapting_warms_the_heads_then_is_judged_against_its_start(data, start, tmp_path):
    out = tmp_path / "adapt"
    done = run_cli_ok(
        ["train", "--adapt", str(start), *train_args(out, data / "train", *ADAPT)[1:]]
    )
    report = json.loads((out / "report.json").read_text())
    for key in ("knn_top1_start", "knn_test_top1_start", "pixels_val_top1", "pixels_test_top1"):
        assert 0 <= report[key] <= 100, key
    last = done.stdout.strip().splitlines()[-1]
    assert last == f"dino-opt train: {report['adapt_verdict']}"
    assert last.startswith("dino-opt train: adapting made the features ")
    assert f"knn {report['knn_top1_trained']:.1f} % vs {report['knn_top1_start']:.1f} %" in last
    assert f"raw pixels {report['pixels_val_top1']:.1f} %" in last
    # epoch 1 (5 steps of 8 images): the backbone stays as it started, the heads move
    began = final_state(start)
    manager = CheckpointManager(out / "checkpoints")
    frozen = manager.load(next(r.path for r in manager.checkpoints() if r.step == 5))
    assert_same_states({"s": _backbone(frozen)}, {"s": _backbone(began)}, keys=("s",))
    assert not torch.equal(
        frozen["student"]["head.mlp.0.weight"], began["student"]["head.mlp.0.weight"]
    )
    unfrozen = final_state(out)
    assert any(not torch.equal(v, began["student"][k]) for k, v in _backbone(unfrozen).items())


def test_the_backbone_learns_at_a_fifth_with_layerwise_decay():
    overrides = [o.format(weights="w.pth") for o in ADAPT_OVERRIDES[1:]]
    cfg = apply_overrides(default_config(), [*TINY, *overrides])
    student, _ = build_models(cfg)
    optimizer = build_optimizer(cfg, student, torch.device("cpu"))
    names = {id(p): n for n, p in student.named_parameters()}
    mults = {names[id(p)]: g["lr_multiplier"] for g in optimizer.param_groups for p in g["params"]}
    depth = len(student.backbone.blocks)
    assert mults["head.mlp.0.weight"] == 1.0
    assert mults["backbone.norm.weight"] == pytest.approx(0.2)
    assert mults[f"backbone.blocks.{depth - 1}.mlp.fc1.weight"] == pytest.approx(0.2 * 0.9)
    assert mults["backbone.patch_embed.proj.weight"] == pytest.approx(0.2 * 0.9 ** (depth + 1))


def test_a_killed_adaptation_resumes_bit_for_bit(data, start, tmp_path):
    def argv(out):
        config = train_args(out, data / "train", *ADAPT, "eval.every_epochs=0")
        return ["train", "--adapt", str(start), *config[1:]]

    run_cli_ok(argv(tmp_path / "reference"))
    run_killed_and_resumed(tmp_path / "killed", argv(tmp_path / "killed"), at_step=6)
    assert_same_states(final_state(tmp_path / "killed"), final_state(tmp_path / "reference"))
