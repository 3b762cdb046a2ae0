"""What registering a kernel as a torch op costs per call, by registration style.

A no-op kernel (``shaders/bench/noop.metal``) wrapped five ways, each one launching it and
returning a new tensor, and timed per call:

* ``direct``: a plain Python function (what the ops cost before they were torch ops);
* ``autograd.Function``: ``Function.apply`` (differentiable, but ``torch.compile`` traces
  into it and breaks the graph at the launch);
* ``custom_op``: ``torch.library.custom_op`` with ``register_fake`` and
  ``register_autograd``;
* ``Library+register_autograd``: the low-level ``Library.define`` / ``Library.impl`` with
  ``register_fake`` and ``torch.library.register_autograd``;
* ``Library+Autograd kernel``: the low-level ``Library.define`` / ``Library.impl`` with
  ``register_fake``, the autograd formula registered by ``Library.impl`` at the
  ``Autograd`` key (:func:`torch_sparse_metal._custom_ops.autograd_kernel`): the style the
  package's ops use.

Each op is defined twice: with one argument, and with 13 like ``sparse_linear`` (9
tensors, a string, 3 flags), since some styles cost more per argument. Each is timed with
an input that does not and one that does require grad (autograd then records the call), as
the minimum over ``repeats`` rounds of ``calls`` calls, styles interleaved round by round.
The ``launch=False`` rows time the same wrappers around no launch at all: the
registration's own cost, without the launch's noise. On MPS a round ends with
``torch.mps.synchronize()``; the time per call is the host's (what a launch-bound step
pays), not the GPU's.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List

import torch

from .. import _custom_ops, _launch, _metal_backend

SHADER = "bench/noop.metal"
STYLES = ("direct", "autograd.Function", "custom_op", "Library+register_autograd",
          "Library+Autograd kernel")
ARGUMENTS = (1, 13)
_NAMESPACE = "torch_sparse_metal_bench"
_LIBRARY = torch.library.Library(_NAMESPACE, "DEF")
_SCHEMAS = {1: "(Tensor x) -> Tensor",
            13: "(Tensor x, " + ", ".join(f"Tensor t{i}" for i in range(8))
                + ", str? s, bool b0, bool b1, bool b2) -> Tensor"}
_registered: Dict[tuple, Dict[str, Callable]] = {}  # (backend, launch, arguments) -> wrappers


def _wrappers(backend: str, launch: bool, arguments: int) -> Dict[str, Callable]:
    """The five styles around one body: launch the no-op kernel (``launch``), return a new
    tensor. Registered under names unique to the three parameters."""
    def body(x: torch.Tensor, *rest) -> torch.Tensor:
        if launch:
            _launch.launch(SHADER, "noop", (x,), threads=1, group_size=1, backend=backend)
        return x.new_empty(x.shape)

    def fake(x: torch.Tensor, *rest) -> torch.Tensor:
        return x.new_empty(x.shape)

    def backward(ctx, grad: torch.Tensor):
        return (grad,) + (None,) * (arguments - 1)

    def setup_context(ctx, inputs, output) -> None:
        pass

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            return body(*args)

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx, grad)

    key = "CPU" if backend == "emulator" else "MPS"
    suffix = f"{backend}_{'launch' if launch else 'nothing'}_{arguments}"
    schema = _SCHEMAS[arguments]
    custom = torch.library.custom_op(f"{_NAMESPACE}::custom_{suffix}", mutates_args=(),
                                     schema=schema)(body)
    custom.register_fake(fake)
    custom.register_autograd(backward, setup_context=setup_context)
    ops = {}
    for style in STYLES[3:]:
        name = f"{'generic' if 'register' in style else 'kernel'}_{suffix}"
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, body, key)
        torch.library.register_fake(f"{_NAMESPACE}::{name}", fake, lib=_LIBRARY)
        ops[style] = op = getattr(getattr(torch.ops, _NAMESPACE), name).default
        if "register" in style:
            torch.library.register_autograd(f"{_NAMESPACE}::{name}", backward,
                                            setup_context=setup_context, lib=_LIBRARY)
        else:
            _LIBRARY.impl(name, _custom_ops.autograd_kernel(op, backward, setup_context),
                          "Autograd", with_keyset=True)
    return dict(zip(STYLES, (body, Function.apply, custom, *ops.values())))


def _arguments(x: torch.Tensor, arguments: int) -> tuple:
    if arguments == 1:
        return (x,)
    small = torch.empty(1, dtype=torch.int32, device=x.device)
    return (x, *[small] * 8, None, True, False, False)


def run(calls: int = 2000, repeats: int = 5, device: str = "emulator") -> List[Dict[str, object]]:
    """Rows ``{style, launch, arguments, requires_grad, us_per_call, overhead_us}``;
    ``overhead_us`` is the time per call over the direct call's with the same input,
    arguments and body."""
    backend = "metal" if device == "mps" else "emulator"
    sync = torch.mps.synchronize if device == "mps" else (lambda: None)
    rows = []
    for launch in (True, False):
        for arguments in ARGUMENTS:
            key = (backend, launch, arguments)
            if key not in _registered:
                _registered[key] = _wrappers(backend, launch, arguments)
            wrappers = _registered[key]
            for requires_grad in (False, True):
                x = torch.zeros(4, device="mps" if device == "mps" else "cpu",
                                requires_grad=requires_grad)
                args = _arguments(x, arguments)
                best = {style: float("inf") for style in STYLES}
                for fn in wrappers.values():  # warm up: compile, first dispatch
                    for _ in range(min(calls, 50)):
                        fn(*args)
                for _ in range(repeats):
                    for style, fn in wrappers.items():
                        sync()
                        start = time.perf_counter()
                        for _ in range(calls):
                            fn(*args)
                        sync()
                        best[style] = min(best[style], (time.perf_counter() - start) / calls)
                for style in STYLES:
                    rows.append(dict(style=style, launch=launch, arguments=arguments,
                                     requires_grad=requires_grad,
                                     us_per_call=1e6 * best[style],
                                     overhead_us=1e6 * (best[style] - best["direct"])))
    return rows


def default_device() -> str:
    return "mps" if _metal_backend.is_available() else "emulator"


def format_table(rows: List[Dict[str, object]], device: str) -> str:
    where = ("host time per call on MPS" if device == "mps" else
             "Metal EMULATOR on the CPU: host time per call, this machine only")
    lines = [f"per-call cost of each op registration style ({where}; minimum over rounds)",
             f"{'style':<26} {'body':<12} {'args':>4} {'us/call':>9} {'+ direct':>9} "
             f"{'grad us/call':>13} {'+ direct':>9}"]
    for launch in (True, False):
        for arguments in ARGUMENTS:
            for style in STYLES:
                pair = sorted((r for r in rows if (r["style"], r["launch"], r["arguments"])
                               == (style, launch, arguments)), key=lambda r: r["requires_grad"])
                if len(pair) < 2:
                    continue
                plain, grad = pair
                lines.append(f"{style:<26} {'no-op kernel' if launch else 'no launch':<12} "
                             f"{arguments:>4} {plain['us_per_call']:>9.2f} "
                             f"{plain['overhead_us']:>+9.2f} {grad['us_per_call']:>13.2f} "
                             f"{grad['overhead_us']:>+9.2f}")
    lines.append("grad: the input requires grad (autograd records the call). The package's ops "
                 "use Library+Autograd kernel.")
    return "\n".join(lines)
