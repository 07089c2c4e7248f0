"""The training step: the autocast precision chosen for the CPU, stochastic
depth on the kept samples only (against the mask form of the same draw, in
float64), a whole step of every recipe free of host synchronisation
(counted from outside by a dispatch mode), and one step for every recipe
(the recipes contribute terms; the engine's calls are written once)."""

import json
import math

import pytest
import torch
from dino_opt import train as train_module
from dino_opt.config import ConfigError, load_config
from dino_opt.models.layers import Block, DropPath, kept_samples, residual_subset
from dino_opt.models.vit import vit_tiny
from dino_opt.models.vit_dinov3 import RopeBlock
from dino_opt.observe import RunFolder, RunLog
from dino_opt.observe import runlog as runlog_module
from dino_opt.runtime import device as device_module
from dino_opt.runtime import resolve_precision
from dino_opt.train import (
    DINOModel,
    DINOTerms,
    DINOv2Terms,
    GramTerm,
    MemoryOptimizedDINOTrainer,
    StepTerms,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    build_trainer,
    frozen_teacher_dtype,
)
from dino_opt.train import trainer as trainer_module
from dino_opt.tune.hardware import resolve_hardware, resolve_preset
from reference import block_reference
from tiny import TINY
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CPU = torch.device("cpu")

# ---------------------------------------------------------------- precision


def test_the_bf16_flags_are_read_from_cpuinfo(tmp_path):
    def flags(*names):
        path = tmp_path / f"cpuinfo-{len(names)}-{'-'.join(names)}"
        first = "processor\t: 0\nvendor_id\t: AuthenticAMD\n"
        path.write_text(f"{first}flags\t\t: fpu sse2 avx2 {' '.join(names)}\n\nprocessor\t: 1\n")
        return device_module.cpu_computes_bf16(str(path))

    assert flags("avx512f", "avx512_bf16")
    assert flags("amx_tile", "amx_bf16")
    assert not flags()
    assert not flags("avx512f", "avx512bw")  # bfloat16 emulated: far slower than float32
    assert not device_module.cpu_computes_bf16(str(tmp_path / "missing"))
    # this machine's answer is its own flags'
    text = open("/proc/cpuinfo").read() if device_module.Path("/proc/cpuinfo").exists() else ""
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    assert device_module.cpu_computes_bf16() == any(
        f in line.split() for f in device_module.BF16_CPU_FLAGS
    )


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_on_a_cpu_that_computes_it(monkeypatch, native):
    monkeypatch.setattr(device_module, "cpu_computes_bf16", lambda: native)
    want = torch.bfloat16 if native else None
    assert resolve_precision("auto", CPU) is want
    assert resolve_precision("fp32", CPU) is None  # asked for: as asked
    assert resolve_precision("bf16", CPU) is torch.bfloat16
    cfg = load_config(None, [*TINY, "hardware.precision=auto"])
    # a frozen teacher is stored in bfloat16 only where bfloat16 is computed natively
    assert frozen_teacher_dtype(cfg, CPU) is want
    # the CPU preset names what this CPU computes (a run folder's config says what ran)
    named = resolve_preset("auto", device="cpu").values["hardware.precision"]
    assert named == ("bf16" if native else "fp32")
    trainer = _trainer(TINY + ["hardware.precision=auto"])
    assert trainer.amp_dtype is want


