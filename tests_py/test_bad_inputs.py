"""Malformed inputs a user may hand the tools (a head file's record, a
Hugging Face folder's config.json and index, student weights of the wrong
shapes, an unreadable path): exit status 2 and one line naming the file,
never a traceback."""

import json
import math

import pytest
import torch
from dino_opt.cli import main
from dino_opt.distributed import embed as distributed_embed
from dino_opt.models import build_backbone
from dino_opt.weights import load_student_start
from dino_opt.weights.heads import HEAD_KEY, load_head
from safetensors.torch import save_file
from tiny import error_line


@pytest.fixture(scope="module")
def head(run, tiny_data, tmp_path_factory):
    """A linear head of the tiny run: its tensors and record."""
    path = tmp_path_factory.mktemp("head") / "linear.safetensors"
    argv = ["eval", "linear", str(run), "--data", str(tiny_data), "--epochs", "1"]
    assert main([*argv, "--head", str(path), "--device", "cpu"]) == 0
    return load_head(path)


def _without(record: dict, key: str) -> dict:
    return {k: v for k, v in record.items() if k != key}


# (what is wrong, the record made from the good one, what the line says)
RECORDS = [
    ("not an object", lambda r: [r], "is a list, not a JSON object"),
    ("no kind", lambda r: _without(r, "kind"), "has kind None"),
    ("an unknown kind", lambda r: {**r, "kind": "cluster"}, "has kind 'cluster'"),
    ("classes not a list", lambda r: {**r, "classes": "abc"}, "has classes='abc', not a list"),
    ("a text size", lambda r: {**r, "image_size": "32"}, "has image_size='32', not a int"),
    ("a boolean size", lambda r: {**r, "image_size": True}, "has image_size=True"),
    ("a size of 0", lambda r: {**r, "image_size": 0}, "has image_size=0"),
    ("NaN in mean", lambda r: {**r, "mean": [math.nan, 0.4, 0.4]}, "not one finite number per"),
    ("a short std", lambda r: {**r, "std": [0.2]}, "not one finite number per"),
    ("no n_blocks", lambda r: _without(r, "n_blocks"), "has n_blocks=None"),
    ("no identity", lambda r: {**r, "backbone": {}}, "does not name its backbone"),
    ("more classes", lambda r: {**r, "classes": [*r["classes"], "extra"]}, "says tensors"),
    ("a wider input", lambda r: {**r, "dim": r["dim"] + 1}, "says tensors"),
]


@pytest.mark.parametrize(("what", "change", "says"), RECORDS, ids=[r[0] for r in RECORDS])
def test_a_malformed_head_record_iserror_line(
    run, tiny_data, head, tmp_path, capsys, what, change, says
):
    tensors, record = head
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata={HEAD_KEY: json.dumps(change(record))})
    argv = ["predict", str(run), str(path), str(tiny_data / "val"), "-o", str(tmp_path / "p.csv")]
    line = error_line(capsys, [*argv, "--device", "cpu"])
    assert str(path) in line and says in line, line
    assert not (tmp_path / "p.csv").exists()


def test_a_head_without_its_tensors_iserror_line(run, tiny_data, head, tmp_path, capsys):
    _, record = head
    path = tmp_path / "bad.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, str(path), metadata={HEAD_KEY: json.dumps(record)})
    argv = ["predict", str(run), str(path), str(tiny_data / "val"), "-o", str(tmp_path / "p.csv")]
    assert "says tensors" in error_line(capsys, argv)


@pytest.fixture(scope="module")
def hf_folder(run, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "model"
    assert main(["export", str(run), "--format", "hf", "--output", str(path)]) == 0
    return path


# (what is wrong, config.json's text, what the line says)
CONFIGS = [
    ("not JSON", "{not json", "config.json: not valid JSON"),
    ("a list", "[1, 2]", "config.json: holds a JSON list, not an object"),
    ("text heads", '{"num_attention_heads": "six"}', "num_attention_heads is 'six'"),
    ("text RoPE base", '{"model_type": "dinov3_vit", "rope_theta": "x"}', "config.json: not a"),
]


@pytest.mark.parametrize(("what", "text", "says"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_bad_hugging_face_config_iserror_line(
    hf_folder, tiny_data, tmp_path, capsys, what, text, says
):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((hf_folder / "model.safetensors").read_bytes())
    (folder / "config.json").write_text(text)
    line = error_line(capsys, ["knn", "--weights", str(folder), "--data", str(tiny_data)])
    assert str(folder) in line and says in line, line


@pytest.mark.parametrize(
    "index",
    ["{}", '{"weight_map": [1]}', '{"weight_map": {"a": "../elsewhere.safetensors"}}', "[]"],
)
def test_a_bad_hugging_face_index_iserror_line(hf_folder, tiny_data, tmp_path, capsys, index):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    (folder / "model.safetensors.index.json").write_text(index)
    line = error_line(capsys, ["knn", "--weights", str(folder), "--data", str(tiny_data)])
    assert "model.safetensors.index.json" in line, line


def test_student_weights_of_the_wrong_shapes_areerror_line(tmp_path):
    net, _ = build_backbone("torchvision:resnet18")
    state = {k: torch.zeros(1) for k in net.net.state_dict()}  # every key, wrong shapes
    path = tmp_path / "student.safetensors"
    save_file(state, str(path))
    with pytest.raises(ValueError, match="student.safetensors does not fit torchvision:resnet18: "):
        load_student_start(path, net)
    with pytest.raises(ValueError) as e:
        load_student_start(path, net)
    assert "\n" not in str(e.value)


def test_a_permission_error_iserror_line(run, tiny_data, tmp_path, capsys, monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "e.npy"))

    monkeypatch.setattr(distributed_embed, "embed_weights", refused)
    argv = ["embed", str(run), str(tiny_data / "val"), "-o", str(tmp_path / "e.npy")]
    line = error_line(capsys, argv)
    assert line.endswith(f"Permission denied: '{tmp_path / 'e.npy'}'")


def test_a_bug_is_a_traceback_and_a_line_saying_so(run, tiny_data, tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise TypeError("an internal mistake")

    monkeypatch.setattr(distributed_embed, "embed_weights", broken)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["embed", str(run), str(tiny_data / "val"), "-o", str(tmp_path / "e.npy")])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" in err and "TypeError: an internal mistake" in err
    assert err.strip().splitlines()[-1] == (
        "dino-opt embed: internal error: a bug in dino-opt, not in what you gave it; please "
        "report it with the traceback above"
    )
