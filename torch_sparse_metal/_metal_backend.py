"""The ``"metal"`` backend: real Metal kernels on MPS tensors, through the compiled extension.

:func:`torch_sparse_metal._launch.launch` calls :func:`dispatch` here. This module only
validates and converts the arguments and hands them to ``torch_sparse_metal._metal_launcher``
(``csrc/metal/launcher.mm``), which compiles each shader source once, caches its pipelines
and encodes the dispatch on torch's current MPS stream without committing it.

The extension is imported lazily, on the first :func:`dispatch` or
:func:`device_capabilities`, so this module imports on any platform.

Capabilities (:func:`device_capabilities`) are probed once from the device and can be
forced off, as llama.cpp lets one do, to exercise the fallback kernels on capable hardware:

* ``TSM_FORCE_NO_SIMDGROUP_MATRIX=1``: report ``supports_apple7`` as False
  (no ``simdgroup_matrix``);
* ``TSM_FORCE_NO_ATOMIC_FLOAT=1``: report ``supports_metal3`` as False
  (no native ``atomic_float``).

Shaders compile with safe math and precise functions, as the emulator computes and as
torch's own shaders do; ``TSM_METAL_FAST_MATH=1`` (read by the extension when it first
compiles a shader) opts into Metal's fast math.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any, Dict, List, Sequence, Union

import numpy as np
import torch

from ._shaders import shader_source
from .metal._record import as_dim3, record_launch

__all__ = ["MetalUnavailableError", "dispatch", "is_available", "device_capabilities"]

EXTENSION = "torch_sparse_metal._metal_launcher"

UNAVAILABLE_MESSAGE = ("the Metal backend needs macOS with an Apple GPU and the compiled "
                       "extension; on other machines use backend 'emulator' or 'reference'")

FORCE_NO_SIMDGROUP_MATRIX = "TSM_FORCE_NO_SIMDGROUP_MATRIX"
FORCE_NO_ATOMIC_FLOAT = "TSM_FORCE_NO_ATOMIC_FLOAT"

# Metal binds at most 31 buffers; setBytes is meant for data under 4 KB.
_MAX_BUFFER_ARGUMENTS = 31
# NumPy scalar kinds whose bytes a Metal scalar can take: bool, signed, unsigned, float.
_SCALAR_KINDS = "biuf"


class MetalUnavailableError(RuntimeError):
    """The Metal backend cannot run here (not macOS, no Apple GPU, or extension not built)."""


def _extension():
    """The compiled launcher module, or :class:`MetalUnavailableError` with the reason."""
    if sys.platform != "darwin":
        raise MetalUnavailableError(f"{UNAVAILABLE_MESSAGE} (this is {sys.platform!r})")
    try:
        return importlib.import_module(EXTENSION)
    except ImportError as exc:
        raise MetalUnavailableError(
            f"{UNAVAILABLE_MESSAGE} ({EXTENSION} could not be imported: {exc}; build it "
            "with `pip install --no-build-isolation -e .` on the Mac)") from exc


def is_available() -> bool:
    """True on macOS when the extension imports and torch's MPS backend is usable."""
    if sys.platform != "darwin":
        return False
    try:
        _extension()
    except MetalUnavailableError:
        return False
    return bool(torch.backends.mps.is_available())


def _device_info() -> Dict[str, Any]:
    return dict(_extension().device_info())


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def device_capabilities() -> Dict[str, Any]:
    """The Metal device's capabilities, probed once (``device_capabilities.cache_clear()``
    to probe again).

    Keys, from the extension's ``device_info()``: ``name``, ``supports_apple7``
    (``simdgroup_matrix``), ``supports_metal3`` (native ``atomic_float``),
    ``max_threads_per_threadgroup``, ``max_threadgroup_memory`` (bytes),
    ``recommended_max_working_set_size`` (bytes), ``metal_language_version``, ``fast_math``;
    plus ``forced_off``: the capabilities switched off by the ``TSM_FORCE_NO_*``
    environment variables. The returned dict is shared: do not modify it.
    """
    caps = _device_info()
    forced: List[str] = []
    if _env_flag(FORCE_NO_SIMDGROUP_MATRIX):
        caps["supports_apple7"] = False
        forced.append("supports_apple7")
    if _env_flag(FORCE_NO_ATOMIC_FLOAT):
        caps["supports_metal3"] = False
        forced.append("supports_metal3")
    caps["forced_off"] = tuple(forced)
    return caps


