"""bench/reference_trainer.py (the original DINO step in plain PyTorch)
against dino_opt's MemoryOptimizedDINOTrainer from the same initialisation on
the same crops, its pieces against dino_opt's, and bench/bench_train.py as a
smoke test. No timings are asserted."""

import copy
import json
import math
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from dino_opt import DINOLoss
from dino_opt.config import apply_overrides, default_config
from dino_opt.ops import Schedules
from dino_opt.train import DINOModel, MemoryOptimizedDINOTrainer, build_models, param_groups
from forked import run_script
from torch import nn
from torch.autograd import DeviceType

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))
from bench_train import (  # noqa: E402
    PRESETS,
    bound_verdict,
    covered_fraction,
    device_work,
    flops_per_image,
    largest_batch,
)
from reference_trainer import (  # noqa: E402
    LoopEMAModel,
    ReferenceDINOLoss,
    ReferenceDINOTrainer,
    clip_gradients,
    ema_update_foreach,
    ema_update_loop,
    multicrop_forward,
)

OUT, N_LOCAL, B = 64, 3, 4


def tiny_models(dtype, seed):
    cfg = apply_overrides(
        default_config(),
        [
            "model.backbone=vit_tiny",
            f"model.out_dim={OUT}",
            "model.hidden_dim=48",
            "model.bottleneck_dim=16",
            # no drop path: dino_opt's ViT runs the crop sizes packed and draws
            # the dropped samples block by block, the published forward size
            # by size, so the draws differ (the subset drop path's equality to
            # the mask form, for the same draws, is tested in test_packing)
            "model.drop_path_rate=0.0",
        ],
    )
    torch.manual_seed(seed)
    student, teacher = build_models(cfg)
    return student.to(dtype), teacher.to(dtype)


def crops(gen, dtype):
    g = [torch.randn(B, 3, 32, 32, generator=gen, dtype=dtype) for _ in range(2)]
    return g + [torch.randn(B, 3, 16, 16, generator=gen, dtype=dtype) for _ in range(N_LOCAL)]


def loss_args():
    return (OUT, 2 + N_LOCAL, 0.04, 0.06, 1, 3)  # teacher temperature warm-up over 1 epoch