def test_under_bf16_the_losses_stay_float32(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_computes_bf16", lambda: True)
    trainer = _trainer(TINY)
    seen = {}
    loss_fn = trainer.loss_fn
    forward = loss_fn.forward

    def spy(student, teacher, *args, **kwargs):
        seen.update(student=student.dtype, teacher=teacher.dtype)
        return forward(student, teacher, *args, **kwargs)

    monkeypatch.setattr(loss_fn, "forward", spy)
    loss, _ = trainer.train_step_optimized(_crops(load_config(None, TINY)), 1)
    assert seen == {"student": torch.float32, "teacher": torch.float32}
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert trainer.optimize_step()
    assert all(p.dtype == torch.float32 for p in trainer.model.teacher.parameters())


# ---------------------------------------------------------------- drop path


def test_kept_samples_is_dinov3s_count():
    assert kept_samples(8, 0.1) == 7
    assert kept_samples(10, 0.1) == 9
    assert kept_samples(4, 0.1) == 3
    assert kept_samples(1, 0.5) == 1  # at least one
    assert kept_samples(64, 0.4) == 38


def _randomized(block):
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return block


BLOCKS = {
    "dino": lambda p: Block(32, 4, drop_path=p),
    "dinov2": lambda p: Block(32, 4, drop_path=p, ffn_layer="swiglu", init_values=1e-5),
    "dinov3": lambda p: RopeBlock(32, 4, drop_path=p, ffn_layer="swiglu64", mask_k_bias=True),
}


@pytest.mark.parametrize("kind", sorted(BLOCKS))
@pytest.mark.parametrize("batch, p", [(8, 0.3), (5, 0.5), (6, 0.1)])
def test_subset_drop_path_equals_the_mask_form_for_the_same_draw(kind, batch, p):
    block = _randomized(BLOCKS[kind](p)).double().train()
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, 9, 32, generator=gen, dtype=torch.float64, requires_grad=True)
    rope = None
    if kind == "dinov3":
        rope = (
            torch.rand(8, 8, generator=gen, dtype=torch.float64),
            torch.rand(8, 8, generator=gen, dtype=torch.float64),
        )
    # the block's own draws, read by replaying its generator
    torch.manual_seed(11)
    kept = kept_samples(batch, p)
    draws = [torch.randperm(batch)[:kept] for _ in range(2)]
    rows = []
    hook = block.attn.register_forward_hook(lambda m, a, out: rows.append(a[0].shape[0]))
    torch.manual_seed(11)
    ours = block(x) if rope is None else block(x, rope)
    hook.remove()
    # the dropped samples never ran: attention saw the kept samples' rows (9 tokens each)
    assert rows == [9 * (kept if kept < batch else batch)]
    names, params = zip(*block.named_parameters(), strict=True)
    grads = torch.autograd.grad(ours.sin().sum(), [x, *params])
    ref = block_reference(block, x, draws, rope)
    expect = torch.autograd.grad(ref.sin().sum(), [x, *params])
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    for n, g, e in zip(("x", *names), grads, expect, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12, msg=n)
    # in eval mode nothing is dropped
    block.eval()
    plain = block(x) if rope is None else block(x, rope)
    torch.testing.assert_close(plain, block_reference(block, x, [torch.arange(batch)] * 2, rope))


def test_residual_subset_keeps_the_stream_dtype():
    x = torch.randn(6, 4, 8)
    index = torch.tensor([0, 2, 5])
    out = residual_subset(x, lambda t: (t * 2).bfloat16(), index)
    assert out.dtype == torch.float32
    expect = x.clone()
    expect[index] += (x[index] * 2).bfloat16().float() * 2.0
    torch.testing.assert_close(out, expect)
    drop = DropPath(0.0).train()
    torch.testing.assert_close(drop.add(x, lambda t: t + 1), 2 * x + 1)


def test_the_subset_draw_keeps_the_expectation():
    # each sample's branch is kept with probability kept / batch and scaled
    # by batch / kept: the mean over many draws is the branch itself
    torch.manual_seed(0)
    drop = DropPath(0.25).train()
    x = torch.zeros(8, 1, 1, dtype=torch.float64)
    total = sum(drop.add(x, lambda t: torch.ones_like(t)) for _ in range(4000)) / 4000
    assert math.isclose(total.mean().item(), 1.0, abs_tol=1e-9)  # exactly batch per draw
    assert (total - 1.0).abs().max().item() < 0.1  # each sample near its expectation


# ---------------------------------------------------------------- the residual stream


class _Conversions(TorchDispatchMode):
    """The dtype conversions (``_to_copy``) of tensors other than ``params``."""

    def __init__(self, params):
        super().__init__()
        self.params = {id(p) for p in params}
        self.converted: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and id(args[0]) not in self.params:
            self.converted.append((tuple(args[0].shape), args[0].dtype, kwargs.get("dtype")))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["dino", "dinov2"])
