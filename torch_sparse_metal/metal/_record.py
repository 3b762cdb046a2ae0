"""``record()``: the launches made inside a block, for tests that count dispatches."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, List, Tuple

Dim3 = Tuple[int, int, int]


@dataclass(frozen=True)
class Launch:
    """One kernel dispatch: ``threads`` is the grid in threads, ``group_size`` the threadgroup."""
    kernel: str
    threads: Dim3
    group_size: Dim3
    backend: str  # "emulator" or "metal"


_lock = threading.Lock()
_active: List[List[Launch]] = []


@contextlib.contextmanager
def record() -> Iterator[List[Launch]]:
    """Yield a list that collects every launch made (by any thread) until the block ends."""
    launches: List[Launch] = []
    with _lock:
        _active.append(launches)
    try:
        yield launches
    finally:
        with _lock:
            _active.remove(launches)


def record_launch(kernel: str, threads: Dim3, group_size: Dim3, backend: str) -> None:
    if not _active:
        return
    launch = Launch(kernel, tuple(threads), tuple(group_size), backend)
    with _lock:
        for launches in _active:
            launches.append(launch)


def as_dim3(value, what: str) -> Dim3:
    """``int`` or 1-3 ints -> a 3-tuple padded with 1; rejects zero/negative entries in groups."""
    if isinstance(value, int):
        dims = (value,)
    else:
        try:
            dims = tuple(int(v) for v in value)
        except TypeError:
            raise TypeError(f"{what} must be an int or a tuple of 1-3 ints, got {value!r}") from None
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"{what} must have 1-3 dimensions, got {value!r}")
    if any(d < 0 for d in dims):
        raise ValueError(f"{what} must not be negative, got {value!r}")
    return tuple(dims) + (1,) * (3 - len(dims))
