"""Autocast for the package's ops, as torch's own ops have it.

Under ``torch.autocast(device_type, dtype=...)`` torch casts the floating-point arguments
of ops such as ``linear`` and ``mm`` to the autocast dtype (float16 or bfloat16) before they
run (its ``lower_precision_fp`` policy), and those of ops such as ``cross_entropy`` to
float32 (``fp32``); float64 tensors and tensors of another device are left alone.
:func:`register` gives an op of this package one of the two rules at the
``Autocast<device>`` dispatch keys (``CPU`` for the emulator, ``MPS`` for the Metal
launcher): the cast is an ordinary differentiable ``to``, so a float32 parameter receives
its gradient in float32, and the kernels see one dtype.

The ops' Python entry points validate their arguments before the dispatcher sees them;
:func:`kernel_dtype` tells them which dtype the op will run in under autocast, so that a
float32 weight with a float16 input (what an autocast model passes a layer) is accepted
where it would otherwise be a dtype mismatch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch


# The autocast dispatch key of each kernel backend's device type. AutocastMPS arrived in
# torch 2.5; with an older torch, MPS has no autocast to follow.
_AUTOCAST_KEYS = (("cpu", "AutocastCPU"), ("mps", "AutocastMPS"))


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast casts ``device``'s floating tensors to, or None when autocast is off
    for its device type."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def _eligible(t: torch.Tensor, device_type: str) -> bool:
    """torch's autocast eligibility: floating, not float64, on the autocast's device type."""
    return (t.is_floating_point() and t.dtype != torch.float64
            and t.device.type == device_type)


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and _eligible(value, device_type):
        return value.to(dtype)
    return value


def kernel_dtype(op: str, tensors: Dict[str, Optional[torch.Tensor]],
                 to: Optional[torch.dtype] = None) -> torch.dtype:
    """The dtype ``op`` runs in for these floating-point tensors (``None`` skipped, the first
    one's device deciding): their common dtype, or under autocast the dtype its rule gives
    them (``to``: float32 for the fp32 rule, None for the autocast dtype). Raises ValueError
    naming two that differ."""
    items = [(name, t) for name, t in tensors.items() if t is not None]
    device = items[0][1].device
    dtype = autocast_dtype(device)
    if dtype is not None and to is not None:
        dtype = to
    dtypes = [(name, dtype if dtype is not None and _eligible(t, device.type) else t.dtype)
              for name, t in items]
    (first_name, first), *rest = dtypes
    for name, other in rest:
        if other != first:
            where = ("under torch.autocast" if dtype is not None else
                     "(torch.autocast would cast float16, bfloat16 and float32 to one)")
            raise ValueError(f"{op}: {name} has dtype {other} but {first_name} has dtype "
                             f"{first}; they must match {where}")
    return first


def cast_for_reference(device: torch.device, *tensors: Any) -> tuple:
    """``tensors`` as the op's autocast kernel would pass them on (the plain-torch path runs
    the same dtypes as the kernels)."""
    dtype = autocast_dtype(device)
    if dtype is None:
        return tensors
    return tuple(_cast(t, device.type, dtype) for t in tensors)


def register(library: torch.library.Library, name: str, op: torch._ops.OpOverload,
             to: Optional[torch.dtype] = None) -> None:
    """``op``'s kernels at the autocast keys: its floating arguments cast to ``to`` (float32:
    torch's fp32 rule), or to the autocast dtype (None), then ``op`` again with that key
    excluded (what ``torch.library.register_autocast`` does, with the dtype autocast is set
    to rather than a fixed one)."""
    for device_type, key in _AUTOCAST_KEYS:
        if hasattr(torch._C.DispatchKey, key):
            library.impl(name, _kernel(op, device_type, key, to), key, with_keyset=True)


def _kernel(op: torch._ops.OpOverload, device_type: str, key: str,
            to: Optional[torch.dtype]) -> Callable[..., Any]:
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(keyset, *args):
        dtype = to or torch.get_autocast_dtype(device_type)
        cast = [_cast(a, device_type, dtype) for a in args]
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*cast)
    return kernel
