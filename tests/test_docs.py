"""The docs say what the code does."""

import pathlib
import re

import pytest

from spmdzero.config.keys import NOOP_KEYS, REFUSED_KEYS, ZERO3_REASON

from conftest import REPO, run_python


def test_every_classified_key_is_in_its_docs_table():
    text = pathlib.Path(REPO, "docs", "config.md").read_text()
    noops = text.split("## No-ops under GSPMD", 1)[1].split("## Refused", 1)[0]
    refused = text.split("## Refused", 1)[1]
    for key in NOOP_KEYS:
        assert f"`{key}`" in noops, key
    for key in REFUSED_KEYS:
        assert f"`{key}`" in refused, key
    assert "ZeRO-3 only" in noops and ZERO3_REASON.startswith("ZeRO-3 only")


def test_readme_test_command_is_what_ci_runs():
    readme = pathlib.Path(REPO, "README.md").read_text()
    ci = pathlib.Path(REPO, ".ci", "run").read_text()
    assert "make test" in readme and re.search(r"^make test$", ci, re.M)


@pytest.mark.slow
def test_readme_quickstart_runs():
    readme = pathlib.Path(REPO, "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1]
    code = re.search(r"```python\n(.*?)```", quickstart, re.S).group(1)
    out = run_python(code, "print('steps', engine.global_steps)")
    assert "steps 16" in out  # 1024 samples / 64 per optimizer step
