"""The Metal emulator: real Metal Shading Language kernels, run on CPU tensors.

Its public API is this module's ``__all__`` (documented in docs/emulator.md): compile a
source or a file, launch its kernels, record the launches and their counters, sanitize,
and the errors. The rest of the package uses nothing else of it; what both backends share
(the bind-time checks, the launch records, the errors) lives beside the launch contract
(``torch_sparse_metal._binding``, ``_record``, ``errors``). From a shell:
``python -m torch_sparse_metal.emulator check|run`` (``__main__``).

``compile_shader(source)`` has the call shape of ``torch.mps.compile_shader``::

    lib = compile_shader(src)
    lib.my_kernel(out, x, 3.0, threads=n, group_size=256)

Tensors bind to ``[[buffer(i)]]`` in argument order; Python numbers are converted to the
parameter's declared type; ``threads`` is the grid in threads (dispatchThreads semantics:
edge threadgroups are smaller); ``threadgroup_memory`` gives the byte length of each
``[[threadgroup(n)]]`` parameter. docs/emulator.md lists the semantics reproduced.

``compile_shader(src, sanitize=True)`` builds a checked variant: out-of-bounds accesses,
races and divergent barriers raise :class:`KernelFault` with ``kind`` naming the fault.
``TSM_SANITIZE=1`` in the environment sanitizes every kernel the package itself launches
(the test suite sets it).

The translator, from MSL to the C++ the emulator builds, is passes in one direction. Each
module's docstring names its layer; a module imports only modules of its own layer or of
layers before it, and no module imports itself through others (tests/test_import_layers.py
checks both, imports inside functions included). The layers, bottom first:

* base: the exceptions every layer raises (torch_sparse_metal.errors, shared with the Metal
  backend, outside this package).
* parse: the source read, as text (_msl_text) and as clang's AST (_clang; _clang_view makes
  the source one clang parses).
* analyse: what the source is, changing nothing: Metal's rules checked (_frontend), which
  conditions and values all threads share (_uniformity), whether rounds may be probed
  (_bounds_probe), where simdgroup matrix products and tensor ops are (_matrix_products,
  _tensor_ops).
* lower: edits that give the emulator's C++ Metal's meaning where C++ reads a form
  differently (_cxx_forms, _designators, _program_constants, _thread_arrays).
* plan: how each kernel's threadgroup runs, chosen once per kernel (_schedule), and the
  group function that runs it as barrier regions (_group_plan reads the kernel for it,
  _regions writes it) or lanes at once (_lanes).
* emit: the edited source rewritten into C++, with its binding table (_rewrite,
  _access_rewrite).
* drive: a shader through the passes (_translation), preprocessed, checked, compiled and
  cached (_compiler, _includes, _function_constants, _cache).
* run: the libraries loaded and their kernels launched (_library, this module; the bind-time
  checks and launch records they use are the launch contract's, outside this package). A
  module whose docstring names no layer is of this one.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from pathlib import Path
from typing import Dict, Mapping, Optional, Sequence, Union

from .. import _record
from .._record import Launch, coalescing_efficiency, lane_efficiency, record
from ..errors import KernelFault, LaunchError, MetalCompileError, UnknownKernelError
from . import _cache, _compiler, _library
from ._clang import DEFAULT_LANGUAGE_VERSION, LANGUAGE_VERSIONS, LAUNCHER_LANGUAGE_VERSIONS
from ._compiler import compile_file, compile_source
from ._cache import cache_dir
from ._compiler import compiler as cxx_compiler
from ._library import DEFAULT_SEGMENT_BYTES, Kernel, Library
from ._textures import Sampler

__all__ = ["compile_shader", "load_shader_file", "record", "instrumented", "sanitize_by_default",
           "coalescing_efficiency", "lane_efficiency", "Launch", "Library",
           "Kernel", "Sampler", "KernelFault", "LaunchError", "MetalCompileError", "UnknownKernelError",
           "LANGUAGE_VERSIONS", "DEFAULT_LANGUAGE_VERSION", "LAUNCHER_LANGUAGE_VERSIONS",
           "DEFAULT_SEGMENT_BYTES", "cxx_compiler", "cache_dir"]

_lock = threading.Lock()
_libraries: Dict[tuple, Library] = {}


def _after_fork_in_child() -> None:
    """A child forked while another thread held one of the emulator's locks (compiling a
    shader, say) would wait for it forever: the child has only the forking thread. (The
    runtime does the same for its dispatch lock.)"""
    global _lock
    _lock = threading.Lock()
    _record._lock = threading.Lock()
    _cache._lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


_instrumented_depth = [0]


def sanitize_by_default() -> bool:
    """Whether the package's kernels run sanitized: ``TSM_SANITIZE=1``, or inside instrumented()."""
    return _instrumented_depth[0] > 0 or \
        os.environ.get("TSM_SANITIZE", "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def instrumented(segment_bytes: int = DEFAULT_SEGMENT_BYTES):
    """Inside the block the package's kernels run in their instrumented (sanitized) build,
    so the launches ``record()`` collects carry ``counters`` (for the benchmarks).

    ``segment_bytes``: the size of the aligned segments in which the counters count device
    memory transactions of every sanitized launch in the block (a power of two, 4 to 4096;
    default 128, the cache line of Apple's GPUs)."""
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) \
            or not 4 <= segment_bytes <= 4096 or segment_bytes & (segment_bytes - 1):
        raise ValueError(f"instrumented: segment_bytes must be a power of two from 4 to 4096, "
                         f"got {segment_bytes!r}")
    with _lock:
        _instrumented_depth[0] += 1
        _library.segment_bytes.append(segment_bytes)
    try:
        yield
    finally:
        with _lock:
            _instrumented_depth[0] -= 1
            stack = _library.segment_bytes  # this block's entry: the last equal to it
            del stack[len(stack) - 1 - stack[::-1].index(segment_bytes)]


