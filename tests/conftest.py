"""Test-suite-wide settings.

Every kernel the package launches from ``shaders/`` runs under the emulator's sanitizer
(bounds, races, divergent barriers) in the tests: a kernel bug fails CI on Linux even when
the numbers happen to come out right.
"""
import os

os.environ.setdefault("TSM_SANITIZE", "1")
