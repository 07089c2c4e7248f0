"""The per-rank memory model (dino_opt.tune.memory.model): its parameter
counts are the real modules', FSDP's per-rank state shrinks with the world
size, checkpointing shrinks activations, ``dino-opt presets --memory-model``
prints it (table and JSON), and its predictions agree within 10 % with what
2 gloo processes measure (DDP and FSDP), with one process's activations
under each checkpointing policy and with a distillation's step (features,
one or two students; heads) from a frozen teacher."""

import json
from pathlib import Path

import pytest
import torch
from dino_opt.cli import main
from dino_opt.config import apply_overrides, load_config
from dino_opt.models import VisionTransformer
from dino_opt.observe import AllocationTrace
from dino_opt.train import (
    DINOModel,
    HeadsDistillTrainer,
    build_loss,
    build_models,
    build_optimizer,
    recipe_of,
)
from dino_opt.train.distill import FrozenTeacher
from dino_opt.tune import (
    MEMORY_ARCHS,
    arch_config,
    block_bytes_per_token,
    count_model,
    estimate_memory,
    largest_batch,
    memory_table,
    selective_outputs,
    sequence_lengths,
)
from dino_opt.tune.memory.distill import trace_saved
from gloo_ranks import run_ranks
from workers.dist_memory_worker import (
    MEMORY_RUN,
    _distill_step,
    _forward_backward,
    _optimizer_step,
    distill_config,
    distill_teacher,
    heads_teacher,
)

HERE = Path(__file__).parent
WORLDS = (1, 2, 8, 64, 1024)


@pytest.fixture(scope="module")
def counts():
    return {name: count_model(arch_config(name)) for name in MEMORY_ARCHS}


def test_counts_are_the_real_modules():
    # DINOv2 with a separate iBOT head, small enough to build for real
    small = [
        "model.backbone=vit_tiny",
        "recipe.ibot.separate_head=true",
        "recipe.ibot.out_dim=512",
        "model.out_dim=256",
    ]
    cfg = load_config("dinov2_vits14", small)
    c = count_model(cfg)
    student, teacher = build_models(cfg)
    assert c.student == sum(p.numel() for p in student.parameters())
    assert c.trainable == sum(p.numel() for p in student.parameters() if p.requires_grad)
    assert c.teacher == sum(p.numel() for p in teacher.parameters())
    assert set(c.units) == {"root", "head", "ibot_head"} | {f"blocks.{i}" for i in range(12)}
    assert c.unit_size("ibot_head") == sum(p.numel() for p in student.ibot_head.parameters())
    assert sum(c.unit_size(u) for u in c.units) == c.student
    assert (c.embed_dim, c.depth, c.num_heads, c.ffn, c.ffn_hidden) == (192, 12, 3, "mlp", 768)


def test_architectures(counts):
    backbone = {n: c.student - sum(c.unit_size(u) for u in c.head_units) for n, c in counts.items()}
    assert backbone["dino_vits16"] == 21_665_664  # DINO's ViT-S/16
    assert backbone["dino_vitb16"] == 85_798_656  # DINO's ViT-B/16
    g = counts["dinov2_vitg14"]
    assert (g.embed_dim, g.depth, g.ffn, g.ffn_hidden, g.layerscale) == (
        1536,
        40,
        "swiglu",
        4096,
        True,
    )
    assert g.head_units == ["head", "ibot_head"] and g.unit_size("head") > 50_000_000
    assert counts["dinov2_vits14"].head_units == ["head"]  # the iBOT head is shared


def test_fsdp_state_shrinks_with_the_world_size(counts):
    for name, c in counts.items():
        cfg = arch_config(name)
        rows = [estimate_memory(cfg, strategy="fsdp", world_size=w, counts=c) for w in WORLDS]
        for key in ("parameters", "gradients", "optimizer"):
            values = [getattr(r, key) for r in rows]
            assert values == sorted(values, reverse=True) and values[0] > 200 * values[-1], key
            for w, v in zip(WORLDS, values, strict=True):  # rank 0's shard: 1/world and padding
                assert 4 * c.trainable / w <= v / (2 if key == "optimizer" else 1) * 1.001
        assert rows[0].parameters == 4 * c.student and rows[0].optimizer == 8 * c.trainable
        ddp = [estimate_memory(cfg, strategy="ddp", world_size=w, counts=c) for w in WORLDS]
        assert len({r.peak for r in ddp}) == 1 and ddp[0].buckets == 4 * c.trainable
        assert all(f.peak < d.peak for f, d in zip(rows[1:], ddp[1:], strict=True))


