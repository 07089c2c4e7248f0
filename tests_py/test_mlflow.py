"""MLflow as a tracker (logging.mlflow): a tiny run logged to a local file
store and read back with MLflow's own client (its status, the resolved
config as parameters, the metrics by step, the figures, reports, pictures
and exported weights as artifacts); without mlflow, one line."""

import contextlib
import io
import sys

import pytest
from dino_opt.cli import main
from tiny import TINY

mlflow = pytest.importorskip("mlflow")


def _artifacts(client, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, item.path) if item.is_dir else {item.path}
    return found


@pytest.mark.slow
def test_a_run_is_read_back_with_mlflows_client(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    out = tmp_path / "run"
    argv = [
        "train",
        "--output-dir",
        str(out),
        "--quiet",
        f"data.root={tiny_data / 'train'}",
        *TINY,
        "logging.mlflow=true",
        f"logging.mlflow_tracking_uri={uri}",
        "logging.curves=true",
        "eval.pictures=2",
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.get_run((out / "mlflow_id.txt").read_text().strip())
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params = run.data.params
    assert params["model.backbone"] == "vit_tiny" and params["data.batch_size"] == "8"
    assert params["augmentation.global_crop_size"] == "32"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert len(losses) >= 4 and [m.step for m in losses] == sorted(m.step for m in losses)
    assert "report/knn_top1_trained" in run.data.metrics
    files = _artifacts(client, run.info.run_id)
    assert {
        "config.yaml",
        "report.json",
        "metrics.jsonl",
        "figures/training_curves.png",
        "weights/teacher_backbone.safetensors",
    } <= files
    assert any(f.startswith("pictures/") for f in files)


def test_without_mlflow_is_one_line(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    argv = [
        "train",
        "--output-dir",
        str(tmp_path / "run"),
        "--quiet",
        f"data.root={tiny_data / 'train'}",
        *TINY,
        "logging.mlflow=true",
    ]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "dino-opt train: error: logging.mlflow=true needs the mlflow package: "
        "pip install 'dino_opt[mlflow]'"
    )