# DINOLoss sums the teacher rows for the center in float32 (whatever the
# dtype), so float64 centers agree to ~1e-8, not ~1e-15.
CENTER_TOL = dict(rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float64, dict(rtol=1e-9, atol=1e-11)), (torch.float32, dict(rtol=1e-4, atol=1e-5))],
)
def test_reference_step_matches_dino_opt_trainer(gen, dtype, tol):
    """Two steps (epoch 0 with the last layer frozen, then epoch 1) of both
    trainers from the same init on the same crops (no drop path): loss,
    gradients, student and teacher parameters and center agree.

    float64 runs DINO's AdamW. float32 runs SGD with momentum: AdamW's first
    step divides each gradient element by its own magnitude, so in float32 the
    rounding noise of gradients that are zero in exact arithmetic (key biases:
    softmax ignores a constant shift of the keys) decides a full +-lr step,
    and any two correct implementations differ there by up to 2 lr."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    student, teacher = tiny_models(dtype, seed)
    ref_student, ref_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    initial = copy.deepcopy(student.state_dict())
    lr, wd, mom = [1e-3, 2e-3], [0.04, 0.05], [0.9, 0.95]

    def optimizer(net):
        if dtype == torch.float64:
            return torch.optim.AdamW(param_groups(net), lr=0.0)
        return torch.optim.SGD(param_groups(net), lr=0.0, momentum=0.9)

    # A clip value the gradients stay under: DINO clips each parameter's
    # gradient on its own and dino_opt the global norm, which only agree then.
    clip = 1e6
    ref = ReferenceDINOTrainer(
        ref_student,
        ref_teacher,
        ReferenceDINOLoss(*loss_args()).to(dtype),
        optimizer(ref_student),
        device="cpu",
        precision="fp32",
        clip_grad=clip,
        freeze_last_layer=1,
        lr_schedule=lr,
        wd_schedule=wd,
        momentum_schedule=mom,
    )
    model = DINOModel(student, teacher, mom)
    loss_fn = DINOLoss(*loss_args()).to(dtype)
    ours = MemoryOptimizedDINOTrainer(
        model,
        loss_fn,
        optimizer(student),
        {"use_amp": False, "gradient_clip": clip, "freeze_last_layer": 1},
        torch.device("cpu"),
    )
    schedules = Schedules(lr=np.array(lr), weight_decay=np.array(wd), momentum=np.array(mom))
    for it, epoch in enumerate([0, 1]):  # epoch 0: last layer frozen; epoch 1: trained
        batch = crops(gen, dtype)
        torch.manual_seed(seed + it)  # the same drop-path draws in both
        ref_loss = ref.train_step(batch, epoch, it)
        assert isinstance(ref_loss, float) and math.isfinite(ref_loss)
        assert ref.last_grad_norms and max(ref.last_grad_norms) < clip
        torch.manual_seed(seed + it)
        ours.set_schedules(schedules, it)
        loss, _ = ours.train_step_optimized(batch, epoch)
        torch.testing.assert_close(loss.item(), ref_loss, **tol)
        for (name, a), b in zip(student.named_parameters(), ref_student.parameters(), strict=True):
            if "last_layer" in name and epoch == 0:
                assert b.grad is None, name  # the reference dropped it
            elif b.grad is not None:
                scale = float(b.grad.abs().max())
                torch.testing.assert_close(
                    a.grad, b.grad, rtol=tol["rtol"], atol=tol["rtol"] * scale + 1e-30
                )
        assert ours.optimize_step()
        assert float(ours.last_grad_norm) < clip
        for (name, a), b in zip(student.named_parameters(), ref_student.parameters(), strict=True):
            torch.testing.assert_close(
                a, b, **tol, msg=lambda m, n=name, i=it: f"student {n}, step {i}: {m}"
            )
            if it == 0 and "last_layer" in name:  # frozen in epoch 0, in both
                assert torch.equal(b, initial[name])
        for (name, a), b in zip(teacher.named_parameters(), ref_teacher.parameters(), strict=True):
            torch.testing.assert_close(
                a, b, **tol, msg=lambda m, n=name, i=it: f"teacher {n}, step {i}: {m}"
            )
        center = loss_fn.state_dict()["center"]
        torch.testing.assert_close(center, ref.loss_fn.center, **CENTER_TOL)
        # Carry on from one center: AdamW would magnify its float32 rounding
        # in gradient elements near zero.
        ref.loss_fn.center = center.clone()
    # the last layer did move in epoch 1
    w = dict(student.named_parameters())["head.last_layer.weight_v"]
    assert not torch.equal(w, initial["head.last_layer.weight_v"])


def test_multicrop_forward_is_the_wrappers_forward(gen):
    student, _ = tiny_models(torch.float64, 0)
    student.eval()  # no drop path: deterministic
    batch = crops(gen, torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(multicrop_forward(student, batch), student(batch))


def test_reference_loss_matches_dinoloss_with_its_center(gen):
    ref, fused = ReferenceDINOLoss(*loss_args()).double(), DINOLoss(*loss_args()).double()
    for epoch in (0, 1, 2):  # the center moves; the teacher temperature warms up
        s = torch.randn((2 + N_LOCAL) * B, OUT, generator=gen, dtype=torch.float64)
        t = torch.randn(2 * B, OUT, generator=gen, dtype=torch.float64)
        s1, s2 = s.clone().requires_grad_(), s.clone().requires_grad_()
        a, b = ref(s1, t, epoch), fused(s2, t, epoch)
        a.backward()
        b.backward()
        # from epoch 1 on the centers differ by DINOLoss's float32 row sum
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(s1.grad, s2.grad, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(ref.center, fused.state_dict()["center"], **CENTER_TOL)


def test_loop_ema_matches_fused_ema(gen):
    student, teacher = tiny_models(torch.float64, 1)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    loop = LoopEMAModel(copy.deepcopy(student), copy.deepcopy(teacher), [0.9, 0.99])
    fused = DINOModel(copy.deepcopy(student), copy.deepcopy(teacher), [0.9, 0.99])
    for model in (loop, fused):  # DINOModel starts the teacher at the student
        key = "head.mlp.0.weight"
        torch.testing.assert_close(model.teacher.state_dict()[key], student.state_dict()[key])
        with torch.no_grad():
            for p in model.student.parameters():
                p.mul_(0.5)
    for _ in range(2):
        assert loop.update_teacher() == fused.update_teacher()
    assert loop.teacher_step == fused.teacher_step == 2
    for a, b in zip(loop.teacher.parameters(), fused.teacher.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_clip_gradients_clips_each_parameter_on_its_own():
    model = nn.Linear(2, 1)
    model.weight.grad = torch.tensor([[3.0, 4.0]])  # norm 5
    model.bias.grad = torch.tensor([1.0])  # norm 1
    norms = clip_gradients(model, 3.0)
    assert norms == pytest.approx([5.0, 1.0])
    torch.testing.assert_close(model.weight.grad, torch.tensor([[1.8, 2.4]]), rtol=1e-5, atol=0)
    torch.testing.assert_close(model.bias.grad, torch.tensor([1.0]))


@pytest.mark.parametrize("threshold", [0, 31, 32, 63, 64, 100, 500, 4111, 8192, 20000])
def test_largest_batch_search(threshold):
    calls = []

    def fits(b):
        calls.append(b)
        return b <= threshold

    got = largest_batch(fits, 64, granularity=32, limit=8192)
    assert got == min(threshold, 8192) // 32 * 32
    assert len(calls) <= 16


def test_the_busy_share_leaves_out_user_annotations():
    # record_function("bench_window") has a device-side twin over the whole
    # window: with it, a GPU busy 40 % of the window read 100 %.
    def event(start, end, device=DeviceType.CUDA, annotation=False):
        span = SimpleNamespace(start=start, end=end)
        return SimpleNamespace(time_range=span, device_type=device, is_user_annotation=annotation)

    events = [
        event(0, 100, annotation=True),
        event(0, 100, DeviceType.CPU, annotation=True),
        event(10, 30),
        event(25, 40),
        event(70, 85),
        event(90, 95, DeviceType.CPU),
    ]
    work = device_work(events, DeviceType.CUDA)
    assert work == [(10, 30), (25, 40), (70, 85)]
    assert covered_fraction(work, 0, 100) == pytest.approx(0.45)


def test_the_foreach_ema_is_the_loop(gen):
    """dinov2's foreach EMA (the strong baseline's) against DINO's loop: the
    same teacher, in float64 to rounding, in float32 within an ulp or two."""
    for dtype, tol in ((torch.float64, 1e-15), (torch.float32, 1e-6)):
        student, teacher = (
            nn.Sequential(nn.Linear(7, 5), nn.LayerNorm(5)).to(dtype) for _ in range(2)
        )
        for net in (student, teacher):
            with torch.no_grad():
                for p in net.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype))
        teachers = [teacher, copy.deepcopy(teacher)]
        for m in (0.996, 0.9, 0.5):
            ema_update_loop(student, teachers[0], m)
            ema_update_foreach(student, teachers[1], m)
        for a, b in zip(teachers[0].parameters(), teachers[1].parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_flops_per_image_is_the_vits_count_by_hand():
    """The bench's MFU numerator for its CPU preset (ViT-T/16, 2x64 + 4x32
    crops, head 2048-2048-256-4096) against the count written out: per block
    24 N d^2 + 4 N^2 d, the patch embedding 2 P (3 p^2) d, the head's four
    products; the teacher's forward on the globals, the student's forward
    and backward (twice the forward, but the patch embedding's input needs
    no gradient) on every crop."""
    s = dict(PRESETS["cpu"], patch_size=16, drop_path_rate=0.0, seed=0)
    d, depth, p = 192, 12, 16
    head = 2 * (d * 2048 + 2048 * 2048 + 2048 * 256 + 256 * s["out_dim"])

    def crop(size: int) -> tuple[int, int]:  # (backbone forward, patch embedding)
        patches = (size // p) ** 2
        tokens = patches + 1
        embed = 2 * patches * 3 * p * p * d
        return depth * (24 * tokens * d * d + 4 * tokens * tokens * d) + embed, embed

    (g, g_embed), (n, n_embed) = crop(s["global_size"]), crop(s["local_size"])
    student = 2 * (g + head) + s["n_local"] * (n + head)
    embed = 2 * g_embed + s["n_local"] * n_embed
    expected = 2 * (g + head) + 3 * student - embed
    assert flops_per_image(s) == pytest.approx(expected, rel=1e-9)


def test_the_bound_is_read_from_the_model_step():
    def rows(e2e, model, busy=None):
        return {
            "all_no_ckpt": {"images_per_s": e2e},
            "model_step": {"images_per_s": model, "gpu_busy": busy},
        }

    assert bound_verdict(rows(50.0, 100.0, 0.99)).startswith(
        "bound by the input: end-to-end at 0.50x"
    )
    assert bound_verdict(rows(98.0, 100.0, 0.97)).startswith("bound by the GPU")
    assert bound_verdict(rows(98.0, 100.0, 0.60)).startswith("bound by the host")
    assert "no GPU busy share" in bound_verdict(rows(98.0, 100.0))
    assert bound_verdict({"all_no_ckpt": {"images_per_s": 5.0}}) is None


def test_covered_fraction_against_a_grid():
    rng = random.Random(0)
    for _ in range(50):
        start, end = sorted(rng.uniform(0, 100) for _ in range(2))
        intervals = []
        for _ in range(rng.randrange(0, 12)):
            a = rng.uniform(-10, 110)
            intervals.append((a, a + rng.uniform(0, 30)))
        # reference: the share of fine grid points inside some interval
        n = 20_000
        points = [start + (end - start) * (k + 0.5) / n for k in range(n)]
        inside = sum(any(a <= x <= b for a, b in intervals) for x in points) / n
        assert covered_fraction(intervals, start, end) == pytest.approx(inside, abs=2e-3)
    assert covered_fraction([(0, 5), (5, 10)], 0, 10) == 1.0
    assert covered_fraction([], 0, 10) == 0.0
    assert covered_fraction([(1, 2)], 3, 3) == 0.0


def run_bench(tmp_path, *extra, device="cpu"):
    out = tmp_path / "train.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["--quick", "--workers", "1", "--device", device, "--json", str(out), *extra]
    proc = run_script(BENCH / "bench_train.py", args, env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_bench_quick_smoke_in_process(tmp_path):
    payload, stdout = run_bench(tmp_path, "--no-isolate")
    results = {r["case"]: r for r in payload["results"]}
    ran = {"baseline", "strong", "dino_opt", "loader", "fused_loss", "fused_ema", "checkpointing"}
    assert ran | {"all", "all_no_ckpt"} <= set(results)
    assert {"bf16", "compile", "sdpa"} <= set(payload["skipped"])  # on the CPU, today
    for case, r in results.items():
        assert "error" not in r, (case, r)
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"]), case
        assert r["images_per_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["ops_per_step"] > 100, case  # aten operators dispatched per step
    assert set(results["all"]["toggles"]) == {"loader", "fused_loss", "fused_ema", "checkpointing"}
    # the default rows: the step dino-opt train builds from its config
    assert results["default"]["toggles"] == ["default", "loader"]
    assert results["default_fp32"]["toggles"] == ["default", "loader", "fp32"]
    # selective checkpointing recomputes, it does not change the losses
    assert results["default_lean"]["toggles"] == ["default", "loader", "lean"]
    lean, default = results["default_lean"]["losses"], results["default"]["losses"]
    assert lean == pytest.approx(default, rel=1e-3)
    # Same init, same PIL crops, no drop path (--quick): the first loss (before
    # any update) agrees between the baseline and every row on the PIL loader.
    base = results["baseline"]["losses"][0]
    for case in ("strong", "dino_opt", "fused_loss", "fused_ema", "checkpointing"):
        assert results[case]["losses"][0] == pytest.approx(base, rel=1e-4), case
    # on the CPU the strong baseline is the published step with dinov2's EMA:
    # the same losses while the EMA has not yet moved the teacher apart
    assert results["strong"]["toggles"] == ["strong"]
    assert results["strong"]["losses"] == pytest.approx(results["baseline"]["losses"], rel=1e-4)
    assert "vs strong" in stdout and "ops/step" in stdout
    # the model step: all_no_ckpt's trainer on crops made once on the device
    assert results["model_step"]["loader"] == "crops on the device"
    assert "loader" not in results["model_step"]["toggles"]
    assert payload["bound"] and payload["bound"] in payload["notes"]
    assert len(payload["table"]["rows"]) == len(results)
    assert "vs baseline" in stdout.splitlines()[-3 - len(results)]
    assert stdout.splitlines()[-1] == f"plot: {tmp_path / 'train.png'}"
    assert (tmp_path / "train.png").stat().st_size > 10_000


def test_bench_quick_smoke_isolated(tmp_path):
    payload, _ = run_bench(tmp_path, "--only", "baseline,fused_ema")
    results = {r["case"]: r for r in payload["results"]}
    assert set(results) == {"baseline", "fused_ema"}
    assert payload["isolated_processes"]
    for r in results.values():
        assert "error" not in r and len(r["losses"]) == 2
    assert results["fused_ema"]["losses"][0] == pytest.approx(
        results["baseline"]["losses"][0], rel=1e-4
    )


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_reports_gpu_busy_share_on_cuda(tmp_path):
    # The small model, in one process: 8 test processes share the GPU, and
    # the recipe's model in a process per row took over a minute there.
    payload, stdout = run_bench(
        tmp_path,
        "--config",
        "cpu",
        "--no-isolate",
        "--only",
        "baseline,all",
        "--batch-size",
        "8",
        "--without",
        "compile",
        device="cuda",
    )
    assert "GPU busy %" in payload["table"]["columns"]
    for r in payload["results"]:
        assert 0.0 < r["gpu_busy"] <= 1.0, r["case"]


def test_bench_rows_that_do_not_fit_its_time_budget_are_reported_not_run(tmp_path):
    payload, stdout = run_bench(
        tmp_path, "--only", "baseline,dino_opt", "--time-budget", "5", "--without", "compile"
    )
    assert "left out of every row (--without): compile" in payload["notes"]
    results = {r["case"]: r for r in payload["results"]}
    assert set(results) == {"baseline", "dino_opt"}
    for r in results.values():
        assert r["error"] == "not run: the bench's time budget (5 s) was spent"
    assert [row[1] for row in payload["table"]["rows"]] == ["failed", "failed"]
    assert "not run" in stdout
