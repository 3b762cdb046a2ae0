"""KMeans never makes a float64 tensor on the data's device (MPS has no float64).

There is no MPS device here, so the test gives the CPU two roles and tracks which one each
tensor plays. :class:`DeviceFloat64Guard` is a ``TorchFunctionMode`` that sees every torch
call the package makes (functions, methods, factories) and marks tensors as "on the
device" by provenance:

* the input data is on the device;
* anything an op computes from a device tensor is on the device, and so is anything made
  with an explicit ``device=`` argument or moved with ``.to(<some device>)`` (in the
  package every explicit device is the data's device: ``device=x.device``);
* ``.cpu()`` is the one way back to the host: under the guard it returns a fresh alias, so
  the host copy is a distinct object even though on the CPU ``t.cpu()`` is ``t`` itself;
  likewise factories without ``device=`` (``torch.zeros(n)``, ``torch.rand(...)``) and
  ``torch.from_numpy`` make host tensors.

Any op that returns a float64 device tensor is recorded with the caller's source line. On
a real MPS device exactly those ops fail (``x.double()``, ``x.sum(dtype=torch.float64)``,
``x.to(torch.float64)``, ...), while ``.cpu().double()`` is fine. What the guard cannot
see: ops that run outside torch's Python API (the emulator's kernels write into tensors
the package allocated through torch, which the guard has already classified), and a
``.to("cpu")`` spelled that way would be counted as a move to the device, a false alarm
(the package uses ``.cpu()``), never a missed one.
"""
from __future__ import annotations

import os
import traceback

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

import torch_sparse_metal as tsm
from torch_sparse_metal.cluster import kmeans as kmeans_module

_MARK = "_tsm_test_on_device"


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _on_device(t: torch.Tensor) -> bool:
    return getattr(t, _MARK, False)


def _mark(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _MARK, True)
    return t


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, str)) for a in args)


def _caller() -> traceback.FrameSummary:
    """The innermost frame outside torch and this file: the line that made the op."""
    frames = traceback.extract_stack()
    for frame in reversed(frames):
        if frame.filename != __file__ and f"{os.sep}torch{os.sep}" not in frame.filename:
            return frame
    return frames[-1]


class DeviceFloat64Guard(TorchFunctionMode):
    """Records every torch call that yields a float64 tensor on the (simulated) device."""

    def __init__(self) -> None:
        super().__init__()
        self.violations = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", repr(func))
        if name == "cpu":  # device -> host: a new object, unmarked
            return out.view_as(out) if out is args[0] else out
        if name == "to":
            on_device = _names_a_device(args[1:], kwargs) or _on_device(args[0])
        else:
            on_device = (any(_on_device(t) for t in _tensors((args, kwargs)))
                         or kwargs.get("device") is not None)
        if on_device:
            for t in _tensors(out):
                _mark(t)
                if t.dtype == torch.float64:
                    caller = _caller()
                    self.violations.append(f"{name} at {caller.filename}:{caller.lineno}: "
                                           f"{caller.line}")
        return out


def test_guard_catches_device_float64_and_allows_host_float64():
    x = _mark(torch.randn(4, 3))
    with DeviceFloat64Guard() as guard:
        x.cpu().double().sum()                       # host: fine
        torch.zeros(3, dtype=torch.float64)          # host factory: fine
        (x * 2).cpu().sum(dtype=torch.float64)       # fine
        torch.zeros(3, dtype=torch.float64).to(x.dtype).to(x.device)  # back to the device
    assert guard.violations == []
    with DeviceFloat64Guard() as guard:
        x.double()
        x.sum(dtype=torch.float64)
        torch.zeros(3, dtype=torch.float64, device=x.device)
        torch.zeros(3, dtype=torch.float64).to(x.device)
        x.double().cpu()
    assert len(guard.violations) == 5, guard.violations


@pytest.mark.parametrize("backend", ["reference", "emulator"])
@pytest.mark.parametrize("init", ["k-means++", "random"])
def test_kmeans_makes_no_float64_on_the_device(backend, init):
    g = torch.Generator().manual_seed(0)
    centers = torch.tensor([[0.0, 0.0], [5.0, 5.0], [-5.0, 5.0]])
    x = (centers.repeat_interleave(30, 0) + 0.4 * torch.randn(90, 2, generator=g))
    x = _mark(x[torch.randperm(90, generator=g)].contiguous())
    with tsm.use_backend(backend), DeviceFloat64Guard() as guard:
        km = tsm.KMeans(3, init=init, n_init=2, seed=1, verbose=False).fit(x)
        km.predict(x), km.transform(x), km.score(x), km.assign(x[0]), km(x[:5])
        km.partial_fit(x[:20])
        # Empty-cluster relocation (a centroid far from all data) and partial_fit from
        # scratch, where the data seeds the centroids.
        tsm.KMeans(3, init=torch.tensor([[0.0, 0.0], [5.0, 5.0], [1e4, 1e4]])).fit(x)
        tsm.KMeans(3, init=init, seed=2).partial_fit(x[:30])
    assert guard.violations == [], "\n".join(guard.violations)
    assert km.cluster_centers_.dtype == torch.float32


def test_kmeans_verbose_makes_no_float64_on_the_device(capsys):
    x = _mark(torch.randn(40, 3, generator=torch.Generator().manual_seed(3)))
    with tsm.use_backend("reference"), DeviceFloat64Guard() as guard:
        tsm.KMeans(4, seed=0, verbose=True).fit(x)
    assert guard.violations == [], "\n".join(guard.violations)
    assert "inertia" in capsys.readouterr().out


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200, 1000])
def test_host_sum_is_float64_accurate(n):
    g = torch.Generator().manual_seed(n)
    t = torch.rand(n, 3, generator=g) * 1e3
    got = kmeans_module._host_sum(t)
    assert got.dtype == torch.float64 and got.device.type == "cpu" and got.shape == (3,)
    exact = t.double().sum(0)
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=0)
    vec = kmeans_module._host_sum(t[:, 0])
    assert vec.shape == () and float(vec) == pytest.approx(float(exact[0]), rel=1e-6)
    assert kmeans_module._host_sum(t[:0]).tolist() == [0.0, 0.0, 0.0]


def test_host_sum_error_does_not_grow_with_n():
    # 2^20 values near 1: only the 64-term block sums round in float32.
    g = torch.Generator().manual_seed(0)
    t = 1.0 + torch.rand(1 << 20, generator=g) * 1e-3
    exact = float(t.double().sum())
    assert float(kmeans_module._host_sum(t)) == pytest.approx(exact, rel=1e-7)


def test_inertia_matches_a_float64_sum():
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(5000, 4)).astype(np.float32))
    with tsm.use_backend("reference"):
        km = tsm.KMeans(5, seed=0).fit(x)
    d = torch.cdist(x.double(), km.cluster_centers_.double()).min(1).values ** 2
    assert km.inertia_ == pytest.approx(float(d.sum()), rel=1e-5)
    assert km.score(x) == pytest.approx(-km.inertia_, rel=1e-9)
