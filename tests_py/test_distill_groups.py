"""Students on their own groups of ranks (``distributed.student_groups``):
the split teacher forward and the per-group DDP on 4 gloo ranks; the job on
2 (a ViT-T/8 and a ResNet-18, one rank each) against the same students
trained together in one process, resumed bit for bit after a killed rank,
resumed from the other layout's checkpoint, evaluated and exported; bad
layouts in one line."""

from pathlib import Path

import pytest
import tiny
import torch
from dino_opt.config import ConfigError, apply_overrides, default_config
from dino_opt.runtime import student_groups
from gloo_ranks import run_ranks
from test_distill_students import STUDENTS, _tensors, check_each_student_is_evaluated_and_exported

HERE = Path(__file__).parent
GROUPS = "distributed.student_groups=true"


def test_the_teacher_runs_once_per_batch_split_over_the_students(tmp_path):
    """4 ranks, 2 students: each rank's teacher sees 3 of the batch's 6
    images and gets the whole batch's tokens back (as one forward gives
    them); DDP averages a student's gradient over its own group only; the
    metrics' mean over all ranks is each student's mean and their sum."""
    ranks = run_ranks(HERE / "workers" / "dist_groups_worker.py", tmp_path, world=4)
    assert [(r["index"], r["data_rank"], r["lead"]) for r in ranks] == [
        (0, 0, True),
        (0, 1, False),
        (1, 0, True),
        (1, 1, False),
    ]
    for r in ranks:
        assert r["seen"] == [3]  # one forward, of this rank's share
        assert r["shapes"] == [[6, 64], [6, 16, 64]]
        assert r["cls_diff"] < 1e-5 and r["patch_diff"] < 1e-5
    # inputs rank+1: group (0, 1) averages 1 and 2, group (2, 3) 3 and 4
    assert ranks[0]["gradient"] == ranks[1]["gradient"] == [1.5, 1.5]
    assert ranks[2]["gradient"] == ranks[3]["gradient"] == [3.5, 3.5]
    m = ranks[0]["metrics"]
    assert all(r["metrics"] == m for r in ranks)
    assert m["a"] == pytest.approx(1.5) and m["b"] == pytest.approx(3.5)
    assert m["loss"] == pytest.approx(5.0)
    assert m["cosine_a"] == pytest.approx(0.15) and m["cosine_b"] == pytest.approx(0.35)


@pytest.mark.parametrize(
    ("students", "world", "batch", "needle"),
    [
        (3, 2, 6, "number of processes (2) must be a multiple of 3"),
        (2, 4, 5, "data.batch_size (5) must be a multiple of 2"),
        (1, 2, 4, "multiple of 1"),
    ],
)
def test_a_layout_the_ranks_cannot_hold_is_one_line(students, world, batch, needle):
    with pytest.raises(ValueError, match=r"student_groups") as e:
        student_groups(students, 0, world, batch)
    assert "\n" not in str(e.value) and (needle in str(e.value) or students == 1)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ([], "name more students with recipe.distill.students"),
        (
            ["recipe.distill.students=[resnet18]", "distributed.strategy=fsdp"],
            "shards a ViT block by block",
        ),
        (
            ["recipe.distill.students=[resnet18]", "data.batch_size=5"],
            "data.batch_size (5) must be a multiple of 2",
        ),
        (["recipe.distill.students=[resnet18]", "model.init_from=x.pth"], "model.init_from"),
    ],
)
def test_bad_group_configs_are_one_line(extra, needle):
    base = ["recipe.name=distill", "recipe.distill.teacher=t.pth", "model.backbone=vit_tiny"]
    with pytest.raises(ConfigError) as e:
        apply_overrides(default_config(), [*base, GROUPS, *extra])
    assert needle in str(e.value)
    with pytest.raises(ConfigError, match="for recipe.name=distill, not dino"):
        apply_overrides(default_config(), [GROUPS])


def _train(out: Path, root: Path, teacher: Path, *extra: str, ranks: int = 2) -> dict:
    """A run of STUDENTS with a checkpoint every 2 steps (joining the
    students on rank 0 takes a while)."""
    return tiny.train(
        out,
        root / "train",
        *STUDENTS,
        f"recipe.distill.teacher={teacher}",
        "checkpoint.every_steps=2",
        *extra,
        ranks=ranks,
    )


