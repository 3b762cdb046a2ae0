"""A compiled emulator library and the call that dispatches one of its kernels."""
from __future__ import annotations

import ctypes
import math
import numbers
import os
import re
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from . import _cache, _rewrite
from ._compiler import CompiledLibrary
from ._errors import FAULT_KINDS, KernelFault, LaunchError
from ._record import COUNTERS, as_dim3, record_launch

MAX_BUFFERS = 31
MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_MEMORY = 32 * 1024


class _Launch(ctypes.Structure):
    _fields_ = [
        ("buffers", ctypes.c_void_p * MAX_BUFFERS),
        ("buffer_bytes", ctypes.c_uint64 * MAX_BUFFERS),
        ("num_buffers", ctypes.c_int32),
        ("grid", ctypes.c_uint32 * 3),
        ("group", ctypes.c_uint32 * 3),
        ("threadgroup_bytes", ctypes.c_uint64 * MAX_BUFFERS),
        ("num_threadgroup", ctypes.c_int32),
        ("use_fibers", ctypes.c_int32),
        ("num_workers", ctypes.c_int32),
        ("sanitize", ctypes.c_int32),
        ("buffer_names", ctypes.c_char_p * MAX_BUFFERS),
        ("threadgroup_names", ctypes.c_char_p * MAX_BUFFERS),
        ("counters", ctypes.c_uint64 * len(COUNTERS)),
        ("interruptible", ctypes.c_int32),
        ("time_limit_s", ctypes.c_double),
    ]


# (scalar code, size) -> NumPy dtype, for converting Python scalars to the declared type.
_SCALAR_DTYPES = {
    ("f", 4): np.float32, ("d", 8): np.float64, ("h", 2): np.float16,
    ("i", 1): np.int8, ("i", 2): np.int16, ("i", 4): np.int32, ("i", 8): np.int64,
    ("u", 1): np.uint8, ("u", 2): np.uint16, ("u", 4): np.uint32, ("u", 8): np.uint64,
    ("o", 1): np.bool_,
}
_TYPE_NAMES = {"f": "float", "d": "double", "h": "half", "b": "bfloat", "i": "signed integer",
               "u": "unsigned integer", "o": "bool", "s": "struct or vector"}


@dataclass(frozen=True)
class ParamInfo:
    kind: int      # _rewrite.P_BUFFER / P_THREADGROUP / P_BUILTIN
    index: int
    passing: int   # 0 pointer, 1 reference, 2 value
    size: int
    scalar: str
    is_const: bool
    text: str

    def describe(self) -> str:
        return f"`{self.text}`"

    @property
    def name(self) -> str:
        """The parameter's name in the kernel source."""
        found = re.findall(r"(\w+)\s*(?:\[\[.*)?$", self.text)
        return found[0] if found else ""


