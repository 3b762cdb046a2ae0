"""Reading the project's kernels from ``shaders/``."""
from __future__ import annotations

import functools
import re
from pathlib import Path

from ._paths import SHADERS_DIR

_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)


def shader_path(name: str) -> Path:
    """``shaders/<name>``; a name leading out of ``shaders/`` names no shader."""
    path = SHADERS_DIR / name
    inside = SHADERS_DIR.resolve() in path.resolve().parents
    if not inside or not path.is_file():
        raise FileNotFoundError(f"no shader {name!r} in {SHADERS_DIR}")
    return path


@functools.lru_cache(maxsize=None)
def shader_source(name: str) -> str:
    """The source of ``shaders/<name>`` with its quoted ``#include``s inlined.

    Metal's ``newLibraryWithSource:`` has no include path, so the Metal launcher gets one
    self-contained string; system includes (``<metal_stdlib>``) stay as they are.
    """
    return _flatten(shader_path(name), seen=set())


def _flatten(path: Path, seen: set) -> str:
    if path in seen:  # include guards would make a second copy empty anyway
        return ""
    seen.add(path)

    def expand(match: re.Match) -> str:
        return _flatten((path.parent / match.group(1)).resolve(), seen)

    return _QUOTED_INCLUDE.sub(expand, path.read_text())
