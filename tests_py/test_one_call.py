"""The one-call Python API (dino_opt.train, dino_opt.embed, dino_opt.load)
gives what the command line gives with the same options: the same report
of the same tiny training, the same embeddings, the same network; and
dino_opt.train stays the training engine's package."""

import json

import dino_opt
import dino_opt.train.build as build
import numpy as np
import pytest
import torch
import yaml
from dino_opt.cli import main
from dino_opt.weights import open_backbone
from PIL import Image
from tiny import TINY, ranks_env, read_run

# what differs between two runs of one training: where and how long
_PLACE = ("train_seconds", "run_folder", "checkpoint", "profile")


def _as_keywords(overrides: list[str]) -> dict:
    """``section.key=value`` overrides as ``dino_opt.train``'s keyword arguments."""
    return {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)}


@pytest.mark.slow
def test_train_gives_the_report_of_the_command(one_epoch, tmp_path):
    root, cli_run = one_epoch  # tiny.tiny_one_epoch: `dino-opt train` with these options
    options = _as_keywords([*TINY, "schedule.epochs=1", "schedule.warmup_epochs=0"])
    report = dino_opt.train(root / "train", out=tmp_path / "run", quiet=True, **options)
    expected = json.loads((cli_run / "report.json").read_text())
    assert report.keys() == expected.keys()
    for key in report.keys() - set(_PLACE):
        number = isinstance(report[key], float)
        assert report[key] == (
            pytest.approx(expected[key], abs=1e-6) if number else expected[key]
        ), key
    assert report["run_folder"] == str(tmp_path / "run")


@pytest.mark.slow
def test_nproc_starts_the_processes_of_the_command(one_epoch, tmp_path, monkeypatch):
    root, _ = one_epoch
    for key, value in ranks_env().items():
        monkeypatch.setenv(key, value)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    options = _as_keywords([*TINY, "schedule.epochs=1", "schedule.warmup_epochs=0"])
    report = dino_opt.train(root / "train", out=tmp_path / "run", nproc=2, **options)
    assert report["run_folder"] == str(tmp_path / "run")
    run = read_run(tmp_path / "run")
    assert run["report"] == report and run["state"]["world_size"] == 2
    with pytest.raises(ValueError, match="nproc must be an int >= 1, got 0"):
        dino_opt.train(root / "train", nproc=0)


def test_sections_and_dotted_keys_are_overrides(tmp_path):
    with pytest.raises(ValueError, match="give a section as a mapping"):
        dino_opt.train(tmp_path, epochs=3)
    with pytest.raises(ValueError, match="schedule.epochs must be >= 1"):
        dino_opt.train(tmp_path, schedule={"epochs": 0})
    with pytest.raises(ValueError, match="no demo of recipe 'dinov9'"):
        dino_opt.train(tmp_path, recipe="dinov9")
    # the model section given as model=: read as the other sections are
    with pytest.raises(ValueError, match="model.depth must be >= 1"):
        dino_opt.train(tmp_path, model={"backbone": "vit_tiny", "depth": 0})


def test_embed_gives_what_the_command_writes(run, tiny_data, tmp_path, capsys):
    assert (
        main(
            [
                "embed",
                str(run),
                str(tiny_data / "train"),
                "-o",
                str(tmp_path / "e.npy"),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    emb = dino_opt.embed(run, tiny_data / "train", device="cpu", output=tmp_path / "api.npy")
    np.testing.assert_array_equal(emb.cls.numpy(), np.load(tmp_path / "e.npy"))
    np.testing.assert_array_equal(emb.mean_patch.numpy(), np.load(tmp_path / "e.mean_patch.npy"))
    assert emb.names == json.loads((tmp_path / "e.paths.json").read_text())
    np.testing.assert_array_equal(np.load(tmp_path / "api.npy"), np.load(tmp_path / "e.npy"))
    with pytest.raises(FileExistsError):
        dino_opt.embed(run, tiny_data / "train", device="cpu", output=tmp_path / "api.npy")


def test_load_gives_the_network_the_commands_open(run, tiny_data, tmp_path):
    net = dino_opt.load(run)
    opened = open_backbone(run)
    assert not net.training
    assert net.state_dict().keys() == opened.net.state_dict().keys()
    for key, value in opened.net.state_dict().items():
        assert torch.equal(net.state_dict()[key], value), key
    t = net.transform
    assert (t.size, t.mean, t.std) == (opened.image_size, opened.mean, opened.std)
    image = next(iter(sorted((tiny_data / "train").rglob("*.jpg"))))
    x = t(image)
    assert x.shape == (3, t.size, t.size) and x.dtype == torch.float32
    assert torch.equal(t(Image.open(image)), x)
    with torch.no_grad():
        assert net(x[None]).shape[0] == 1


def test_the_engine_package_is_still_importable():
    assert build.__name__ == "dino_opt.train.build"
    assert dino_opt.train.build_models is build.build_models
    assert callable(dino_opt.train)
