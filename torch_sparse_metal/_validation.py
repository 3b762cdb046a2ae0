"""Argument checks shared by the ops: each raises before any kernel runs, naming the op.

Every message starts with ``"<op>: "`` so a failure deep inside a model still says which
call was wrong. Index arrays end up int32, contiguous and on the data's device: that is
what the kernels read.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Dict, Optional, Sequence, Tuple

import torch

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1

# What each backend can run. "reference" is plain torch and takes any floating dtype.
KERNEL_DTYPES: Dict[str, Tuple[torch.dtype, ...]] = {
    "metal": (torch.float32,),
    "emulator": (torch.float32, torch.float64),  # Metal has no double; the emulator does
}
# The ops whose kernels are also instantiated for the 2-byte types (TSM_INSTANTIATE_ALL_DTYPES
# in shaders/tsm_common.h). bfloat needs MSL 3.1 (macOS 14) on Metal: offered only when the
# launcher compiles 3.1 or later (_metal_backend.require_bfloat).
KERNEL_DTYPES_WITH_HALF: Dict[str, Tuple[torch.dtype, ...]] = {
    "metal": (torch.float32, torch.float16, torch.bfloat16),
    "emulator": (torch.float32, torch.float16, torch.bfloat16, torch.float64),
}


def check_tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_int(op: str, name: str, value: object, *, minimum: Optional[int] = None) -> int:
    """``value`` as an ``int``: a Python or NumPy integer (not a bool), ``>= minimum``."""
    n = None
    if not isinstance(value, bool):
        try:
            n = operator.index(value)
        except TypeError:
            pass
    if n is None or (minimum is not None and n < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{op}: {name} must be an int{bound}, got {value!r}")
    return n


def check_number(op: str, name: str, value: object, *, minimum: float = -math.inf,
                 maximum: float = math.inf) -> float:
    """``value`` as a ``float``: a Python or NumPy real number (not a bool) in
    ``[minimum, maximum]`` (so never NaN)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) \
            and minimum <= value <= maximum:
        return float(value)
    if maximum == math.inf:
        bound = "" if minimum == -math.inf else f" >= {minimum:g}"
        raise ValueError(f"{op}: {name} must be a number{bound}, got {value!r}")
    raise ValueError(f"{op}: {name} must lie in [{minimum:g}, {maximum:g}], got {value!r}")