@pytest.fixture(scope="module")
def together(distill_data, distill_teacher, tmp_path_factory):
    """Both students in one process (its loader the groups' one shard)."""
    return _train(tmp_path_factory.mktemp("one") / "run", distill_data, distill_teacher, ranks=1)


@pytest.fixture(scope="module")
def grouped(distill_data, distill_teacher, tmp_path_factory):
    return _train(tmp_path_factory.mktemp("groups") / "run", distill_data, distill_teacher, GROUPS)


def _close(a: dict, b: dict, what: str, tol: float) -> None:
    flat_a, flat_b = _tensors(a), _tensors(b)
    assert flat_a.keys() == flat_b.keys(), what
    for name, value in flat_b.items():
        if value.is_floating_point():
            assert torch.allclose(flat_a[name], value, atol=tol, rtol=tol), f"{what}.{name}"
        else:
            assert torch.equal(flat_a[name], value), f"{what}.{name}"


def test_groups_train_each_student_as_one_process_trains_them_all(grouped, together):
    """The same batches (one group rank each), the same initialisation:
    each student, its EMA and its AdamW state end as when both are trained
    in one process, up to the teacher's forward on half batches; the
    metric rows match; each student is evaluated, its checkpoint exports."""
    for key in ("student", "teacher", "optimizer"):
        _close(grouped["state"][key], together["state"][key], key, 1e-4)
    a, b = grouped["rows"], together["rows"]
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "loss_vit_tiny", "loss_resnet18", "loss_distill_cls_cosine_resnet18"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), (x["step"], key)
    check_each_student_is_evaluated_and_exported(grouped, grouped["out"].parent)


def test_a_killed_rank_resumes_grouped_students_bit_for_bit(
    grouped, distill_data, distill_teacher, tmp_path
):
    kill = ("debug.inject_kill_at_step=3", "debug.inject_kill_rank=1")
    run = _train(tmp_path / "run", distill_data, distill_teacher, GROUPS, *kill)
    assert run["report"].get("restarts"), run["report"]
    for key in ("student", "teacher", "optimizer"):
        a, b = _tensors(run["state"][key]), _tensors(grouped["state"][key])
        assert a.keys() == b.keys(), key
        for name, value in b.items():
            assert torch.equal(a[name], value), f"{key}.{name} differs"


def test_groups_resume_a_run_of_all_students_in_one_process(
    together, distill_data, distill_teacher, tmp_path
):
    """A checkpoint of both students trained in one process, at step 4,
    resumed with each student on its own rank: each takes its part (its
    optimizer's positions after the other's) and ends as the one-process
    run does."""
    folder = together["out"] / "checkpoints"
    step4 = next(p for p in folder.glob("*.pth") if torch.load(p, weights_only=True)["step"] == 4)
    run = _train(
        tmp_path / "run", distill_data, distill_teacher, GROUPS, f"checkpoint.resume={step4}"
    )
    assert run["report"]["resumed_from"] == str(step4)
    for key in ("student", "teacher", "optimizer"):
        _close(run["state"][key], together["state"][key], key, 1e-4)


def test_fsdp_shards_each_student_over_its_group(distill_data, distill_teacher, tmp_path):
    """4 ranks: a ViT-T on ranks 0-1 and a ViT-S on ranks 2-3, each
    sharded over its pair (the frozen teacher over all four), rank 3 killed
    at step 3 and the run restarted from step 2: it ends as the same
    students trained with DDP over their pairs (within 1e-5: FSDP reduces
    the gradients in another order), and every student is evaluated."""
    run = (
        GROUPS,
        "recipe.distill.students=[vit_small]",
        "schedule.epochs=1",
        "schedule.warmup_epochs=0",
        "eval.every_epochs=0",
        "checkpoint.every_steps=2",
    )
    kill = ("distributed.strategy=fsdp", "debug.inject_kill_at_step=3", "debug.inject_kill_rank=3")
    sharded = _train(tmp_path / "fsdp", distill_data, distill_teacher, *run, *kill, ranks=4)
    ddp = _train(tmp_path / "ddp", distill_data, distill_teacher, *run, ranks=4)
    assert sharded["report"].get("restarts"), sharded["report"]
    assert {"knn_top1_trained"} <= set(sharded["report"]["students"]["vit_small"])
    for key in ("student", "teacher", "optimizer"):
        _close(sharded["state"][key], ddp["state"][key], key, 1e-5)
    assert len(sharded["rows"]) >= len(ddp["rows"]) == 5