def test_under_bf16_autocast_the_residual_stream_is_bf16(kind):
    """The stream goes to bfloat16 once, after the embeddings (summed in
    float32); in the blocks no activation is converted (autocast casts only
    the weights), forward or backward; the features leave the final norm."""
    extra = {"ffn_layer": "swiglu", "layerscale_init": 1e-5} if kind == "dinov2" else {}
    net = vit_tiny(patch_size=8, img_size=32, depth=2, drop_path_rate=0.2, **extra).train()
    crops = [torch.randn(4, 3, 32, 32), torch.randn(6, 3, 16, 16)]
    seen = {}
    # (a hook that returns something replaces the call's inputs or output)
    net.blocks[0].register_forward_pre_hook(lambda m, a: seen.update({"in": a[0].dtype}))
    net.blocks[-1].register_forward_hook(lambda m, a, out: seen.update({"out": out.dtype}))
    mode = _Conversions(list(net.parameters()))
    inside = []
    net.blocks[0].register_forward_pre_hook(lambda m, a: inside.append(len(mode.converted)))
    net.blocks[-1].register_forward_hook(lambda m, a, out: inside.append(len(mode.converted)))
    with torch.autocast("cpu", dtype=torch.bfloat16), mode:
        out = net(crops)
        start, end = inside
        out.float().square().sum().backward()
    assert seen == {"in": torch.bfloat16, "out": torch.bfloat16}
    assert mode.converted[start:end] == []  # forward: the blocks convert no activation
    # backward: the blocks' packed rows (T, C) are never converted (the
    # weights' gradients go to float32, the embeddings' come back to theirs)
    params = {tuple(p.shape) for p in net.parameters()} | {tuple(out.shape)}
    rows = [c for c in mode.converted[end:] if len(c[0]) == 2 and c[0] not in params]
    assert rows == []
    assert all(
        p.grad is not None and p.grad.dtype == torch.float32 for p in net.blocks.parameters()
    )
    # float32 without autocast: the stream stays float32
    with torch.no_grad():
        assert net.prepare_tokens(crops[0]).dtype == torch.float32


# ---------------------------------------------------------------- host synchronisation

# What makes a host wait for a device: a tensor read as a Python value
# (.item(), bool(), .tolist() all call _local_scalar_dense), and the
# operators whose output shape depends on the values (nonzero, masked
# select, unique, ...), which copy a count back to the host.
SYNCING = {
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "repeat_interleave",
}


class HostSyncs(TorchDispatchMode):
    """Records each syncing operator run on a device tensor. A tensor is on
    the host while it and everything it was made from are the batch as the
    loader gave it or made by a factory that names no device; what the
    step's input path returns is on the device (the test hands it out as
    copies, since on the CPU ``.to(device)`` returns the same tensor)."""

    def __init__(self, host: list[torch.Tensor]):
        super().__init__()
        self.host = {id(t) for t in host}
        self.keep = list(host)  # ids stay unique while the tensors live
        self.syncs: list[str] = []
        self.copying = False

    def on_device(self, tensors: list) -> list:
        """Copies of ``tensors`` that count as device tensors."""
        self.copying = True
        try:
            return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]
        finally:
            self.copying = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [
            a
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        ]
        on_host = not self.copying and bool(inputs) and all(id(t) in self.host for t in inputs)
        name = func.overloadpacket.__name__
        if name in SYNCING and not on_host:
            self.syncs.append(name)
        out = func(*args, **kwargs)
        if on_host:
            self.on_host(out)
        return out

    def on_host(self, out) -> None:
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.host.add(id(t))
                self.keep.append(t)

    def __enter__(self):
        self.factories = _HostFactories(self)
        self.factories.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.factories.__exit__(*exc)


