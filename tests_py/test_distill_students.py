"""A distillation into several students (``recipe.distill.students``) as
the job runs it, on 2 gloo processes: a ViT-T/8 and a ResNet-18 from one
frozen ViT teacher (a bare DINO-format file); each student's loss in the
metrics, each one evaluated between epochs and at the end and exported; a
rank killed mid-run and the restarted run ending bit for bit as the one
never stopped; bad student lists in one line."""

import json
import math
from pathlib import Path

import pytest
import tiny
import torch
import torchvision
from dino_opt.cli import main
from dino_opt.config import ConfigError, apply_overrides, load_config, save_config
from dino_opt.train import build_models
from dino_opt.tune.memory.model import estimate_memory
from gloo_ranks import run_ranks
from tiny import TINY, TINY_DEPTH, distill_teacher_net

STUDENTS = [
    *TINY,
    "recipe.name=distill",
    "recipe.distill.students=[resnet18]",
    "model.drop_path_rate=0",
    "data.batch_size=4",
    "data.num_workers=1",
    "logging.tensorboard=false",
    "logging.profile=false",
    "checkpoint.every_steps=2",
    "checkpoint.keep=20",
    "eval.every_epochs=1",
]


def _train(out: Path, root: Path, teacher: Path, *extra: str) -> dict:
    return tiny.train(
        out, root / "train", *STUDENTS, f"recipe.distill.teacher={teacher}", *extra, ranks=2
    )


@pytest.fixture(scope="module")
def reference(distill_data, distill_teacher, tmp_path_factory):
    return _train(tmp_path_factory.mktemp("ref") / "run", distill_data, distill_teacher)


def check_each_student_is_evaluated_and_exported(run: dict, folder: Path) -> None:
    """Every student evaluated between epochs and at the end (the first one
    as the run's own evaluation); ``export --student resnet18`` of the run
    into ``folder`` loads into torchvision's ResNet-18 with its EMA weights."""
    report, out = run["report"], run["out"]
    assert "knn_top1_trained" in report
    assert {"knn_top1_trained"} <= set(report["students"]["resnet18"])
    assert (out / "students" / "resnet18" / "evaluation.json").is_file()
    lines = (out / "metrics.jsonl").read_text().splitlines()
    between = [r for r in map(json.loads, lines) if r.get("event") == "evaluation"]
    assert {"knn_top1_teacher", "knn_top1_student_resnet18"} <= set(between[0]) | set(between[1])
    target = folder / "resnet18.pth"
    export = ["export", str(out), "--format", "dino", "--output", str(target)]
    assert main([*export, "--student", "resnet18"]) == 0
    net = torchvision.models.resnet18(weights=None)
    net.fc = torch.nn.Identity()
    net.load_state_dict(torch.load(target, weights_only=True))
    key = "members.resnet18.backbone.conv1.weight"
    assert torch.equal(net.conv1.weight, run["state"]["teacher"][key])


