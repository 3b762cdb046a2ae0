"""Test-suite-wide settings.

Every kernel the package launches from ``shaders/`` runs under the emulator's sanitizer
(bounds, races, divergent barriers) in the tests: a kernel bug fails CI on Linux even when
the numbers happen to come out right.
"""
import os

os.environ.setdefault("TSM_SANITIZE", "1")


import pytest  # noqa: E402

from torch_sparse_metal import checks  # noqa: E402


@pytest.fixture(autouse=True)
def _forget_device_errors():
    """What one test's kernels flagged, or the patterns it left behind, are not the next
    test's errors (``tsm.check_errors()`` reads process-wide state)."""
    checks.clear()
    yield
    checks.clear()