class _HostFactories(TorchFunctionMode):
    """A tensor made from no tensor, with no device named (``torch.linspace(a,
    b, n)``) or with the host named as such (``device="cpu"``, as an
    optimizer keeps its step counts), is the host's on any run; one made on
    a ``torch.device`` (the run's) is not."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        host = kwargs.get("device") in (None, "cpu")
        if host and not any(isinstance(a, torch.Tensor) for a in leaves):
            self.syncs.on_host(out)
        return out


def _crops(cfg, b=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    gs, ls = cfg.augmentation.global_crop_size, cfg.augmentation.local_crop_size
    crops = [torch.randn(b, 3, gs, gs, generator=g) for _ in range(2)]
    return crops + [
        torch.randn(b, 3, ls, ls, generator=g) for _ in range(cfg.augmentation.num_local_views)
    ]


def _trainer(overrides):
    torch.manual_seed(0)
    cfg = load_config(None, overrides)
    student, teacher = build_models(cfg)
    model = DINOModel(student, teacher, 0.9)
    trainer = build_trainer(cfg, model, build_loss(cfg), build_optimizer(cfg, student, CPU), CPU)
    trainer.set_schedules(build_schedules(cfg, 5), 7)
    return trainer


RECIPES = {
    "dino": [],
    "dinov2": ["recipe.name=dinov2", "model.layerscale_init=1e-5"],
    "dinov3": [
        "recipe.name=dinov3",
        "recipe.centering=sinkhorn_knopp",
        "recipe.ibot.separate_head=true",
        "recipe.ibot.out_dim=64",
    ],
}


def _step_syncs(monkeypatch, overrides, steps=3):
    """The syncing operators of each of ``steps`` whole steps (schedules,
    forward and backward, optimizer step and EMA) of ``TINY`` with ``overrides``."""
    trainer = _trainer([*TINY, "hardware.precision=fp32", *overrides])
    cfg = load_config(None, [*TINY, *overrides])
    moved, current = trainer.to_device, []
    # what the input path returns is on the device
    monkeypatch.setattr(trainer, "to_device", lambda ts: current[-1].on_device(moved(ts)))
    syncs = []
    for step in range(steps):
        crops = _crops(cfg, seed=step)
        side = cfg.augmentation.global_crop_size // cfg.model.patch_size
        masks = torch.rand(2 * 8, side, side, generator=torch.Generator().manual_seed(step)) < 0.4
        extra = {} if cfg.recipe.name == "dino" else {"masks": masks}
        with HostSyncs([*crops, masks]) as mode:
            current.append(mode)
            trainer.set_schedules(build_schedules(cfg, 5), 7 + step)
            loss, metrics = trainer.train_step_optimized(crops, 1, **extra)
            assert trainer.optimize_step()
        syncs.append(mode.syncs)
        assert torch.isfinite(loss)
    return syncs


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_training_step_makes_no_host_synchronisation(monkeypatch, recipe):
    # the default AdamW is fused: it skips a non-finite step on the device
    syncs = _step_syncs(monkeypatch, RECIPES[recipe])
    assert syncs == [[], [], []]


def test_the_checker_sees_a_sync(monkeypatch):
    # A non-fused optimizer needs the host to decide whether to step (the
    # documented check): one read of the finite flag per step
    syncs = _step_syncs(monkeypatch, ["optim.fused=false"], steps=1)
    assert syncs == [["_local_scalar_dense"]]
    # masks turned into indices on the device would sync: the checker sees it
    masks = torch.rand(4, 3, 3) < 0.5
    with HostSyncs([masks]) as mode:
        masks.flatten().nonzero()  # on the host: no sync
        (moved,) = mode.on_device([masks])
        moved.flatten().nonzero()
        moved.any().item()
    assert mode.syncs == ["nonzero", "_local_scalar_dense"]


# ---------------------------------------------------------------- one step

ENGINE_CALLS = (
    "train_step_optimized",
    "optimize_step",
    "set_schedules",
    "_backward",
    "_clip",
    "discard_accumulation",
)


def test_every_recipe_runs_the_one_step():
    trainers = [
        v
        for v in vars(train_module).values()
        if isinstance(v, type) and issubclass(v, MemoryOptimizedDINOTrainer)
    ]
    assert len(trainers) == 5  # the engine, DINOv2, DINOv3 and the two distillations
    for cls in trainers:
        for name in ENGINE_CALLS:
            assert getattr(cls, name) is getattr(MemoryOptimizedDINOTrainer, name), (cls, name)
    # DINOv3 is DINOv2's terms and the Gram term, composed
    v3 = _trainer([*TINY, *RECIPES["dinov3"]])
    assert type(v3.terms) is DINOv2Terms
    assert [type(t) for t in v3.extra_terms] == [GramTerm]
    assert type(_trainer(TINY).terms) is DINOTerms
    with pytest.raises(TypeError):  # a recipe's terms must say its student pass and loss
        StepTerms()


class _Recorded(DINOTerms):
    """DINO's terms, recording which engine hooks ran."""

    def __init__(self):
        self.calls = []

    def attach(self, trainer):
        self.calls.append("attach")

    def set_schedules(self, trainer, schedules, iteration):
        self.calls.append(f"schedules {iteration}")

    def before_step(self, trainer):
        self.calls.append("before")

    def passes(self, trainer, inputs):
        out = super().passes(trainer, inputs)
        self.calls.append(f"passes {len(out)}")
        return out

    def after_step(self, trainer):
        self.calls.append(f"after {trainer.model.teacher_step}")


