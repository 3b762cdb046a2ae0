"""The ``"metal"`` backend: real Metal kernels on MPS tensors, through the compiled extension.

:func:`torch_sparse_metal._launch.launch` calls :func:`dispatch` here. This module checks
and converts the arguments and hands them to ``torch_sparse_metal._metal_launcher``
(``csrc/metal/launcher.mm``), which compiles each shader source once, caches its pipelines
and encodes the dispatch on torch's current MPS stream without committing it.

Bind-time checks use the pipeline's reflection (:func:`kernel_info`, cached per kernel)
and the emulator's own checks (:mod:`torch_sparse_metal._binding`), so a bad launch
raises the same :class:`~torch_sparse_metal.emulator.LaunchError`, with the same message, on
both backends; an unknown kernel raises
:class:`~torch_sparse_metal.emulator.UnknownKernelError` and a shader Apple's compiler
rejects :class:`~torch_sparse_metal.emulator.MetalCompileError`, naming the shader file and
line, on both.

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
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch

from ._paths import SHADERS_DIR
from ._shaders import shader_source
from . import _binding
from .errors import MetalCompileError, UnknownKernelError
from ._record import as_dim3, record_launch
from ._binding import P_BUFFER, P_THREADGROUP

__all__ = ["MetalUnavailableError", "MetalPipelineError", "MetalDispatchError", "dispatch",
           "is_available", "unavailable_reason", "device_capabilities", "kernel_info",
           "kernel_failure", "library_source", "PipelineInfo"]

EXTENSION = "torch_sparse_metal._metal_launcher"

UNAVAILABLE_MESSAGE = ("the Metal backend needs macOS 14 or later on Apple silicon and the "
                       "compiled extension; on other machines use backend 'emulator' or "
                       "'reference'")
REBUILD_HINT = ("the extension is built by `pip install --no-build-isolation --no-deps -e .` on "
                "the Mac (Xcode's command-line tools: `xcode-select --install`); that command "
                "prints why the build failed")

FORCE_NO_SIMDGROUP_MATRIX = "TSM_FORCE_NO_SIMDGROUP_MATRIX"
FORCE_NO_ATOMIC_FLOAT = "TSM_FORCE_NO_ATOMIC_FLOAT"

# NumPy scalar kinds whose bytes a Metal scalar can take: bool, signed, unsigned, float.
_SCALAR_KINDS = "biuf"

# MTLDataType values of scalar parameters (Metal/MTLArgument.h) -> ParamInfo.scalar codes;
# every other type (vectors, structs) is "s" and checked by size only.
_METAL_SCALAR_TYPES = {3: "f", 16: "h", 121: "b", 29: "i", 37: "i", 45: "i", 81: "i",
                       33: "u", 41: "u", 49: "u", 85: "u", 53: "o"}
# BFloat kernels need the Metal Shading Language 3.1 (macOS 14 and its SDK).
_BFLOAT_LANGUAGE_VERSION = (3, 1)


class MetalUnavailableError(RuntimeError):
    """The Metal backend cannot run here (not macOS, no Apple GPU, or extension not built)."""


class MetalPipelineError(RuntimeError):
    """Metal compiled a kernel's library but could not make its compute pipeline."""


class MetalDispatchError(RuntimeError):
    """The extension failed to encode a dispatch that passed every check."""


@functools.lru_cache(maxsize=None)
def _import_extension(name: str):
    """``(module, None)`` or ``(None, ImportError)``: a failed import is not retried on
    every launch (``_import_extension.cache_clear()`` after rebuilding)."""
    try:
        return importlib.import_module(name), None
    except ImportError as exc:
        return None, exc


# setup.py writes why the extension did not build here (pip shows no build output without -v).
BUILD_ERROR = Path(__file__).resolve().parent / "_metal_launcher.build-error.txt"


def build_error() -> Optional[str]:
    """What the last ``pip install`` said when the extension failed to build here, if it did."""
    try:
        return BUILD_ERROR.read_text().strip() or None
    except OSError:
        return None


def _extension():
    """The compiled launcher module, or :class:`MetalUnavailableError` with the reason."""
    if sys.platform != "darwin":
        raise MetalUnavailableError(f"{UNAVAILABLE_MESSAGE} (this is {sys.platform!r})")
    module, error = _import_extension(EXTENSION)
    if module is None:
        built = build_error()
        why = f"the install's build of it failed: {built}" if built else REBUILD_HINT
        raise MetalUnavailableError(
            f"{UNAVAILABLE_MESSAGE}: {EXTENSION} could not be imported ({error}); {why}"
        ) from error
    return module


