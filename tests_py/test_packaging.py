"""How dino_opt installs: the torch a build compiles against is found past
pip's build isolation and pinned in the metadata, and without any torch
`pip install` stops before CMake with one line giving the command to run.
(`make wheel-smoke` and `make cpp-example` test the wheel and the C++
package themselves.)"""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TORCH_PIN = ROOT / "build_support" / "torch_pin.py"
sys.path.insert(0, str(TORCH_PIN.parent))
import torch_pin  # noqa: E402 - build_support is not a package

HIDE_SITE = """import sys
sys.path[:] = [p for p in sys.path if "site-packages" not in p and "dist-packages" not in p]
"""


@pytest.mark.parametrize(
    "version,pin",
    [
        ("2.14.1+cu130", "torch==2.14.*"),
        ("2.11.0", "torch==2.11.*"),
        ("3.0.0a0+git1", "torch==3.0.*"),
    ],
)
def test_the_pin_is_the_torch_series(version, pin):
    assert torch_pin.torch_requirement(version) == pin


def test_torch_is_found_past_build_isolation(tmp_path):
    """pip's isolation hides the environment's packages with a sitecustomize
    on PYTHONPATH; the query then asks the interpreter without it."""
    (tmp_path / "sitecustomize.py").write_text(HIDE_SITE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    hidden = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True)
    assert hidden.returncode != 0  # the isolation works: torch is not importable as run
    run = subprocess.run(
        [sys.executable, str(TORCH_PIN), "--cmake"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    prefix, cuda = (run.stdout.splitlines() + [""])[:2]
    assert prefix == torch.utils.cmake_prefix_path and cuda == (torch.version.cuda or "")


def test_pip_install_without_torch_stops_with_the_command(tmp_path):
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    run = subprocess.run(
        [python, "-m", "pip", "install", "--disable-pip-version-check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0
    line = next(x for x in out.splitlines() if "compiles against an installed torch" in x)
    assert f"{python} -m pip install torch" in line and "--no-build-isolation" in line
    assert "CMake" not in out  # it stopped at the metadata, before configuring anything