def test_the_engine_calls_the_terms_at_their_boundaries():
    torch.manual_seed(0)
    cfg = load_config(None, TINY)
    student, teacher = build_models(cfg)
    terms = _Recorded()
    trainer = MemoryOptimizedDINOTrainer(
        DINOModel(student, teacher, 0.9),
        build_loss(cfg),
        build_optimizer(cfg, student, CPU),
        {"accumulation_steps": 2, "crop_batch_size": 3, "freeze_last_layer": 0},
        CPU,
        terms=terms,
    )
    schedules = build_schedules(cfg, 5)
    for it in range(2):
        trainer.set_schedules(schedules, it)
        for micro in range(2):
            loss, _ = trainer.train_step_optimized(_crops(cfg, seed=2 * it + micro), 1)
            assert torch.isfinite(loss)
            assert trainer.optimize_step() == (micro == 1)
    # 4 crops in groups of 3: two passes; before at each step's first
    # micro-batch, after once per optimizer step (the teacher updated)
    assert terms.calls == [
        "attach",
        "schedules 0",
        "before",
        "passes 2",
        "passes 2",
        "after 1",
        "schedules 1",
        "before",
        "passes 2",
        "passes 2",
        "after 2",
    ]


@pytest.mark.parametrize("crop_batch_size", [None, 3])
def test_the_frozen_last_layer_gets_no_weight_gradient(monkeypatch, crop_batch_size):
    """In the frozen epochs the last layer's weight gradient is not computed
    (it is None after the backward, before the optimizer step), and the
    step's result is the published one that computes and discards it: every
    parameter equal after two steps, then the layer trains in epoch 1. The
    step sets the layer's flag each time: one left frozen (by an earlier
    trainer of the same model) does not outlive it. DINOv2's last layers
    are frozen by their learning rate (their moments accumulate, as in
    dinov2), so they keep their gradient."""
    overrides = [*TINY, "hardware.precision=fp32", "optim.freeze_last_layer=1"]
    if crop_batch_size:
        overrides.append(f"hardware.crop_batch_size={crop_batch_size}")
    cfg = load_config(None, overrides)
    v2 = _trainer([*TINY, *RECIPES["dinov2"]])
    v2.train_step_optimized(_crops(cfg), 0, masks=torch.rand(16, 4, 4) < 0.4)
    assert v2.model.student.head.last_layer.weight_v.grad is not None
    schedules = build_schedules(cfg, 5)
    params = {}
    for skipped in (True, False):
        if not skipped:  # the published form: computed, then discarded
            monkeypatch.setattr(trainer_module, "_skips_frozen_weight_gradient", lambda s: False)
        trainer = _trainer(overrides)
        last = trainer.model.student.head.last_layer
        last.frozen = not skipped  # the step sets it either way
        for step, epoch in enumerate((0, 0, 1)):
            trainer.set_schedules(schedules, step)
            trainer.train_step_optimized(_crops(cfg, seed=step), epoch)
            assert (last.weight_v.grad is None) is (skipped and epoch == 0)
            assert trainer.optimize_step()
            if step == 1:
                params[skipped] = {
                    n: p.detach().clone() for n, p in trainer.model.student.named_parameters()
                }
    for name, p in params[True].items():
        torch.testing.assert_close(p, params[False][name], rtol=1e-6, atol=1e-7, msg=name)


# ---------------------------------------------------------------- compiled


