"""Bind-time checks shared by the emulator and the Metal launcher.

Both backends describe a kernel's parameters the same way, as :class:`ParamInfo`: the
emulator from its own binding table, the Metal launcher from the pipeline's reflection.
The checks below then give the same :class:`LaunchError` (a ``ValueError``), with the same
message naming the kernel and the argument, whichever backend a launch goes to.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence, Tuple

import numpy as np
import torch

from .errors import LaunchError

# A parameter's kind (tsm_emu::ParamKind in csrc/emulator): what ParamInfo.kind holds, on both
# backends.
P_BUFFER, P_THREADGROUP, P_BUILTIN, P_ABSENT, P_TEXTURE, P_SAMPLER = 0, 1, 2, 3, 4, 5

MAX_BUFFERS = 31
# Metal's argument tables of textures and samplers (per stage, on macOS).
MAX_TEXTURES = 128
MAX_SAMPLERS = 16
# Metal's limit, and the emulator's (it has no pipeline to ask).
MAX_THREADS_PER_THREADGROUP = 1024
# The SIMD-group width every kernel of the project assumes.
SIMD_WIDTH = 32
THREADGROUP_MEMORY_ALIGNMENT = 16

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
    """One ``[[buffer(i)]]`` or ``[[threadgroup(i)]]`` parameter of a kernel.

    ``size`` is the byte size of the pointee (or referenced type; of a texture, its kind and
    access, see emulator/_textures.py); ``scalar`` its kind:
    ``f`` float, ``h`` half, ``b`` bfloat, ``d`` double, ``i``/``u`` signed/unsigned
    integer, ``o`` bool, ``s`` anything else (vectors, structs). ``text`` is the parameter
    as the source declares it (the emulator) or its name (Metal's reflection). ``used`` is
    False for a binding Metal's reflection reports the function never reads: its size and
    type may then be unreported (0, ``s``), and nothing is checked against them.
    """
    kind: int      # P_BUFFER / P_THREADGROUP / P_BUILTIN / P_TEXTURE / P_SAMPLER (emulator)
    index: int
    passing: int   # 0 pointer, 1 reference, 2 value
    size: int
    scalar: str
    is_const: bool
    text: str
    used: bool = True

    def describe(self) -> str:
        return f"`{self.text}`"

    @property
    def name(self) -> str:
        """The parameter's name in the kernel source."""
        found = re.findall(r"(\w+)\s*(?:\[\[.*)?$", self.text)
        return found[0] if found else ""


def where(kernel: str, index: int, param: ParamInfo) -> str:
    """How a message names argument ``index`` of ``kernel``."""
    return f"{kernel}: argument {index} ([[buffer({index})]] {param.describe()})"


def check_group(kernel: str, group: Tuple[int, int, int], max_threads: int) -> None:
    """``group`` fits the pipeline: 1 to ``max_threads`` threads."""
    n = group[0] * group[1] * group[2]
    if n == 0 or n > max_threads:
        raise LaunchError(f"{kernel}: group_size {group} has {n} threads; a Metal threadgroup "
                          f"holds 1 to {max_threads} (the pipeline's "
                          "maxTotalThreadsPerThreadgroup)")


def check_arguments(kernel: str, buffers: Mapping[int, ParamInfo], args: Sequence[object]) -> None:
    """One argument per ``[[buffer(i)]]``, in index order, and ``None`` where the indices
    have a gap (MLX's copy kernels use 0, 1 and 3): torch's command encoder is shared, so
    every slot is named, and a slot left unbound is one no parameter reads."""
    count = len(args)
    if count > MAX_BUFFERS:
        raise LaunchError(f"{kernel}: {count} arguments; Metal binds at most {MAX_BUFFERS} "
                          "buffers")
    expected = max(buffers) + 1 if buffers else 0
    gaps = [i for i in range(expected) if i not in buffers]
    if count != expected:
        gap_note = f"; None at {', '.join(map(str, gaps))}, where it has none" if gaps else ""
        raise LaunchError(f"{kernel}: expected {expected} arguments (one per [[buffer(i)]]{gap_note}), "
                          f"got {count}")
    for i, arg in enumerate(args):
        if i in buffers and arg is None:
            raise LaunchError(f"{where(kernel, i, buffers[i])}: got None; only an index the kernel "
                              "declares no [[buffer(i)]] for takes None")
        if i not in buffers and arg is not None:
            raise LaunchError(f"{kernel}: argument {i} has no [[buffer({i})]] parameter; pass None "
                              "there")


def check_threadgroup_memory(kernel: str, declared: Mapping[int, ParamInfo],
                             lengths: Sequence[int], limit: int) -> None:
    """A length for every declared ``[[threadgroup(n)]]``, each a multiple of 16, and at
    most ``limit`` bytes in total."""
    if len(lengths) > MAX_BUFFERS:
        raise LaunchError(f"{kernel}: {len(lengths)} threadgroup_memory entries; Metal has at "
                          f"most {MAX_BUFFERS} [[threadgroup(n)]] slots")
    needed = max(declared) + 1 if declared else 0
    if len(lengths) < needed:
        raise LaunchError(f"{kernel}: threadgroup_memory must give the byte length of each of "
                          f"its {needed} [[threadgroup(n)]] parameters, got {list(lengths)}")
    for n, nbytes in enumerate(lengths):
        if nbytes < 0 or nbytes % THREADGROUP_MEMORY_ALIGNMENT:
            raise LaunchError(f"{kernel}: threadgroup_memory[{n}] = {nbytes}: Metal needs a "
                              "non-negative multiple of 16 bytes")
    if sum(lengths) > limit:
        raise LaunchError(f"{kernel}: threadgroup_memory totals {sum(lengths)} bytes; Metal "
                          f"allows {limit}")


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


# Metal's setBytes:length:atIndex: is documented for data smaller than 4 KB.
MAX_SET_BYTES = 4096


def table_bytes(where: str, param: ParamInfo, table: np.ndarray) -> bytes:
    """The bytes of a small NumPy array passed by value to a ``constant T*`` parameter:
    C-contiguous, at most :data:`MAX_SET_BYTES`, elements of the declared type."""
    if not table.flags.c_contiguous or table.size == 0:
        raise LaunchError(f"{where}: a table passed by value must be a non-empty C-contiguous "
                          "NumPy array")
    if table.nbytes > MAX_SET_BYTES:
        raise LaunchError(f"{where}: a table passed by value holds at most {MAX_SET_BYTES} "
                          f"bytes (Metal's setBytes), got {table.nbytes}; bind a tensor")
    scalar_bytes(where, param, table.reshape(-1)[0])  # the element type, as for a scalar
    return table.tobytes()


def scalar_bytes(where: str, param: ParamInfo, arg) -> bytes:
    """The bytes of a NumPy or Python scalar for ``param``, checked against its declared
    type: a NumPy scalar must match it exactly, a Python number must fit it. A NumPy scalar
    for a binding the kernel does not use binds as its own bytes."""
    if not param.used:
        if isinstance(arg, np.generic):
            return arg.tobytes()
        raise LaunchError(f"{where}: the kernel does not use this binding and Metal reports no "
                          f"type for it, so a Python {type(arg).__name__} has no bytes to "
                          "bind; pass a NumPy scalar or a tensor")
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
            return _float_bytes(where, param, declared, arg)
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
