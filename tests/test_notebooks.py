"""Notebooks run top to bottom, and again with every cell after the imports re-run."""

import json
import pathlib

import pytest

from conftest import REPO, run_python

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", sorted(pathlib.Path(REPO, "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_runs_and_reruns(path):
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    program = "\n".join(cells) + "\nprint('--- re-run ---')\n" + "\n".join(cells[1:])
    out = run_python(program)
    assert out.count("global steps") == 2 and "--- re-run ---" in out
