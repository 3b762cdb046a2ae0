"""``record()``: the launches made inside a block, for tests that count dispatches."""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

Dim3 = Tuple[int, int, int]


COUNTERS = ("device_bytes_read", "device_bytes_written", "threadgroup_accesses",
            "bank_conflicts", "barriers", "fmas", "atomics")


@dataclass(frozen=True)
class Launch:
    """One kernel dispatch: ``threads`` is the grid in threads, ``group_size`` the threadgroup.

    ``counters`` (emulator, sanitized libraries only; None otherwise), summed over the
    dispatch: ``device_bytes_read`` / ``device_bytes_written`` (what the kernel asked for, no
    cache model; an access that changed memory counts as written), ``threadgroup_accesses``,
    ``bank_conflicts`` (extra cycles: per SIMD-group instruction, a bank serving n distinct
    4-byte words of 32 banks costs n - 1), ``barriers`` (threadgroup barriers completed),
    ``fmas`` (explicit fma/mad calls and simdgroup_matrix products), ``atomics``.
    """
    kernel: str
    threads: Dim3
    group_size: Dim3
    backend: str  # "emulator" or "metal"
    counters: Optional[Dict[str, int]] = None


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


def record_launch(kernel: str, threads: Dim3, group_size: Dim3, backend: str,
                  counters: Optional[Dict[str, int]] = None) -> None:
    if not _active:
        return
    launch = Launch(kernel, tuple(threads), tuple(group_size), backend, counters)
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
