"""Where host code would drain an Apple GPU: ``watch()`` lists a block's host-device syncs.

On MPS every host read of device data (``.item()``, ``bool(t)``, ``.tolist()``,
``.cpu()``), every blocking copy of host data to the device (``torch.tensor(data,
device="mps")``, ``torch.from_numpy(a).to("mps")``) and every op whose output size depends
on the data (``nonzero``, boolean-mask indexing, ``bincount``, ``unique``) commits torch's
command buffer and waits for the GPU to finish it. On CPU tensors, where the emulator runs,
the same calls cost nothing, so a sync-free training step cannot be shown by timing here.
It is shown by counting them::

    with tsm.syncs.watch() as syncs:
        loss = loss_fn(model(x), y); loss.backward(); opt.step()
    assert not syncs.events, syncs.report()

What is counted is what the host code does to tensors, whatever device they are on (a
read of a CPU tensor counts too: on CPU the watcher cannot tell the device's tensors from
the host's), so the rule the package keeps is stricter than MPS needs: its hot paths read
no tensor at all. Calls made by the emulator itself (``torch_sparse_metal.emulator``), which
stands in for the GPU, are not counted.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncEvent", "SyncWatch", "watch"]

_aten = torch.ops.aten
# Ops that hand a tensor's value to the host.
_READS = {_aten._local_scalar_dense.default: "reads a value back (.item(), bool(), int())",
          _aten.item.default: "reads a value back (.item())",
          _aten.is_nonzero.default: "reads a value back (bool(), if t:)",
          _aten.equal.default: "reads a comparison back (torch.equal)"}
# Copies that may cross between the host and a device. Inside one of the package's ops the
# watcher sees the composite `to` as well as what it becomes.
_COPIES = {_aten._to_copy.default, _aten.copy_.default, _aten.to.device, _aten.to.other,
           _aten.to.dtype_layout}
# Ops whose output size is computed from the data: on MPS they wait for the GPU first.
_DATA_SIZED = {_aten.nonzero.default: "nonzero (output size from the data)",
               _aten.masked_select.default: "masked_select (output size from the data)",
               _aten.bincount.default: "bincount (its length is max + 1 of the data)",
               _aten._unique2.default: "unique (output size from the data)",
               _aten.unique_consecutive.default: "unique_consecutive (output size from the data)",
               _aten.unique_dim.default: "unique (output size from the data)",
               _aten.histc.default: "histc (reads the range back when min == max)"}
# A tensor made from host data (torch.tensor, torch.as_tensor, torch.from_numpy): on
# MPS the copy to the device is blocking.
_FROM_HOST = _aten.lift_fresh.default
_EMULATOR = "torch_sparse_metal.emulator"
_NAMESPACE = "torch_sparse_metal"
_BACKEND_KEYS = {"cpu": torch._C.DispatchKey.CPU, "mps": torch._C.DispatchKey.MPS}


@dataclass(frozen=True)
class SyncEvent:
    """One call that would synchronise on MPS: its ``kind`` ("read", "copy to host",
    "copy to device", "data-sized"), what it was, and the innermost frame of the caller's
    code that made it (``file:line in function``)."""
    kind: str
    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.what} at {self.where}"


@dataclass
class SyncWatch:
    """The events of a ``watch()`` block, in order."""
    events: List[SyncEvent] = field(default_factory=list)

    def report(self) -> str:
        if not self.events:
            return "no host-device synchronisation"
        lines = [f"{len(self.events)} host-device synchronisation(s):"]
        lines += [f"  {e}" for e in self.events]
        return "\n".join(lines)


def _caller() -> Optional[str]:
    """The innermost frame outside torch and this module, or None when the emulator made
    the call (it is the device, not host code)."""
    for frame, line in traceback.walk_stack(sys._getframe(2)):
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_EMULATOR):
            return None
        if module == __name__ or module == "torch" or module.startswith(("torch.", "contextlib")):
            continue
        code = frame.f_code
        return f"{code.co_filename}:{line} in {code.co_name}"
    return "<unknown>"


def _index_is_boolean(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()) if i is not None)


class _Watcher(TorchDispatchMode):
    def __init__(self, record: Callable[[str, str], None]) -> None:
        super().__init__()
        self._record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            self._record("read", _READS[func])
        elif func in _DATA_SIZED:
            self._record("data-sized", _DATA_SIZED[func])
        elif func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._record("data-sized", "repeat_interleave without output_size")
        elif func in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default) \
                and _index_is_boolean(args):
            self._record("data-sized", f"{func.__name__} with a boolean mask (a nonzero)")
        elif func is _FROM_HOST:
            self._record("copy to device", "a tensor made from host data (torch.tensor, "
                                           "torch.as_tensor, torch.from_numpy)")
        elif func in _COPIES:
            self._check_transfer(func, args, kwargs)
        elif func.namespace == _NAMESPACE:
            return self._run_watched(func, args, kwargs)
        return func(*args, **kwargs)

    def _run_watched(self, func, args, kwargs):
        """Run one of the package's ops with this watcher still on: torch calls a mode with
        itself switched off, which would hide what the op's host code does (its kernel is
        Python, and reads or copies there are what this module is for). Its backend kernel
        is called directly, with the watcher pushed again around it."""
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        key = _BACKEND_KEYS.get(tensors[0].device.type if tensors else "cpu")
        if key is None:
            return func(*args, **kwargs)
        with _Watcher(self._record):
            return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)

    def _check_transfer(self, func, args, kwargs) -> None:
        bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                 for i, a in enumerate(func._schema.arguments)}
        if func is _aten.copy_.default:
            dst, src = bound["self"].device, bound["src"].device
        else:
            src = bound["self"].device
            other = bound.get("other")
            dst = other.device if isinstance(other, torch.Tensor) else \
                torch.device(bound.get("device") or src)
        if src.type == dst.type:
            return
        if dst.type == "cpu":
            self._record("copy to host", f"{func.__name__} from {src} to the host")
        elif not bound.get("non_blocking"):
            self._record("copy to device", f"blocking {func.__name__} from the host to {dst}")


# Tensor methods that read the data on the host without dispatching an op for CPU tensors.
_HOST_READERS = {"tolist": "copy to host", "numpy": "copy to host", "__array__": "copy to host"}


@contextlib.contextmanager
def watch() -> Iterator[SyncWatch]:
    """Record every call in the block that would synchronise the GPU on MPS.

    While it is active it replaces ``Tensor.tolist``, ``Tensor.numpy`` and
    ``Tensor.__array__`` (CPU tensors read their data without dispatching an op), so calls
    from other threads are counted too; the ops are watched on this thread and on
    autograd's (which inherit its dispatch modes).
    """
    result = SyncWatch()

    def record(kind: str, what: str) -> None:
        where = _caller()
        if where is not None:
            result.events.append(SyncEvent(kind, what, where))

    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READERS}

    def reader(name: str, original):
        def method(self, *args, **kwargs):
            record(_HOST_READERS[name], f"Tensor.{name}()")
            return original(self, *args, **kwargs)
        method.__name__ = name
        return method

    for name, original in originals.items():
        setattr(torch.Tensor, name, reader(name, original))
    try:
        with _Watcher(record):
            yield result
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
