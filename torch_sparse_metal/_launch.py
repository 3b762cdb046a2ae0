"""The one launcher contract shared by every op.

Op host code validates, allocates and computes the grid once, then calls :func:`launch`;
the backend decides who runs the kernel:

* ``"emulator"``: the kernel's ``.metal`` source compiled for the CPU by
  :mod:`torch_sparse_metal.emulator` (CPU tensors);
* ``"metal"``: the Objective-C++ extension ``torch_sparse_metal._metal_launcher`` that
  encodes into torch's current MPS stream (MPS tensors, macOS only).

Arguments bind to ``[[buffer(i)]]`` in order. Tensors must be contiguous and on the
backend's device. Scalars must be typed NumPy scalars (``np.int32(n)``, ``np.float32(a)``,
...): the Metal side receives their bytes as they are, so the host code, not a guess,
decides their width. The emulator additionally checks that width against the kernel's
declared parameter type, so a wrong scalar type fails in CI on Linux. A small table of
host values (a C-contiguous NumPy array of at most 4 KB, for a ``constant T*``
parameter) is passed by value too, as the bytes of the dispatch: on Metal with
``setBytes``, which copies them when the dispatch is encoded, so nothing waits for the
GPU and the array need not outlive the call.
"""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np
import torch

from . import emulator as _emulator

Arg = Union[torch.Tensor, np.generic, np.ndarray]
Dims = Union[int, Sequence[int]]


def launch(shader: str, kernel: str, args: Sequence[Arg], *, threads: Dims,
           group_size: Dims, threadgroup_memory: Sequence[int] = (), backend: str) -> None:
    """Dispatch ``kernel`` of ``shaders/<shader>`` over ``threads`` (dispatchThreads semantics).

    ``threadgroup_memory[n]`` is the byte length of the ``[[threadgroup(n)]]`` parameter.
    """
    for a in args:
        if not isinstance(a, (torch.Tensor, np.generic, np.ndarray)):
            raise TypeError(f"launch({kernel}): scalar arguments must be typed NumPy scalars "
                            f"(np.int32, np.float32, ...) or small NumPy arrays, got "
                            f"{type(a).__name__}")
    if backend == "emulator":
        library = _emulator.load_shader_file(shader)
        getattr(library, kernel)(*args, threads=threads, group_size=group_size,
                                 threadgroup_memory=list(threadgroup_memory))
    elif backend == "metal":
        from . import _metal_backend
        _metal_backend.dispatch(shader, kernel, args, threads=threads, group_size=group_size,
                                threadgroup_memory=list(threadgroup_memory))
    else:
        raise ValueError(f"launch({kernel}): backend {backend!r} runs no kernels")


def max_threads_per_group(shader: str, kernel: str, backend: str) -> int:
    """The most threads a threadgroup of ``kernel`` may have: on Metal the pipeline's
    ``maxTotalThreadsPerThreadgroup`` (register use can put it below 1024), on the
    emulator Metal's limit of 1024. Ops with threadgroups that large size them from this."""
    if backend == "emulator":
        return _emulator.load_shader_file(shader)[kernel].max_total_threads_per_threadgroup
    if backend == "metal":
        from . import _metal_backend
        return _metal_backend.kernel_info(shader, kernel).max_total_threads_per_threadgroup
    raise ValueError(f"max_threads_per_group({kernel}): backend {backend!r} runs no kernels")
