"""Reading the project's kernels from ``shaders/``."""
from __future__ import annotations

import functools
import re
from pathlib import Path

from ._paths import SHADERS_DIR

_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$')
_PRAGMA_ONCE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+once\b")


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
    self-contained string; system includes (``<metal_stdlib>``) stay as they are. ``#line``
    markers keep every line's file and number (paths relative to ``shaders/``), so Apple's
    compiler reports errors where they are, as the emulator does.
    """
    return _flatten(shader_path(name), seen=set())


def _display_name(path: Path) -> str:
    try:
        return path.relative_to(SHADERS_DIR.resolve()).as_posix()
    except ValueError:
        return path.name


def _flatten(path: Path, seen: set) -> str:
    path = path.resolve()
    if path in seen:  # include guards would make a second copy empty anyway
        return ""
    seen.add(path)
    name = _display_name(path)
    out = [f'#line 1 "{name}"\n']
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        include = _QUOTED_INCLUDE.match(line)
        if include:
            out.append(_flatten(path.parent / include.group(1), seen))
            out.append(f'#line {number + 1} "{name}"\n')
        elif _PRAGMA_ONCE.match(line):
            out.append("\n")  # `seen` includes each file once; in one string it would warn
        else:
            out.append(line + "\n")
    return "".join(out)
