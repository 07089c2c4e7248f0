"""The trainer step against a plain-PyTorch DINO step written from the
published algorithm; accumulation and crop batching against one big step."""

import copy

import numpy as np
import pytest
import torch
from dino_opt import DINOLoss
from dino_opt.ops import Schedules
from dino_opt.train import DINOModel, MemoryOptimizedDINOTrainer, param_groups
from reference import dino_loss_reference
from torch import nn

OUT = 32


class TinyWrapper(nn.Module):
    """A multi-crop wrapper around a small conv net: one backbone call per
    crop list, features concatenated, then a head with a `last_layer`."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.head = nn.Sequential(nn.Linear(8, 16), nn.GELU())
        self.last_layer = nn.Linear(16, OUT, bias=False)

    def forward(self, crops):
        if isinstance(crops, torch.Tensor):
            crops = [crops]
        feats = torch.cat([self.backbone(c) for c in crops])
        return self.last_layer(self.head(feats))


def make_crops(gen, b=4, n_local=3, dtype=torch.float64):
    g = [torch.randn(b, 3, 12, 12, generator=gen, dtype=dtype) for _ in range(2)]
    loc = [torch.randn(b, 3, 6, 6, generator=gen, dtype=dtype) for _ in range(n_local)]
    return g + loc


def build(gen, n_crops, *, center_momentum=0.9, config=None, momentum=0.9):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    student = TinyWrapper().double()
    teacher = copy.deepcopy(student)
    model = DINOModel(student, teacher, momentum)
    loss = DINOLoss(OUT, n_crops, 0.04, 0.04, 0, 5, center_momentum=center_momentum).double()
    opt = torch.optim.AdamW(param_groups(student), lr=1e-2, weight_decay=0.04)
    cfg = {"use_amp": False, "freeze_last_layer": 0, "gradient_clip": 0.5}
    cfg.update(config or {})
    return MemoryOptimizedDINOTrainer(model, loss, opt, cfg, torch.device("cpu")), model


def test_one_step_matches_a_plain_pytorch_dino_step(gen):
    crops = make_crops(gen)
    trainer, model = build(gen, len(crops))
    ref_student = copy.deepcopy(model.student)
    ref_teacher = copy.deepcopy(model.teacher)
    ref_opt = torch.optim.AdamW(param_groups(ref_student), lr=1e-2, weight_decay=0.04)

    loss, _ = trainer.train_step_optimized(crops, epoch=0)
    assert trainer.optimize_step()

    # The reference: every crop through the student, the two global ones
    # through the teacher, DINO's double loop, clip, AdamW, EMA.
    s_out = ref_student(crops)
    with torch.no_grad():
        t_out = ref_teacher(crops[:2])
    center = torch.zeros(1, OUT, dtype=s_out.dtype)
    ref_loss = dino_loss_reference(s_out, t_out, center, 0.1, 0.04, len(crops))
    ref_loss.backward()
    torch.nn.utils.clip_grad_norm_(ref_student.parameters(), 0.5)
    ref_opt.step()
    with torch.no_grad():
        for t, s in zip(ref_teacher.parameters(), ref_student.parameters(), strict=True):
            t.mul_(0.9).add_(s, alpha=0.1)

    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-10, atol=1e-12)
    for a, b in zip(model.student.parameters(), ref_student.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    for a, b in zip(model.teacher.parameters(), ref_teacher.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def grads_after(trainer, model, micro_batches, epoch=1):
    for crops in micro_batches:
        trainer.train_step_optimized(crops, epoch)
    return [p.grad.clone() for p in model.student.parameters()]


def test_accumulating_micro_batches_equals_one_big_batch(gen):
    crops = make_crops(gen, b=8)
    halves = [[c[:4] for c in crops], [c[4:] for c in crops]]
    # A fixed center (momentum 1): otherwise the second micro-batch would see
    # the center updated by the first, as in training, and differ on purpose.
    big, big_model = build(gen, len(crops), center_momentum=1.0)
    acc, acc_model = build(gen, len(crops), center_momentum=1.0, config={"accumulation_steps": 2})
    acc_model.load_state_dict(big_model.state_dict())
    g_big = grads_after(big, big_model, [crops])
    g_acc = grads_after(acc, acc_model, halves)
    for a, b in zip(g_big, g_acc, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert acc.optimize_step()  # both micro-batches are in: this call steps


def test_optimize_step_waits_for_all_micro_batches(gen):
    crops = make_crops(gen)
    trainer, _ = build(gen, len(crops), config={"accumulation_steps": 3})
    trainer.train_step_optimized(crops, 1)
    assert not trainer.optimize_step()
    trainer.train_step_optimized(crops, 1)
    assert not trainer.optimize_step()
    trainer.train_step_optimized(crops, 1)
    assert trainer.optimize_step()


@pytest.mark.parametrize("group", [1, 2, 3])
def test_crop_batching_gives_the_same_loss_and_gradients(gen, group):
    crops = make_crops(gen, n_local=4)
    whole, whole_model = build(gen, len(crops))
    grouped, grouped_model = build(gen, len(crops), config={"crop_batch_size": group})
    grouped_model.load_state_dict(whole_model.state_dict())
    loss_whole, _ = whole.train_step_optimized(crops, 1)
    loss_grouped, _ = grouped.train_step_optimized(crops, 1)
    torch.testing.assert_close(loss_grouped, loss_whole, rtol=1e-10, atol=1e-12)
    for a, b in zip(
        whole_model.student.parameters(), grouped_model.student.parameters(), strict=True
    ):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grouped.loss_fn.center, whole.loss_fn.center)


def test_last_layer_is_frozen_in_the_first_epochs(gen):
    crops = make_crops(gen)
    trainer, model = build(gen, len(crops), config={"freeze_last_layer": 1})
    before = model.student.last_layer.weight.clone()
    trainer.train_step_optimized(crops, epoch=0)
    trainer.optimize_step()
    assert torch.equal(model.student.last_layer.weight, before)
    trainer.train_step_optimized(crops, epoch=1)
    trainer.optimize_step()
    assert not torch.equal(model.student.last_layer.weight, before)


def test_schedules_follow_dino():
    s = Schedules.dino(
        base_lr=0.001,
        min_lr=1e-6,
        weight_decay=0.04,
        weight_decay_end=0.4,
        momentum_teacher=0.996,
        epochs=10,
        warmup_epochs=2,
        niter_per_epoch=5,
    )
    # main_dino.py: a linear warm-up from 0 over 2 epochs, then
    # final + (base - final) * (1 + cos(pi * i / n)) / 2 over the rest.
    i = np.arange(40)
    cosine = 1e-6 + 0.5 * (0.001 - 1e-6) * (1 + np.cos(np.pi * i / 40))
    np.testing.assert_allclose(s.lr, np.concatenate([np.linspace(0, 0.001, 10), cosine]))
    i = np.arange(50)
    wd = 0.4 + 0.5 * (0.04 - 0.4) * (1 + np.cos(np.pi * i / 50))
    np.testing.assert_allclose(s.weight_decay, wd)
    np.testing.assert_allclose(s.momentum, 1 + 0.5 * (0.996 - 1) * (1 + np.cos(np.pi * i / 50)))


def test_param_groups_exempt_biases_and_norms():
    m = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    decay, no_decay = param_groups(m)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 3])]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0


@pytest.mark.parametrize("fused", [False, True])
def test_a_nonfinite_step_is_skipped_and_reported(gen, fused):
    crops = make_crops(gen, dtype=torch.float32)
    trainer, model = build(gen, len(crops))
    model.float()
    trainer.loss_fn.float()
    trainer.optimizer = torch.optim.AdamW(param_groups(model.student), lr=1e-2, fused=fused)
    trainer.train_step_optimized(crops, 1)
    assert trainer.optimize_step() and bool(trainer.last_step_finite)  # one good step first
    student = copy.deepcopy(model.student.state_dict())
    teacher = copy.deepcopy(model.teacher.state_dict())
    opt_state = copy.deepcopy(trainer.optimizer.state_dict()["state"])
    weight = model.student.head[0].weight
    hook = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    trainer.train_step_optimized(crops, 1)
    assert trainer.optimize_step()
    hook.remove()
    assert not bool(trainer.last_step_finite)
    for name, value in model.student.state_dict().items():
        assert torch.equal(value, student[name]), name
    if not fused:  # the fused path skips on the device and still moves the teacher
        for name, value in model.teacher.state_dict().items():
            assert torch.equal(value, teacher[name]), name
    for i, state in trainer.optimizer.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(v, opt_state[i][k]), (i, k)
    assert model.teacher_step == 2  # the momentum schedule stays aligned with the steps
    trainer.train_step_optimized(crops, 1)
    trainer.optimize_step()
    assert bool(trainer.last_step_finite)
    assert not torch.equal(model.student.head[0].weight, student["head.0.weight"])


@pytest.mark.parametrize("group", [None, 1, 3])
def test_captured_outputs_are_the_global_views(gen, group):
    crops = make_crops(gen, n_local=3)
    trainer, model = build(gen, len(crops), config={"crop_batch_size": group})
    before = copy.deepcopy(model)
    trainer.capture_outputs = True
    trainer.train_step_optimized(crops, 1)
    got = trainer.captured
    with torch.no_grad():
        torch.testing.assert_close(got["teacher_logits"], before.teacher(crops[:2]))
        torch.testing.assert_close(got["student_logits"], before.student(crops[:2]))
    trainer.capture_outputs = False
    trainer.train_step_optimized(crops, 1)
    assert trainer.captured == {}
