"""The build on a machine without the CUDA toolkit (docs/building.md, the
install matrix), configure step only: with a CUDA build of torch and the
toolkit hidden (scripts/no_cuda_toolkit.sh, a mount namespace), CMake gets past
torch's own config and says, in one line, that the CUDA kernels were left out
and how to get them; the same build folder configured again with the toolkit
in place compiles them (installing the toolkit, then reinstalling, is what
that line tells the user to do). `make build-no-cuda-toolkit` builds,
installs and runs such a build."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
HIDE = ROOT / "scripts" / "no_cuda_toolkit.sh"
LINE = "dino_opt: CUDA kernels left out (CPU-only build)"

pytestmark = pytest.mark.skipif(
    torch.version.cuda is None, reason="torch is a CPU build: no CUDA kernels to leave out"
)


@pytest.fixture(scope="module")
def hide():
    """The command prefix that runs a command with the toolkit hidden; the
    test skips where that cannot be done (no unshare, no permission)."""
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")
    probe = subprocess.run(["bash", str(HIDE), "true"], capture_output=True, text=True, timeout=120)
    if probe.returncode == 3:
        pytest.skip(probe.stderr.strip())
    assert probe.returncode == 0, probe.stdout + probe.stderr
    return ["bash", str(HIDE)]


def configure(build: Path, prefix: list[str]) -> str:
    python = f"-DPython_EXECUTABLE={sys.executable}"
    run = subprocess.run(
        [*prefix, "cmake", "-S", str(ROOT), "-B", str(build), python],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    return out


def test_configure_without_the_toolkit_says_so_in_one_line(tmp_path, hide):
    out = configure(tmp_path / "build", hide)
    lines = [line for line in out.splitlines() if LINE in line]
    assert len(lines) == 1, out
    assert f"torch is a CUDA {torch.version.cuda} build" in lines[0]
    assert f"install the CUDA {torch.version.cuda} toolkit" in lines[0]
    assert "dino_opt: CUDA kernels OFF," in out
    # Torch's config skipped its toolkit search: not even its warning.
    assert "CUDA cannot be found" not in out

    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        return  # no toolkit here to install afterwards
    # The toolkit "installed": the same build folder now compiles the kernels.
    again = configure(tmp_path / "build", [])
    assert LINE not in again
    assert "dino_opt: CUDA kernels ON" in again, again[-4000:]