def test_checkpointing_shrinks_activations(counts):
    for name, c in counts.items():
        cfg = arch_config(name)
        for strategy in ("ddp", "fsdp"):
            settings = [("none", 1), ("selective", 1), ("full", 1), ("full", 2)]
            est = {
                (p, e): estimate_memory(
                    cfg, strategy=strategy, world_size=8, checkpointing=p, every=e, counts=c
                )
                for p, e in settings
            }
            acts = {k: v.activations for k, v in est.items()}
            assert acts["none", 1] > acts["selective", 1] > acts["full", 1], name
            assert acts["none", 1] > acts["full", 2] > acts["full", 1], name
            assert est["none", 1].peak > est["selective", 1].peak > est["full", 1].peak, name
        resharded = estimate_memory(cfg, strategy="fsdp", world_size=8, counts=c)
        kept = estimate_memory(
            cfg, strategy="fsdp", world_size=8, counts=c, reshard_after_forward=False
        )
        assert kept.unsharded > resharded.unsharded


def test_a_recompute_threshold_keeps_less(counts):
    """Selective checkpointing at a rising threshold keeps less, and past
    every output's cost keeps what full checkpointing keeps."""
    for name, c in counts.items():
        cfg = arch_config(name)
        tokens = sequence_lengths(cfg, c)[0]
        costs = sorted(cost for _, cost in selective_outputs(c, 2, tokens).values())
        kept = [
            block_bytes_per_token(c, 2, "selective", tokens=tokens, threshold=t)
            for t in (0.0, *costs, costs[-1] + 1)
        ]
        assert kept[0] == kept[1] and kept == sorted(kept, reverse=True), name
        assert kept[-1] == block_bytes_per_token(c, 2, "full") < kept[-2], name
        peaks = [
            estimate_memory(
                apply_overrides(cfg, [f"hardware.recompute_threshold={t}"]),
                checkpointing="selective",
                counts=c,
            ).peak
            for t in (0.0, costs[-1])
        ]
        assert peaks[0] > peaks[1], name


def test_batch_and_crops_scale_activations():
    small, big = (estimate_memory(arch_config("dino_vits16", b)) for b in (32, 64))
    assert big.activations == pytest.approx(2 * small.activations, rel=0.01)
    assert big.parameters == small.parameters
    fewer = estimate_memory(load_config(None, ["augmentation.num_local_views=2"]))
    assert fewer.activations < estimate_memory(load_config(None, [])).activations


def test_largest_batch_is_the_last_that_fits(counts):
    cfg, c = arch_config("dinov2_vitl14"), counts["dinov2_vitl14"]
    cap = 0.9 * 80 * 2**30
    for setting in (
        {"strategy": "ddp"},
        {"strategy": "fsdp", "world_size": 64, "checkpointing": "full"},
    ):
        b = largest_batch(cfg, cap, c, **setting)
        assert estimate_memory(arch_config("dinov2_vitl14", b), counts=c, **setting).peak <= cap
        assert estimate_memory(arch_config("dinov2_vitl14", b + 1), counts=c, **setting).peak > cap
    assert largest_batch(cfg, 2**30, c) == 0  # 1 GiB: not even the states


def test_bad_arguments():
    cfg = arch_config("dino_vits16")
    with pytest.raises(ValueError, match="strategy must be one of ddp, fsdp"):
        estimate_memory(cfg, strategy="zero3")
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        estimate_memory(cfg, world_size=0)
    with pytest.raises(ValueError, match="unknown architecture 'vit_h14'"):
        arch_config("vit_h14")
    with pytest.raises(ValueError, match="covers ViT backbones"):
        count_model(load_config(None, ["model.backbone=resnet18", "model.patch_size=16"]))