def compile_shader(source: str, *, include_dirs: Sequence[str] = (), sanitize: bool = False,
                   language_version: str = DEFAULT_LANGUAGE_VERSION,
                   function_constants: Optional[Mapping[Union[str, int], object]] = None) -> Library:
    """Compile MSL ``source`` for the emulator (cached by content: no recompilation).

    The source is first checked against Metal's language rules for ``language_version``
    ("3.0", "3.1", "3.2" or "4.0": ``__METAL_VERSION__`` and what that version allows; the
    default is what the Metal launcher picks on the newest macOS): what Apple's compiler
    would reject raises :class:`MetalCompileError` naming the file and line.
    ``sanitize=True``: race-checked variant (each threadgroup one Metal thread at a time, much
    slower; every build checks bounds). ``include_dirs``: where quoted and angle includes resolve, besides the
    package's ``shaders/`` and the emulated ``<metal_*>`` headers; nothing outside them can
    be included (no absolute paths, no ``..`` or symbolic link out of them).
    ``function_constants``: values of ``[[function_constant(n)]]`` constants, by name or by
    index (``{"use_bias": True, 3: 128}``), as ``MTLFunctionConstantValues`` gives them; each
    must match its declared type. A kernel using a constant given no value cannot be launched.

    Security: the emulator compiles the shader as C++ with the system compiler and loads
    the result into this process, so compiling a shader runs it as native code with your
    rights (static initialisers run on loading, kernels on launch), exactly as building a
    ``torch.utils.cpp_extension`` does. Compile only shaders you would run.
    """
    if not isinstance(source, str):
        raise TypeError(f"compile_shader expects the shader source as a str, got {type(source).__name__}")
    constants = dict(function_constants or {})
    # Everything the build depends on: TSM_EMU_REGIONS and TSM_EMU_LANES too, or a library
    # built one way would be handed out for the other.
    key = (source, tuple(str(d) for d in include_dirs), bool(sanitize), language_version,
           tuple(sorted(((type(k).__name__, k), type(v).__name__, repr(v)) for k, v in constants.items())),
           _compiler.regions_enabled(), _compiler.lanes_enabled())
    with _lock:
        if key not in _libraries:
            _libraries[key] = Library(compile_source(source, include_dirs=[Path(d) for d in include_dirs],
                                                     sanitize=bool(sanitize),
                                                     language_version=language_version,
                                                     function_constants=constants))
        return _libraries[key]


def load_shader_file(name: str, *, sanitize: Optional[bool] = None,
                     language_version: str = DEFAULT_LANGUAGE_VERSION) -> Library:
    """The emulator library of ``shaders/<name>``, the project's own kernels.

    ``sanitize`` defaults to the ``TSM_SANITIZE`` environment variable.
    """
    return _load_shader_file(name, sanitize_by_default() if sanitize is None else bool(sanitize),
                             language_version)


@functools.lru_cache(maxsize=None)
def _load_shader_file(name: str, sanitize: bool, language_version: str) -> Library:
    from .._shaders import shader_path
    return Library(compile_file(shader_path(name), sanitize=sanitize, language_version=language_version))
