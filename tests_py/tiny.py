"""The tiny training run the end-to-end tests share: ViT-T/8 of 4 blocks at 32/16 px
(2 global + 2 local crops), head 32-16-64, batch 8, on the CPU, no progress
bar; a tiny built-in data set; `dino-opt knn` read as JSON; a run killed
and resumed, and its final state compared with a reference's. Tests add
their own overrides."""

import contextlib
import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from dino_opt.checkpoint import CheckpointManager, read_sharded
from dino_opt.cli import main
from dino_opt.data import builtin_dataset
from dino_opt.models import VisionTransformer
from forked import CliProcess, run_cli, wait_for

# 4 of ViT-T's 12 blocks: every mechanism a test looks at, a third of the compute
TINY_DEPTH = 4
TINY = [
    "data.batch_size=8",
    "augmentation.global_crop_size=32",
    "augmentation.local_crop_size=16",
    "augmentation.num_local_views=2",
    "model.backbone=vit_tiny",
    f"model.depth={TINY_DEPTH}",
    "model.patch_size=8",
    "model.out_dim=64",
    "model.hidden_dim=32",
    "model.bottleneck_dim=16",
    "schedule.epochs=2",
    "schedule.warmup_epochs=1",
    "logging.log_every=1",
    "logging.progress=false",
    "hardware.device=cpu",
    # float32 on every machine: the tests compare runs to 1e-4 (DDP with FSDP,
    # resumes), which bfloat16 autocast, the default on a CPU that computes it
    # natively, would not hold (test_step covers that default)
    "hardware.precision=fp32",
    # the end of a run evaluates by k-NN only and draws nothing: test_train_cli
    # turns the rest on
    "eval.linear=false",
    "eval.dense=false",
    "eval.pictures=0",
    "logging.curves=false",
    "logging.tsne=false",
]


# A run killed and resumed: a checkpoint each step, two loader threads (their
# order must survive the kill), no TensorBoard or profile files.
RESUMABLE = [
    "data.num_workers=2",
    "logging.tensorboard=false",
    "logging.profile=false",
    "checkpoint.every_steps=1",
]


def tiny_one_epoch(tmp_path_factory, train_per_class: int = 2, val_per_class: int = 1) -> tuple:
    """``(data root, run folder)``: a tiny built-in data set (40 px images;
    ``train_per_class`` and ``val_per_class`` images a class, no test
    split) and TINY
    trained one epoch on its train split, in this process."""
    root = builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=train_per_class,
        val_per_class=val_per_class,
        test_per_class=0,
        image_size=40,
    )
    out = tmp_path_factory.mktemp("run") / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            main(
                [
                    "train",
                    "--output-dir",
                    str(out),
                    "--quiet",
                    f"data.root={root / 'train'}",
                    *TINY,
                    "schedule.epochs=1",
                    "schedule.warmup_epochs=0",
                ]
            )
            == 0
        )
    return root, out


def tiny_train_only(tmp_path_factory) -> Path:
    """40 images (5 batches of 8 per epoch) in a `train` folder with no `val`
    beside it, so that a run ends without the k-NN evaluation."""
    root = builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=4,
        val_per_class=1,
        test_per_class=0,
        image_size=40,
    )
    train = tmp_path_factory.mktemp("trainonly") / "train"
    train.symlink_to(root / "train")
    return train


def knn_json(capsys, *args: str) -> dict:
    """``dino-opt knn ARGS``: what it printed, as a dict."""
    capsys.readouterr()
    assert main(["knn", *args]) == 0
    return json.loads(capsys.readouterr().out)


def final_state(out: Path) -> dict:
    """The final checkpoint of the run folder ``out`` (its report's)."""
    report = json.loads((out / "report.json").read_text())
    return torch.load(report["checkpoint"], weights_only=True)


