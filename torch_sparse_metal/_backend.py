"""Which implementation runs an op: real Metal, the Metal emulator, or plain torch.

``use_backend(name)`` sets the process-wide choice and, used as a context manager,
restores the previous one on exit::

    tsm.use_backend("emulator")          # from now on
    with tsm.use_backend("reference"):   # only inside the block
        ...

``"auto"`` (the default) runs the Metal kernels on MPS tensors and the plain-torch
reference everywhere else (also for MPS tensors when the Metal launcher is not built,
with one warning saying how to build it). ``"emulator"`` runs the same ``.metal`` kernels
on CPU tensors through the emulator; ``"metal"`` insists on the GPU and fails clearly off
a Mac.
"""
from __future__ import annotations

import threading
import warnings
from typing import Iterable

import torch

BACKENDS = ("auto", "metal", "emulator", "reference")

# Process-wide on purpose: autograd runs backward on its own threads, and ops record the
# backend they resolved in forward so backward never depends on this value.
_current = ["auto"]


def _current_name() -> str:
    return _current[0]


class use_backend:
    """Select the backend; works as a plain call and as a context manager."""

    def __init__(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"use_backend: unknown backend {name!r}; expected one of {BACKENDS}")
        self._previous = _current_name()
        self.name = name
        _current[0] = name

    def __enter__(self) -> "use_backend":
        return self

    def __exit__(self, *exc: object) -> None:
        _current[0] = self._previous

    def __repr__(self) -> str:
        return f"use_backend({self.name!r})"


def get_backend() -> str:
    """The backend name in force (``"auto"`` unless changed)."""
    return _current_name()


def resolve_backend(op: str, tensors: Iterable[torch.Tensor]) -> str:
    """The concrete backend (``"metal"``, ``"emulator"`` or ``"reference"``) for ``op``.

    All tensors must already be on one device (ops check that first).
    """
    tensors = [t for t in tensors if t is not None]
    on_mps = any(t.device.type == "mps" for t in tensors)
    name = _current_name()
    if name == "auto":
        return _auto_for_mps() if on_mps else "reference"
    if name == "metal" and not on_mps:
        raise ValueError(f"{op}: backend 'metal' needs tensors on the 'mps' device, got "
                         f"{tensors[0].device if tensors else 'no tensors'}")
    if name == "emulator" and any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{op}: backend 'emulator' runs on CPU tensors; move the inputs "
                         "to 'cpu' or use backend 'metal'")
    if name == "reference":
        return "reference"
    return name


_warned = threading.Event()


def _auto_for_mps() -> str:
    """``"metal"`` when the launcher can run; else ``"reference"``, saying once why."""
    from . import _metal_backend
    reason = _metal_backend.unavailable_reason()
    if reason is None:
        return "metal"
    if not _warned.is_set():
        _warned.set()
        warnings.warn(f"torch_sparse_metal: MPS tensors run on the plain-torch reference, not "
                      f"the Metal kernels: {reason}", RuntimeWarning, stacklevel=4)
    return "reference"
