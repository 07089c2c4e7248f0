"""End-to-end DINO training throughput: the original training step
(bench/reference_trainer.py) against dino_opt's trainer with each
optimisation switched on one at a time, and all together.

    python bench/bench_train.py [--config cpu|recipe|max_batch] [--quick]
        [--only baseline,dino_opt,loader,...] [--steps N] [--warmup N]
        [--batch-size N] [--workers N] [--repeats N] [--data DIR] [--compile]
        [--photometric cpu|gpu] [--epoch N] [--no-isolate] [--without compile,...]
        [--time-budget S] [--json PATH]

Rows (same model, same initialisation from one seed, same schedules; every
row but the default ones runs DINO's head, its normalised last-layer weight
formed on every forward, and the plain attention unless ``sdpa`` is on):

- ``baseline``: :class:`ReferenceDINOTrainer`, DINO as people run it: the PIL
  multi-crop pipeline through DataLoader, per-resolution backbone calls, the
  double-loop loss with a synchronous center update, per-parameter clipping
  with ``.item()``, the per-parameter EMA loop, float16 autocast with a
  GradScaler on a GPU (float32 on the CPU), ``torch.cuda.synchronize()`` and
  ``loss.item()`` every step.
- ``strong``: the baseline as a careful user improves it in a few lines:
  bfloat16 autocast without a GradScaler (GPU), ``torch.compile`` of each
  ViT block and each head (where ``compile`` runs), fused AdamW (GPU) and
  dinov2's foreach EMA (:func:`ema_update_foreach`); the rest (the PIL
  loader, the double-loop loss, per-parameter clipping, the host syncs) as
  published. Its parts that cannot run here are left out and listed in its
  ``toggles``. The table's "vs strong" column is each row against it.
- ``default``: the step ``dino-opt train`` runs with its defaults, built from
  the config by its own builders (precision ``auto``, fused AdamW, the fused
  loss and EMA, subset drop path), on the native loader;
  ``default_fp32`` the same in float32 (what a CPU without native bfloat16
  gets). Their models are built as ``dino-opt train`` builds them (its head,
  SDPA attention, its blocks compiled where ``hardware.compile`` says).
- ``dino_opt``: ``MemoryOptimizedDINOTrainer`` built as ``dino-opt train``
  builds it (global-norm clipping with foreach kernels, no host sync in the
  step, the loss kept on the device, fused AdamW on a GPU) but with every
  switch below off: the PIL DataLoader, the reference loss, the EMA loop,
  float16 + GradScaler (GPU) / float32 (CPU), eager, no checkpointing.
- one row per switch, each the ``dino_opt`` row with that one thing on:
  ``loader`` (the native MultiCropLoader instead of the PIL DataLoader, same
  worker count), ``fused_loss`` (DINOLoss instead of the double loop),
  ``fused_ema`` (DINOModel's one-launch EMA instead of the loop), ``bf16``
  (bfloat16 autocast, no GradScaler; GPU only), ``sdpa`` (SDPA attention
  instead of a manual one; only when dino_opt's ViT has a manual path),
  ``compile`` (torch.compile of backbones and heads; GPU only unless
  ``--compile``), ``checkpointing`` (gradient checkpointing of the ViT blocks);
- ``all_no_ckpt`` and ``all``: every switch available here, without and with
  checkpointing (which trades speed for memory);
- ``model_step``: ``all_no_ckpt``'s trainer on crops already on the device
  (a few random batches made once and cycled: no loader, no copy), the
  step alone. Beside ``all_no_ckpt`` it says what bounds the end-to-end
  step (a note): the input when the end-to-end row is clearly slower than
  it, else the GPU when the GPU is busy through the model step, else the
  host (launches, syncs).

Configurations: ``recipe`` (GPU): ViT-S/16, 2x224^2 + 8x96^2 crops, out_dim
65536, batch 64, on a synthetic ImageNet-like JPEG set (bench/synthetic_images.py)
or ``--data``; ``max_batch`` (GPU): the same at the largest batch each row
fits (searched with real training steps on random crops: doubling from 64,
then bisection to multiples of 32); ``cpu``: ViT-T/16, 2x64^2 + 4x32^2, out_dim
4096, batch 32, on the built-in data set (dino_opt.data.builtin_dataset);
``cpu_recipe``: the ``recipe`` crops and model at batch 4, 12 steps, on the CPU.
Default: ``recipe`` and ``max_batch`` when CUDA is available, else ``cpu``.
On the CPU, MFU is over the rate ``torch.mm`` reaches in the same run at the
default step's dtype (bfloat16 where the CPU computes it natively).

Method: each row runs in a fresh Python process (``--no-isolate``: one after
the other in this one), builds its models from the seed, runs ``--steps``
training steps from the first iteration of the DINO schedules (epoch
``--epoch``, so the last layer is frozen in epoch 0 as in the recipe), and
times every step: on a GPU with CUDA events recorded after each step (the
interval between two events includes any time the GPU waited for the host or
the loader; no synchronisation is added to dino_opt's steps), on the CPU with a
steady clock. images/s is the batch over a step's time: the median and the
10th/90th percentiles over the steps after ``--warmup`` (with ``--repeats``,
the rows run round by round, interleaved, so that a change in the machine's
load touches all rows alike, and the steps of all rounds are pooled). Peak
memory: the CUDA caching allocator's peak allocation over the row (models,
optimizer state and activations) on a GPU; on the CPU the peak resident set
of the training process (DataLoader worker processes are not in it; the
native loader's threads and buffers are). ops/step (kernels/step on a GPU):
``BUSY_STEPS`` more steps (one with ``--quick``) under torch.profiler, the aten
operators dispatched (every level) or the kernels and copies launched, per step. Losses are read
at the end (for dino_opt's rows from device tensors); steps 1, 10 and the
last are in the table, all in the JSON. With ``--time-budget``, a row is started only while at least
``MIN_ROW_SECONDS`` of the budget are left and is stopped when it runs out;
the rows that did not run or were stopped are in the table and the JSON as
such, so that a bench cut short still writes its results. Both trainers
compute the same step up to the clipping rule (DINO clips each parameter's
gradient to norm 3 on its own, dino_opt the global norm);
tests_py/test_reference_trainer.py checks that they agree.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from dino_opt import DINOLoss
from dino_opt.config import apply_overrides, default_config
from dino_opt.data import MultiCropLoader
from dino_opt.models import WeightNormLinear
from dino_opt.models.vit import Attention
from dino_opt.ops import Schedules
from dino_opt.runtime import compile_totals
from dino_opt.train import (
    DINOModel,
    MemoryOptimizedDINOTrainer,
    build_loss,
    build_models,
    build_optimizer,
    build_trainer,
    param_groups,
)
from dino_opt.tune import checkpointing_ladder, resolve_hardware
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PEAK_TFLOPS,
    RESULTS_DIR,
    closer_for_dataloader,
    device_peak_flops,
    device_slug,
    machine,
    print_table,
    write_json,
)
from reference_trainer import (  # noqa: E402
    LoopEMAModel,
    ReferenceDINOLoss,
    ReferenceDINOTrainer,
    endless,
    make_pil_loader,
    multicrop_forward,
)

TOGGLES = ("loader", "fused_loss", "fused_ema", "bf16", "sdpa", "compile", "checkpointing")
#: What the strong baseline adds to the published step, where it can run.
STRONG_PARTS = ("bf16", "compile")
CASES = (
    "baseline",
    "strong",
    "default",
    "default_fp32",
    "default_lean",
    "default_graphs",
    "dino_opt",
    *TOGGLES,
    "all_no_ckpt",
    "all",
    "model_step",
)
DEFAULT = "default"  # the default row's marker: built from the config as `dino-opt train` builds it
FP32 = "fp32"  # with DEFAULT: hardware.precision=fp32 (the default step without bfloat16)
LEAN = "lean"  # with DEFAULT: selective checkpointing at the first rung of auto's ladder
GRAPHS = "graphs"  # with DEFAULT: hardware.compile_mode=reduce-overhead (CUDA graphs on a GPU)
ON_DEVICE = "on_device"  # the model_step row's marker: crops made on the device
ON_DEVICE_BATCHES = 4  # random batches the model_step row cycles through
# An end-to-end step this much slower than the model step is bound by its input;
# a model step with the GPU busy this share of its time is bound by the GPU.
INPUT_BOUND, GPU_BOUND = 0.9, 0.9
LABELS = {
    "baseline": "baseline: DINO step as published",
    "strong": "strong baseline: + bf16, compiled blocks, fused AdamW, foreach EMA",
    "default": "dino-opt train's step: its defaults, native loader",
    "default_fp32": "dino-opt train's step, precision fp32",
    "default_lean": "dino-opt train's step, selective checkpointing",
    "default_graphs": "dino-opt train's step, CUDA graphs (reduce-overhead)",
    "dino_opt": "dino_opt trainer, switches off",
    "loader": "+ native loader",
    "fused_loss": "+ fused loss",
    "fused_ema": "+ fused EMA",
    "bf16": "+ bf16 autocast",
    "sdpa": "+ SDPA attention",
    "compile": "+ torch.compile",
    "checkpointing": "+ grad checkpointing",
    "all_no_ckpt": "all but checkpointing",
    "all": "all together",
    "model_step": "model step: all but checkpointing, crops on the device",
}

# The DINO recipe (docs/design.md, "The algorithm").
LR, MIN_LR, WD, WD_END, MOMENTUM, CLIP = 0.0005, 1e-6, 0.04, 0.4, 0.996, 3.0
TEACHER_TEMP, STUDENT_TEMP, EPOCHS, WARMUP_EPOCHS = 0.04, 0.1, 100, 10

PRESETS = {
    "cpu": dict(
        backbone="vit_tiny",
        out_dim=4096,
        global_size=64,
        local_size=32,
        n_local=4,
        batch_size=32,
        steps=30,
        warmup=5,
        data="builtin",
    ),
    "cpu_recipe": dict(
        backbone="vit_small",
        out_dim=65536,
        global_size=224,
        local_size=96,
        n_local=8,
        batch_size=4,
        steps=12,
        warmup=2,
        data="synthetic",
    ),
    "recipe": dict(
        backbone="vit_small",
        out_dim=65536,
        global_size=224,
        local_size=96,
        n_local=8,
        batch_size=64,
        steps=60,
        warmup=10,
        data="synthetic",
    ),
    "max_batch": dict(
        backbone="vit_small",
        out_dim=65536,
        global_size=224,
        local_size=96,
        n_local=8,
        batch_size=None,
        steps=25,
        warmup=5,
        data="synthetic",
    ),
}
# The quick run (a smoke test) without drop path, so that every row's first
# loss is the baseline's: dino_opt's ViT packs the crop sizes into one pass
# and draws the dropped samples in another order than the published forward;
# one profiled step, not BUSY_STEPS: on the CPU, reading the profiler's
# events took about 1.1 s of a row's time per step profiled (docs/testing.md).
QUICK = dict(steps=2, warmup=1, drop_path_rate=0.0, busy_steps=1)
MIN_ROW_SECONDS = 15  # with --time-budget: less than this left, a row is not started
QUICK_CPU_BATCH = 4
SEARCH_START, SEARCH_GRANULARITY = 64, 32


# ---------------------------------------------------------------- what can run here


def manual_attention_supported() -> bool:
    """Whether dino_opt's ViT attention has a switch to a manual (q kᵀ,
    softmax, v) path: a boolean ``fused_attn`` attribute on its Attention
    modules (timm's convention). dino_opt.models.vit has none today: its
    attention always goes through SDPA."""
    return isinstance(getattr(Attention(8, 2), "fused_attn", None), bool)


def set_manual_attention(model: torch.nn.Module, manual: bool) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.fused_attn = not manual


def set_published_head(model: torch.nn.Module) -> None:
    """The head's last layer as DINO computes it: the normalised weight
    formed on every forward (torch's weight_norm), not dino_opt's scaled outputs."""
    for m in model.modules():
        if isinstance(m, WeightNormLinear):
            m.scale_outputs = False


def unavailable_toggles(device: torch.device, try_compile: bool) -> dict[str, str]:
    """Switches that cannot run here, with the reason."""
    out = {}
    if device.type != "cuda":
        out["bf16"] = "GPU only in these rows (the default rows run the CPU's own precision)"
    elif not torch.cuda.is_bf16_supported():
        out["bf16"] = "this GPU has no bfloat16"
    if not manual_attention_supported():
        out["sdpa"] = (
            "dino_opt.models.vit has no manual attention path: the baseline and every row "
            "run the same SDPA attention"
        )
    if device.type != "cuda" and not try_compile:
        out["compile"] = "GPU only by default (--compile tries it on the CPU)"
    return out


def case_toggles(case: str, available: list[str]) -> list[str] | None:
    """The switches a row turns on (None: the baseline trainer; ``strong``
    first: the baseline trainer with the strong baseline's parts)."""
    if case == "baseline":
        return None
    if case == "strong":
        return ["strong", *(t for t in STRONG_PARTS if t in available)]
    if case == "dino_opt":
        return []
    if case == DEFAULT:
        return [DEFAULT, "loader"]
    if case == "default_fp32":
        return [DEFAULT, "loader", FP32]
    if case == "default_lean":
        return [DEFAULT, "loader", LEAN]
    if case == "default_graphs":
        return [DEFAULT, "loader", GRAPHS]
    if case == "all":
        return list(available)
    if case == "all_no_ckpt":
        return [t for t in available if t != "checkpointing"]
    if case == "model_step":
        return [t for t in available if t not in ("checkpointing", "loader")] + [ON_DEVICE]
    return [case]


# ---------------------------------------------------------------- one row


def model_config(s: dict):
    """The rows' model (compiled only where a row's switches say so)."""
    return apply_overrides(
        default_config(),
        [
            "hardware.compile=false",
            f"model.backbone={s['backbone']}",
            f"model.out_dim={s['out_dim']}",
            f"model.patch_size={s['patch_size']}",
            f"model.drop_path_rate={s['drop_path_rate']}",
        ],
    )


def recipe_defaults(s: dict, lean: bool = False, graphs: bool = False):
    """The config `dino-opt train` would run for the row's settings: its
    defaults (precision, optimizer, loss, EMA, drop path, compile) with the
    row's model, crops and batch, resolved for the row's device as a run
    resolves it (``hardware.compile: null`` becomes on for a GPU); ``lean``:
    with selective checkpointing at the first rung of ``auto``'s ladder
    (every output the backward reads kept); ``graphs``: compiled in
    ``reduce-overhead`` mode (CUDA graphs on a GPU; where compile is off, as
    on the CPU, the default row)."""
    cfg = apply_overrides(
        model_config(s),
        [
            "hardware.compile=null",
            f"hardware.device={s['device']}",
            f"augmentation.global_crop_size={s['global_size']}",
            f"augmentation.local_crop_size={s['local_size']}",
            f"augmentation.num_local_views={s['n_local']}",
            f"data.batch_size={s.get('batch_size') or 1}",
        ],
    )
    cfg = resolve_hardware(cfg)[0]
    if graphs:
        cfg = apply_overrides(cfg, ["hardware.compile_mode=reduce-overhead"])
    if not lean:
        return cfg
    _, threshold = checkpointing_ladder(cfg)[1]
    return apply_overrides(
        cfg,
        [
            "hardware.activation_checkpointing=selective",
            f"hardware.recompute_threshold={threshold!r}",
        ],
    )


def compile_models(student, teacher, dynamic: bool | None, per_block: bool = False) -> None:
    """torch.compile in place (parameter names unchanged, so the EMA still
    pairs them): backbone and head of both networks, or with ``per_block``
    each ViT block and each head (what a user adds to the published code
    without touching its loop). The blocks share one code object, so the
    recompile limit is raised to hold their graphs (a drop-path rate and a
    crop size each)."""
    import torch._dynamo

    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
    for net in (student, teacher):
        for part in net.backbone.blocks if per_block else (net.backbone,):
            part.compile(dynamic=dynamic)
        net.head.compile(dynamic=dynamic)


class Job:
    """The models, loss, optimizer and trainer of one row; ``step(crops, i)``
    runs training step ``i`` (from the row's first iteration) and returns
    its loss (a float for the baseline, a device tensor for dino_opt)."""

    def __init__(
        self, s: dict, toggles: list[str] | None, batch_size: int, niter_per_epoch: int
    ) -> None:
        strong = toggles is not None and "strong" in toggles
        self.baseline = toggles is None or strong  # the published trainer
        use = set(toggles or ())
        self.device = device = torch.device(s["device"])
        cuda = device.type == "cuda"
        torch.manual_seed(s["seed"])
        default = DEFAULT in use
        # the default row's models as `dino-opt train` builds them (its
        # attention, its blocks compiled where its config says so)
        lean, graphs = LEAN in use, GRAPHS in use
        student, teacher = build_models(
            recipe_defaults(s, lean, graphs) if default else model_config(s)
        )
        if not default:  # the published model: its head, plain attention unless switched
            for net in (student, teacher):
                set_published_head(net)
                if manual_attention_supported():
                    set_manual_attention(net, manual="sdpa" not in use)
        student, teacher = student.to(device), teacher.to(device)
        if "compile" in use:
            compile_models(student, teacher, s.get("compile_dynamic", False), per_block=strong)
        self.schedules = Schedules.dino(
            base_lr=LR * batch_size / 256,
            min_lr=MIN_LR,
            weight_decay=WD,
            weight_decay_end=WD_END,
            momentum_teacher=MOMENTUM,
            epochs=EPOCHS,
            warmup_epochs=WARMUP_EPOCHS,
            niter_per_epoch=niter_per_epoch,
        )
        self.epoch = int(s["epoch"])
        self.it0 = self.epoch * niter_per_epoch
        ncrops = 2 + s["n_local"]
        loss_args = (s["out_dim"], ncrops, TEACHER_TEMP, TEACHER_TEMP, 0, EPOCHS, STUDENT_TEMP)
        torch.manual_seed(s["seed"])  # the same drop-path draws in every row
        if self.baseline:
            published = "fp16" if cuda else "fp32"  # DINO's use_fp16 on a GPU
            self.trainer = ReferenceDINOTrainer(
                student,
                teacher,
                ReferenceDINOLoss(*loss_args).to(device),
                torch.optim.AdamW(param_groups(student), lr=0.0, fused=strong and cuda),
                device=device,
                precision="bf16" if "bf16" in use else published,
                ema="foreach" if strong else "loop",
                clip_grad=CLIP,
                freeze_last_layer=1,
                lr_schedule=self.schedules.lr,
                wd_schedule=self.schedules.weight_decay,
                momentum_schedule=self.schedules.momentum,
            )
            return
        if DEFAULT in use:
            cfg = recipe_defaults(dict(s, batch_size=batch_size), lean, graphs)
            if FP32 in use:
                cfg = apply_overrides(cfg, ["hardware.precision=fp32"])
            model = DINOModel(student, teacher, self.schedules.momentum)
            model.teacher_step = self.it0
            optimizer = build_optimizer(cfg, student, device)
            self.trainer = build_trainer(cfg, model, build_loss(cfg).to(device), optimizer, device)
            return
        model_class = DINOModel if "fused_ema" in use else LoopEMAModel
        model = model_class(student, teacher, self.schedules.momentum)
        model.teacher_step = self.it0
        loss_class = DINOLoss if "fused_loss" in use else ReferenceDINOLoss
        precision = "bf16" if "bf16" in use else ("fp16" if cuda else "fp32")
        self.trainer = MemoryOptimizedDINOTrainer(
            model,
            loss_class(*loss_args).to(device),
            torch.optim.AdamW(param_groups(student), lr=0.0, fused=cuda),
            {
                "use_amp": precision != "fp32",
                "precision": precision,
                "gradient_checkpointing": "checkpointing" in use,
                "gradient_clip": CLIP,
                "freeze_last_layer": 1,
            },
            device,
        )

    def step(self, crops, i: int):
        it = self.it0 + i
        if self.baseline:
            return self.trainer.train_step(crops, self.epoch, it)
        self.trainer.set_schedules(self.schedules, it)
        loss, _ = self.trainer.train_step_optimized(crops, self.epoch)
        self.trainer.optimize_step()
        return loss


def device_stream(s: dict, batch_size: int):
    """``(iterator of crop lists, close, stats)`` cycling through
    ``ON_DEVICE_BATCHES`` batches of random crops made once on the device."""
    device = torch.device(s["device"])
    gen = torch.Generator(device=device).manual_seed(s["seed"])
    g, n = s["global_size"], s["local_size"]
    shapes = [g] * 2 + [n] * s["n_local"]
    batches = [
        [torch.randn(batch_size, 3, x, x, device=device, generator=gen) for x in shapes]
        for _ in range(ON_DEVICE_BATCHES)
    ]
    return endless(batches), batches.clear, None


def data_stream(s: dict, native: bool, batch_size: int):
    """``(iterator of crop lists, close, stats)`` over the row's data."""
    device = torch.device(s["device"])
    common = dict(
        global_size=s["global_size"],
        local_size=s["local_size"],
        n_local=s["n_local"],
        global_scale=(0.4, 1.0),
        local_scale=(0.05, 0.4),
        seed=s["seed"],
    )
    if native:
        photometric = s["photometric"]
        loader = MultiCropLoader(
            s["data_root"],
            batch_size,
            num_threads=s["workers"],
            dtype=torch.float32,
            photometric=photometric,
            device=device if photometric == "gpu" else None,
            pin_memory=device.type == "cuda",
            **common,
        )
        gen = (b.crops for b in endless(loader, loader.set_epoch))

        def close():
            gen.close()
            loader.close()

        return gen, close, loader.stats

    loader = make_pil_loader(
        s["data_root"], batch_size, workers=s["workers"], pin_memory=device.type == "cuda", **common
    )
    gen = (b[0] for b in endless(loader))
    return gen, closer_for_dataloader(gen, loader), None


class StepClock:
    """The end of every step: CUDA events on the current stream (no
    synchronisation until ``seconds()``), else a steady clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Per-step seconds (one fewer than the marks)."""
        pairs = zip(self.marks[:-1], self.marks[1:], strict=True)
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def search_batch(s: dict, toggles: list[str] | None, limit: int) -> dict:
    """The largest batch (multiple of 32) for which two full training steps
    on random crops fit in GPU memory."""
    device = torch.device(s["device"])
    s = dict(s, compile_dynamic=None)  # one dynamic-batch graph instead of one per size
    tried = {}

    def trial(b: int) -> bool:
        # Everything a trial allocates is local here, so it is garbage once
        # this returns (an exception's traceback would otherwise keep it alive).
        try:
            job = Job(s, toggles, b, niter_per_epoch=1000)
            g, n = s["global_size"], s["local_size"]
            for i in range(2):
                crops = [torch.randn(b, 3, g, g, device=device) for _ in range(2)]
                crops += [torch.randn(b, 3, n, n, device=device) for _ in range(s["n_local"])]
                job.step(crops, i)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return True
        except Exception as e:  # noqa: BLE001 - only out-of-memory is an answer
            if not _is_oom(e):
                raise
            return False

    def fits(b: int) -> bool:
        ok = trial(b)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        tried[b] = ok
        print(f"    batch {b}: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    best = largest_batch(fits, SEARCH_START, granularity=SEARCH_GRANULARITY, limit=limit)
    return {"batch_size": best, "tried": {str(k): v for k, v in tried.items()}}


def largest_batch(
    fits: Callable[[int], bool], start: int, *, granularity: int = 32, limit: int = 8192
) -> int:
    """The largest multiple of ``granularity`` up to ``limit`` for which
    ``fits`` holds, assuming it holds below some threshold and not above:
    doubling from ``start`` (halving when ``start`` does not fit), then
    bisection. 0 when not even ``granularity`` fits."""

    def down(b: int) -> int:
        return b // granularity * granularity

    b = max(granularity, down(min(start, limit)))
    if fits(b):
        lo, hi = b, None
        while lo < limit:
            b = min(2 * lo, down(limit))
            if b <= lo:
                break
            if not fits(b):
                hi = b
                break
            lo = b
        if hi is None:
            return lo
    else:
        lo, hi = 0, b
        b = down(hi // 2)
        while b >= granularity:
            if fits(b):
                lo = b
                break
            hi, b = b, down(b // 2)
        if lo == 0:
            return 0
    while True:
        mid = down((lo + hi) // 2)
        if mid <= lo:
            return lo
        if fits(mid):
            lo = mid
        else:
            hi = mid


BUSY_STEPS = 3  # profiled steps after the timed ones: the GPU's busy share, operators per step


def flops_per_image(s: dict) -> float:
    """The model FLOPs of one image's training step, counted by
    ``torch.utils.flop_counter`` on the eager models (CPU, one image): the
    teacher's forward on the global crops, the student's forward and
    backward on all crops. Attention goes through SDPA's math kernel, whose
    matrix products the counter sees (it does not count the CPU's fused
    attention kernel). Recomputation (checkpointing) is not counted, as MFU
    leaves it out."""
    torch.manual_seed(s["seed"])
    student, teacher = build_models(model_config(s))
    g, n = s["global_size"], s["local_size"]
    crops = [torch.randn(1, 3, g, g) for _ in range(2)]
    crops += [torch.randn(1, 3, n, n) for _ in range(s["n_local"])]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        with torch.no_grad():
            multicrop_forward(teacher, crops[:2])
        multicrop_forward(student, crops).sum().backward()
    return float(counter.get_total_flops())


def covered_fraction(intervals, start: float, end: float) -> float:
    """Share of ``[start, end]`` covered by the union of ``(a, b)`` intervals."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    covered, run_start, run_end = 0.0, None, None
    for a, b in clipped:
        if run_end is None or a > run_end:
            if run_end is not None:
                covered += run_end - run_start
            run_start, run_end = a, b
        else:
            run_end = max(run_end, b)
    if run_end is not None:
        covered += run_end - run_start
    return covered / (end - start) if end > start else 0.0


def profiled_steps(job, stream, first_step: int, steps: int, device: torch.device) -> tuple:
    """``steps`` more steps (data included) under torch.profiler: the share
    of their wall time during which the GPU ran a kernel or a copy (the union
    of the device activity CUPTI records, over the window's host time; None
    on the CPU), and the operators per step: on a GPU the kernels and copies
    launched, on the CPU the aten operators dispatched (every level: a
    composite and the operators it calls each count): ``(busy, ops)``."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        with record_function("bench_window"):
            for i in range(steps):
                job.step(next(stream), first_step + i)
            if cuda:
                torch.cuda.synchronize()
    events = prof.events()
    if not cuda:
        ops = sum(1 for e in events if e.name.startswith("aten::"))
        return None, ops / steps
    work = device_work(events, DeviceType.CUDA)
    window = next(e for e in events if e.name == "bench_window").time_range
    return covered_fraction(work, window.start, window.end), len(work) / steps


def device_work(events, device_type) -> list[tuple[float, float]]:
    """The ``(start, end)`` of each kernel and copy among profiler ``events``
    on ``device_type``. A user annotation (``record_function``) has a
    device-side twin that spans its whole range, busy or not: counted, it
    made every window read ~100 % busy, so annotations are left out, as torch
    leaves them out of device time."""
    return [
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == device_type and not getattr(e, "is_user_annotation", False)
    ]


def measure(s: dict, case: str, toggles: list[str] | None, batch_size: int) -> dict:
    """One row: ``s["steps"]`` training steps on the row's data."""
    device = torch.device(s["device"])
    reset_peak_memory(device)
    niter = max(1, s["data_images"] // batch_size)
    native = toggles is not None and "loader" in toggles
    on_device = toggles is not None and ON_DEVICE in toggles
    job = Job(s, toggles, batch_size, niter)
    stream, close, stats_fn = (
        device_stream(s, batch_size) if on_device else data_stream(s, native, batch_size)
    )
    clock = StepClock(device)
    losses = []
    t0 = time.perf_counter()
    try:
        clock.mark()
        for i in range(s["steps"]):
            crops = next(stream)
            losses.append(job.step(crops, i))
            clock.mark()
            if i + 1 == s["warmup"]:
                t_warm = time.perf_counter()
        step_s = clock.seconds()  # waits for the GPU once, at the end
        t_end = time.perf_counter()
        graphs, compile_s = compile_totals()  # the row's own process: its compilation
        loader_stats = stats_fn() if stats_fn is not None else None
        busy, ops = profiled_steps(job, stream, s["steps"], s["busy_steps"], device)
    finally:
        close()
    losses = [float(x) for x in losses]  # dino_opt: device tensors, read now
    measured = step_s[s["warmup"] :]
    rates = [batch_size / t for t in measured]
    window = (t_end - t_warm) if s["warmup"] else (t_end - t0)
    result = {
        "case": case,
        "toggles": toggles,
        "batch_size": batch_size,
        "steps": s["steps"],
        "warmup": s["warmup"],
        "step_seconds": step_s,
        "images_per_s": statistics.median(rates),
        "images_per_s_p10": float(np.percentile(rates, 10)),
        "images_per_s_p90": float(np.percentile(rates, 90)),
        "images_per_s_window": batch_size * len(measured) / window,
        "peak_memory_bytes": peak_memory(device),
        "gpu_busy": busy,
        "ops_per_step": ops,
        "compile_graphs": graphs,
        "compile_seconds": compile_s,
        "losses": losses,
        "loader": "crops on the device"
        if on_device
        else ("native MultiCropLoader" if native else "PIL DataLoader"),
    }
    if loader_stats is not None:
        result["loader_stats"] = {
            k: v for k, v in loader_stats.items() if isinstance(v, (int, float, str))
        }
    del job
    reset_peak_memory(device)
    return result


def merge_rounds(rounds: list[dict]) -> dict:
    """One row's rounds as one result: rates pooled over every measured step
    of every round (median, p10, p90), the highest peak memory, the first
    round's losses (the rounds repeat the same steps); each round is kept."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return dict(rounds[0])
    if len(ok) == 1 and len(rounds) == 1:
        return dict(ok[0])
    b, w = ok[0]["batch_size"], ok[0]["warmup"]
    rates = [b / t for r in ok for t in r["step_seconds"][w:]]
    busy = [r["gpu_busy"] for r in ok if r.get("gpu_busy") is not None]
    out = dict(ok[0])
    out.update(
        images_per_s=statistics.median(rates),
        images_per_s_p10=float(np.percentile(rates, 10)),
        images_per_s_p90=float(np.percentile(rates, 90)),
        images_per_s_window=statistics.median(r["images_per_s_window"] for r in ok),
        peak_memory_bytes=max((r["peak_memory_bytes"] or 0) for r in ok) or None,
        gpu_busy=statistics.median(busy) if busy else None,
        ops_per_step=statistics.median(r["ops_per_step"] for r in ok),
        compile_seconds=statistics.median(r.get("compile_seconds", 0.0) for r in ok),
        rounds=[
            {
                k: r.get(k)
                for k in (
                    "images_per_s",
                    "images_per_s_window",
                    "peak_memory_bytes",
                    "step_seconds",
                    "losses",
                    "error",
                )
            }
            for r in rounds
        ],
    )
    out.pop("step_seconds", None)
    return out


class Budget:
    """The bench's time budget (``--time-budget``; None: none)."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def describe(self) -> str:
        return f"the bench's time budget ({self.seconds:.0f} s)"


def run_spec(spec: dict) -> dict:
    s, case, toggles = spec["settings"], spec["case"], spec["toggles"]
    if spec["mode"] == "search":
        return search_batch(s, toggles, spec["limit"])
    return measure(s, case, toggles, spec["batch_size"])


def execute(spec: dict, isolate: bool, budget: Budget) -> dict:
    """``run_spec`` in a fresh process (``isolate``) or in this one; a failure
    becomes ``{"error": ...}``, and so does a row for which the budget has
    too little left (not started) or that outlasts it (stopped)."""
    left = budget.left()
    if left is not None and left < MIN_ROW_SECONDS:
        return {"error": f"not run: {budget.describe()} was spent"}
    if not isolate:
        try:
            return run_spec(spec)
        except Exception as e:  # noqa: BLE001 - reported in the row
            traceback.print_exc()
            return {"error": f"{type(e).__name__}: {e}"}
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        command = [sys.executable, str(Path(__file__).resolve()), "--child"]
        try:
            proc = subprocess.run([*command, str(spec_path), str(out_path)], timeout=left)
        except subprocess.TimeoutExpired:
            return {"error": f"stopped after {left:.0f} s: {budget.describe()} ran out"}
        if out_path.exists():
            return json.loads(out_path.read_text())
        return {"error": f"the row's process exited with status {proc.returncode}"}


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    try:
        result = run_spec(spec)
    except Exception as e:  # noqa: BLE001 - reported in the row
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    Path(out_path).write_text(json.dumps(result))


# ---------------------------------------------------------------- the whole bench


def resolve_data(s: dict, args, min_images: int) -> None:
    """Fills ``data_root``, ``data_images`` and ``data`` (a description)."""
    from baseline_augment import list_image_folder

    if args.data is not None:
        root = Path(args.data)
        desc = {"source": str(root), "kind": "ImageFolder"}
    elif s["data"] == "builtin":
        from dino_opt.data import builtin_dataset

        root = builtin_dataset() / "train"
        desc = {"source": str(root), "kind": "dino_opt built-in data set (train split)"}
    else:
        from synthetic_images import ensure_synthetic_set

        count = max(args.count, -(-min_images // 1000) * 1000)
        ds = ensure_synthetic_set(count, seed=0)
        root = ds.root
        desc = {
            "source": str(root),
            "kind": "synthetic ImageNet-like JPEGs (bench/synthetic_images.py)",
            "mean_pixels": ds.mean_pixels,
            "mean_bytes": ds.mean_bytes,
        }
    n = len(list_image_folder(root))
    if n == 0:
        sys.exit(f"no images under {root}")
    s.update(data_root=str(root), data_images=n, data=desc)


def settings_for(config: str, args, device: torch.device) -> dict:
    s = dict(PRESETS[config])
    s.update(
        config=config,
        device=str(device),
        patch_size=16,
        drop_path_rate=0.1,
        seed=args.seed,
        epoch=args.epoch,
        photometric=args.photometric,
        workers=args.workers,
        busy_steps=BUSY_STEPS,
    )
    if args.quick:
        s.update(QUICK)
        if config == "cpu":
            s["batch_size"] = QUICK_CPU_BATCH
    for key in ("steps", "warmup", "batch_size"):
        if getattr(args, key) is not None and not (key == "batch_size" and config == "max_batch"):
            s[key] = getattr(args, key)
    if s["warmup"] >= s["steps"]:
        sys.exit(f"--warmup ({s['warmup']}) must be below --steps ({s['steps']})")
    return s


def bound_verdict(results: dict) -> str | None:
    """What bounds the end-to-end step (``all_no_ckpt``), read against the
    model step on crops already on the device (``model_step``): the input,
    the GPU or the host; None without both rows."""
    e2e = results.get("all_no_ckpt", {}).get("images_per_s")
    model = results.get("model_step", {})
    if not e2e or not model.get("images_per_s"):
        return None
    ratio = e2e / model["images_per_s"]
    said = f"end-to-end at {ratio:.2f}x the model step's images/s"
    if ratio < INPUT_BOUND:
        return f"bound by the input: {said}"
    busy = model.get("gpu_busy")
    if busy is None:
        return f"bound by the model step ({said}); no GPU busy share here to tell GPU from host"
    if busy >= GPU_BOUND:
        return f"bound by the GPU: {said}, the GPU busy {100 * busy:.0f} % of the model step"
    return f"bound by the host: {said}, the GPU busy only {100 * busy:.0f} % of the model step"


def _fmt(x, digits: int) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def run_config(config: str, args, device: torch.device, cases: list[str]) -> None:
    s = settings_for(config, args, device)
    skipped = unavailable_toggles(device, args.compile)
    skipped.update({t: "left out (--without)" for t in args.without if t not in skipped})
    available = [t for t in TOGGLES if t not in skipped]
    rows_cases = [case for case in cases if case not in skipped]
    isolate = not args.no_isolate
    budget = args.budget
    notes = [f"{LABELS[c]}: skipped: {skipped[c]}" for c in cases if c in skipped]
    if args.without:
        notes.append(f"left out of every row (--without): {', '.join(args.without)}")
    left_out = [t for t in STRONG_PARTS if t in skipped]
    if "strong" in rows_cases and (left_out or device.type != "cuda"):
        parts = [f"{t} ({skipped[t]})" for t in left_out]
        parts += [] if device.type == "cuda" else ["fused AdamW (GPU only)"]
        notes.append(f"{LABELS['strong']}: here without {'; '.join(parts)}")
    batches = {}
    searches = {}
    if config == "max_batch":
        if device.type != "cuda":
            sys.exit("--config max_batch needs a GPU")
        for case in rows_cases:
            print(f"{case}: searching the largest batch", flush=True)
            spec = dict(
                settings=s,
                case=case,
                toggles=case_toggles(case, available),
                mode="search",
                limit=args.max_batch_limit,
            )
            r = execute(spec, isolate, budget)
            searches[case] = r
            batches[case] = r.get("batch_size") or 0
            print(f"  {case}: batch {batches[case]}", flush=True)
        biggest = max(batches.values(), default=0)
        # the set holds several batches of the largest so that epoch ends are rare
        resolve_data(s, args, min_images=4 * biggest)
    else:
        resolve_data(s, args, min_images=(s["steps"] + 2) * s["batch_size"])
        batches = {case: s["batch_size"] for case in rows_cases}
    for case, b in batches.items():
        if b > s["data_images"]:
            batches[case] = 0
            notes.append(f"{LABELS[case]}: batch {b} is more than the {s['data_images']} images")

    print(
        f"config {config}: {s['backbone']}/{s['patch_size']}, 2x{s['global_size']}^2 + "
        f"{s['n_local']}x{s['local_size']}^2 crops, out_dim {s['out_dim']}, "
        f"{s['steps']} steps ({s['warmup']} warm-up), {s['workers']} loader workers, "
        f"{device_slug(device)}, data {s['data_root']} ({s['data_images']} images)",
        flush=True,
    )
    runs: dict[str, list[dict]] = {case: [] for case in rows_cases}
    for r_i in range(args.repeats):
        if args.repeats > 1:
            print(f"round {r_i + 1}/{args.repeats}", flush=True)
        for case in rows_cases:
            if not batches.get(case):
                continue
            print(f"{case}: {LABELS[case]} (batch {batches[case]})", flush=True)
            spec = dict(
                settings=s,
                case=case,
                toggles=case_toggles(case, available),
                mode="measure",
                batch_size=batches[case],
            )
            r = execute(spec, isolate, budget)
            runs[case].append(r)
            if "error" in r:
                print(f"  failed: {r['error']}", flush=True)
            else:
                print(
                    f"  {r['images_per_s']:.1f} images/s (p10 {r['images_per_s_p10']:.1f}, "
                    f"p90 {r['images_per_s_p90']:.1f}), peak "
                    f"{r['peak_memory_bytes'] / 2**20:.0f} MiB, "
                    f"loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}",
                    flush=True,
                )
    results = {}
    for case in rows_cases:
        toggles = case_toggles(case, available)
        if not runs[case]:
            r = {"error": "no batch fits"}
        else:
            r = merge_rounds(runs[case])
        r.update(case=case, toggles=toggles, label=LABELS[case])
        if case in searches:
            r["batch_search"] = searches[case]
        results[case] = r

    base = results.get("baseline", {}).get("images_per_s")
    strong = results.get("strong", {}).get("images_per_s")
    per_image = flops_per_image(s)
    peak = device_peak_flops(device, args.peak_tflops)
    for r in results.values():
        ips = r.get("images_per_s")
        r["mfu"] = ips * per_image / peak if ips and peak else None
    with_batch = config == "max_batch"
    columns = ["case"] + (["batch"] if with_batch else [])
    columns += [
        "images/s",
        "p10",
        "p90",
        "peak MiB",
        *(["GPU busy %"] if device.type == "cuda" else []),
        *(["MFU %"] if peak else []),
        "kernels/step" if device.type == "cuda" else "ops/step",
        "compile s",
        "loss@1",
        "loss@10",
        "loss@last",
        "vs baseline",
        *(["vs strong"] if strong else []),
    ]
    rows = []
    for case, r in results.items():
        row = [r.get("label", LABELS[case])] + ([str(batches.get(case, 0))] if with_batch else [])
        if "error" in r:
            rows.append(row + ["failed"] + ["n/a"] * (len(columns) - len(row) - 1))
            notes.append(f"{LABELS[case]}: {r['error']}")
            continue
        losses = r["losses"]
        ips = r["images_per_s"]
        row += [
            _fmt(ips, 1),
            _fmt(r["images_per_s_p10"], 1),
            _fmt(r["images_per_s_p90"], 1),
            _fmt(None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**20, 0),
            *(
                [_fmt(None if r["gpu_busy"] is None else 100 * r["gpu_busy"], 0)]
                if device.type == "cuda"
                else []
            ),
            *([_fmt(100 * r["mfu"], 1)] if peak else []),
            _fmt(r.get("ops_per_step"), 0),
            _fmt(r.get("compile_seconds"), 1),
            _fmt(losses[0], 4),
            _fmt(losses[9], 4) if len(losses) >= 10 else "n/a",
            _fmt(losses[-1], 4),
            f"{ips / base:.2f}x" if base else "n/a",
            *([f"{ips / strong:.2f}x"] if strong else []),
        ]
        rows.append(row)

    bound = bound_verdict(results)
    if bound:
        notes.append(bound)
    mem_kind = (
        "CUDA allocator peak (models, optimizer state, activations)"
        if device.type == "cuda"
        else "peak RSS of the training process (DataLoader worker processes not included; "
        "the native loader's threads are)"
    )
    notes += [
        f"peak memory: {mem_kind}",
        (
            "kernels/step: the kernels and copies a step launches on the GPU"
            if device.type == "cuda"
            else "ops/step: the aten operators a step dispatches (every level)"
        )
        + f", counted by torch.profiler over {s['busy_steps']} steps after the timed ones",
        "compile s: the seconds torch.compile spent in the row's process (forward and "
        "backward graphs, in its warm-up steps; 0: nothing compiled)",
        "the baseline clips each parameter's gradient to norm 3 on its own (DINO), dino_opt "
        "the global norm; otherwise the steps compute the same thing",
        "rows on the native loader see other random crops of the same images (its own "
        "RNG streams), so their losses differ from the PIL rows' by the data",
        "dino_opt's rows run the crop sizes packed through the ViT, which draws the "
        "drop-path samples in another order than the published per-size calls: with drop "
        "path on, their losses differ from the baseline's by the draws",
        f"model FLOPs per image and step {per_image / 1e9:.2f} G (torch.utils.flop_counter: the "
        "teacher's forward on the globals, the student's forward and backward on every crop)"
        + (
            (
                f"; MFU over the torch.mm rate measured in this run, {peak / 1e9:.0f} GFLOP/s "
                "at the default step's dtype"
                if device.type == "cpu" and not args.peak_tflops
                else f"; MFU over a peak of {peak / 1e12:.1f} TFLOP/s"
            )
            if peak
            else "; no MFU: this device's peak is not known (--peak-tflops)"
        ),
        "steps from the first iteration of the recipe's schedules (lr warm-up), epoch "
        f"{s['epoch']}" + (" (last layer frozen)" if s["epoch"] < 1 else ""),
    ]
    try:
        import dino_opt

        build_info = dino_opt.build_info()
    except Exception:  # noqa: BLE001
        build_info = None
    slug = device_slug(device)
    out = args.json
    if out is None:
        out = RESULTS_DIR / (
            f"train_{slug}.json" if config == "cpu" else f"train_{slug}_{config}.json"
        )
    elif len(args.configs) > 1:
        out = out.with_name(f"{out.stem}_{config}{out.suffix}")
    title = (
        f"DINO training step, {config}: {s['backbone']}/{s['patch_size']}, 2x{s['global_size']}^2 "
        f"+ {s['n_local']}x{s['local_size']}^2, out_dim {s['out_dim']}, "
        + ("largest batch per row" if with_batch else f"batch {s['batch_size']}")
        + f", {slug}, {s['workers']} workers; median of {s['steps'] - s['warmup']} steps after "
        f"{s['warmup']} warm-up" + (f", x {args.repeats} rounds" if args.repeats > 1 else "")
    )
    write_json(
        out,
        {
            "bench": "train",
            "config": config,
            "device": slug,
            "machine": machine(),
            "build_info": build_info,
            "settings": s,
            "flops_per_image": per_image,
            "bound": bound,
            "peak_flops": peak,
            "isolated_processes": isolate,
            "skipped": {c: skipped[c] for c in cases if c in skipped},
            "notes": notes,
            "results": list(results.values()),
            "table": {"title": title, "columns": columns, "rows": rows},
        },
    )
    print("\nnotes:")
    for n in notes:
        print(f"  - {n}")
    print_table(title, columns, rows)
    print(f"plot: {plot_results(out)}")


def plot_results(json_path: Path) -> Path:
    """Draws a results file beside it (same name, .png): images/s with its
    p10-p90 range and peak memory per row, and the loss per step of each row."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = json.loads(Path(json_path).read_text())
    results = [r for r in data["results"] if r.get("images_per_s")]
    labels = [r.get("label", LABELS.get(r["case"], r["case"])) for r in results]
    fig = Figure(figsize=(16, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    speed, memory, loss = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.2, 1, 1.2]})
    ys = list(range(len(results)))[::-1]
    ips = [r["images_per_s"] for r in results]
    low = [r["images_per_s"] - r["images_per_s_p10"] for r in results]
    high = [r["images_per_s_p90"] - r["images_per_s"] for r in results]
    colors = ["tab:gray" if r["case"] in ("baseline", "strong") else "tab:blue" for r in results]
    speed.barh(ys, ips, xerr=[low, high], color=colors, capsize=3)
    speed.set_yticks(ys, labels, fontsize=8)
    speed.set_xlabel("images / s (median; bars: p10-p90)")
    base = next((r["images_per_s"] for r in results if r["case"] == "baseline"), None)
    for y, r in zip(ys, results, strict=True):
        value = r["images_per_s"]
        text = f"  {value:.1f}" + (f" ({value / base:.2f}x)" if base else "")
        speed.text(r["images_per_s_p90"], y, text, va="center", fontsize=7)
    speed.set_xlim(0, 1.3 * max((r["images_per_s_p90"] for r in results), default=1.0))
    gib = [(r["peak_memory_bytes"] or 0) / 2**30 for r in results]
    memory.barh(ys, gib, color=colors)
    memory.set_yticks(ys, [])
    memory.set_xlabel("peak memory (GiB)")
    for r, label in zip(results, labels, strict=True):
        loss.plot(range(1, len(r["losses"]) + 1), r["losses"], label=label, linewidth=1)
    loss.set_xlabel("step")
    loss.set_ylabel("DINO loss")
    loss.legend(fontsize=6)
    for ax in (speed, memory, loss):
        ax.grid(True, alpha=0.3)
    fig.suptitle(data["table"]["title"], fontsize=8)
    fig.tight_layout()
    out = Path(json_path).with_suffix(".png")
    fig.savefig(out)
    return out


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        action="append",
        dest="configs",
        choices=tuple(PRESETS),
        help="configuration (repeatable; default: recipe and max_batch on a GPU, else cpu)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--quick", action="store_true", help=f"CI size: {QUICK} (CPU batch {QUICK_CPU_BATCH})"
    )
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated rows")
    parser.add_argument("--steps", type=int, help="training steps per row (warm-up included)")
    parser.add_argument("--warmup", type=int, help="steps left out of the statistics")
    parser.add_argument("--batch-size", type=int, help="images per step (not with max_batch)")
    parser.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="DataLoader workers and native loader threads (default: usable cores)",
    )
    parser.add_argument("--data", type=Path, help="an ImageFolder directory")
    parser.add_argument("--count", type=int, default=2000, help="synthetic images (GPU configs)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds over all rows, interleaved (rates pooled over the rounds)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epoch", type=int, default=0, help="epoch of the steps (0: recipe start)")
    parser.add_argument(
        "--photometric",
        choices=("cpu", "gpu"),
        default="cpu",
        help="native loader: colour augmentation in its threads or on the GPU",
    )
    parser.add_argument("--compile", action="store_true", help="also run torch.compile on a CPU")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense 16-bit matrix rate for MFU (default: by datasheet for "
        f"{', '.join(PEAK_TFLOPS)})",
    )
    parser.add_argument("--max-batch-limit", type=int, default=8192)
    parser.add_argument(
        "--no-isolate", action="store_true", help="run the rows in this process, not one each"
    )
    parser.add_argument(
        "--without",
        default="",
        help="switches left out of every row, e.g. compile (dino-opt train's default is eager)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds for the whole bench: rows that do not fit are reported as not run",
    )
    parser.add_argument("--json", type=Path, help="output file (default docs/results/train_*.json)")
    parser.add_argument(
        "--replot", type=Path, nargs="+", help="only draw the plots of these results files"
    )
    args = parser.parse_args()
    if args.replot:
        for path in args.replot:
            print(f"plot: {plot_results(path)}")
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available")
    if not args.configs:
        args.configs = ["recipe", "max_batch"] if device.type == "cuda" else ["cpu"]
    if device.type != "cuda" and set(args.configs) - {"cpu", "cpu_recipe"}:
        parser.error("the recipe and max_batch configurations need a GPU")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from {', '.join(CASES)}")
    if args.photometric == "gpu" and device.type != "cuda":
        parser.error("--photometric gpu needs --device cuda")
    if args.time_budget is not None and args.time_budget <= 0:
        parser.error("--time-budget must be positive")
    args.budget = Budget(args.time_budget)
    args.without = [t.strip() for t in args.without.split(",") if t.strip()]
    if set(args.without) - set(TOGGLES):
        parser.error(f"--without takes switches from {', '.join(TOGGLES)}")
    # What the imports made lives as long as the process: each row's
    # collections (reset_peak_memory) skip it (a full pass over it: 0.3 s)
    gc.freeze()
    for config in args.configs:
        run_config(config, args, device, cases)


if __name__ == "__main__":
    main()