def check_floating(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_floating_point():
        raise ValueError(f"{op}: {name} must be a floating-point tensor, got dtype {t.dtype}")


def check_dim(op: str, name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")


def check_floating_tensor(op: str, name: str, t: object, dim: int) -> torch.Tensor:
    """``t`` is a ``dim``-D floating-point tensor (checked in that order)."""
    check_tensor(op, name, t)
    check_dim(op, name, t, dim)
    check_floating(op, name, t)
    return t


def check_length(op: str, name: str, t: torch.Tensor, length: int, what: str) -> None:
    """``t`` is 1-D with ``length`` elements; ``what`` says where the length comes from."""
    check_dim(op, name, t, 1)
    if t.shape[0] != length:
        raise ValueError(f"{op}: {name} has {t.shape[0]} elements but {what} is {length}")


def check_same_dtype(op: str, tensors: Dict[str, Optional[torch.Tensor]]) -> torch.dtype:
    """All given tensors (``None`` skipped) share the dtype of the first one."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but {first_name} has "
                             f"dtype {first.dtype}; they must match")
    return first.dtype


def check_same_device(op: str, tensors: Dict[str, Optional[torch.Tensor]]) -> torch.device:
    """All given tensors (``None`` skipped) are on the device of the first one."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on "
                             f"{first.device}; all tensors must be on one device")
    return first.device


def check_kernel_dtype(op: str, dtype: torch.dtype, backend: str, *,
                       table: Optional[Dict[str, Tuple[torch.dtype, ...]]] = None) -> None:
    """The backend has kernels for ``dtype`` (any floating dtype for "reference", or any
    backend ``table`` does not list). ``table``: an op's own backend -> dtypes map, for ops
    instantiated for more dtypes than :data:`KERNEL_DTYPES` (default)."""
    supported = (KERNEL_DTYPES if table is None else table).get(backend)
    if supported is None or dtype in supported:
        return
    names = ", ".join(str(d) for d in supported)
    hint = " (float64 runs only on the emulator: Metal has no double)" \
        if dtype == torch.float64 else ""
    raise ValueError(f"{op}: dtype {dtype} is not supported by backend {backend!r}; "
                     f"supported: {names}{hint}")


def check_fits_uint32(op: str, what: str, n: int) -> None:
    """Kernels index with 32-bit ``uint``: grids and flat offsets must fit."""
    if n > UINT32_MAX:
        raise ValueError(f"{op}: {what} is {n}, past the 32-bit limit {UINT32_MAX} "
                         "of the kernels' indexing")


def _check_index_dtype(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: {name} must be an int32 (or int64) tensor, got dtype {t.dtype}")


def validate_csr(op: str, indptr: torch.Tensor, indices: torch.Tensor, *, n_cols: int,
                 n_rows: Optional[int] = None,
                 names: Tuple[str, str, str, str] = ("indptr", "indices", "out_features",
                                                     "in_features")
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Check a CSR pattern and return ``(indptr, indices)`` as contiguous int32 tensors.

    ``indptr`` has ``n_rows + 1`` entries (any length >= 1 when ``n_rows`` is None), starts
    at 0, never decreases and ends at ``nnz = len(indices)``; every index lies in
    ``[0, n_cols)``. int64 arrays are accepted and converted; values past 2**31 - 1 are an
    error. The value checks read back one small tensor: a single device sync. ``names``:
    what the messages call the two arrays and the row and column counts (a block pattern's
    are ``crow``, ``col`` and its block rows and columns).
    """
    ptr_name, idx_name, rows_name, cols_name = names
    check_tensor(op, ptr_name, indptr)
    check_tensor(op, idx_name, indices)
    _check_index_dtype(op, ptr_name, indptr)
    _check_index_dtype(op, idx_name, indices)
    check_dim(op, ptr_name, indptr, 1)
    check_dim(op, idx_name, indices, 1)
    check_same_device(op, {ptr_name: indptr, idx_name: indices})
    if indptr.shape[0] == 0:
        raise ValueError(f"{op}: {ptr_name} is empty; it needs {rows_name} + 1 >= 1 elements")
    if n_rows is not None and indptr.shape[0] != n_rows + 1:
        raise ValueError(f"{op}: {ptr_name} has {indptr.shape[0]} elements but {rows_name} + 1 "
                         f"is {n_rows + 1}")
    nnz = indices.shape[0]
    if nnz > INT32_MAX:
        raise ValueError(f"{op}: nnz = {nnz} is past the int32 limit {INT32_MAX}")
    if n_cols > INT32_MAX:
        raise ValueError(f"{op}: {cols_name} = {n_cols} is past the int32 limit {INT32_MAX}")

    # One read-back for every value check (each .item() would be a sync on MPS).
    p = indptr.long()
    i = indices.long()
    empty = torch.zeros((), dtype=torch.long, device=p.device)
    stats = torch.stack([
        p[0], p[-1], p.min(), p.max(),
        (p[1:] < p[:-1]).sum() if p.shape[0] > 1 else empty,
        i.min() if nnz else empty, i.max() if nnz else empty,
    ]).tolist()
    first, last, p_min, p_max, n_decreasing, i_min, i_max = stats

    for name, lo, hi in ((ptr_name, p_min, p_max), (idx_name, i_min, i_max)):
        if hi > INT32_MAX or lo < -INT32_MAX - 1:
            raise ValueError(f"{op}: {name} holds values past the int32 range (min {lo}, "
                             f"max {hi}, limit {INT32_MAX}); the kernels index with int32")
    if first != 0:
        raise ValueError(f"{op}: {ptr_name} must start at 0, got {first}")
    if n_decreasing:
        raise ValueError(f"{op}: {ptr_name} must not decrease, but it does in {n_decreasing} "
                         "place(s)")
    if last != nnz:
        raise ValueError(f"{op}: {ptr_name} must end at nnz = len({idx_name}) = {nnz}, got {last}")
    if nnz and (i_min < 0 or i_max >= n_cols):
        bad = i_min if i_min < 0 else i_max
        raise ValueError(f"{op}: {idx_name} must lie in [0, {cols_name}) = [0, {n_cols}), "
                         f"found {bad}")
    return (indptr.to(torch.int32).contiguous(), indices.to(torch.int32).contiguous())


def flat_batch(op: str, name: str, t: torch.Tensor, features: int,
               contiguous: bool = True) -> Tuple[torch.Tensor, Sequence[int]]:
    """``(*, features)`` -> ``((batch, features), leading shape)``; contiguous unless
    ``contiguous`` is False (then a 2-D ``t`` keeps its layout)."""
    if t.dim() == 0:
        raise ValueError(f"{op}: {name} must have at least 1 dimension (*, {features}), "
                         "got a 0-D tensor")
    if t.shape[-1] != features:
        raise ValueError(f"{op}: {name} has {t.shape[-1]} features in its last dimension "
                         f"but in_features is {features}")
    lead = tuple(t.shape[:-1])
    # math.prod, not -1: reshape(-1, 0) is ambiguous when in_features is 0.
    flat = t.reshape(math.prod(lead), features)
    return (flat.contiguous() if contiguous else flat), lead
