"""The docs site builds with mkdocs --strict (broken links and missing pages fail)."""

import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_docs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "index.html").exists() and (tmp_path / "troubleshooting" / "index.html").exists()
