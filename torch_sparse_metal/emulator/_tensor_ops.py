"""``op.run(left, right, destination)`` of Metal 4's ``mpp::tensor_ops::matmul2d``, recognised
in clang's AST.

Layer: analyse (the layers are in the package's docstring). Imports only the parse layer
(_clang); the planners (_schedule, _regions) ask it.

The emulator runs it as a SIMD-group collective (tsm_emu/tensor_ops.h): on cooperative tensors
the lanes exchange their shares, in as many rounds as the operands need; on metal::tensor
operands they meet once, to show that all of them are there. A kernel that reaches one
synchronises, so it runs as fibers; the planning of barrier regions, whose stops
hand over one value per lane, leaves such a kernel to them. The call keeps the default site
its declaration gives it (the line of the call).

A call is recognised by the type of the object it is made on: a ``matmul2d`` of
``mpp::tensor_ops``, also in a template where clang leaves the call unresolved (MLX's nax
fragments make the operation from their template arguments).
"""
from __future__ import annotations

import re

from ._clang import _cindex, _dependent_name

_MATMUL2D = re.compile(r"\bmatmul2d<")


def is_run(cursor) -> bool:
    """Whether ``cursor`` is a call of ``run`` on a matmul2d."""
    k = _cindex().CursorKind
    if cursor.kind != k.CALL_EXPR or cursor.spelling not in ("run", ""):
        return False
    kids = list(cursor.get_children())
    if not kids or kids[0].kind != k.MEMBER_REF_EXPR or (kids[0].spelling or _dependent_name(kids[0])) != "run":
        return False
    base = next(iter(kids[0].get_children()), None)
    if base is None:
        return False
    return any(_MATMUL2D.search(t.spelling) for t in (base.type, base.type.get_canonical()))


def contains(cursor) -> bool:
    """Whether a matmul2d's ``run`` is called anywhere under ``cursor``."""
    return any(is_run(c) for c in cursor.walk_preorder())
