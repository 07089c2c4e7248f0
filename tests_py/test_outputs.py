"""What a command writes for the user: an existing output refused without
--force; --force never on the source, the working folder or a parent of
either; a writer killed mid-write leaving the old file (or none), never a
torn one; an output's side files replaced with it; the ONNX check failing
the export above its tolerance; outputs checked before the work."""

import json
import os
import signal

import numpy as np
import pytest
from dino_opt.checkpoint import check_output, write_file, write_files, write_folder
from dino_opt.cli import main
from dino_opt.eval.pictures import write_pictures
from dino_opt.weights.export import onnx as onnx_export
from PIL import Image
from tiny import error_line


def _tree(folder) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")}


def test_force_never_replaces_the_source_the_working_folder_or_a_parent(
    run, tmp_path, capsys, monkeypatch
):
    before = _tree(run)
    monkeypatch.chdir(tmp_path)
    cases = [
        (run, "is the source"),
        (run.parent, "holds the source"),
        (tmp_path, "is the working folder"),
        (".", "is the working folder"),
        (tmp_path.parent, "holds the working folder"),
    ]
    for output, says in cases:
        argv = ["export", str(run), "--format", "hf", "--output", str(output), "--force"]
        line = error_line(capsys, argv)
        assert says in line and "refused, nothing removed" in line, line
    assert _tree(run) == before
    # without --force any existing output is refused, naming it
    line = error_line(capsys, ["export", str(run), "--format", "hf", "--output", str(run)])
    assert f"output {str(run)!r} exists" in line and "--force" in line
    assert _tree(run) == before


def test_predict_never_writes_over_its_head(run, tiny_data, tmp_path, capsys):
    head = tmp_path / "head.safetensors"
    head.write_bytes(b"a head")
    argv = ["predict", str(run), str(head), str(tiny_data / "val"), "-o", str(head)]
    assert "exists" in error_line(capsys, argv)
    assert "is the source" in error_line(capsys, [*argv, "--force"])
    assert head.read_bytes() == b"a head"