def test_cli_table_and_json(capsys):
    args = [
        "presets",
        "--memory-model",
        "--arch",
        "dino_vits16",
        "dinov2_vitg14",
        "--world",
        "1",
        "64",
        "--checkpointing",
        "none",
        "full",
    ]
    assert main([*args, "--memory", "80"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == [
        "arch",
        "batch",
        "strategy",
        "world",
        "ckpt",
        "params",
        "grads",
        "optim",
        "teacher",
        "comm",
        "activ",
        "peak",
        "fits",
        "max",
        "batch",
    ]
    rows = [line.split() for line in out[1:] if line.startswith(("dino_", "dinov2_"))]
    assert len(rows) == 2 * 2 * 2 * 2
    assert {r[0] for r in rows} == {"dino_vits16", "dinov2_vitg14"} and rows[0][1] == "64"
    vits = [r for r in rows if r[:5] == ["dino_vits16", "64", "ddp", "1", "none"]]
    assert vits[0][12:] == ["yes", "536"]  # 9.5 GiB at 64 images; 536 fit in 72 GiB
    assert main([*args, "--json", "--strategy", "fsdp", "--batch", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["rows"]) == 2 * 2 * 2 and set(report["archs"]) == set(MEMORY_ARCHS)
    expected = memory_table(["dinov2_vitg14"], (64,), ("fsdp",), ("full",), batch_size=8)[0]
    got = [
        r
        for r in report["rows"]
        if r["arch"] == "dinov2_vitg14" and r["world_size"] == 64 and r["checkpointing"] == "full"
    ]
    assert got == [expected.to_dict()] and got[0]["batch_size"] == 8
    assert main([*args, "--json", "--memory", "80"]) == 0
    report = json.loads(capsys.readouterr().out)
    for row in report["rows"]:
        assert row["fits"] == (row["peak"] <= 0.9 * 80 * 2**30) and row["largest_batch"] > 0
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["presets", "--memory-model", "--arch", "nope"])
    # `--memory` without a number is the same table
    short = ["presets", "--memory", "--arch", "dino_vits16", "--world", "1", "--json"]
    assert main(short) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*short[:1], "--memory-model", *short[2:]]) == 0
    assert alone == json.loads(capsys.readouterr().out) and len(alone["rows"]) == 2 * 3


def _pct(model: int, measured: int) -> float:
    return abs(model / measured - 1)


def test_two_ranks_measured_within_10_percent(tmp_path):
    """DDP and FSDP (with and without selective checkpointing) over 2 gloo
    processes (dist_memory_worker.py): each state part by its tensors'
    storages, the step above them by the allocation trace."""
    runs = ["ddp:none", "fsdp:none", "fsdp:selective"]
    results = run_ranks(HERE / "workers" / "dist_memory_worker.py", tmp_path, *runs)
    cfg = load_config(None, MEMORY_RUN)
    for rank, result in enumerate(results):
        for run, measured in result.items():
            strategy, policy = run.split(":")
            model = estimate_memory(cfg, strategy=strategy, world_size=2, checkpointing=policy)
            for key in ("parameters", "teacher", "optimizer", "buckets", "gradients", "step"):
                got = getattr(model, key)
                assert _pct(got, measured[key]) <= 0.10 if got else measured[key] == 0, (
                    rank,
                    run,
                    key,
                    got,
                    measured[key],
                )
            kept = sum(measured[k] for k in ("parameters", "teacher", "optimizer", "buckets"))
            assert _pct(model.peak, kept + measured["step"]) <= 0.10, (rank, run)
        # the same step, whichever way the student is spread and recomputed
        assert result["fsdp:none"]["losses"] == pytest.approx(result["ddp:none"]["losses"])
        assert result["fsdp:selective"]["losses"] == pytest.approx(result["fsdp:none"]["losses"])


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine, OpenMP's spinning
    threads make the step ten times slower (the bytes are the same)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# MEMORY_RUN's vit_tiny in float32: attention over a local crop's 5 keys