def test_each_student_is_trained_evaluated_and_exported(reference, tmp_path, capsys):
    rows, report, out = reference["rows"], reference["report"], reference["out"]
    assert rows and all("loss_vit_tiny" in r and "loss_resnet18" in r for r in rows)
    check_each_student_is_evaluated_and_exported(reference, tmp_path)
    assert "knn_top1_random_init" in report["students"]["resnet18"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    between = [r for r in map(json.loads, lines) if r.get("event") == "evaluation"]
    assert len(between) == 2 and between[0]["epoch"] == between[1]["epoch"] == 1  # every student
    teacher = reference["state"]["teacher"]
    assert teacher["members.resnet18.head.patch.weight"].shape == (384, 512)
    assert teacher["members.vit_tiny.head.patch.weight"].shape == (384, 192)
    # the EMA's BatchNorm statistics are the student's (it never runs in training mode)
    student = reference["state"]["student"]
    key = "members.resnet18.backbone.layer1.0.bn1.running_mean"
    assert torch.equal(teacher[key], student[key]) and teacher[key].abs().sum() > 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(
            [
                "export",
                str(out),
                "--format",
                "dino",
                "--output",
                str(tmp_path / "x.pth"),
                "--student",
                "resnet50",
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and "trained vit_tiny, resnet18" in err


def test_a_killed_rank_resumes_every_student_bit_for_bit(
    reference, distill_data, distill_teacher, tmp_path
):
    kill = ("debug.inject_kill_at_step=3", "debug.inject_kill_rank=1")
    run = _train(tmp_path / "run", distill_data, distill_teacher, *kill)
    assert run["report"].get("restarts"), run["report"]
    for key in ("student", "teacher", "optimizer"):
        a, b = run["state"][key], reference["state"][key]
        flat_a, flat_b = _tensors(a), _tensors(b)
        assert flat_a.keys() == flat_b.keys(), key
        for name, value in flat_b.items():
            assert torch.equal(flat_a[name], value), f"{key}.{name} differs"


def test_fsdp_shards_every_student_and_resumes_bit_for_bit(distill_data, distill_teacher, tmp_path):
    """distributed.strategy=fsdp with two ViT students: each sharded on its
    own (blocks, projector, the student), the teacher too; a killed rank
    restarted ends as the run never stopped, and both are evaluated."""
    fsdp = (
        "recipe.distill.students=[vit_small]",
        "distributed.strategy=fsdp",
        "checkpoint.every_steps=2",
        "checkpoint.keep=2",
        "schedule.epochs=1",
        "schedule.warmup_epochs=0",
        "eval.every_epochs=0",
    )
    ref = _train(tmp_path / "ref", distill_data, distill_teacher, *fsdp)
    run = _train(
        tmp_path / "run",
        distill_data,
        distill_teacher,
        *fsdp,
        "debug.inject_kill_at_step=3",
        "debug.inject_kill_rank=1",
    )
    assert run["report"].get("restarts") and Path(ref["report"]["checkpoint"]).is_dir()
    assert {"knn_top1_trained"} <= set(ref["report"]["students"]["vit_small"])
    assert all("loss_vit_tiny" in r and "loss_vit_small" in r for r in ref["rows"])
    for key in ("student", "teacher", "optimizer"):
        a, b = _tensors(run["state"][key]), _tensors(ref["state"][key])
        assert a.keys() == b.keys(), key
        assert any(".members.vit_small." in k for k in b) or key == "optimizer"
        for name, value in b.items():
            assert torch.equal(a[name], value), f"{key}{name} differs"


def _tensors(state, prefix=""):
    """Every tensor of a nested state, by its path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return {}
    out = {}
    for k, v in items:
        out.update(_tensors(v, f"{prefix}.{k}"))
    return out


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["recipe.distill.students=[vit_tiny]"], "names a backbone twice"),
        (
            ["recipe.distill.students=[resnet18]", "recipe.distill.mode=heads"],
            "with recipe.distill.mode=features",
        ),
        (
            ["recipe.distill.students=[resnet18]", "distributed.strategy=fsdp"],
            "recipe.distill.students names 'resnet18'",
        ),
        (["recipe.name=dino", "recipe.distill.students=[resnet18]"], "for recipe.name=distill"),
        (["recipe.distill.students=[resnet19]"], "did you mean 'resnet18'"),
    ],
)
def test_bad_student_lists_are_one_line(extra, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*TINY, "recipe.name=distill", "recipe.distill.teacher=t.pth", *extra])
    assert needle in str(e.value) and "\n" not in str(e.value)


def _memory_rows(distill_teacher, tmp_path, capsys, student):
    """``dino-opt presets --memory-model`` of a distillation's config with
    ``student`` beside the ViT, at 1 and 8 ranks: (the config, its rows)."""
    cfg = load_config(
        None,
        [
            *TINY,
            "recipe.name=distill",
            f"recipe.distill.teacher={distill_teacher}",
            f"recipe.distill.students=[{student}]",
        ],
    )
    path = tmp_path / "distill.yaml"
    save_config(cfg, path)
    assert (
        main(
            [
                "presets",
                "--memory-model",
                "--config",
                str(path),
                "--world",
                "1",
                "8",
                "--checkpointing",
                "none",
                "--json",
            ]
        )
        == 0
    )
    return cfg, json.loads(capsys.readouterr().out)["rows"]


def test_the_memory_model_of_students_opens_their_teacher(distill_teacher, tmp_path, capsys):
    # dino-opt presets --memory-model of a distillation's config: the
    # teacher is opened (its width and parameters); DDP and FSDP rows
    cfg, rows = _memory_rows(distill_teacher, tmp_path, capsys, "vit_small")
    assert [(r["strategy"], r["world_size"]) for r in rows] == [
        ("ddp", 1),
        ("ddp", 8),
        ("fsdp", 1),
        ("fsdp", 8),
    ]
    assert rows[3]["teacher"] < rows[1]["teacher"]  # the frozen teacher and the EMAs sharded
    resolved = apply_overrides(cfg, ["recipe.distill.teacher_dim=384"])  # the teacher's width
    teacher = sum(t.numel() for t in torch.load(distill_teacher).values())
    emas = sum(p.numel() for p in build_models(resolved)[1].parameters())  # both students'
    assert rows[0]["teacher_count"] == teacher + emas
    alone = estimate_memory(resolved, frozen_teacher=distill_teacher_net(), world_size=8)
    assert rows[1]["peak"] == alone.peak


def test_the_memory_model_of_a_resnet_student_has_ddp_rows(distill_teacher, tmp_path, capsys):
    # a ResNet-18 beside the ViT: traced on the meta device; FSDP shards ViT
    # students only, so the table has the DDP rows
    cfg, rows = _memory_rows(distill_teacher, tmp_path, capsys, "resnet18")
    assert [(r["strategy"], r["world_size"]) for r in rows] == [("ddp", 1), ("ddp", 8)]
    resolved = apply_overrides(cfg, ["recipe.distill.teacher_dim=384"])
    students = sum(p.numel() for p in build_models(resolved)[0].parameters())
    assert rows[0]["parameter_count"] == students and rows[0]["activations"] > 0


@pytest.mark.parametrize("students", [[], ["vit_small"]])
def test_fsdp_shards_the_frozen_teacher_over_the_ranks(distill_teacher, tmp_path, students):
    """distributed.strategy=fsdp: each rank holds half the teacher's
    parameters (its backbone sharded block by block, frozen), and the
    sharded teacher's tokens are the whole one's; each student is sharded
    on its own (its blocks, its projector, itself)."""
    worker = Path(__file__).parent / "workers" / "dist_distill_fsdp_worker.py"
    listed = f"recipe.distill.students=[{','.join(students)}]"
    ranks = run_ranks(
        worker,
        tmp_path,
        str(distill_teacher),
        *TINY,
        "recipe.name=distill",
        "model.drop_path_rate=0",
        listed,
        timeout=600,
    )
    numel = ranks[0]["numel"]
    assert sum(r["local_numel"] for r in ranks) == numel
    for r in ranks:
        assert r["sharded"] and r["all_dtensors"] and r["frozen"]
        assert abs(r["local_numel"] / numel - 0.5) < 0.01
        assert r["tokens_diff"] < 1e-5 and all(math.isfinite(v) for v in r["losses"])
        units = set(r["student_units"])
        for prefix, depth in (
            [("", TINY_DEPTH)]
            if not students
            else [("members.vit_tiny.", TINY_DEPTH), ("members.vit_small.", TINY_DEPTH)]
        ):
            assert {f"{prefix}backbone.blocks.{i}" for i in range(depth)} <= units
            assert {f"{prefix}head", prefix.rstrip(".")} <= units
