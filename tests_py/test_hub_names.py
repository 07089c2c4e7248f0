"""Weights by name (dino_opt.weights.load.hub), never touching the network: the
torch.hub, Hugging Face and timm caches are populated by the test in each
library's own layout with small weights it writes, and the libraries are
offline (HF_HUB_OFFLINE). A name resolves to its cached file and reads as
the weights written there; not cached while offline, a gated repository
(huggingface_hub's own GatedRepoError), an unknown name: one line each,
exit 2 in the command line."""

import json
import os
import subprocess
import sys
import urllib.error
from pathlib import Path

import huggingface_hub
import pytest
import torch
from dino_opt.api import training_config
from dino_opt.cli import main
from dino_opt.models import VisionTransformer
from dino_opt.train import build_models
from dino_opt.weights import (
    RELEASED,
    WeightsNameError,
    export_backbone,
    init_from,
    is_weights_name,
    read_weights,
    weights_location,
)
from huggingface_hub import errors as hf_errors

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _vit(seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    return VisionTransformer(patch_size=14, embed_dim=48, depth=2, num_heads=3, img_size=28)


def _same_backbone(weights, vit: VisionTransformer) -> None:
    mine = vit.state_dict()
    for key in ("cls_token", "blocks.1.attn.qkv.weight", "norm.weight"):
        assert torch.equal(weights.teacher["backbone"][key], mine[key]), key


def _hf_snapshot(hub: os.PathLike, repo: str) -> os.PathLike:
    """huggingface_hub's layout of ``repo`` at one commit: refs/main and its snapshot folder."""
    folder = hub / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Empty torch.hub and Hugging Face caches (TORCH_HOME, HF_HOME), offline.
    huggingface_hub reads its variables when imported: its constants follow."""
    torch_home, hf_home = tmp_path / "torch", tmp_path / "hf"
    monkeypatch.setenv("TORCH_HOME", str(torch_home))
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return torch_home / "hub" / "checkpoints", hf_home / "hub"


def test_a_torch_hub_name_reads_its_cached_checkpoint(caches):
    checkpoints, _ = caches
    checkpoints.mkdir(parents=True)
    vit = _vit()
    export_backbone(vit, "dinov2", checkpoints / "dinov2_vits14_pretrain.pth")
    weights = read_weights("dinov2_vits14")
    assert weights.format == "dinov2"
    assert weights.path == checkpoints / "dinov2_vits14_pretrain.pth"
    _same_backbone(weights, vit)


def test_hf_and_timm_names_read_their_cached_snapshots(caches):
    _, hub = caches
    vit = _vit(1)
    export_backbone(vit, "hf", _hf_snapshot(hub, "someone/tiny-dinov2"), force=True)
    weights = read_weights("hf:someone/tiny-dinov2")
    assert weights.format == "hf"
    _same_backbone(weights, vit)
    pytest.importorskip("timm")
    snapshot = _hf_snapshot(hub, "timm/vit_small_patch14_dinov2.lvd142m")
    export_backbone(vit, "timm", snapshot / "model.safetensors")
    weights = read_weights("timm:vit_small_patch14_dinov2.lvd142m")
    assert weights.format == "timm" and weights.path.name == "model.safetensors"
    _same_backbone(weights, vit)


def test_not_cached_while_offline_is_one_line_naming_the_cache(caches, capsys):
    checkpoints, hub = caches
    with pytest.raises(WeightsNameError, match="not in torch.hub's cache .* HF_HUB_OFFLINE=1"):
        weights_location("dino_vits16")
    with pytest.raises(WeightsNameError, match=r"not in the Hugging Face cache \(.*\) and HF_HUB_"):
        weights_location("hf:someone/missing")
    with pytest.raises(SystemExit) as e:
        main(["knn", "--weights", "dinov3_vits16", "--data", "nowhere"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "facebook/dinov3-vits16-pretrain-lvd1689m" in err


def test_a_failed_torch_hub_download_is_one_line(caches, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def no_network(url, dst, *args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    with pytest.raises(WeightsNameError, match="could not download .*no route to host.* put the"):
        weights_location("dinov2_vitb14_reg")


def test_a_gated_repository_is_its_line(caches, monkeypatch):
    def gated(*args, **kwargs):
        error = hf_errors.GatedRepoError.__new__(hf_errors.GatedRepoError)
        Exception.__init__(error, "403 Client Error: access to this model is restricted")
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(WeightsNameError) as e:
        weights_location("dinov3_vitl16")
    line = str(e.value)
    assert "gated repository" in line and "accept its licence" in line and "HF_TOKEN" in line
    assert "\n" not in line


def test_unknown_names_say_so_with_the_closest(caches):
    with pytest.raises(WeightsNameError, match="no released model's name .*'dinov2_vits14'"):
        weights_location("dinov2_vits15")
    pytest.importorskip("timm")
    with pytest.raises(WeightsNameError, match="no pretrained tag 'nope' .* lvd142m"):
        weights_location("timm:vit_small_patch14_dinov2.nope")


def test_an_existing_path_wins_over_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dinov2_vits14").mkdir()
    assert not is_weights_name("dinov2_vits14")
    assert weights_location("dinov2_vits14") == Path("dinov2_vits14")
    assert is_weights_name("hf:a/b") and is_weights_name("dinov2_vitg14_reg")
    assert not is_weights_name("runs/x/checkpoints")


def test_models_lists_every_name_and_where_it_is_cached(tmp_path):
    # in a process of its own: the libraries read TORCH_HOME, HF_HOME and HF_HUB_OFFLINE there
    checkpoints = tmp_path / "torch" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.save({"cls_token": torch.zeros(1)}, checkpoints / "dino_deitsmall16_pretrain.pth")
    (
        _hf_snapshot(tmp_path / "hf" / "hub", RELEASED["dinov3_vits16"].repo) / "config.json"
    ).write_text("{}")
    env = {
        **os.environ,
        "TORCH_HOME": str(tmp_path / "torch"),
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "dino_opt.cli", "models", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert set(rows) == set(RELEASED)
    assert rows["dino_vits16"]["cached"] == str(checkpoints / "dino_deitsmall16_pretrain.pth")
    assert rows["dinov3_vits16"]["cached"].endswith(COMMIT)
    assert rows["dinov2_vits14"]["cached"] is None and rows["dinov2_vits14"]["params_m"] > 20


def test_adapt_by_name_sets_the_network_it_holds():
    cfg = training_config(adapt="dinov2_vits14_reg", overrides=["model.depth=2"])
    m = cfg.model
    assert (m.init_from, m.backbone, m.patch_size, m.num_register_tokens) == (
        "dinov2_vits14_reg",
        "vit_small",
        14,
        4,
    )
    assert m.depth == 2 and cfg.optim.freeze_backbone_epochs == 1


# name -> the layout its released file has (what export_backbone writes, tested against the
# libraries' own loaders in test_weights*.py)
LAYOUTS = {
    "dino_vits8": "dino",
    "dino_resnet50": "dino",
    "dinov2_vits14": "dinov2",
    "dinov2_vits14_reg": "dinov2",
    "dinov3_vits16": "hf",
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_names_keys_build_the_network_its_weights_load_into(name, caches):
    checkpoints, hub = caches
    cfg = training_config(
        adapt=name, overrides=["model.out_dim=64", "model.hidden_dim=32", "model.bottleneck_dim=16"]
    )
    student, teacher = build_models(cfg)
    released = RELEASED[name]
    if released.url:
        checkpoints.mkdir(parents=True, exist_ok=True)
        target = checkpoints / Path(released.url).name
    else:
        target = _hf_snapshot(hub, released.repo)
    export_backbone(teacher.backbone, LAYOUTS[name], target, force=True)
    notes = init_from(name, student, teacher)
    assert notes[0].startswith(f"{read_weights(name).format} weights (")