# costs 4.9 FLOPs per byte to recompute, over a global crop's 17 16.7, its
# linear layers 96 and fc2 384. 10: the local crops' attention recomputed;
# 100: only fc2 kept.
@pytest.mark.parametrize(
    "policy, every, threshold",
    [
        ("full", 1, 0),
        ("selective", 1, 0),
        ("full", 2, 0),
        ("selective", 1, 10),
        ("selective", 1, 100),
    ],
)
def test_one_process_step_within_10_percent(policy, every, threshold, one_thread):
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            *MEMORY_RUN,
            f"hardware.activation_checkpointing={policy}",
            f"hardware.checkpoint_every={every}",
            f"hardware.recompute_threshold={threshold}",
        ],
    )
    student, teacher = build_models(cfg)
    loss_fn = build_loss(cfg)
    optimizer = build_optimizer(cfg, student, torch.device("cpu"), lr=1e-3)
    _forward_backward(student, teacher, loss_fn, cfg, seed=0)
    _optimizer_step(student, optimizer, cfg)  # AdamW's moments exist before the trace
    with AllocationTrace() as trace:
        _forward_backward(student, teacher, loss_fn, cfg, seed=1)
        _optimizer_step(student, optimizer, cfg)
    model = estimate_memory(cfg, strategy="ddp", world_size=1)
    assert _pct(model.step, trace.peak()) <= 0.10, (model.step, trace.peak())


