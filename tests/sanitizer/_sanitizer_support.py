"""Helpers shared by the sanitizer tests: naming threads as the sanitizer's messages do, and
building one library out of several kernel files."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Tuple, Union

from torch_sparse_metal.emulator import compile_shader


KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"





Dim = Union[int, Tuple[int, ...]]


def _xyz(v: Dim) -> Tuple[int, int, int]:
    v = (v,) if isinstance(v, int) else tuple(v)
    return tuple(v) + (0,) * (3 - len(v))  # type: ignore[return-value]


def thread(position: Dim, index: int, group: Dim) -> str:
    """How a sanitizer message names a thread: its grid position, its index in its
    threadgroup and the threadgroup's position."""
    p, g = _xyz(position), _xyz(group)
    return f"thread {p} (index {index} in threadgroup {g})"


def line_of(path: Path, needle: str, occurrence: int = 1) -> int:
    """1-based line of the `occurrence`-th line of `path` containing `needle`."""
    seen = 0
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        if needle in text:
            seen += 1
            if seen == occurrence:
                return number
    raise AssertionError(f"{needle!r} not found {occurrence} time(s) in {path.name}")


def library_of_files(names: Iterable[str], *, sanitize: bool):
    """One library holding the kernels of several files of kernels/ (one compile, not one
    per file); the files are #included, so line numbers in reports are the files' own."""
    source = "".join(f'#include "{name}"\n' for name in sorted(names))
    return compile_shader(source, include_dirs=[str(KERNELS_DIR)], sanitize=sanitize)
