"""The notebooks run top to bottom in a real Jupyter kernel, and again with every cell after
the first re-run in the same kernel (a second ``initialize`` included)."""

import pathlib

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


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
