"""Which implementation runs an op: real Metal, the Metal emulator, or plain torch.

``use_backend(name)`` sets the process-wide choice and, used as a context manager,
restores the previous one on exit::

    tsm.use_backend("emulator")          # from now on
    with tsm.use_backend("reference"):   # only inside the block
        ...

``"auto"`` (the default) runs the Metal kernels on MPS tensors and the plain-torch
reference everywhere else. It fails safe: MPS tensors run on the reference, with one
warning saying why, when the Metal launcher is not built, when a kernel an op needs cannot
be built on this GPU (Apple's compiler rejects its shader for that dtype, or its pipeline
cannot be made: that op and dtype only), or when a dispatch fails (that op, from then on).
``"emulator"`` runs the same ``.metal`` kernels on CPU tensors through the emulator;
``"metal"`` insists on the GPU and raises each of those errors.
"""
from __future__ import annotations

import threading
import warnings
from typing import Callable, Dict, Iterable, Optional, Tuple, TypeVar

import torch

# (shader, kernel name) pairs: the kernels an op may launch for the call at hand.
Kernels = Callable[[], Iterable[Tuple[str, str]]]
T = TypeVar("T")

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


def resolve_backend(op: str, tensors: Iterable[torch.Tensor], kernels: Optional[Kernels] = None
                    ) -> str:
    """The concrete backend (``"metal"``, ``"emulator"`` or ``"reference"``) for ``op``.

    All tensors must already be on one device (ops check that first). ``kernels`` lists what
    the call may launch: under ``"auto"`` on MPS each must build on this GPU, or the call
    runs on the reference (one warning per op and kernel).
    """
    tensors = [t for t in tensors if t is not None]
    on_mps = any(t.device.type == "mps" for t in tensors)
    name = _current_name()
    if name == "auto":
        if not on_mps:
            return "reference"
        backend = _auto_for_mps()
        if backend == "metal" and (op in _failed_dispatch or _unbuildable(op, kernels)):
            return "reference"
        return backend
    if name == "metal" and not on_mps:
        raise ValueError(f"{op}: backend 'metal' needs tensors on the 'mps' device, got "
                         f"{tensors[0].device if tensors else 'no tensors'}")
    if name == "emulator" and any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{op}: backend 'emulator' runs on CPU tensors; move the inputs "
                         "to 'cpu' or use backend 'metal'")
    if name == "reference":
        return "reference"
    return name


# What was said once: "launcher", or (op, kernel) and (op, "dispatch") pairs.
_warned_for: set = set()
_warn_lock = threading.Lock()
# op -> the dispatch error after which "auto" runs it on the reference.
_failed_dispatch: Dict[str, str] = {}


def _warn_once(key: object, message: str) -> None:
    with _warn_lock:
        if key in _warned_for:
            return
        _warned_for.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def _unbuildable(op: str, kernels: Optional[Kernels]) -> bool:
    """Whether a kernel of ``kernels`` cannot be built on this GPU; says so once per op and
    kernel, with the compiler's or Metal's message."""
    if kernels is None:
        return False
    from . import _metal_backend
    for shader, kernel in kernels():
        error = _metal_backend.kernel_failure(shader, kernel)
        if error is not None:
            _warn_once((op, kernel), f"torch_sparse_metal: {op} runs on the plain-torch "
                                     f"reference: its kernel {kernel} (shaders/{shader}) "
                                     f"cannot be built on this GPU: {error}")
            return True
    return False


def require_kernel_dtype(op: str, dtype: torch.dtype, backend: str,
                         table: Dict[str, Tuple[torch.dtype, ...]]) -> None:
    """``backend`` has ``op``'s kernels for ``dtype`` (``table``: the op's backend -> dtypes),
    and on Metal a bfloat16 kernel has the MSL 3.1 it needs: ValueError naming ``op``."""
    from ._validation import check_kernel_dtype
    check_kernel_dtype(op, dtype, backend, table=table)
    if backend == "metal" and dtype == torch.bfloat16:
        from ._metal_backend import require_bfloat
        require_bfloat(op)


def kernels_or_reference(op: str, backend: str, on_kernels: Callable[[], T],
                         on_reference: Callable[[], T]) -> T:
    """``on_kernels()`` on a kernel backend, ``on_reference()`` on the reference, and under
    ``"auto"`` the reference also when the Metal dispatch fails: one warning, and the op
    runs on the reference from then on (``"metal"`` raises the error)."""
    if backend == "reference":
        return on_reference()
    if backend != "metal" or _current_name() != "auto":
        return on_kernels()
    from ._metal_backend import MetalDispatchError, MetalPipelineError
    from .emulator import LaunchError, MetalCompileError
    try:
        return on_kernels()
    except (MetalDispatchError, MetalPipelineError, MetalCompileError, LaunchError) as error:
        _failed_dispatch[op] = str(error)
        _warn_once((op, "dispatch"), f"torch_sparse_metal: {op} runs on the plain-torch "
                                     f"reference from now on: a Metal dispatch failed: {error}")
        return on_reference()


def _auto_for_mps() -> str:
    """``"metal"`` when the launcher can run; else ``"reference"``, saying once why."""
    from . import _metal_backend
    reason = _metal_backend.unavailable_reason()
    if reason is None:
        return "metal"
    _warn_once("launcher", f"torch_sparse_metal: MPS tensors run on the plain-torch "
                           f"reference, not the Metal kernels: {reason}")
    return "reference"