def test_compile_defaults_to_the_gpu_only():
    # resolved when a run starts, so the run folder says what ran and a tool
    # rebuilding a model from a run's config never compiles it unasked
    def resolved(*extra):
        return resolve_hardware(load_config(None, [*TINY, *extra]))[0].hardware.compile

    assert load_config(None, TINY).hardware.compile is None
    assert resolved() is False  # TINY runs on the CPU
    assert resolved("hardware.compile=true") is True
    assert resolved("hardware.device=auto") is torch.cuda.is_available()
    student, _ = build_models(load_config(None, [*TINY, "hardware.device=auto"]))
    assert student.backbone.blocks[0]._compiled_call_impl is None  # unresolved null: eager


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_blocks_and_heads_have_no_graph_break_and_never_recompile(monkeypatch, recipe):
    """Every block and head compiled whole (a graph break would raise), static
    shapes (a DINOv2 head's rows dynamic, for its masked patches): the graphs
    are made in the first step (per crop size and drop-path rate)
    and none after, while the schedules move lr, weight decay, momentum and
    the teacher temperature, except the frozen-last-layer epochs' own graph
    of DINO's student head: made once at the freeze's end (epoch 0, then 1)
    and none when epoch 0 comes back (a rollback); the losses are eager's.
    The backend only counts the graphs dynamo hands it (inductor's code
    generation is not what this checks, and takes minutes on two cores)."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **kw: real(*a, backend=counting, **kw))
    torch._dynamo.reset()
    overrides = [*TINY, *RECIPES[recipe], "model.drop_path_rate=0.2"]
    losses = {}
    for compiled in (False, True):
        trainer = _trainer([*overrides, f"hardware.compile={str(compiled).lower()}"])
        cfg = load_config(None, overrides)
        side = cfg.augmentation.global_crop_size // cfg.model.patch_size
        losses[compiled], made = [], []
        for step, epoch in enumerate((0, 1, 1, 0)):  # the frozen last layer, then not
            torch.manual_seed(step)  # the same drop-path draws in both runs
            masks = torch.rand(16, side, side, generator=torch.Generator().manual_seed(step)) < 0.4
            extra = {} if recipe == "dino" else {"masks": masks}
            trainer.set_schedules(build_schedules(cfg, 5), 3 + step)
            loss, _ = trainer.train_step_optimized(_crops(cfg, seed=step), epoch, **extra)
            assert trainer.optimize_step()
            losses[compiled].append(loss.item())
            made.append(len(graphs))
        if compiled:
            # DINOv2's last layers are frozen by their learning rate: one graph
            thawed = 1 if recipe == "dino" else 0
            assert made[0] > 0 and made[1:] == [made[0] + thawed] * 3, made
            heads = [trainer.model.student.head, trainer.model.teacher.head]
            assert all(h._compiled_call_impl is not None for h in heads)  # whole, too
        else:
            assert made == [0, 0, 0, 0]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


@pytest.mark.parametrize("recipe", ["dino", "dinov2"])
def test_compile_mode_reaches_every_compiled_block_and_head(monkeypatch, recipe):
    """``hardware.compile_mode`` is the mode of every torch.compile a run
    makes (student and teacher blocks, heads), except a head with dynamic
    rows (DINOv2's), which keeps the default under reduce-overhead (a CUDA
    graph per count of masked patches); the trainer replays CUDA graphs only
    where compile is on in reduce-overhead mode."""
    modes = []
    real = torch.compile

    def recording(*args, **kwargs):
        modes.append((kwargs.get("mode"), kwargs.get("dynamic")))
        return real(*args, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    for mode in ("default", "reduce-overhead"):
        modes.clear()
        overrides = [*TINY, *RECIPES[recipe], "hardware.compile=true"]
        trainer = _trainer([*overrides, f"hardware.compile_mode={mode}"])
        depth = len(trainer.model.student.backbone.blocks)
        blocks, heads = modes[: 2 * depth], modes[2 * depth :]
        assert blocks == [(mode, False)] * (2 * depth)
        rows_fixed = recipe == "dino"
        head_mode = mode if rows_fixed else "default"
        assert heads and set(heads) == {(head_mode, not rows_fixed)}, heads
        assert trainer.cuda_graphs is (mode == "reduce-overhead")
    assert _trainer([*TINY, "hardware.compile_mode=reduce-overhead"]).cuda_graphs is False
    with pytest.raises(ConfigError, match="hardware.compile_mode"):
        load_config(None, [*TINY, "hardware.compile_mode=fast"])


@pytest.mark.parametrize("compiled", [True, False])
def test_the_first_step_says_what_compile_cost(tmp_path, monkeypatch, capsys, compiled):
    """With hardware.compile on, the run's log says after its first step how
    many graphs torch.compile made and in how many seconds, and writes it as
    a ``compiled`` event; once, and not at all with compile off."""
    monkeypatch.setattr(runlog_module, "compile_totals", lambda: (24, 3.25))
    cfg = load_config(
        None,
        [
            *TINY,
            f"hardware.compile={str(compiled).lower()}",
            "logging.tensorboard=false",
            "logging.progress=false",
        ],
    )
    log = RunLog(cfg, RunFolder(tmp_path), lead=True, step=0, total=3, metadata={})
    for _ in range(3):
        log.advance()
    log.close({})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    printed = capsys.readouterr().out
    if compiled:
        assert rows == [{"step": 1, "event": "compiled", "graphs": 24, "seconds": 3.25}]
        assert "torch.compile: 24 graphs" in printed and "3.2 s" in printed
    else:
        assert rows == [] and "torch.compile" not in printed
