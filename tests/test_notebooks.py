"""The notebooks run top to bottom in a real Jupyter kernel, and again with every cell after
the first re-run in the same kernel (a second ``initialize`` included)."""

import pathlib

import pytest

from conftest import REPO


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted(pathlib.Path(REPO, "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs_and_reruns(path):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": REPO}})
    with client.setup_kernel():
        for index, cell in enumerate(notebook.cells):
            client.execute_cell(cell, index)
        for index, cell in enumerate(notebook.cells[2:], start=2):
            client.execute_cell(cell, index)
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", sorted(pathlib.Path(REPO, "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_is_valid_nbformat_4_5(path):
    """Every cell has an id (nbformat 4.5): Jupyter warns about a missing one on every load."""
    import json

    import nbformat

    raw = json.loads(path.read_text())
    assert all("id" in cell for cell in raw["cells"])
    nbformat.validate(nbformat.reads(path.read_text(), as_version=4))
