"""Training curves from metrics rows: CPU and GPU memory keys, missing keys,
a single row, and metrics.jsonl files."""

import json
import math

import pytest
from dino_opt.observe import plot_training_curves, read_metrics

PNG = b"\x89PNG\r\n\x1a\n"


def _row(step, **extra):
    row = {
        "step": step,
        "epoch": 0,
        "loss": 5.0 / step,
        "lr": 1e-4 * step,
        "weight_decay": 0.04,
        "momentum": 0.996 + 1e-4 * step,
        "images_per_second": 100.0 + step,
    }
    row.update(extra)
    return row


def _png(path):
    assert path.read_bytes()[:8] == PNG
    return path


def test_one_row(tmp_path):
    out = plot_training_curves([_row(1, host_rss_gb=1.2)], tmp_path / "one.png")
    assert out == tmp_path / "one.png"
    _png(out)


def test_cpu_memory_keys(tmp_path):
    rows = [
        _row(s, host_rss_gb=1.0 + s / 100, host_peak_rss_gb=1.1 + s / 100) for s in range(1, 30)
    ]
    _png(plot_training_curves(rows, tmp_path / "sub" / "cpu.png"))  # parent made


def test_gpu_keys_missing_keys_and_bad_values(tmp_path):
    rows = [
        _row(1, gpu_memory_current_gb=2.0, gpu_memory_reserved_gb=3.0, host_rss_gb=1.0),
        {"step": 2, "loss": math.nan, "lr": None},  # no memory, no throughput
        _row(3, gpu_memory_current_gb=2.1, gpu_memory_peak_gb=2.5),
        {"loss": 1.0},  # no step: its position
        "not a row",
    ]
    _png(plot_training_curves(rows, tmp_path / "gpu.png", title="mixed"))


def test_no_rows(tmp_path):
    _png(plot_training_curves([], tmp_path / "empty.png"))


def test_read_metrics(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_row(1)) + "\n\n" + json.dumps(_row(2)) + "\n")
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text(json.dumps(_row(1)) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)
