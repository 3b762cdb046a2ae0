"""``record()``: the launches made inside a block, for tests that count dispatches."""
from __future__ import annotations

import contextlib
import operator
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

from .errors import LaunchError

Dim3 = Tuple[int, int, int]


COUNTERS = ("device_bytes_read", "device_bytes_written", "threadgroup_accesses",
            "bank_conflicts", "barriers", "fmas", "atomics",
            "device_instructions", "device_transactions", "device_min_transactions",
            "atomic_instructions", "atomic_conflicts", "memory_instructions", "active_lanes")

SIMD_WIDTH = 32


def coalescing_efficiency(counters: Dict[str, int]) -> float:
    """The minimum device transactions for the bytes each instruction used over the
    transactions it took (1.0 when no device memory was touched)."""
    taken = counters["device_transactions"]
    return counters["device_min_transactions"] / taken if taken else 1.0


def lane_efficiency(counters: Dict[str, int]) -> float:
    """Active lanes per memory instruction over the SIMD width: 1.0 when every memory
    instruction ran on all 32 lanes (1.0 when there was none)."""
    issued = counters["memory_instructions"]
    return counters["active_lanes"] / (SIMD_WIDTH * issued) if issued else 1.0


@dataclass(frozen=True)
class Launch:
    """One kernel dispatch: ``threads`` is the grid in threads, ``group_size`` the threadgroup.

    ``counters`` (emulator, sanitized libraries only, and only for a dispatch that began
    inside a record() block: counting makes a sanitized tiled matmul take about twice as
    long; None otherwise), summed over the dispatch: ``device_bytes_read`` /
    ``device_bytes_written`` (what the kernel asked for, no cache model; an access that
    changed memory counts as written), ``threadgroup_accesses``, ``bank_conflicts`` (extra
    cycles: per SIMD-group instruction, a bank serving n distinct 4-byte words of 32 banks
    costs n - 1), ``barriers`` (threadgroup barriers completed), ``fmas`` (explicit fma/mad
    calls and simdgroup_matrix products), ``atomics``; and per SIMD-group instruction (the
    k-th access of each lane at one place in the code between two stops):
    ``device_instructions``, ``device_transactions`` (distinct aligned segments touched,
    loads, stores and atomics) and ``device_min_transactions`` (what the bytes touched would
    need), ``atomic_instructions`` and ``atomic_conflicts`` (lanes on the busiest address
    minus one), ``memory_instructions`` and their ``active_lanes``. See
    :func:`coalescing_efficiency` and :func:`lane_efficiency`.
    """
    kernel: str
    threads: Dim3
    group_size: Dim3
    backend: str  # "emulator" or "metal"
    counters: Optional[Dict[str, int]] = None


# Lists of the record() blocks now open, in any thread. A block is removed by identity:
# two blocks that collected the same launches compare equal.
_lock = threading.Lock()
_active: List[List[Launch]] = []


@contextlib.contextmanager
def record() -> Iterator[List[Launch]]:
    """Yield a list that collects every launch made (by any thread) until the block ends.

    Blocks nest and overlap (in one thread or several): each collects every launch made
    while it is open.
    """
    launches: List[Launch] = []
    with _lock:
        _active.append(launches)
    try:
        yield launches
    finally:
        with _lock:
            _active[:] = [a for a in _active if a is not launches]


def recording() -> bool:
    """Whether a record() block is open: a launch made now is collected."""
    return bool(_active)


def record_launch(kernel: str, threads: Dim3, group_size: Dim3, backend: str,
                  counters: Optional[Dict[str, int]] = None) -> None:
    if not _active:
        return
    launch = Launch(kernel, tuple(threads), tuple(group_size), backend, counters)
    with _lock:
        for launches in _active:
            launches.append(launch)


# Metal's grid and threadgroup positions are 32-bit `uint`s.
MAX_DIMENSION = 2**32 - 1


def as_dim3(value, what: str) -> Dim3:
    """An int or 1-3 ints (NumPy integers too) -> a 3-tuple padded with 1.

    Raises TypeError for anything else, :class:`LaunchError` for a negative entry or one
    past ``2**32 - 1``, which Metal cannot dispatch.
    """
    def as_int(v) -> int:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)

    try:
        try:
            dims = (as_int(value),)
        except TypeError:
            dims = tuple(as_int(v) for v in value)
    except TypeError:
        raise TypeError(f"{what} must be an int or a tuple of 1-3 ints, got {value!r}") from None
    if not 1 <= len(dims) <= 3:
        raise LaunchError(f"{what} must have 1-3 dimensions, got {value!r}")
    if any(d < 0 for d in dims):
        raise LaunchError(f"{what} must not be negative, got {value!r}")
    if any(d > MAX_DIMENSION for d in dims):
        raise LaunchError(f"{what} = {value!r}: each dimension must be at most 2**32 - 1 = "
                          f"{MAX_DIMENSION} (Metal's grid positions are 32-bit)")
    return tuple(dims) + (1,) * (3 - len(dims))
