"""Where the package's non-Python files live: ``shaders/`` and the emulator's ``csrc/``.

A source checkout (or an editable install) keeps them at the repository root; a built
wheel carries copies under ``torch_sparse_metal/_data`` (see ``setup.py``).
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _data_root() -> Path:
    installed = _PACKAGE / "_data"
    if (installed / "shaders").is_dir():
        return installed
    return _PACKAGE.parent


SHADERS_DIR = _data_root() / "shaders"
EMULATOR_DIR = _data_root() / "csrc" / "emulator"
EMULATOR_INCLUDE_DIR = EMULATOR_DIR / "include"
