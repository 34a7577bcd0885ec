"""notebooks/quickstart.ipynb runs top to bottom (in its own kernel, with its own local Ray)."""

import pytest

from conftest import REPO

pytestmark = pytest.mark.integration


def test_quickstart_notebook_executes():
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    outputs = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "tiny 2 2" in outputs
    assert "answer tokens: 下雨了。<|eos|>" in outputs
    assert "run notebook: 8 steps" in outputs
    assert outputs.count("train/loss by step:") == 1
    assert "plotted: ['notebook train/loss', 'notebook train/lr', 'notebook train/tokens_per_s_per_worker', " \
           "'notebook val/loss']" in outputs
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the plot, shown in the notebook