def test_the_dinov3_gram_teacher_is_counted():
    # The dinov3 recipe keeps a frozen copy of the teacher's backbone (its Gram
    # teacher) and that copy's float32 patch tokens of the global crops.
    common = ["model.backbone=vit_small", "data.batch_size=8", "recipe.ibot.separate_head=true"]
    v2 = load_config(None, [*common, "recipe.name=dinov2"])
    v3 = load_config(None, [*common, "recipe.name=dinov3"])
    c2, c3 = count_model(v2), count_model(v3)
    with torch.device("meta"):
        _, teacher = build_models(v3)
    backbone = sum(p.numel() for p in teacher.backbone.parameters())
    assert c3.teacher - c2.teacher == backbone
    e2, e3 = estimate_memory(v2, counts=c2), estimate_memory(v3, counts=c3)
    assert e3.teacher - e2.teacher == 4 * backbone
    patches = (v3.augmentation.global_crop_size // v3.model.patch_size) ** 2
    assert e3.activations - e2.activations == 2 * 8 * patches * 384 * 4


def test_fsdp_shards_the_dinov3_gram_teacher_as_the_teachers_backbone():
    # Under fsdp the Gram teacher is sharded as the teacher's backbone: rank
    # 0 keeps its first-dimension chunk of each backbone parameter (float32);
    # nothing stays gathered after its forward (its root included).
    common = ["model.backbone=vit_small", "data.batch_size=8", "recipe.ibot.separate_head=true"]
    v2 = load_config(None, [*common, "recipe.name=dinov2"])
    v3 = load_config(None, [*common, "recipe.name=dinov3"])
    c2, c3 = count_model(v2), count_model(v3)
    assert (c2.frozen_copies, c3.frozen_copies) == (0, 1)
    with torch.device("meta"):
        _, teacher = build_models(v3)
    params = list(teacher.backbone.parameters())
    whole = sum(p.numel() for p in params)
    for world in (2, 8, 64):
        shard = sum(-(-p.shape[0] // world) * p[0].numel() for p in params)
        assert c3.local_frozen(world) == shard and whole / world <= shard
        assert world == 64 or shard < whole / world * 1.05  # padding: small shards only
        e2, e3 = (
            estimate_memory(v, strategy="fsdp", world_size=world, counts=c)
            for v, c in ((v2, c2), (v3, c3))
        )
        assert e3.teacher - e2.teacher == 4 * shard


# ---------------------------------------------------------------- distillation

DISTILL = [
    *MEMORY_RUN,
    "recipe.name=distill",
    "recipe.distill.teacher=teacher.pth",
    "augmentation.global_crop_size=64",
    "augmentation.local_crop_size=32",
]


@pytest.mark.parametrize(
    "extra, teacher_dim",
    [
        (["recipe.distill.projector_hidden=256"], 768),
        (["hardware.activation_checkpointing=selective"], 96),
        (["hardware.activation_checkpointing=full"], 96),
        (["recipe.distill.students=[vit_small]"], 96),
        (["model.backbone=resnet18", "model.patch_size=16"], 96),
        (["recipe.distill.students=[resnet18]"], 96),
        (["recipe.distill.local_weight=1"], 96),
        (["recipe.distill.whiten=0.001"], 768),
        (["recipe.distill.local_weight=1", "recipe.distill.students=[resnet18]"], 96),
        (["model.backbone=convnext_tiny", "model.patch_size=16"], 96),
        (
            [
                "recipe.distill.mode=heads",
                "recipe.ibot.separate_head=true",
                "recipe.ibot.out_dim=512",
            ],
            192,
        ),
    ],
)
def test_a_distillation_step_within_10_percent(extra, teacher_dim, one_thread):
    """The step of a feature distillation (one student or two; a projector
    with a hidden layer; each checkpointing policy; a ResNet-18 or a
    ConvNeXt-T student, alone or beside a ViT, traced on the meta device)
    and of one through heads, from a frozen ViT teacher, against the
    allocation trace."""
    heads = "recipe.distill.mode=heads" in extra
    dim = [] if heads else [f"recipe.distill.teacher_dim={teacher_dim}"]
    cfg = load_config(None, [*DISTILL, *dim, *extra])
    torch.manual_seed(0)
    student, ema = build_models(cfg)
    if heads:  # a dino_opt teacher with its heads
        frozen = build_models(cfg)[1]
    else:
        frozen = VisionTransformer(
            patch_size=8, embed_dim=teacher_dim, depth=3, num_heads=3, img_size=64
        )
    loss_fn = build_loss(cfg)
    loss_fn.attach_teacher(FrozenTeacher(frozen.requires_grad_(False).eval(), 8))
    options = {
        "precision": "fp32",
        "accumulation_steps": 1,
        "freeze_last_layer": 0,
        "gradient_clip": 3.0,
    }
    optimizer = build_optimizer(cfg, student, torch.device("cpu"), lr=1e-3)
    kind = recipe_of(cfg).trainer_class(cfg)
    assert (kind is HeadsDistillTrainer) == heads
    trainer = kind(DINOModel(student, ema, 0.9), loss_fn, optimizer, options, "cpu")
    # oneDNN's CPU convolutions copy their values into blocked layouts whose
    # size depends on the CPU's instruction set (an AVX2 EPYC: +27 MiB for a
    # ResNet-18), as cuDNN's workspace on a GPU, which the model leaves out:
    # measured with them off, what the framework keeps is what is compared
    with torch.backends.mkldnn.flags(enabled=False):
        _distill_step(trainer, cfg, 0)  # AdamW's moments exist before the trace
        with AllocationTrace() as trace:
            _distill_step(trainer, cfg, 1)
    model = estimate_memory(cfg, frozen_teacher=frozen)
    assert _pct(model.step, trace.peak()) <= 0.10, (model.step, trace.peak())
    frozen_numel = sum(p.numel() for p in frozen.parameters())
    assert model.teacher_count == frozen_numel + sum(p.numel() for p in ema.parameters())


def test_the_whiteners_state_is_kept_with_the_teacher():
    """recipe.distill.whiten: the loss's whitening statistics and matrices,
    as many bytes as the built loss holds, counted with the teacher (kept
    for the whole run, not the step)."""
    frozen = VisionTransformer(patch_size=8, embed_dim=384, depth=1, num_heads=6, img_size=64)
    plain = load_config(None, [*DISTILL, "recipe.distill.teacher_dim=384"])
    whiten = load_config(
        None, [*DISTILL, "recipe.distill.teacher_dim=384", "recipe.distill.whiten=0.001"]
    )
    held = sum(b.numel() * b.element_size() for b in build_loss(whiten).buffers())
    assert held == 2 * (12 * 384 * 384 + 8 * 384 + 8)
    a, b = (estimate_memory(c, frozen_teacher=frozen) for c in (plain, whiten))
    assert b.teacher - a.teacher == held


def test_a_sharded_distillation_on_two_ranks_within_10_percent(tmp_path):
    """distributed.strategy=fsdp over 2 gloo processes: one student, two
    (each sharded on its own), and one through heads (the frozen teacher's
    backbone sharded, its heads whole), from a sharded frozen teacher; every
    state part by its local shards, the step by the allocation trace."""
    runs = ["distill:", "distill:vit_small", "distillheads:"]
    results = run_ranks(HERE / "workers" / "dist_memory_worker.py", tmp_path, *runs)
    for rank, result in enumerate(results):
        for run, measured in result.items():
            kind, students = run.split(":")
            cfg = distill_config(students, kind == "distillheads")
            frozen = heads_teacher(cfg) if kind == "distillheads" else distill_teacher()
            model = estimate_memory(cfg, strategy="fsdp", world_size=2, frozen_teacher=frozen)
            for key in ("parameters", "teacher", "optimizer", "gradients", "step"):
                got = getattr(model, key)
                assert _pct(got, measured[key]) <= 0.10, (rank, run, key, got, measured[key])


def test_students_on_their_own_ranks_within_10_percent(tmp_path):
    """distributed.student_groups over 2 gloo processes: a ViT-T on rank 0,
    a ViT-S on rank 1, each with the whole frozen teacher run on half the
    batch; the model gives the fuller rank (the ViT-S's), which holds less
    than a rank of both students."""
    run = "distillgroups:vit_small"
    worker = HERE / "workers" / "dist_memory_worker.py"
    measured = [r[run] for r in run_ranks(worker, tmp_path, run)]
    cfg, frozen = distill_config("vit_small", groups=True), distill_teacher()
    model = estimate_memory(cfg, strategy="ddp", world_size=2, frozen_teacher=frozen)
    held = [m["parameters"] + m["teacher"] + m["optimizer"] + m["step"] for m in measured]
    assert held[1] > held[0]  # the ViT-S's rank
    for key in ("parameters", "teacher", "optimizer", "gradients", "step"):
        got = getattr(model, key)
        assert _pct(got, measured[1][key]) <= 0.10, (key, got, measured[1][key])
    both = estimate_memory(distill_config("vit_small"), world_size=2, frozen_teacher=frozen)
    assert model.peak < both.peak and model.parameters < both.parameters
    # with fsdp over 4 ranks each student is sharded over its pair
    pairs = estimate_memory(cfg, strategy="fsdp", world_size=4, frozen_teacher=frozen)
    assert pairs.parameters == pytest.approx(model.parameters / 2, rel=0.02)
    assert pairs.optimizer == pytest.approx(model.optimizer / 2, rel=0.02)


def test_the_trace_counts_each_saved_storage_once_where_it_is_first_saved():
    """Linear, ReLU, Linear on the meta device: the first saves its input
    (5 x 8 floats; its weight is a parameter, left out), the ReLU its output
    (5 x 16), which the second saves again (counted once); the gradients of
    each Linear where its forward began; 16-bit values at a = 2."""
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        x = torch.empty(5, 8)
    trace = trace_saved(lambda: net(x).sum(), net)
    assert trace.kept == [(0, 160), (1, 320)] and trace.total == 480 and trace.largest == 320
    assert trace.grads == [(0, 4 * (8 * 16 + 16)), (2, 4 * (16 * 4 + 4))]
    # back at the ReLU: both values, the second Linear's gradients (all of
    # them, less the first's) and the ReLU's working set (2 x 320)
    assert trace.backward_peak() == 480 - 576 + 2 * 320
    assert trace_saved(lambda: net(x).sum(), net, a=2).kept == [(0, 80), (1, 160)]


def test_a_distillation_estimate_needs_its_teacher():
    cfg = load_config(None, [*DISTILL, "recipe.distill.teacher_dim=96"])
    teacher = VisionTransformer(patch_size=8, embed_dim=96, depth=1, num_heads=3, img_size=64)
    resnet = load_config(
        None, [*DISTILL, "recipe.distill.teacher_dim=96", "recipe.distill.students=[resnet18]"]
    )
    for call, words in (
        (lambda: estimate_memory(cfg), "needs its teacher network"),
        (
            lambda: estimate_memory(resnet, strategy="fsdp", frozen_teacher=teacher),
            "covers ViT students; got 'resnet18'",
        ),
    ):
        with pytest.raises(ValueError, match=words) as e:
            call()
        assert "\n" not in str(e.value)