def unavailable_reason() -> Optional[str]:
    """None when the Metal kernels can run here; otherwise why not, and what to do."""
    try:
        _extension()
    except MetalUnavailableError as exc:
        return str(exc)
    if not torch.backends.mps.is_available():
        return f"{UNAVAILABLE_MESSAGE}: torch's MPS backend is not available here"
    return None


def is_available() -> bool:
    """True on macOS when the extension imports and torch's MPS backend is usable: what
    decides whether the kernels can run on the GPU (``torch.backends.mps.is_available()``
    alone does not know about the extension)."""
    return unavailable_reason() is None


def _device_info() -> Dict[str, Any]:
    return dict(_extension().device_info())


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _language_version(name: str) -> tuple:
    """``"3.1"`` -> ``(3, 1)``; ``"default"`` (macOS before 13) -> ``(0, 0)``."""
    match = re.fullmatch(r"(\d+)\.(\d+)", name)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


@functools.cache
def device_capabilities() -> Dict[str, Any]:
    """The Metal device's capabilities, probed once (``device_capabilities.cache_clear()``
    to probe again).

    Keys, from the extension's ``device_info()``: ``name``, ``supports_apple7``
    (``simdgroup_matrix``), ``supports_metal3`` (native ``atomic_float``),
    ``max_threads_per_threadgroup``, ``max_threadgroup_memory`` (bytes),
    ``recommended_max_working_set_size`` (bytes), ``metal_language_version``, ``fast_math``;
    ``supports_bfloat``: the shaders are compiled as MSL 3.1 or later (macOS 14 and an
    extension built with its SDK), which bfloat kernels need; plus ``forced_off``: the
    capabilities switched off by the ``TSM_FORCE_NO_*`` environment variables. The
    returned dict is shared: do not modify it.
    """
    caps = _device_info()
    caps["supports_bfloat"] = (_language_version(str(caps.get("metal_language_version", "")))
                               >= _BFLOAT_LANGUAGE_VERSION)
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


def require_bfloat(op: str) -> None:
    """Raise, naming ``op``, when the launcher compiles an MSL older than 3.1: its shaders
    then contain no bfloat kernels (``shaders/matmul.h`` instantiates them from 3.1 on)."""
    caps = device_capabilities()
    if not caps["supports_bfloat"]:
        raise ValueError(f"{op}: bfloat16 kernels need the Metal Shading Language 3.1 (macOS "
                         f"14 and an extension built with the macOS 14 SDK or later); the "
                         f"launcher compiles MSL {caps.get('metal_language_version')}. Use "
                         "float16 or float32")


# ---------------------------------------------------------------------------------------
# Pipelines: reflection, compile errors, unknown kernels


@dataclass(frozen=True)
class PipelineInfo:
    """What a compiled kernel declares and allows, from its pipeline's reflection."""
    kernel: str
    buffers: Mapping[int, _binding.ParamInfo]      # [[buffer(i)]] parameters by index
    threadgroups: Mapping[int, _binding.ParamInfo]  # [[threadgroup(n)]] parameters by index
    max_total_threads_per_threadgroup: int
    thread_execution_width: int
    static_threadgroup_memory: int


def _reflected_buffer(entry: Sequence[Any]) -> _binding.ParamInfo:
    index, name, size, data_type, *rest = entry
    return _binding.ParamInfo(P_BUFFER, int(index), 0, int(size),
                              _METAL_SCALAR_TYPES.get(int(data_type), "s"), False, str(name),
                              bool(rest[0]) if rest else True)


def pipeline_info_from_reflection(kernel: str, reflection: Mapping[str, Any]) -> PipelineInfo:
    """Build :class:`PipelineInfo` from the extension's ``pipeline_info()`` dict: buffers as
    ``(index, name, data size, MTLDataType, used)``, threadgroups as ``(index, name, data
    size)``. An extension built before ``used`` was reported gives four fields: every
    buffer then counts as used.

    Reflection says nothing of pointer versus reference, so every buffer counts as a
    pointer (a tensor of any size may bind to it). A buffer Metal reports unused keeps its
    slot (an argument is still expected there) but its size and type are not checked."""
    buffers = {int(entry[0]): _reflected_buffer(entry) for entry in reflection["buffers"]}
    threadgroups = {
        int(index): _binding.ParamInfo(P_THREADGROUP, int(index), 0, int(size), "s", False,
                                       str(name))
        for index, name, size in reflection["threadgroups"]}
    width = int(reflection["thread_execution_width"])
    if width != _binding.SIMD_WIDTH:
        raise RuntimeError(f"{kernel}: the pipeline's threadExecutionWidth is {width}; every "
                           f"kernel of torch_sparse_metal assumes SIMD-groups of "
                           f"{_binding.SIMD_WIDTH} threads (Apple GPUs have them)")
    return PipelineInfo(kernel, buffers, threadgroups,
                        int(reflection["max_total_threads_per_threadgroup"]), width,
                        int(reflection["static_threadgroup_memory"]))


