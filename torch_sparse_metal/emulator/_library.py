"""A compiled emulator library and the call that dispatches one of its kernels.

Layer: run, the top (the layers are in the package's docstring): it loads what the
compiler (_compiler) built.
"""
from __future__ import annotations

import ctypes
import math
import numbers
import os
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _binding
from . import _cache, _msl_text, _textures
from .._binding import (MAX_BUFFERS, MAX_SAMPLERS, MAX_TEXTURES, MAX_THREADS_PER_THREADGROUP, ParamInfo, check_arguments,
                       check_group, check_threadgroup_memory, scalar_bytes)
from ._compiler import CompiledLibrary
from ..errors import FAULT_KINDS, KernelFault, LaunchError, UnknownKernelError
from .._record import COUNTERS, as_dim3, record_launch, recording

MAX_THREADGROUP_MEMORY = 32 * 1024


class _Launch(ctypes.Structure):
    """``struct tsm_launch`` of csrc/emulator/src/c_interface.h."""
    _fields_ = [
        ("buffers", ctypes.c_void_p * MAX_BUFFERS),
        ("buffer_bytes", ctypes.c_uint64 * MAX_BUFFERS),
        ("num_buffers", ctypes.c_int32),
        ("grid", ctypes.c_uint32 * 3),
        ("group", ctypes.c_uint32 * 3),
        ("threadgroup_bytes", ctypes.c_uint64 * MAX_BUFFERS),
        ("num_threadgroup", ctypes.c_int32),
        ("num_workers", ctypes.c_int32),
        ("sanitize", ctypes.c_int32),
        ("buffer_names", ctypes.c_char_p * MAX_BUFFERS),
        ("threadgroup_names", ctypes.c_char_p * MAX_BUFFERS),
        ("counters", ctypes.c_uint64 * len(COUNTERS)),
        ("interruptible", ctypes.c_int32),
        ("time_limit_s", ctypes.c_double),
        ("segment_bytes", ctypes.c_uint32),
        ("count_instructions", ctypes.c_int32),
        ("python", ctypes.c_void_p * 4),
        ("raised", ctypes.c_void_p * 3),
        ("textures", ctypes.c_void_p * MAX_TEXTURES),
        ("samplers", ctypes.c_void_p * MAX_SAMPLERS),
    ]


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


# Python runs a signal's handler only in its main thread, between bytecodes: never while
# that thread waits in a dispatch. A dispatch from the main thread is given Python's C API
# to run the pending handlers every few milliseconds (tsm_launch.python); a handler that
# raises (an alarm's, pytest-timeout's) stops the dispatch, and the launch raises its
# exception. (A Python function as the callback would not do: the handlers would run on
# entering it, and ctypes swallows what a callback raises.)
_PYTHON_API = tuple(_address(getattr(ctypes.pythonapi, name)) for name in
                    ("PyGILState_Ensure", "PyGILState_Release", "PyErr_CheckSignals", "PyErr_Fetch"))
_restore_error = ctypes.pythonapi.PyErr_Restore  # a PyDLL function: raises the error it restores
_restore_error.argtypes = [ctypes.c_void_p] * 3
_restore_error.restype = None


# The bytes of one device memory transaction the counters count in (a GPU's cache line:
# 128 bytes on Apple's GPUs). instrumented(segment_bytes=...) changes it.
DEFAULT_SEGMENT_BYTES = 128
segment_bytes = [DEFAULT_SEGMENT_BYTES]


# A worker thread is started per dispatch: on this machine (2 cores, g++ 12, measured
# 2026-11-23 with other jobs running) that costs about 10 us, as much as a few hundred of the
# cheapest Metal threads (`y[i] += a * x[i]`: 4096 threads took 110 us on one worker, 120 us
# on two; 16384 threads 390 and 286 us), and a tiled matmul gained from 4096 threads on
# (64^3: 494 -> 338 us, 128^3: 3.76 -> 2.03 ms). So by default a dispatch gets one worker
# per 8K threads, up to the core count: two from 16K threads on. Sanitized dispatches too:
# their threads cost 30-70x more and would gain from a second worker sooner, but below 16K
# threads (most kernels' tests) they keep one order, so a report is the same in every run.
THREADS_PER_WORKER = 1 << 13


