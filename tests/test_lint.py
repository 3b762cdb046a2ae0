"""The code passes ruff with the project's configuration (pyproject.toml): CI lints through the
test suite, so the README's test command is still the one command CI runs."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed: `pip install -r requirements.txt` installs it")
    done = subprocess.run([ruff, "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