_COMPILER_ERROR = re.compile(r"^(?P<file>[^\s:][^:\n]*):(?P<line>\d+):(?:\d+:)?\s*"
                             r"(?:fatal )?error:\s*(?P<message>.*)$", re.M)


def compile_error(shader: str, log: str, language_version: str) -> MetalCompileError:
    """The :class:`MetalCompileError` for Apple's compiler output ``log``: its first error,
    at the file and line the ``#line`` markers of :func:`shader_source` give, with that
    line's text when the file is one of ``shaders/``."""
    first = _COMPILER_ERROR.search(log)
    what = f"compiling {shader} for Metal (MSL {language_version})"
    if first is None:
        return MetalCompileError(f"{what} failed:\n{log.strip()}", log)
    line, path = int(first.group("line")), SHADERS_DIR / first.group("file")
    lines = path.read_text().splitlines() if path.is_file() else []
    source_line = lines[line - 1] if 0 < line <= len(lines) else None
    message = (f"{what} failed: {first.group('message').strip()}\n"
               f"  at {first.group('file')} line {line}: {(source_line or '').strip()}"
               f"\n\nfull compiler output:\n{log.strip()}")
    return MetalCompileError(message, log, line, source_line)


# Kernel-name suffix -> the dtype's code in shaders/tsm_common.h (TSM_DTYPE_*): each dtype's
# kernels are compiled as a library of their own, so that a rejection costs one dtype.
_LIBRARY_DTYPES = {"float": "TSM_DTYPE_FLOAT", "half": "TSM_DTYPE_HALF",
                   "bfloat": "TSM_DTYPE_BFLOAT"}


@functools.lru_cache(maxsize=None)
def _with_dtype(source: str, dtype: str) -> str:
    # Cached by the text (whose hash Python keeps), so the same str object reaches the
    # extension, whose fast path knows a source by identity.
    return f"#define TSM_LIBRARY_DTYPE {_LIBRARY_DTYPES[dtype]}\n{source}"


def library_source(shader: str, kernel: str) -> str:
    """The source Metal compiles for the library holding ``kernel`` of
    ``shaders/<shader>``: its dtype's kernels only (the ``_<dtype>`` suffix
    :func:`torch_sparse_metal._kernel_names.kernel_name` gives it), or the whole file for a
    kernel without one."""
    source = shader_source(shader)
    suffix = kernel.rsplit("_", 1)[-1]
    return _with_dtype(source, suffix) if suffix in _LIBRARY_DTYPES else source


@functools.lru_cache(maxsize=None)
def kernel_info(shader: str, kernel: str) -> PipelineInfo:
    """The pipeline of ``kernel`` in ``shaders/<shader>`` as Metal built it (compiled once,
    per dtype, and cached): its parameters, ``maxTotalThreadsPerThreadgroup``,
    ``threadExecutionWidth`` (checked to be 32) and static threadgroup memory."""
    ext = _extension()
    source = library_source(shader, kernel)
    try:
        names = ext.kernel_names(source)
    except ext.CompileError as exc:
        version = device_capabilities().get("metal_language_version", "?")
        raise compile_error(shader, str(exc), version) from None
    if kernel not in names:
        raise UnknownKernelError(kernel, shader, names)
    try:
        reflection = ext.pipeline_info(source, kernel)
    except RuntimeError as exc:
        raise MetalPipelineError(f"{shader}: Metal could not make the compute pipeline of "
                                 f"{kernel}: {exc}") from exc
    return pipeline_info_from_reflection(kernel, reflection)


@functools.lru_cache(maxsize=None)
def kernel_failure(shader: str, kernel: str) -> Optional[Exception]:
    """None when ``kernel`` of ``shaders/<shader>`` builds on this GPU (its library compiles
    and its pipeline can be made), else the error saying why. Tried once: a failure is
    remembered too (``cache_clear()`` here and on :func:`kernel_info` to try again)."""
    try:
        kernel_info(shader, kernel)
    except MetalUnavailableError:
        raise
    except (MetalCompileError, MetalPipelineError, UnknownKernelError, RuntimeError,
            ValueError) as exc:
        return exc
    return None