def _num_workers(total_threads: int) -> int:
    env = os.environ.get("TSM_EMU_WORKERS")
    if env:  # asked for explicitly (tests that need threadgroups to really overlap)
        return max(1, int(env))
    return max(1, min(os.cpu_count() or 1, total_threads // THREADS_PER_WORKER))


TIMEOUT_ENV = "TSM_EMU_TIMEOUT"


def _time_limit(kernel: str, timeout: Optional[float]) -> float:
    """Seconds a dispatch may run (0: no limit): ``timeout``, else ``$TSM_EMU_TIMEOUT``."""
    where = f"{kernel}: timeout"
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip()
        if not env:
            return 0.0
        where = f"{kernel}: {TIMEOUT_ENV}={env!r}"
        try:
            timeout = float(env)
        except ValueError:
            raise LaunchError(f"{where} is not a number of seconds") from None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
            or not 0 < timeout < math.inf:
        raise LaunchError(f"{where} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Kernel:
    """One kernel of a library; call it like ``torch.mps.compile_shader``'s kernels."""

    # Metal reports this per pipeline; the emulator has none to ask and runs Metal's limit.
    max_total_threads_per_threadgroup = MAX_THREADS_PER_THREADGROUP

    def __init__(self, library: "Library", index: int, name: str, params: List[ParamInfo]) -> None:
        self._library = library
        self._index = index
        self.name = name
        self.params = params
        self._params = params
        self._buffers = {p.index: p for p in params if p.kind == _msl_text.P_BUFFER}
        self._threadgroup = {p.index: p for p in params if p.kind == _msl_text.P_THREADGROUP}
        self.num_buffer_args = max(self._buffers) + 1 if self._buffers else 0
        self._buffer_names = [self._buffers[i].name.encode() if i in self._buffers else b""
                              for i in range(self.num_buffer_args)]
        self.num_threadgroup_args = max(self._threadgroup) + 1 if self._threadgroup else 0
        self._threadgroup_names = [self._threadgroup[i].name.encode() if i in self._threadgroup else b""
                                   for i in range(self.num_threadgroup_args)]

    def __repr__(self) -> str:
        return f"<emulated Metal kernel {self.name} of {self._library.origin}>"

    def __call__(self, *args, threads=None, group_size=None,
                 threadgroup_memory: Optional[Sequence[int]] = None,
                 textures: Optional[Union[Sequence[Optional[torch.Tensor]], Mapping[int, torch.Tensor]]] = None,
                 samplers: Optional[Union[Sequence[Optional[_textures.Sampler]],
                                          Mapping[int, _textures.Sampler]]] = None,
                 timeout: Optional[float] = None) -> None:
        """Dispatch the kernel; returns when every thread finished.

        ``textures``, ``samplers``: the tensors bound to its ``[[texture(n)]]`` and the
        :class:`Sampler` states bound to its ``[[sampler(n)]]`` parameters: a list by index
        (None where it declares none) or a mapping ``{n: tensor}``; the tensor layouts are in
        docs/emulator.md.
        ``timeout``: seconds the dispatch may run before it is stopped with
        ``KernelFault("hang")`` (default: ``$TSM_EMU_TIMEOUT``, else no limit). Called from
        the main thread, Ctrl-C stops the dispatch and raises ``KeyboardInterrupt``, and so does
        any Python signal handler that raises (its exception is raised from here). Either
        way the process and the library stay usable; what the kernel wrote is incomplete.
        """
        needs = self._library.needs_constants.get(self.name)
        if needs:
            raise LaunchError(f"{self.name}: the kernel uses function constant(s) {', '.join(needs)}, "
                              f"given no value: pass them to compile_shader(function_constants=...)")
        time_limit = _time_limit(self.name, timeout)
        if threads is None:
            raise LaunchError(f"{self.name}: threads= (the grid size in threads) is required")
        grid = as_dim3(threads, f"{self.name}: threads")
        if group_size is None:
            group_size = min(grid[0], 256) or 1
        group = as_dim3(group_size, f"{self.name}: group_size")
        check_group(self.name, group, self.max_total_threads_per_threadgroup)
        check_arguments(self.name, self._buffers, args)
        launch = _Launch()
        keepalive = []
        for i, arg in enumerate(args):
            if arg is None:  # a gap in the kernel's [[buffer(i)]] indices: nothing to bind
                continue
            ptr, nbytes, keep = self._bind(i, self._buffers[i], arg)
            launch.buffers[i] = ptr
            launch.buffer_bytes[i] = nbytes
            keepalive.append(keep)
        launch.num_buffers = len(args)
        tg = list(threadgroup_memory or [])
        check_threadgroup_memory(self.name, self._threadgroup, tg, MAX_THREADGROUP_MEMORY)
        for n, nbytes in enumerate(tg):
            launch.threadgroup_bytes[n] = nbytes
        launch.num_threadgroup = len(tg)
        keepalive += _textures.bind(self.name, self._params, textures, samplers, launch)
        launch.grid[:] = grid
        launch.group[:] = group
        launch.num_workers = _num_workers(grid[0] * grid[1] * grid[2])
        launch.sanitize = int(self._library.sanitize)
        main_thread = threading.current_thread() is threading.main_thread()
        launch.interruptible = int(main_thread)
        if main_thread:
            launch.python[:] = _PYTHON_API
        launch.time_limit_s = time_limit
        launch.segment_bytes = segment_bytes[-1]
        # The counters reach nobody outside a record() block.
        counting = self._library.sanitize and recording()
        launch.count_instructions = int(counting)
        for i, name in enumerate(self._buffer_names):
            launch.buffer_names[i] = name
        for i, name in enumerate(self._threadgroup_names):
            launch.threadgroup_names[i] = name
        if 0 in grid:
            record_launch(self.name, grid, group, "emulator")
            return
        err = ctypes.create_string_buffer(4096)
        rc = self._library._dispatch(self._index, ctypes.byref(launch), err, len(err))
        del keepalive
        counters = dict(zip(COUNTERS, launch.counters)) if counting and rc == 0 else None
        record_launch(self.name, grid, group, "emulator", counters)
        if launch.raised[0]:
            try:
                _restore_error(*launch.raised)  # steals the references PyErr_Fetch gave
            except BaseException as raised:  # noqa: B902 -- KeyboardInterrupt and SystemExit too
                if hasattr(raised, "add_note"):
                    outcome = ("the dispatch was stopped, and what it wrote is incomplete" if rc != 0
                               else "the dispatch had finished")
                    raised.add_note(f"(raised by a signal handler while kernel {self.name} ran: {outcome})")
                raise
        if rc != 0:
            kind, _, message = err.value.decode(errors="replace").partition("\t")
            if kind == "launch":
                raise LaunchError(f"{self.name}: {message}")
            if kind == "interrupted":  # Python's SIGINT handler usually raised it already
                raise KeyboardInterrupt(f"kernel {self.name}: {message}")
            if kind in FAULT_KINDS:
                raise KernelFault(kind, f"kernel {self.name}: {message}")
            raise RuntimeError(f"{self.name}: {kind}: {message}")

    def _bind(self, i: int, param: ParamInfo, arg) -> Tuple[int, int, object]:
        where = _binding.where(self.name, i, param)
        if isinstance(arg, torch.Tensor):
            if arg.device.type != "cpu":
                raise LaunchError(f"{where}: the emulator runs on CPU tensors, got a tensor on "
                                  f"{arg.device}")
            if not arg.is_contiguous():
                raise LaunchError(f"{where}: tensor must be contiguous (Metal buffers have no strides; "
                                  "call .contiguous())")
            nbytes = arg.numel() * arg.element_size()
            if param.passing != 0 and nbytes < param.size:
                raise LaunchError(f"{where}: the kernel reads {param.size} bytes, the tensor has {nbytes}")
            return arg.data_ptr(), nbytes, arg
        if isinstance(arg, np.ndarray):
            if not arg.flags.c_contiguous:
                raise LaunchError(f"{where}: NumPy array must be C-contiguous (the kernel's writes "
                                  "must land in your array, not in a copy)")
            tensor = torch.from_numpy(arg) if arg.size else torch.empty(0)
            return tensor.data_ptr(), arg.nbytes, (tensor, arg)
        if isinstance(arg, (bytes, bytearray)):
            buf = ctypes.create_string_buffer(bytes(arg), max(len(arg), 1))
            return ctypes.addressof(buf), len(arg), buf
        value = scalar_bytes(where, param, arg)
        buf = ctypes.create_string_buffer(value, len(value))
        return ctypes.addressof(buf), len(value), buf


class Library:
    """A compiled shader: its kernels are attributes (``lib.my_kernel(...)``)."""

    def __init__(self, compiled: CompiledLibrary) -> None:
        self.origin = compiled.origin
        self.path = compiled.path
        self.sanitize = compiled.sanitize
        self.language_version = compiled.language_version
        self.needs_constants = compiled.needs_constants
        try:
            self._dll = ctypes.CDLL(str(compiled.path), mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError as e:
            raise OSError(f"{self.origin}: cannot load the emulator's build of it, {compiled.path}, "
                          f"from the compile cache ({_cache.ENV} chooses its directory; deleting "
                          f"the file makes the next run rebuild it): {e}") from None
        self._dll.tsm_num_kernels.restype = ctypes.c_int
        self._dll.tsm_kernel_name.restype = ctypes.c_char_p
        self._dll.tsm_kernel_name.argtypes = [ctypes.c_int]
        self._dll.tsm_kernel_num_params.restype = ctypes.c_int
        self._dll.tsm_kernel_param.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int32)]
        self._dispatch = self._dll.tsm_dispatch
        self._dispatch.restype = ctypes.c_int
        self._dispatch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
        parsed = {k.host_name: k for k in compiled.kernels}
        self._kernels: Dict[str, Kernel] = {}
        for i in range(self._dll.tsm_num_kernels()):
            name = self._dll.tsm_kernel_name(i).decode()
            params = []
            for j in range(self._dll.tsm_kernel_num_params(i)):
                out = (ctypes.c_int32 * 6)()
                self._dll.tsm_kernel_param(i, j, out)
                params.append(ParamInfo(out[0], out[1], out[2], out[3], chr(out[4]), bool(out[5]),
                                        parsed[name].params[j].text))
            self._kernels[name] = Kernel(self, i, name, params)

    @property
    def kernel_names(self) -> Tuple[str, ...]:
        return tuple(self._kernels)

    def __getattr__(self, name: str) -> Kernel:
        kernels = self.__dict__.get("_kernels", {})
        if name in kernels:
            return kernels[name]
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnknownKernelError(name, self.__dict__.get("origin", "library"), kernels)

    def __getitem__(self, name: str) -> Kernel:
        return self.__getattr__(name)

    def __dir__(self):
        return list(super().__dir__()) + list(self._kernels)

    def __repr__(self) -> str:
        checked = " (sanitized)" if self.sanitize else ""
        return f"<emulated Metal library {self.origin}{checked}: {', '.join(self._kernels)}>"
