"""Every notebook in notebooks/ runs top to bottom (nbclient), on the CPU in
small sizes, and is the one scripts/make_notebooks.py writes."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's scratch folders go with tmp_path
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError naming the cell on any error
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]


def test_notebooks_are_generated_from_the_script(tmp_path):
    assert NOTEBOOKS, "no notebooks"
    script = (ROOT / "scripts" / "make_notebooks.py").read_text()
    for path in NOTEBOOKS:
        assert path.name in script, f"{path.name} is not written by scripts/make_notebooks.py"
    before = {p: p.read_text() for p in NOTEBOOKS}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_notebooks.py")], check=True)
    for p, text in before.items():
        assert p.read_text() == text, f"{p.name} differs from what the script writes"
