"""The notebooks run top to bottom in a real Jupyter kernel, and again with every cell after
the first re-run in the same kernel (a second ``initialize`` included)."""

import pathlib

import pytest

from conftest import REPO


NOTEBOOKS = sorted(pathlib.Path(REPO, "notebooks").glob("*.ipynb"))
# zero_on_a_mesh shows the default backend's own objects (a JAX mesh, the states as JAX arrays)
BACKEND_FREE = [p for p in NOTEBOOKS if p.name == "quickstart.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path,backend", [(p, "") for p in NOTEBOOKS] + [(p, "torch_xla") for p in BACKEND_FREE],
                         ids=lambda v: getattr(v, "name", v) or "default")
def test_notebook_runs_and_reruns(path, backend):
    """On the default backend, and the quickstart also with SPMDZERO_BACKEND=torch_xla in the
    kernel's environment: its config names no backend, so it trains there."""
    import os

    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": REPO}})
    env = {**os.environ, "SPMDZERO_BACKEND": backend}
    with client.setup_kernel(env=env):
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        for index, cell in enumerate(notebook.cells[2:], start=2):
            client.execute_cell(cell, index)
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    text = "".join(o.get("text", "") for c in notebook.cells if c.cell_type == "code" for o in c.outputs)
    if path.name == "quickstart.ipynb":  # the same training on either backend
        assert "global steps 20, loss 0.3892 -> 0.0392" in text and "5.50 bytes/param on each device" in text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_valid_nbformat_4_5(path):
    """Every cell has an id (nbformat 4.5): Jupyter warns about a missing one on every load."""
    import json

    import nbformat

    raw = json.loads(path.read_text())
    assert all("id" in cell for cell in raw["cells"])
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))
