"""The package's ``torch.library`` namespace, ``torch_sparse_metal``: every kernel launch is an op.

Each op module (``ops/``, ``nn/functional.py``, ``optim/adamw.py``) defines its ops here with
:func:`define`: a schema, the kernel (host code that allocates and launches), a fake
implementation (shapes and dtypes only, for ``torch.compile``, ``torch.export`` and
``opcheck``) and, for differentiable ops, a backward formula registered with
``torch.library.register_autograd``. Under ``torch.compile`` the ops are opaque nodes of the
graph; in eager mode they run through the dispatcher.

Backends. Which implementation runs (metal / emulator / reference) stays a Python decision
made at call time by the public functions (:func:`torch_sparse_metal._backend.resolve_backend`):

* ``"reference"`` never calls an op: the public function runs plain torch ops, which
  ``torch.compile`` traces natively;
* the kernel backends call the op, and the dispatcher picks the kernel from the device,
  which is exactly what ``resolve_backend`` requires of each: the kernel registered for
  ``CPU`` runs on the emulator, the one for ``MPS`` on the Metal launcher. A backward
  runs on the device its forward ran on, so it uses the backend the forward resolved.

Registration style: the low-level ``Library.define`` / ``Library.impl`` with
``register_fake`` and ``register_autograd``, chosen by the per-call overhead
``python -m torch_sparse_metal.bench ops`` measures (the README has the numbers): it is the
cheapest style that ``torch.compile`` can trace and ``opcheck`` can check
(``torch.library.custom_op`` adds a few microseconds per call on top of it; a plain
``autograd.Function`` is cheaper still but opaque to neither). Callers keep the
``OpOverload`` :func:`define` returns and call it directly (no attribute lookups per call).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

import torch

NAMESPACE = "torch_sparse_metal"
_LIBRARY = torch.library.Library(NAMESPACE, "DEF")
DEFINED: List[str] = []  # every op's name, in definition order (the tests opcheck each)

# The dispatch key of each kernel backend's tensors.
_BACKEND_KEYS = (("emulator", "CPU"), ("metal", "MPS"))


def define(schema: str, kernel: Callable[..., Any], fake: Callable[..., Any], *,
           backward: Optional[Callable[..., Any]] = None,
           setup_context: Optional[Callable[..., Any]] = None) -> torch._ops.OpOverload:
    """Register ``torch_sparse_metal::<schema>`` and return its ``OpOverload``.

    ``kernel(*args, backend=...)`` runs the op's kernels on ``backend`` (``"emulator"`` for
    CPU tensors, ``"metal"`` for MPS tensors); ``fake(*args)`` returns outputs of the right
    shapes, dtypes and devices without touching data. ``backward`` / ``setup_context``: as
    ``torch.library.register_autograd`` takes them (omitted: the op is not differentiable).
    """
    name = schema.split("(", 1)[0]
    qualified = f"{NAMESPACE}::{name}"
    _LIBRARY.define(schema)
    DEFINED.append(name)
    for backend, key in _BACKEND_KEYS:
        _LIBRARY.impl(name, functools.partial(kernel, backend=backend), key)
    torch.library.register_fake(qualified, fake, lib=_LIBRARY)
    if backward is not None:
        torch.library.register_autograd(qualified, backward, setup_context=setup_context,
                                        lib=_LIBRARY)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def empty_like_none(like: torch.Tensor) -> torch.Tensor:
    """The placeholder an op returns for an output it did not compute (ops return tensors,
    never None): an empty tensor of ``like``'s dtype and device."""
    return like.new_empty(0)