# Starting a worker thread costs about as much as running tens of thousands of small Metal
# threads (measured: a 4096-thread dispatch took 250 us on two workers, 97 us on one), so by
# default a dispatch gets one worker per 64K threads, up to the core count.
THREADS_PER_WORKER = 1 << 16


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

    def __init__(self, library: "Library", index: int, name: str, params: List[ParamInfo]) -> None:
        self._library = library
        self._index = index
        self.name = name
        self.params = params
        self._buffers = {p.index: p for p in params if p.kind == _rewrite.P_BUFFER}
        self._threadgroup = {p.index: p for p in params if p.kind == _rewrite.P_THREADGROUP}
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
                 timeout: Optional[float] = None) -> None:
        """Dispatch the kernel; returns when every thread finished.

        ``timeout``: seconds the dispatch may run before it is stopped with
        ``KernelFault("hang")`` (default: ``$TSM_EMU_TIMEOUT``, else no limit). Called from
        the main thread, Ctrl-C stops the dispatch and raises ``KeyboardInterrupt``. Either
        way the process and the library stay usable; what the kernel wrote is incomplete.
        """
        time_limit = _time_limit(self.name, timeout)
        if threads is None:
            raise LaunchError(f"{self.name}: threads= (the grid size in threads) is required")
        grid = as_dim3(threads, f"{self.name}: threads")
        if group_size is None:
            group_size = min(grid[0], 256) or 1
        group = as_dim3(group_size, f"{self.name}: group_size")
        n_group = group[0] * group[1] * group[2]
        if n_group == 0 or n_group > MAX_THREADS_PER_THREADGROUP:
            raise LaunchError(f"{self.name}: group_size {group} has {n_group} threads; a Metal "
                              f"threadgroup holds 1 to {MAX_THREADS_PER_THREADGROUP}")
        if len(args) > MAX_BUFFERS:
            raise LaunchError(f"{self.name}: {len(args)} arguments; Metal binds at most "
                              f"{MAX_BUFFERS} buffers")
        if len(args) != self.num_buffer_args:
            raise LaunchError(f"{self.name}: expected {self.num_buffer_args} arguments "
                              f"(one per [[buffer(i)]]), got {len(args)}")
        launch = _Launch()
        keepalive = []
        for i, arg in enumerate(args):
            param = self._buffers.get(i)
            if param is None:
                raise LaunchError(f"{self.name}: argument {i} has no [[buffer({i})]] parameter")
            ptr, nbytes, keep = self._bind(i, param, arg)
            launch.buffers[i] = ptr
            launch.buffer_bytes[i] = nbytes
            keepalive.append(keep)
        launch.num_buffers = len(args)
        tg = list(threadgroup_memory or [])
        if len(tg) > MAX_BUFFERS:
            raise LaunchError(f"{self.name}: {len(tg)} threadgroup_memory entries; Metal has at "
                              f"most {MAX_BUFFERS} [[threadgroup(n)]] slots")
        if len(tg) < self.num_threadgroup_args:
            raise LaunchError(f"{self.name}: threadgroup_memory must give the byte length of each of "
                              f"its {self.num_threadgroup_args} [[threadgroup(n)]] parameters, got {tg}")
        for n, nbytes in enumerate(tg):
            if nbytes < 0 or nbytes % 16:
                raise LaunchError(f"{self.name}: threadgroup_memory[{n}] = {nbytes}: Metal needs a "
                                  "non-negative multiple of 16 bytes")
        if sum(tg) > MAX_THREADGROUP_MEMORY:
            raise LaunchError(f"{self.name}: threadgroup_memory totals {sum(tg)} bytes; Metal allows "
                              f"{MAX_THREADGROUP_MEMORY}")
        for n, nbytes in enumerate(tg):
            launch.threadgroup_bytes[n] = nbytes
        launch.num_threadgroup = len(tg)
        launch.grid[:] = grid
        launch.group[:] = group
        launch.use_fibers = int(self._library.uses_synchronisation)
        launch.num_workers = _num_workers(grid[0] * grid[1] * grid[2])
        launch.sanitize = int(self._library.sanitize)
        launch.interruptible = int(threading.current_thread() is threading.main_thread())
        launch.time_limit_s = time_limit
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
        counters = dict(zip(COUNTERS, launch.counters)) if self._library.sanitize and rc == 0 else None
        record_launch(self.name, grid, group, "emulator", counters)
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
        where = f"{self.name}: argument {i} ([[buffer({i})]] {param.describe()})"
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
        value = self._scalar_bytes(where, param, arg)
        buf = ctypes.create_string_buffer(value, len(value))
        return ctypes.addressof(buf), len(value), buf

    @staticmethod
    def _float_bytes(where: str, param: ParamInfo, declared: str, arg) -> bytes:
        """A Python number as the declared floating type, rounded to nearest; a finite number
        that would round to infinity does not fit (as an integer out of range)."""
        try:
            value = float(arg)
        except OverflowError:  # an int past float64's range
            raise LaunchError(f"{where}: {arg} does not fit the declared {declared} of "
                              f"{param.size} bytes") from None
        if param.scalar == "b":
            t = torch.tensor(value, dtype=torch.bfloat16)
            converted, data = float(t), t.view(torch.int16).numpy().tobytes()
        else:
            dtype = _SCALAR_DTYPES.get((param.scalar, param.size))
            if dtype is None:
                raise LaunchError(f"{where}: cannot convert a Python {type(arg).__name__} to the "
                                  f"declared {declared} of {param.size} bytes; pass a tensor or bytes")
            with np.errstate(over="ignore"):  # overflow is reported below, with the parameter
                array = np.array(value, dtype=dtype)
            converted, data = float(array), array.tobytes()
        if math.isinf(converted) and math.isfinite(value):
            raise LaunchError(f"{where}: {arg} does not fit the declared {declared} of "
                              f"{param.size} bytes (it would become infinity)")
        return data

    @staticmethod
    def _scalar_bytes(where: str, param: ParamInfo, arg) -> bytes:
        declared = _TYPE_NAMES.get(param.scalar, param.scalar)
        if isinstance(arg, np.generic):
            kind = {"f": "f", "i": "i", "u": "u", "b": "o"}.get(arg.dtype.kind, "?")
            if arg.dtype == np.float16:
                kind = "h"
            elif arg.dtype == np.float64:
                kind = "d"
            if arg.dtype.itemsize != param.size or (param.scalar != "s" and kind != param.scalar):
                raise LaunchError(f"{where}: got a NumPy {arg.dtype} ({arg.dtype.itemsize} bytes), the "
                                  f"kernel declares {declared} of {param.size} bytes")
            return arg.tobytes()
        if isinstance(arg, (bool, int, float)):
            if param.scalar in "fdhb":
                return Kernel._float_bytes(where, param, declared, arg)
            dtype = _SCALAR_DTYPES.get((param.scalar, param.size))
            if dtype is None:
                raise LaunchError(f"{where}: cannot convert a Python {type(arg).__name__} to the declared "
                                  f"{declared} of {param.size} bytes; pass a tensor or bytes")
            if isinstance(arg, float):
                raise LaunchError(f"{where}: a Python float cannot bind to the declared {declared}")
            info = np.iinfo(dtype) if param.scalar in "iu" else None
            if info is not None and not info.min <= int(arg) <= info.max:
                raise LaunchError(f"{where}: {arg} does not fit the declared {declared} of {param.size} bytes")
            return np.array(arg, dtype=dtype).tobytes()
        raise LaunchError(f"{where}: cannot bind a {type(arg).__name__}; pass a tensor, a NumPy scalar "
                          "or a Python number")


class Library:
    """A compiled shader: its kernels are attributes (``lib.my_kernel(...)``)."""

    def __init__(self, compiled: CompiledLibrary) -> None:
        self.origin = compiled.origin
        self.path = compiled.path
        self.uses_synchronisation = compiled.uses_synchronisation
        self.sanitize = compiled.sanitize
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
        raise AttributeError(f"no kernel named {name!r} in {self.__dict__.get('origin', 'library')}; "
                             f"kernels: {', '.join(kernels) or '(none)'}")

    def __getitem__(self, name: str) -> Kernel:
        return self.__getattr__(name)

    def __dir__(self):
        return list(super().__dir__()) + list(self._kernels)

    def __repr__(self) -> str:
        checked = " (sanitized)" if self.sanitize else ""
        return f"<emulated Metal library {self.origin}{checked}: {', '.join(self._kernels)}>"