# ---------------------------------------------------------------------------------------
# Dispatch


Arg = Union[torch.Tensor, np.generic, None]


def _pack(info: PipelineInfo, index: int, arg: Arg) -> Union[torch.Tensor, bytes, None]:
    kernel = info.kernel
    if arg is None:  # a gap in the [[buffer(i)]] indices, checked by _binding.check_arguments
        return None
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "mps":
            raise ValueError(f"dispatch({kernel}): argument {index} is on {arg.device}; the "
                             "Metal backend needs tensors on 'mps'")
        if not arg.is_contiguous():
            raise ValueError(f"dispatch({kernel}): argument {index} must be contiguous "
                             f"(shape {tuple(arg.shape)}, strides {arg.stride()})")
        return arg
    param = info.buffers[index]
    where = _binding.where(kernel, index, param)
    if isinstance(arg, np.ndarray):
        return _binding.table_bytes(where, param, arg)
    return _binding.scalar_bytes(where, param, arg)


def _check_scalar_type(kernel: str, index: int, arg: Arg) -> None:
    """Scalars must be typed NumPy scalars Metal has a type for (no double)."""
    if arg is None or isinstance(arg, torch.Tensor):  # None: a gap, see _binding.check_arguments
        return
    if not isinstance(arg, (np.generic, np.ndarray)):
        raise TypeError(f"dispatch({kernel}): argument {index} must be a torch.Tensor, a typed "
                        f"NumPy scalar (np.int32, np.float32, ...) or a small NumPy array, got "
                        f"{type(arg).__name__}")
    kind = arg.dtype.kind
    what = "array" if isinstance(arg, np.ndarray) else "scalar"
    if kind not in _SCALAR_KINDS:
        raise TypeError(f"dispatch({kernel}): argument {index} is a NumPy {arg.dtype} "
                        f"{what}; Metal takes bool, integer or floating values")
    if kind == "f" and arg.dtype.itemsize > 4:
        raise TypeError(f"dispatch({kernel}): argument {index} is a NumPy {arg.dtype} "
                        f"{what}; Metal has no double (pass np.float32 or np.float16)")


def dispatch(shader: str, kernel: str, args: Sequence[Arg], *, threads,
             group_size, threadgroup_memory: Sequence[int] = ()) -> None:
    """Encode ``kernel`` of ``shaders/<shader>`` on the current MPS stream.

    ``threads`` is the grid in threads and ``group_size`` the threadgroup (ints or 1-3
    ints; dispatchThreads semantics). ``args[i]`` binds ``[[buffer(i)]]``: contiguous MPS
    tensors at their storage offset, typed NumPy scalars and small NumPy arrays (tables of
    at most 4 KB, for ``constant T*``) as their bytes (``setBytes``), checked against the
    parameter's declared type; ``None`` where the kernel's indices have a gap (no
    ``[[buffer(i)]]`` there), which binds nothing. ``threadgroup_memory[n]`` is the byte
    length of ``[[threadgroup(n)]]`` (a multiple of 16); every declared one needs a length. The
    dispatch is encoded, not committed: torch commits when it synchronises. An empty grid
    encodes nothing.
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
    if len(args) > _binding.MAX_BUFFERS:
        raise ValueError(f"dispatch({kernel}): {len(args)} arguments; Metal binds at most "
                         f"{_binding.MAX_BUFFERS}")
    for i, a in enumerate(args):
        _check_scalar_type(kernel, i, a)
    info = kernel_info(shader, kernel)
    _binding.check_group(kernel, group3, info.max_total_threads_per_threadgroup)
    _binding.check_arguments(kernel, info.buffers, args)
    limit = device_capabilities()["max_threadgroup_memory"] - info.static_threadgroup_memory
    _binding.check_threadgroup_memory(kernel, info.threadgroups, tg_memory, limit)
    packed = [_pack(info, i, a) for i, a in enumerate(args)]
    record_launch(kernel, threads3, group3, "metal")
    try:
        ext.dispatch(library_source(shader, kernel), kernel, packed, threads3, group3, tg_memory)
    except RuntimeError as exc:
        raise MetalDispatchError(f"dispatch({kernel}): {exc}") from exc
