"""What registering a kernel as a torch op costs per call, by registration style.

A no-op kernel (``shaders/bench/noop.metal``) wrapped four ways, each one launching it and
returning a new tensor, and timed per call:

* ``direct``: a plain Python function (what the ops cost before they were torch ops);
* ``autograd.Function``: ``Function.apply`` (differentiable, but opaque to
  ``torch.compile``: a graph break around every call);
* ``custom_op``: ``torch.library.custom_op`` with ``register_fake`` and
  ``register_autograd``;
* ``Library.define``: the low-level ``torch.library.Library.define`` / ``impl`` with
  ``register_fake`` and ``register_autograd``: the style the package's ops use
  (:mod:`torch_sparse_metal._custom_ops`).

Each is timed with an input that does not and one that does require grad (autograd then
records the call), as the minimum over ``repeats`` rounds of ``calls`` calls, styles
interleaved round by round. ``kernel=False`` rows time the same wrappers around no launch
at all: the registration's own cost, without the launch's noise. On MPS a round ends with
``torch.mps.synchronize()``; the time per call is the host's (what a launch-bound step
pays), not the GPU's.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List

import torch

from .. import _launch, _metal_backend

SHADER = "bench/noop.metal"
STYLES = ("direct", "autograd.Function", "custom_op", "Library.define")
_NAMESPACE = "torch_sparse_metal_bench"
_LIBRARY = torch.library.Library(_NAMESPACE, "DEF")
_registered: Dict[tuple, Dict[str, Callable]] = {}  # (backend, kernel) -> the four wrappers


def _wrappers(backend: str, kernel: bool) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The four styles around one body: launch the no-op kernel (``kernel``), return a
    new tensor. Registered under names unique to ``backend`` and ``kernel``."""
    def body(x: torch.Tensor) -> torch.Tensor:
        if kernel:
            _launch.launch(SHADER, "noop", (x,), threads=1, group_size=1, backend=backend)
        return x.new_empty(x.shape)

    def fake(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)

    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return body(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    suffix = f"{backend}_{'kernel' if kernel else 'nothing'}"
    custom = torch.library.custom_op(f"{_NAMESPACE}::custom_{suffix}", mutates_args=())(body)
    custom.register_fake(fake)
    custom.register_autograd(backward)

    name = f"low_level_{suffix}"
    _LIBRARY.define(f"{name}(Tensor x) -> Tensor")
    _LIBRARY.impl(name, body, "CPU" if backend == "emulator" else "MPS")
    torch.library.register_fake(f"{_NAMESPACE}::{name}", fake, lib=_LIBRARY)
    torch.library.register_autograd(f"{_NAMESPACE}::{name}", backward, lib=_LIBRARY)
    low_level = getattr(getattr(torch.ops, _NAMESPACE), name).default
    return dict(zip(STYLES, (body, Function.apply, custom, low_level)))


def run(calls: int = 2000, repeats: int = 5, device: str = "emulator") -> List[Dict[str, object]]:
    """Rows ``{style, kernel, requires_grad, us_per_call, overhead_us}``; ``overhead_us`` is
    the time per call over the direct call's with the same input and body."""
    backend = "metal" if device == "mps" else "emulator"
    sync = torch.mps.synchronize if device == "mps" else (lambda: None)
    rows = []
    for kernel in (True, False):
        key = (backend, kernel)
        if key not in _registered:
            _registered[key] = _wrappers(backend, kernel)
        wrappers = _registered[key]
        for requires_grad in (False, True):
            x = torch.zeros(4, device="mps" if device == "mps" else "cpu",
                            requires_grad=requires_grad)
            best = {style: float("inf") for style in STYLES}
            for fn in wrappers.values():  # warm up: compile, first dispatch
                for _ in range(min(calls, 50)):
                    fn(x)
            for _ in range(repeats):
                for style, fn in wrappers.items():
                    sync()
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(x)
                    sync()
                    best[style] = min(best[style], (time.perf_counter() - start) / calls)
            for style in STYLES:
                rows.append(dict(style=style, kernel=kernel, requires_grad=requires_grad,
                                 us_per_call=1e6 * best[style],
                                 overhead_us=1e6 * (best[style] - best["direct"])))
    return rows


def default_device() -> str:
    return "mps" if _metal_backend.is_available() else "emulator"


def format_table(rows: List[Dict[str, object]], device: str) -> str:
    where = ("host time per call on MPS" if device == "mps" else
             "Metal EMULATOR on the CPU: host time per call, this machine only")
    lines = [f"per-call cost of each op registration style ({where}; minimum over rounds)",
             f"{'style':<20} {'body':<14} {'us/call':>9} {'+ vs direct':>12} "
             f"{'us/call grad':>13} {'+ vs direct':>12}"]
    for kernel in (True, False):
        for style in STYLES:
            pair = [r for r in rows if r["style"] == style and r["kernel"] == kernel]
            if len(pair) < 2:
                continue
            plain, grad = sorted(pair, key=lambda r: r["requires_grad"])
            lines.append(f"{style:<20} {'no-op kernel' if kernel else 'no launch':<14} "
                         f"{plain['us_per_call']:>9.2f} {plain['overhead_us']:>+12.2f} "
                         f"{grad['us_per_call']:>13.2f} {grad['overhead_us']:>+12.2f}")
    lines.append("grad: the input requires grad (autograd records the call). The package's ops "
                 "use Library.define.")
    return "\n".join(lines)
