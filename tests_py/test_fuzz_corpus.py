"""scripts/fuzz_corpus.py: the native mode's seeds are what they say, so
that the fuzz run starts from images the loader reads at their depth and
channel count (and from the refusals it must name)."""

import sys
from pathlib import Path

import numpy as np
import pytest
from dino_opt import _C

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import fuzz_corpus  # noqa: E402


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_png_and_tiff_seeds_decode_to_their_arrays(channels, dtype):
    rng = np.random.default_rng()
    a = rng.integers(0, np.iinfo(dtype).max, (5, 7, channels), endpoint=True).astype(dtype)
    assert np.array_equal(_C.decode_raw(fuzz_corpus.png(a)).numpy(), a)
    tiff = fuzz_corpus.tiff(a)
    if channels == 2:  # OpenCV reads TIFFs of 1, 3 or 4 samples per pixel
        with pytest.raises(Exception, match="TIFF with 2 samples per pixel"):
            _C.decode_raw(tiff)
    elif channels == 4 and dtype == np.uint8:  # OpenCV would premultiply the colours
        with pytest.raises(Exception, match="8-bit TIFF with unassociated alpha"):
            _C.decode_raw(tiff)
    else:
        assert np.array_equal(_C.decode_raw(tiff).numpy(), a)


def test_native_seeds_cover_the_layouts_and_the_refusals(tmp_path):
    fuzz_corpus.main(str(tmp_path))
    layouts, refused = set(), 0
    for name, data in fuzz_corpus.raw_images().items():
        assert (tmp_path / f"4-{name}").read_bytes() == b"\x04" + data
        try:
            t = _C.decode_raw(data)
        except Exception:
            refused += 1
            continue
        layouts.add((t.shape[2], str(t.dtype)))
    assert {(1, "torch.uint16"), (4, "torch.uint16"), (13, "torch.float32")} <= layouts
    assert {(1, "torch.uint8"), (2, "torch.uint8"), (3, "torch.uint16")} <= layouts
    assert refused >= 5  # big-endian, Fortran order, cut files, grey TIFFs of 6 channels
