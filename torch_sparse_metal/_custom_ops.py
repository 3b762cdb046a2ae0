"""The package's ``torch.library`` namespace, ``torch_sparse_metal``: every kernel launch is an op.

Each op module (``ops/``, ``nn/functional.py``, ``optim/adamw.py``) defines its ops here with
:func:`define`: a schema, the kernel (host code that allocates and launches), a fake
implementation (shapes and dtypes only, for ``torch.compile``, ``torch.export`` and
``opcheck``) and, for differentiable ops, a backward formula and its ``setup_context``,
registered as the op's ``Autograd`` kernel (:func:`autograd_kernel`); the other ops'
``Autograd`` kernel refuses a gradient (:func:`not_differentiable_kernel`). Under
``torch.compile`` the ops are opaque nodes of the graph; in eager mode they run through the
dispatcher.

Backends. Which implementation runs (metal / emulator / reference) stays a Python decision
made at call time by the public functions (:func:`torch_sparse_metal._backend.resolve_backend`):

* ``"reference"`` never calls an op: the public function runs plain torch ops, which
  ``torch.compile`` traces natively;
* the kernel backends call the op, and the dispatcher picks the kernel from the device,
  which is exactly what ``resolve_backend`` requires of each: the kernel registered for
  ``CPU`` runs on the emulator, the one for ``MPS`` on the Metal launcher. A backward
  runs on the device its forward ran on, so it uses the backend the forward resolved.

Registration style, chosen by the per-call cost ``python -m torch_sparse_metal.bench ops``
measures (numbers in docs/pytorch-integration.md): the low-level ``Library.define`` / ``Library.impl`` with
``register_fake``, and the autograd formula registered by ``Library.impl`` at the
``Autograd`` key. That is the cheapest style ``torch.compile`` can trace and ``opcheck`` can
check: ``torch.library.custom_op`` costs more per call, and so does
``torch.library.register_autograd``, by an amount that grows with the op's number of
arguments; a plain ``autograd.Function`` costs less but ``torch.compile`` breaks the
graph at the launch inside it. Callers keep the ``OpOverload`` :func:`define` returns and
call it directly (no attribute lookups per call).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Union

import torch

from . import _autocast

NAMESPACE = "torch_sparse_metal"
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
DEFINED: List[str] = []  # every op's name, in definition order (the tests opcheck each)

# The dispatch key of each kernel backend's tensors.
_BACKEND_KEYS = (("emulator", "CPU"), ("metal", "MPS"))


def define(schema: str, kernel: Callable[..., Any], fake: Callable[..., Any], *,
           backward: Optional[Callable[..., Any]] = None,
           setup_context: Optional[Callable[..., Any]] = None,
           autocast: Union[bool, torch.dtype] = False) -> torch._ops.OpOverload:
    """Register ``torch_sparse_metal::<schema>`` and return its ``OpOverload``.

    ``kernel(*args, backend=...)`` runs the op's kernels on ``backend`` (``"emulator"`` for
    CPU tensors, ``"metal"`` for MPS tensors); ``fake(*args)`` returns outputs of the right
    shapes, dtypes and devices without touching data. ``backward`` / ``setup_context``: as
    ``torch.library.register_autograd`` takes them; omitted, the op is not differentiable and
    a gradient through it raises (:func:`not_differentiable_kernel`). ``autocast``: under
    ``torch.autocast`` the op's floating arguments are cast first, to the autocast dtype
    (True) as torch's ``linear`` does, or to ``torch.float32`` as its ``cross_entropy``
    does (:mod:`torch_sparse_metal._autocast`).
    """
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    DEFINED.append(name)
    for backend, key in _BACKEND_KEYS:
        _LIBRARY.impl(name, functools.partial(kernel, backend=backend), key)
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    autograd = (not_differentiable_kernel(op) if backward is None
                else autograd_kernel(op, backward, setup_context))
    _LIBRARY.impl(name, autograd, "Autograd", with_keyset=True)
    if autocast is not False:
        _autocast.register(_LIBRARY, name, op, None if autocast is True else autocast)
    return op


def autograd_kernel(op: torch._ops.OpOverload, backward: Callable[..., Any],
                    setup_context: Callable[..., Any]) -> Callable[..., Any]:
    """The kernel of ``op`` for the ``Autograd`` dispatch key (register it with
    ``with_keyset=True``): when a gradient is needed, an ``autograd.Function`` whose forward
    runs ``op`` one level down the dispatcher and then ``setup_context(ctx, inputs,
    output)``, and whose backward is ``backward(ctx, *grads)`` (a tuple: one gradient or
    None per input); otherwise just ``op`` one level down.

    This is what ``torch.library.register_autograd`` builds, without its per-call
    rebuilding of the arguments from the schema, which costs it about 30 us per call for
    an op of 13 arguments such as ``sparse_linear`` (``bench ops`` measures both).
    """
    below_autograd = torch._C._after_autograd_keyset

    def forward(ctx, *args):
        *inputs, keyset = args  # last, so that ctx.needs_input_grad[i] is input i's
        with torch._C._AutoDispatchBelowAutograd():
            output = op.redispatch(keyset & below_autograd, *inputs)
        setup_context(ctx, tuple(inputs), output)
        return output

    def backward_and_keyset(ctx, *grads):
        return (*backward(ctx, *grads), None)

    function = type(f"{op._opname}_autograd", (torch.autograd.Function,),
                    {"forward": staticmethod(forward),
                     "backward": staticmethod(backward_and_keyset)})

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return function.apply(*args, keyset)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)
    return kernel


def not_differentiable_kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """The ``Autograd`` kernel of an op without a derivative. Without one, torch's fallback
    only warns, and a backward through the op gives the inputs no gradient from it (a
    silent zero, or a partial sum). With inputs that require grad (under grad mode), an op
    that writes its arguments in place raises at once; any other runs, and a backward that
    reaches it raises, naming the op."""
    name = f"{NAMESPACE}::{op._opname}"
    written = [arg.name for arg in op._schema.arguments
               if arg.alias_info is not None and arg.alias_info.is_write]
    if written:
        below_autograd = torch._C._after_autograd_keyset

        def kernel(keyset, *args):
            if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
                raise RuntimeError(
                    f"{name} writes {', '.join(written)} in place and has no derivative, but "
                    "an argument requires grad: call it under torch.no_grad() (an optimizer "
                    "step is not part of the graph)")
            with torch._C._AutoDispatchBelowAutograd():
                return op.redispatch(keyset & below_autograd, *args)
        return kernel

    def refuse(ctx, *grads):
        raise RuntimeError(
            f"{name} has no derivative: a gradient was asked through it. Detach its inputs "
            "if none is wanted, or compute this step with torch's own differentiable ops "
            "(tsm.use_backend('reference') runs the package's functions so)")
    return autograd_kernel(op, refuse, lambda ctx, inputs, output: None)


def empty_like_none(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an op returns for an output it did not compute (ops return tensors,
    never None): an empty tensor of ``like``'s dtype and device."""
    return like.new_empty(0)
