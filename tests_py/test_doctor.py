"""``dino-opt doctor``: the report, a self-check that passes on a sound
install and fails (exit 1, naming the operator) when an operator is wrong."""

import subprocess
import sys

import pytest
import torch
from dino_opt import doctor
from dino_opt.cli import main as cli_main


def test_the_command_reports_and_passes_on_this_machine():
    out = subprocess.run(
        [sys.executable, "-m", "dino_opt.cli", "doctor", "--seed", "3"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for what in ("torch", "torch CUDA", "NVIDIA driver", "device", "kernels", "cpu", "cuda"):
        assert what in text
    for op in (
        "dino_loss fwd+bwd float32",
        "dino_loss fwd+bwd bfloat16",
        "ema_update_",
        "ibot_loss fwd+bwd float32",
        "ibot_loss fwd+bwd bfloat16",
        "gram_loss fwd+bwd float32",
        "multicrop_photometric",
    ):
        assert f"ok   {op}" in text
    assert "8 passed, 0 failed" in text


def test_the_cli_subcommand_on_a_device_named(capsys):
    assert cli_main(["doctor", "--device", "cpu"]) == 0
    assert "self-check on cpu" in capsys.readouterr().out


def test_a_wrong_operator_fails_with_exit_1(monkeypatch, capsys):
    # The reference is right and the fused operator wrong: simulated by a
    # reference that is off by a factor in the loss's gradient.
    real = doctor.dino_loss_backward_torch
    monkeypatch.setattr(doctor, "dino_loss_backward_torch", lambda *a: real(*a) * 1.01)
    assert cli_main(["doctor", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL dino_loss fwd+bwd float32" in out
    assert "ok   ema_update_" in out
    assert "failed" in out.splitlines()[-1] and not out.splitlines()[-1].startswith("8 passed")


def test_a_wrong_ibot_operator_fails_with_exit_1(monkeypatch, capsys):
    real = doctor.ibot_loss_torch
    monkeypatch.setattr(doctor, "ibot_loss_torch", lambda *a: (real(*a)[0] * 1.01, real(*a)[1]))
    assert cli_main(["doctor", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL ibot_loss fwd+bwd float32" in out and "ok   dino_loss fwd+bwd float32" in out


def test_a_wrong_gram_operator_fails_with_exit_1(monkeypatch, capsys):
    real = doctor.gram_loss_backward_torch
    monkeypatch.setattr(doctor, "gram_loss_backward_torch", lambda *a: real(*a) * 1.001)
    assert cli_main(["doctor", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL gram_loss fwd+bwd float32" in out and "ok   ibot_loss fwd+bwd float32" in out


def test_a_nan_counts_as_a_failure():
    check = doctor.Check("x", float("nan"), 1e-5, 0.0, "plain torch")
    assert not check.ok and check.line().startswith("FAIL")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_kernels_pass_the_self_check():
    checks = doctor.run_checks(torch.device("cuda"), seed=1)
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
