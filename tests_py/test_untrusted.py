"""Nothing a stranger's file can do: a sharded checkpoint whose description
(or a value) names code is refused in one line by every reader, behind
records rewritten to match its bytes, and nothing of it runs; a network
that a checkpoint's config names as package.module:function is built only
with the user's --trust-code."""

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dino_opt.checkpoint import CheckpointManager, RefusedCheckpointError, read_sharded
from dino_opt.checkpoint.description import read_description
from dino_opt.checkpoint.sharded import manifest
from dino_opt.cli import main
from dino_opt.config import apply_overrides, default_config
from dino_opt.data import builtin_dataset
from dino_opt.train import build_models
from dino_opt.weights import open_teacher
from forked import run_cli
from tiny import TINY, ranks_env, train_args

#: A run of one epoch sharded with FSDP on 2 gloo ranks (with tiny.TINY).
FSDP_RUN = (
    "data.num_workers=1",
    "data.batch_size=4",
    "logging.tensorboard=false",
    "logging.profile=false",
    "distributed.strategy=fsdp",
    "schedule.epochs=1",
    "schedule.warmup_epochs=0",
)


class _Touch:
    """Unpickling it runs ``touch MARKER``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _rerecord(folder: Path) -> None:
    """The records of every sharded checkpoint of ``folder`` (its sidecars and
    index) rewritten to match the bytes now there, as a forger would."""
    manager = CheckpointManager(folder)
    index = json.loads(manager.index_path.read_text())
    for record in manager.checkpoints():
        sha, size, files = manifest(record.path)
        entry = {**record.to_json(), "sha256": sha, "size": size, "files": files}
        manager.sidecar_path(record.path).write_text(json.dumps(entry) + "\n")
        for e in index["checkpoints"]:
            if e["file"] == record.path.name:
                e.update(entry)
    manager.index_path.write_text(json.dumps(index))
    assert all(manager.verify(r.path) for r in manager.checkpoints())


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=4,
        val_per_class=1,
        test_per_class=0,
        image_size=40,
    )


@pytest.fixture(scope="module")
def sharded_run(data, tmp_path_factory):
    """A run of one epoch sharded with FSDP on 2 gloo ranks."""
    out = tmp_path_factory.mktemp("fsdp") / "run"
    done = run_cli(train_args(out, data / "train", *TINY, *FSDP_RUN, nproc=2), ranks_env())
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.fixture
def forged(sharded_run, tmp_path):
    """A copy of the sharded run whose every checkpoint's ``.metadata``
    would create ``tmp_path/MARKER`` when unpickled, its records matching."""
    run = tmp_path / "forged"
    shutil.copytree(sharded_run, run)
    marker = tmp_path / "MARKER"
    for folder in (run / "checkpoints").glob("*.dcp"):
        (folder / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    _rerecord(run / "checkpoints")
    return run, marker


def _refused(capsys, argv: list[str]) -> str:
    """``dino-opt ARGV`` ends with exit status 2 and one line on stderr; that line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_forged_description_is_refused_in_one_line_and_never_run(forged):
    run, marker = forged
    manager = CheckpointManager(run / "checkpoints")
    newest = manager.checkpoints()[-1].path
    with pytest.raises(RefusedCheckpointError, match=r"\.metadata' names the global posix.system"):
        manager.load(newest)
    for tensors in (True, False):  # the tools' read, and a sharded run's before its shards
        with pytest.raises(RefusedCheckpointError):
            read_sharded(newest, tensors=tensors)
    with pytest.raises(RefusedCheckpointError):  # no fallback to an older (forged) one
        manager.load_latest()
    assert not marker.exists()


def test_every_reader_refuses_a_forged_run(sharded_run, forged, data, tmp_path, capsys):
    run, marker = forged
    image = next((data / "val").rglob("*.jpg"))
    head = tmp_path / "head.safetensors"  # a head of the real run, for predict
    probe = ["eval", "linear", str(sharded_run), "--data", str(data), "--epochs", "1"]
    assert main([*probe, "--head", str(head), "--device", "cpu"]) == 0
    commands = [
        ["embed", str(run), str(data / "val"), "-o", str(tmp_path / "e.npy")],
        ["predict", str(run), str(head), str(data / "val"), "-o", str(tmp_path / "p.csv")],
        ["knn", "--checkpoint", str(run), "--data", str(data), "--device", "cpu"],
        ["export", str(run), "--format", "timm", "--output", str(tmp_path / "x.safetensors")],
        ["export", str(run), "--format", "onnx", "--output", str(tmp_path / "x.onnx")],
        ["show", "pca", str(run), str(image), "--output-dir", str(tmp_path / "pictures")],
        ["eval", "linear", str(run), "--data", str(data), "--device", "cpu"],
        # resume, continued pretraining, a distillation's teacher
        ["train", "--output-dir", str(run), "--quiet", "checkpoint.resume=auto"],
        [
            "train",
            "--adapt",
            str(run),
            "--output-dir",
            str(tmp_path / "adapted"),
            "--quiet",
            f"data.root={data / 'train'}",
            "hardware.device=cpu",
            "data.batch_size=8",
        ],
        [
            "train",
            "--output-dir",
            str(tmp_path / "distilled"),
            "--quiet",
            f"data.root={data / 'train'}",
            "hardware.device=cpu",
            "data.batch_size=8",
            "recipe.name=distill",
            f"recipe.distill.teacher={run}",
        ],
    ]
    for argv in commands:
        line = _refused(capsys, argv)
        assert "names the global posix.system" in line and ".metadata" in line, (argv, line)
    # the report lists each checkpoint as skipped, with the refusal as the reason
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]["checkpoints"]
    assert rows and all("names the global posix.system" in r["reason"] for r in rows)
    assert not marker.exists()