def require_native_float_atomics(op: str, hint: str = "") -> None:
    """Raise, naming ``op``, when the GPU lacks Metal 3's ``atomic_float``, which the op's
    kernel uses: checked before the first launch, since such a GPU would otherwise fail to
    compile the shader with a message naming neither the op nor the requirement."""
    caps = device_capabilities()
    if not caps.get("supports_metal3", False):
        raise RuntimeError(f"{op}: this kernel needs native float atomics (Metal 3: Apple "
                           f"silicon on macOS 13 or later); this GPU ({caps.get('name', 'unknown')}) "
                           f"does not report them" + (f". {hint}" if hint else ""))


Arg = Union[torch.Tensor, np.generic]


def _pack(kernel: str, index: int, arg: Arg) -> Union[torch.Tensor, bytes]:
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "mps":
            raise ValueError(f"dispatch({kernel}): argument {index} is on {arg.device}; the "
                             "Metal backend needs tensors on 'mps'")
        if not arg.is_contiguous():
            raise ValueError(f"dispatch({kernel}): argument {index} must be contiguous "
                             f"(shape {tuple(arg.shape)}, strides {arg.stride()})")
        return arg
    if isinstance(arg, np.generic):
        kind = arg.dtype.kind
        if kind not in _SCALAR_KINDS:
            raise TypeError(f"dispatch({kernel}): argument {index} is a NumPy {arg.dtype} "
                            "scalar; Metal takes bool, integer or floating scalars")
        if kind == "f" and arg.dtype.itemsize > 4:
            raise TypeError(f"dispatch({kernel}): argument {index} is a NumPy {arg.dtype} "
                            "scalar; Metal has no double (pass np.float32 or np.float16)")
        return bytes(arg.tobytes())
    raise TypeError(f"dispatch({kernel}): argument {index} must be a torch.Tensor or a typed "
                    f"NumPy scalar (np.int32, np.float32, ...), got {type(arg).__name__}")


def dispatch(shader: str, kernel: str, args: Sequence[Arg], *, threads,
             group_size, threadgroup_memory: Sequence[int] = ()) -> None:
    """Encode ``kernel`` of ``shaders/<shader>`` on the current MPS stream.

    ``threads`` is the grid in threads and ``group_size`` the threadgroup (ints or 1-3
    ints; dispatchThreads semantics). ``args[i]`` binds ``[[buffer(i)]]``: contiguous MPS
    tensors at their storage offset, typed NumPy scalars as their bytes.
    ``threadgroup_memory[n]`` is the byte length of ``[[threadgroup(n)]]`` (rounded up to
    16 by the extension). The dispatch is encoded, not committed: torch commits when it
    synchronises. An empty grid encodes nothing.
    """
    ext = _extension()
    threads3 = as_dim3(threads, "threads")
    group3 = as_dim3(group_size, "group_size")
    if any(g < 1 for g in group3):
        raise ValueError(f"dispatch({kernel}): group_size entries must be >= 1, got {group_size!r}")
    tg_memory = [int(n) for n in threadgroup_memory]
    if any(n < 0 for n in tg_memory):
        raise ValueError(f"dispatch({kernel}): threadgroup_memory lengths must be >= 0, "
                         f"got {tg_memory}")
    args = list(args)
    if len(args) > _MAX_BUFFER_ARGUMENTS:
        raise ValueError(f"dispatch({kernel}): {len(args)} arguments; Metal binds at most "
                         f"{_MAX_BUFFER_ARGUMENTS}")
    packed = [_pack(kernel, i, a) for i, a in enumerate(args)]
    record_launch(kernel, threads3, group3, "metal")
    ext.dispatch(shader_source(shader), kernel, packed, threads3, group3, tg_memory)
