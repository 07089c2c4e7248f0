"""``dino-opt prepare --format dicom`` (dino_opt.data.dicom) on a folder the
test writes with pydicom: rescale slope and intercept applied, a MONOCHROME1
image inverted, a multi-frame file split, a broken file, compressed pixels
no decoder reads and a file that is not DICOM named and counted; the values
equal pydicom's pixel_array after its rescale; a window maps onto a 16-bit
PNG; the result reads natively."""

import json

import numpy as np
import pytest
import torch
from dino_opt import _C
from dino_opt.cli import main
from dino_opt.data import MultiCropLoader, open_source
from dino_opt.data.dicom import parse_window, prepare_dicom

# An optional dependency (`pip install dino_opt[dicom]`): the GPU machine has none.
pydicom = pytest.importorskip("pydicom")
dicom_dataset = pytest.importorskip("pydicom.dataset")
dicom_encaps = pytest.importorskip("pydicom.encaps")
dicom_pixels = pytest.importorskip("pydicom.pixels")
dicom_uid = pytest.importorskip("pydicom.uid")


def write_dicom(
    path, pixels, photometric="MONOCHROME2", bits=16, slope=None, intercept=None, window=None
):
    meta = dicom_dataset.FileMetaDataset()
    meta.MediaStorageSOPClassUID = dicom_uid.CTImageStorage
    meta.MediaStorageSOPInstanceUID = dicom_uid.generate_uid()
    meta.TransferSyntaxUID = dicom_uid.ExplicitVRLittleEndian
    ds = dicom_dataset.FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = dicom_uid.CTImageStorage
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    ds.set_pixel_data(pixels, photometric, bits)
    if pixels.ndim == 3:
        ds.NumberOfFrames = pixels.shape[0]
    if slope is not None:
        ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    ds.save_as(path, enforce_file_format=True)
    return path


@pytest.fixture
def dicom_folder(tmp_path):
    rng = np.random.default_rng()
    root = tmp_path / "dicom"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    ct = rng.integers(0, 4096, (40, 48), dtype=np.uint16)
    write_dicom(root / "a" / "ct.dcm", ct, slope=2, intercept=-1024, window=(40, 400))
    mono1 = rng.integers(0, 4096, (40, 48), dtype=np.uint16)
    write_dicom(root / "b" / "1.2.840.5", mono1, photometric="MONOCHROME1", bits=12)
    frames = rng.integers(0, 1000, (3, 40, 48), dtype=np.uint16)
    write_dicom(root / "b" / "multi.dcm", frames, slope=0.5, intercept=3)
    broken = (root / "a" / "ct.dcm").read_bytes()
    (root / "a" / "broken.dcm").write_bytes(broken[: len(broken) // 2])
    (root / "b" / "notes.txt").write_text("not an image")
    # Compressed pixel data no decoder reads (JPEG 2000 of garbage).
    j2k = write_dicom(root / "b" / "j2k.dcm", ct)
    ds = pydicom.dcmread(j2k)
    ds.file_meta.TransferSyntaxUID = dicom_uid.JPEG2000Lossless
    ds.PixelData = dicom_encaps.encapsulate([b"\xff\x4f\xff\x51garbage"])
    ds["PixelData"].VR = "OB"
    ds.save_as(j2k)
    return root, ct, mono1, frames


def test_prepared_values_are_pydicoms_after_rescale(dicom_folder, tmp_path):
    root, ct, mono1, frames = dicom_folder
    out = tmp_path / "out"
    r = prepare_dicom(root, out, progress=False, num_threads=2)
    assert r["files"] == 3 and r["written"] == 5
    assert len(r["failed"]) == 3
    for name in ("broken.dcm", "notes.txt", "j2k.dcm"):
        (line,) = [f for f in r["failed"] if name in f]
        assert "\n" not in line
    ds = pydicom.dcmread(root / "a" / "ct.dcm")
    want = dicom_pixels.apply_rescale(ds.pixel_array, ds).astype(np.float32)
    assert np.array_equal(np.load(out / "a" / "ct.npy"), want)
    np.testing.assert_array_equal(want, ct.astype(np.float32) * 2 - 1024)
    # MONOCHROME1: inverted within its 12 stored bits, so that higher is brighter.
    got = np.load(out / "b" / "1.2.840.5.npy")
    assert np.array_equal(got, (4095 - mono1).astype(np.float32))
    for i in range(3):
        got = np.load(out / "b" / f"multi_f{i:04d}.npy")
        assert np.array_equal(got, (frames[i] * 0.5 + 3).astype(np.float32))
    stats = json.loads((out / "channel_stats.json").read_text())
    assert stats["channels"] == 1 and stats["dtype"] == "float32"
    assert stats["failed"] == 3 and stats["window"] is None
    # The loader reads what was written, with the recorded statistics.
    sizes = dict(global_size=16, local_size=8, n_local=1)
    with MultiCropLoader(out, 5, image_mode="native", **sizes) as loader:
        assert loader.mean == pytest.approx(stats["mean"]) and loader.layout.channels == 1
        assert next(iter(loader)).crops[0].shape == (5, 1, 16, 16)


def test_a_window_maps_onto_16_bit_png(dicom_folder, tmp_path):
    root, ct, _, _ = dicom_folder
    out = tmp_path / "png"
    args = ["--format", "dicom", "--window", "40,400", "--dicom-output", "png", "--quiet"]
    rc = main(["prepare", str(root / "a"), str(out), *args])
    assert rc == 1  # broken.dcm failed; ct.dcm written
    hu = ct.astype(np.float64) * 2 - 1024
    want = np.round(np.clip((hu - (40 - 200)) / 400, 0, 1).astype(np.float32) * 65535)
    got = _C.decode_raw((out / "ct.png").read_bytes())
    assert got.dtype == torch.uint16
    assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16)[..., 0], want)
    assert len(open_source(out)) == 1


def test_bad_arguments_are_one_line(dicom_folder, tmp_path, capsys):
    root, *_ = dicom_folder
    with pytest.raises(ValueError, match="--window must be none, file or CENTER,WIDTH"):
        parse_window("wide")
    with pytest.raises(ValueError, match="width must be > 0"):
        parse_window("40,0")
    with pytest.raises(ValueError, match="16-bit PNG holds"):
        prepare_dicom(root, tmp_path / "x", output="png")
    missing = tmp_path / "nowhere"
    with pytest.raises(SystemExit) as info:
        main(["prepare", str(missing), str(tmp_path / "y"), "--format", "dicom"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and len(err.strip().splitlines()) == 1