def test_a_sharded_resume_refuses_a_forged_run_without_restarts(forged, data):
    """Resumed on 2 ranks: each refuses before loading a shard, and the
    launcher does not restart them (a restart would fail the same way)."""
    run, marker = forged
    done = run_cli(train_args(run, data / "train", *TINY, *FSDP_RUN, nproc=2), ranks_env())
    refusals = [x for x in done.stderr.splitlines() if "names the global posix.system" in x]
    assert done.returncode != 0 and len(refusals) == 2, done.stderr[-3000:]
    assert "0 of 3 restarts used" in done.stderr and not marker.exists()


def test_a_value_naming_code_is_refused(tmp_path):
    """A non-tensor value of the shards (what the optimizer's param_groups
    are) read with weights_only: one naming code is refused, never run."""
    folder = tmp_path / "checkpoint-e0000-s00000001.dcp"
    marker = tmp_path / "MARKER"
    with pytest.warns(UserWarning, match="save in a single process"):
        dcp.save({"w": torch.ones(3), "lr": _Touch(marker)}, checkpoint_id=folder, no_dist=True)
    torch.save({"step": 1}, folder / "extra.pt")
    assert not marker.exists()  # saving pickles it; only unpickling would run it
    with pytest.raises(RefusedCheckpointError, match="'lr'.*not plain data"):
        read_sharded(folder)
    assert not marker.exists()


def test_a_real_description_reads_as_torch_reads_it(sharded_run):
    newest = CheckpointManager(sharded_run / "checkpoints").checkpoints()[-1].path
    ours = read_description(newest / ".metadata")
    with open(newest / ".metadata", "rb") as f:
        theirs = pickle.load(f)  # our own run's file: trusted here, to compare
    assert ours == theirs
    state = read_sharded(newest)
    assert state["step"] == 5 and state["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "cannot be read: EOFError"),
        (b"\x80\x04K\x01.", "holds a int"),
        (pickle.dumps({"state_dict_metadata": {}}), "holds a dict"),
        (pickle.dumps(io.BytesIO()), "names the global _io.BytesIO"),
        (pickle.dumps(print), "names the global builtins.print"),
    ],
)
def test_malformed_descriptions_are_one_line(tmp_path, content, message):
    path = tmp_path / ".metadata"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message) as e:
        read_description(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_piece_outside_the_folder_is_refused(sharded_run, tmp_path):
    """A description whose pieces lie in a file outside its folder."""
    newest = CheckpointManager(sharded_run / "checkpoints").checkpoints()[-1].path
    metadata = read_description(newest / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match="is stored in '../../elsewhere.distcp', not a file of"):
        read_description(path)


# ------------------------------------------------------- code named in a config


@pytest.fixture
def own_net_checkpoint(tmp_path, monkeypatch):
    """A checkpoint whose config names its student ``own_nets:noted_cnn``
    (a distillation's), which notes each call by creating NOTE."""
    note = tmp_path / "NOTE"
    monkeypatch.setenv("OWN_NETS_NOTE", str(note))
    own = [
        "recipe.name=distill",
        f"recipe.distill.teacher={tmp_path / 'teacher'}",
        "model.backbone=own_nets:noted_cnn",
        "model.patch_size=16",
        "model.trust_code=true",
    ]
    cfg = apply_overrides(default_config(), [*TINY, *own])
    student, teacher = build_models(cfg)
    path = tmp_path / "checkpoint.pth"
    state = {
        "student": student.state_dict(),
        "teacher": teacher.state_dict(),
        "config": cfg.to_dict(),
    }
    torch.save(state, path)
    note.unlink()
    return path, note


def test_code_a_checkpoint_names_runs_only_with_trust_code(own_net_checkpoint, data, capsys):
    path, note = own_net_checkpoint
    argv = ["knn", "--checkpoint", str(path), "--data", str(data), "--device", "cpu"]
    line = _refused(capsys, argv)
    assert line == (
        f"dino-opt knn: error: checkpoint {str(path)!r}: its config names "
        "model.backbone='own_nets:noted_cnn', which would import own_nets and call noted_cnn(); "
        "code named in a file being read is not run unless you allow it: --trust-code (or "
        "model.trust_code=true in your config)"
    )  # the file's own model.trust_code=true counts for nothing
    assert not note.exists()
    capsys.readouterr()
    assert main([*argv, "--trust-code"]) == 0
    assert note.exists() and json.loads(capsys.readouterr().out)["n_val"] == 10


def test_a_teacher_run_naming_code_needs_trust_code(own_net_checkpoint, data, tmp_path):
    """A distillation through heads opens its teacher's run by its config."""
    path, note = own_net_checkpoint
    with pytest.raises(ValueError, match=r"recipe.distill.teacher=.*own_nets:noted_cnn.*--trust"):
        open_teacher(path, heads=True)
    assert not note.exists()


def test_a_tensor_larger_than_its_shards_is_refused(sharded_run, tmp_path):
    """A description whose tensor is larger than every shard together: refused
    before anything is allocated for it."""
    newest = CheckpointManager(sharded_run / "checkpoints").checkpoints()[-1].path
    metadata = read_description(newest / ".metadata")
    entry = metadata.state_dict_metadata["student.backbone.cls_token"]
    entry.size = torch.Size([10**12, 192])
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match="'student.backbone.cls_token' of .* more than its shards"):
        read_description(path)