def _killed_mid_write(path, *, folder: bool = False, sig=signal.SIGKILL) -> None:
    """Forks a writer of ``path`` that has written half of its new bytes
    when it is sent ``sig`` (SIGKILL: dies there; SIGINT: Python's
    KeyboardInterrupt unwinds the writer, which then exits with 3)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        os.close(ready_r)
        # Python's own SIGINT handler even where the test was started with SIGINT
        # ignored (a background job of a shell without job control): else it pauses forever
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def write(f):
            f.write(b"new" * 1000)
            f.flush()
            os.write(ready_w, b"1")
            signal.pause()  # killed here, half way

        try:
            if folder:
                write_folder(path, lambda d: write(open(d / "part", "wb")))  # noqa: SIM115
            else:
                write_file(path, write)
        finally:
            os._exit(3)
    os.close(ready_w)
    assert os.read(ready_r, 1) == b"1"
    os.kill(pid, sig)
    _, status = os.waitpid(pid, 0)
    if sig == signal.SIGKILL:
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    else:
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3
    os.close(ready_r)


def test_a_writer_killed_mid_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "e.npy"
    _killed_mid_write(path)
    assert not path.exists()  # none, never a torn one
    path.write_bytes(b"old")
    _killed_mid_write(path)
    assert path.read_bytes() == b"old"
    folder = tmp_path / "masks"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"old mask")
    _killed_mid_write(folder, folder=True)
    assert _tree(folder) == {"a.png": 8}


def test_a_writer_sent_sigint_leaves_the_old_file_and_no_litter(tmp_path):
    path = tmp_path / "e.npy"
    path.write_bytes(b"old")
    _killed_mid_write(path, sig=signal.SIGINT)
    folder = tmp_path / "masks"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"old mask")
    _killed_mid_write(folder, folder=True, sig=signal.SIGINT)
    assert path.read_bytes() == b"old" and _tree(folder) == {"a.png": 8}
    assert sorted(os.listdir(tmp_path)) == ["e.npy", "masks"]


def test_an_interrupted_writer_leaves_the_old_file_and_no_litter(tmp_path):
    path = tmp_path / "e.csv"
    path.write_bytes(b"old")

    def interrupted(f):
        f.write(b"new")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_file(path, interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_files({path: lambda f: f.write(b"x"), tmp_path / "e.json": interrupted})
    assert path.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["e.csv"]


def test_side_files_are_replaced_with_their_output(run, tiny_data, tmp_path, capsys):
    out = tmp_path / "e.npy"
    embed = ["embed", str(run), str(tiny_data / "val"), "-o", str(out), "--device", "cpu"]
    assert main([*embed, "--patch-maps"]) == 0
    assert (tmp_path / "e.patches.npy").is_file()
    (tmp_path / "e.paths.txt").write_text("an earlier version's names\n")
    line = error_line(capsys, embed)  # an existing output: refused
    assert f"output {str(out)!r} exists" in line
    assert main([*embed, "--force"]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["e.json", "e.mean_patch.npy", "e.npy", "e.paths.json"]
    meta = json.loads((tmp_path / "e.json").read_text())
    assert meta["files"] == ["e.npy", "e.mean_patch.npy", "e.paths.json", "e.json"]
    assert len(json.loads((tmp_path / "e.paths.json").read_text())) == len(np.load(out))
    # a side file alone is an existing output too
    (tmp_path / "f.patches.npy").write_bytes(b"x")
    assert "f.patches.npy' exists" in error_line(
        capsys, [*embed[:-4], "-o", str(tmp_path / "f.npy")]
    )


def test_outputs_are_checked_before_the_work(run, tiny_data, tmp_path, capsys):
    source = [str(run), "--device", "cpu"]
    parquet = ["-o", str(tmp_path / "e.parquet"), "--patch-maps"]
    onnx = ["--format", "onnx", "--output", str(tmp_path / "m.onnx")]
    cases = [
        (["eval", "dense", *source, "--head", str(tmp_path / "h.pt")], "must end in .safetensors"),
        (["embed", *source, str(tiny_data / "val"), *parquet], "Parquet holds the class and mean"),
        (["export", str(run), *onnx, "--data", str(tmp_path / "typo")], "check data"),
    ]
    for argv, says in cases:
        assert says in error_line(capsys, argv)
    assert sorted(os.listdir(tmp_path)) == []


def test_export_refuses_an_existing_output_before_reading_its_source(tmp_path, capsys):
    # the source is not even a checkpoint: the existing output is what is named
    source = tmp_path / "not_a_checkpoint.pt"
    source.write_bytes(b"garbage")
    out = tmp_path / "w.pth"
    out.write_bytes(b"mine")
    line = error_line(capsys, ["export", str(source), "--format", "dino", "--output", str(out)])
    assert f"output {str(out)!r} exists" in line
    assert out.read_bytes() == b"mine"


def test_pictures_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    folder = tmp_path / "pictures"
    images = [np.full((8, 8, 3), v, np.uint8) for v in (10, 200)]
    first = write_pictures(images, ["a", "b"], folder, "pca")
    assert [p.name for p in first] == ["a_pca.png", "b_pca.png"]
    old = first[1].read_bytes()
    saved = Image.Image.save

    def fails_on_b(image, f, **kw):
        if image.getpixel((0, 0))[0] == 99:
            f.write(b"torn")
            raise KeyboardInterrupt
        saved(image, f, **kw)

    monkeypatch.setattr(Image.Image, "save", fails_on_b)
    with pytest.raises(KeyboardInterrupt):
        write_pictures([images[0], np.full((8, 8, 3), 99, np.uint8)], ["a", "b"], folder, "pca")
    assert first[1].read_bytes() == old  # the old picture, not a torn one
    assert sorted(os.listdir(folder)) == ["a_pca.png", "b_pca.png"]  # and no litter


def test_check_output_takes_a_link_for_itself(tmp_path, monkeypatch):
    """Replacing a link replaces the link: a link to the source is no source."""
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "run"
    source.mkdir()
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / "link"
    link.symlink_to(source)
    assert check_output(link, True, (source,)) == link
    with pytest.raises(FileExistsError):
        check_output(link, False, (source,))


def test_an_onnx_export_above_its_tolerance_fails_and_writes_nothing(
    run, tiny_data, tmp_path, capsys, monkeypatch
):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    out = tmp_path / "m.onnx"
    out.write_bytes(b"the previous good export")
    monkeypatch.setattr(onnx_export, "_largest_difference", lambda *a: 0.01)
    argv = ["export", str(run), "--format", "onnx", "--output", str(out), "--force"]
    argv += ["--data", str(tiny_data / "val")]
    line = error_line(capsys, argv)
    assert "differ from PyTorch's by up to 0.01, more than --onnx-tolerance 0.001" in line
    assert out.read_bytes() == b"the previous good export"
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]
    capsys.readouterr()
    assert main([*argv, "--onnx-tolerance", "0.05"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tolerance"] == 0.05 and out.read_bytes()[:4] != b"the "
