"""The Metal emulator: real Metal Shading Language kernels, run on CPU tensors.

``compile_shader(source)`` has the call shape of ``torch.mps.compile_shader``::

    lib = compile_shader(src)
    lib.my_kernel(out, x, 3.0, threads=n, group_size=256)

Tensors bind to ``[[buffer(i)]]`` in argument order; Python numbers are converted to the
parameter's declared type; ``threads`` is the grid in threads (dispatchThreads semantics:
edge threadgroups are smaller); ``threadgroup_memory`` gives the byte length of each
``[[threadgroup(n)]]`` parameter. See the README for the semantics reproduced.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Dict, Sequence, Tuple

from ._compiler import compile_file, compile_source
from ._errors import KernelFault, LaunchError, MetalCompileError
from ._library import Kernel, Library
from ._record import Launch, record

__all__ = ["compile_shader", "load_shader_file", "record", "Launch", "Library", "Kernel",
           "KernelFault", "LaunchError", "MetalCompileError"]

_lock = threading.Lock()
_libraries: Dict[Tuple[str, Tuple[str, ...]], Library] = {}


def compile_shader(source: str, *, include_dirs: Sequence[str] = ()) -> Library:
    """Compile MSL ``source`` for the emulator (cached by content: no recompilation)."""
    if not isinstance(source, str):
        raise TypeError(f"compile_shader expects the shader source as a str, got {type(source).__name__}")
    key = (source, tuple(str(d) for d in include_dirs))
    with _lock:
        if key not in _libraries:
            _libraries[key] = Library(compile_source(source, include_dirs=[Path(d) for d in include_dirs]))
        return _libraries[key]


@functools.lru_cache(maxsize=None)
def load_shader_file(name: str) -> Library:
    """The emulator library of ``shaders/<name>``, the project's own kernels."""
    from .._shaders import shader_path
    return Library(compile_file(shader_path(name)))
