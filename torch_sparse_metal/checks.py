"""Input checks that need the device's data, kept off the hot path.

A check that reads device data back drains the GPU on MPS (see :mod:`torch_sparse_metal.syncs`),
so the ops' hot paths make none. What they cannot check on the host is checked where it
costs nothing or nothing per step:

* **on the device, by the kernels**: a label outside ``[0, classes)`` (``cross_entropy``) or
  an index-array entry outside its range (``sparse_linear``, after a write torch did not
  see) makes the kernel write NaN where the result would depend on it, so no wrong number
  looks right, and set a bit in a per-device error word; :func:`check_errors` raises it;
* **at the next read the user makes**: :func:`check_errors` also compares every live
  ``SparseLinear`` pattern with the fingerprint taken when it was validated, which catches
  writes that bypassed torch's version counter (``.data``, ``.numpy()``) and still lie in
  range. Call it where the loop synchronises anyway (logging the loss, an epoch's end): it
  costs one read-back for everything;
* **in strict mode** (:class:`check_invariants`, opt-in as
  ``torch.sparse.check_sparse_tensor_invariants`` is): every call checks before its kernel
  runs and raises at once, with one read-back per check (the behaviour of the package
  before the MPS hot path was made sync-free).

Patterns built or replaced through torch (a new tensor, an in-place write torch counts)
are validated in every mode, when they change.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Dict, List, Optional

import torch

__all__ = ["InvalidInputError", "check_errors", "check_invariants"]


class InvalidInputError(ValueError):
    """Invalid data a kernel met on the device, or a pattern written behind torch's back,
    found by :func:`check_errors` after the calls that met it."""


# Bits of the error word; shaders/tsm_common.h (TsmError) names the same.
BAD_LABEL = 1
BAD_PATTERN_INDEX = 2
_ERROR_TEXT = {
    BAD_LABEL: "cross_entropy met a label outside [0, classes) that is not ignore_index: "
               "the loss and its gradient are NaN",
    BAD_PATTERN_INDEX: "sparse_linear met an index-array entry outside its range (a pattern "
                       "written behind torch's back, through .data or .numpy()): the outputs "
                       "and gradients that depend on it are NaN",
}

_lock = threading.Lock()
_error_words: Dict[torch.device, torch.Tensor] = {}
_patterns: "weakref.WeakSet" = weakref.WeakSet()


def error_word(device: torch.device) -> torch.Tensor:
    """The device's error word: one int32 the kernels OR their ``TsmError`` bits into
    (zero until a kernel meets invalid data), created on first use."""
    device = torch.device(device)
    with _lock:
        word = _error_words.get(device)
        if word is None:
            word = _error_words[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return word


def watch_pattern(pattern) -> None:
    """Let :func:`check_errors` compare ``pattern`` (a ``CSRPattern``) with its fingerprint.
    Weakly held: a pattern nobody uses any more is not checked."""
    with _lock:
        _patterns.add(pattern)


def check_errors() -> None:
    """Raise :class:`InvalidInputError` for what the kernels flagged since the last call,
    and for any live ``SparseLinear`` pattern written behind torch's back since it was
    validated; the flags are cleared.

    One read-back per device in use (one host-device synchronisation on MPS): call it
    where the loop synchronises anyway.
    """
    with _lock:
        words = list(_error_words.items())
        patterns = list(_patterns)
    # (what it is, a 0-d int64 on its device): read back together, one copy per device.
    pending = [(("word", w), w.reshape(()).long()) for _, w in words]
    problems: List[str] = []
    for pattern in patterns:
        stale = pattern.contents_changed_on_device()
        if stale is None:   # another layout: seen on the host, no read needed
            problems.append(_stale_text(pattern))
        else:
            pending.append((("pattern", pattern), stale.long()))
    by_device: Dict[torch.device, list] = {}
    for what, value in pending:
        by_device.setdefault(value.device, []).append((what, value))
    word = 0
    for group in by_device.values():
        values = torch.stack([v for _, v in group]).tolist()
        for ((kind, obj), _), value in zip(group, values):
            if kind == "word" and value:
                word |= value
                obj.zero_()
            elif kind == "pattern" and value:
                problems.append(_stale_text(obj))
    problems[:0] = [text for bit, text in _ERROR_TEXT.items() if word & bit]
    if problems:
        raise InvalidInputError("check_errors: " + "; ".join(problems))


def clear() -> None:
    """Forget what the kernels flagged and every pattern watched so far: the next
    :func:`check_errors` sees only what comes after (patterns built after this call)."""
    with _lock:
        for word in _error_words.values():
            word.zero_()
        _patterns.clear()


def _stale_text(pattern) -> str:
    return (f"{pattern!r}: its index arrays were written since it was validated, bypassing "
            "torch's version counter (through .data or .numpy()), so results computed since "
            "may have used a stale transpose; the layer's pattern() validates them again")


def _env_enabled() -> bool:
    return os.environ.get("TSM_CHECK_INVARIANTS", "").strip().lower() in ("1", "true", "yes", "on")


class check_invariants:
    """Strict mode: each call checks the data its kernels depend on before they run
    (labels in range, index arrays unchanged since validation) and raises ``ValueError``
    at once, at the price of a read-back (a GPU sync on MPS) per check.

    As ``torch.sparse.check_sparse_tensor_invariants``: a context manager
    (``with tsm.check_invariants(): ...``), or switched for the process with
    :meth:`enable` / :meth:`disable`; ``TSM_CHECK_INVARIANTS=1`` in the environment turns
    it on from the start. Under ``torch.compile`` the setting in force while tracing is
    the one the graph keeps.
    """

    _enabled = _env_enabled()

    def __init__(self, enable: bool = True) -> None:
        self._state = bool(enable)
        self._saved: Optional[bool] = None

    @staticmethod
    def is_enabled() -> bool:
        return check_invariants._enabled

    @staticmethod
    def enable() -> None:
        check_invariants._enabled = True

    @staticmethod
    def disable() -> None:
        check_invariants._enabled = False

    def __enter__(self) -> "check_invariants":
        self._saved = check_invariants._enabled
        check_invariants._enabled = self._state
        return self

    def __exit__(self, *exc: object) -> None:
        check_invariants._enabled = bool(self._saved)