def train_args(out: Path, root: Path, *config: str, nproc: int | None = None) -> list[str]:
    """``dino-opt train`` into the run folder ``out`` on the images of
    ``root``, quietly, with ``config`` (on ``nproc`` ranks)."""
    ranks = ["--nproc", str(nproc)] if nproc else []
    return ["train", "--output-dir", str(out), "--quiet", *ranks, f"data.root={root}", *config]


def error_line(capsys, argv: list[str]) -> str:
    """``dino-opt ARGV`` in this process exits 2 with one line on stderr and
    no traceback (bad input as the user sees it); that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def run_cli_ok(argv: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """``dino-opt ARGV`` in a process of its own (:func:`forked.run_cli`),
    which must exit 0."""
    done = run_cli(argv, env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def checkpointed(out: Path, step: int):
    """Whether the run folder ``out`` lists a checkpoint of ``step`` or later."""
    manager = CheckpointManager(out / "checkpoints")
    return lambda: any(r.step >= step for r in manager.checkpoints())


def kill_when(p: CliProcess, predicate, *, delay: float = 0.0, group: bool = False) -> bool:
    """SIGKILLs ``p`` once ``predicate()`` holds, ``delay`` seconds later
    (``group``: with its whole process group, the launcher and every rank:
    a node lost); whether that came before ``p`` ended. Waits for its end."""
    hit = wait_for(predicate, p)
    if hit:
        time.sleep(delay)
        if group:
            os.killpg(p.pid, signal.SIGKILL)
        else:
            p.kill()
    p.communicate(timeout=120)
    return hit and p.returncode == -signal.SIGKILL


def run_killed_and_resumed(out: Path, argv: list[str], at_step: int = 4) -> None:
    """Runs ``dino-opt ARGV`` (a training of the run folder ``out``),
    SIGKILLs it once a checkpoint of step ``at_step`` or later exists, and
    runs it again to its end (resuming)."""
    assert kill_when(CliProcess(argv), checkpointed(out, at_step)), (
        "the run ended before it could be killed"
    )
    run_cli_ok(argv)


def assert_same_states(a: dict, b: dict, keys=("student", "teacher", "loss")) -> None:
    """The ``keys`` of two checkpoints equal entry by entry, bit for bit."""
    for key in keys:
        assert a[key].keys() == b[key].keys(), key
        for name, value in b[key].items():
            same = (
                torch.equal(a[key][name], value)
                if isinstance(value, torch.Tensor)
                else (a[key][name] == value)
            )
            assert same, f"{key}.{name} differs"


def ranks_env() -> dict:
    """This process's environment for a launcher of ranks: one intra-op
    thread a rank, no RANK or WORLD_SIZE of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def read_run(out: Path) -> dict:
    """The run folder ``out`` read back: ``out``, its ``report``, the metric
    ``rows`` with a loss, and the final checkpoint's ``state`` (read whole
    when sharded)."""
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    path = Path(report["checkpoint"])
    state = read_sharded(path) if path.is_dir() else torch.load(path, weights_only=True)
    return {"out": out, "report": report, "rows": [r for r in rows if "loss" in r], "state": state}


def train(out: Path, root: Path, *overrides: str, ranks: int = 1) -> dict:
    """``dino-opt train`` into the run folder ``out`` on the images of
    ``root`` with ``overrides``, read back (:func:`read_run`). One rank: in
    this process (an exception the run raises reaches the test); more: the
    launcher and its ranks, one intra-op thread each, which must exit 0."""
    argv = train_args(out, root, *overrides, nproc=ranks if ranks > 1 else None)
    if ranks > 1:
        run_cli_ok(argv, ranks_env())
    else:
        assert main(argv) == 0
    return read_run(out)


def distill_teacher_net() -> VisionTransformer:
    """The distillation tests' teacher: a ViT-S/8-wide (384) of 2 blocks."""
    torch.manual_seed(1)
    return VisionTransformer(patch_size=8, embed_dim=384, depth=2, num_heads=6, img_size=32)
