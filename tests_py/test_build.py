import shutil

import dino_opt
import torch
from dino_opt import _C


def test_build_info_reports_the_build():
    info = dino_opt.build_info()
    assert info["torch_version_built"] == torch.__version__.split("+")[0]
    assert info["torch_version"] == torch.__version__
    assert info["cxx_compiler"]
    assert info["openmp"], "the core must be compiled with OpenMP (at::parallel_for)"
    assert info["cuda_available"] == torch.cuda.is_available()
    full = ["JPEG", "PNG", "WebP", "BMP", "TIFF"]
    assert info["image_formats"] == (full if _C.other_formats_available() else ["JPEG"])


def test_cuda_sources_are_compiled_when_torch_and_nvcc_allow():
    info = dino_opt.build_info()
    if torch.version.cuda and shutil.which("nvcc"):
        assert info["cuda_compiled"]
        assert {80, 90} <= set(info["cuda_archs"])
    if not info["cuda_compiled"]:
        assert info["cuda_archs"] == []


def test_operator_is_registered():
    assert hasattr(torch.ops.dino_opt, "ema_update_")
    schema = str(torch.ops.dino_opt.ema_update_.default._schema)
    assert schema.startswith("dino_opt::ema_update_(Tensor(a!)[] teacher, Tensor[] student")
