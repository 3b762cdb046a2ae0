"""``a * b`` of two simdgroup matrices, recognised in clang's AST.

Layer: analyse (the layers are in the package's docstring). Imports only the parse layer
(_clang); the lowering (_cxx_forms) and the planners (_schedule, _regions) ask it.

Metal spells this product as an operator (MLX's Winograd conv: ``(G * g) * Gt``), but it
is a SIMD-group collective like ``simdgroup_multiply``: the lanes exchange their
fragments. The emulator gives every collective a call site, which an operator cannot take
(it has no room for a defaulted argument), so the emulator's view calls
``metal::__tsm_simdgroup_product(a, b)`` instead (tsm_emu/simdgroup_matrix.h); the
planning of barrier regions counts each product as a SIMD-group function.

A product is recognised by its operands' type: Metal's ``operator*`` of two
``simdgroup_matrix`` (also through a typedef); in a template, a ``*`` that clang leaves
unresolved with an operand of type ``simdgroup_matrix<T, 8, 8>`` (the other may be the
product before it: ``(a * b) * c``). Operands of types only an instantiation tells (``M
a; a * b`` with ``M`` a template parameter) are not known to be matrices: the emulator's
header rejects such a product at compile time.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

from ._clang import _cindex

LOWERED = "::metal::__tsm_simdgroup_product("

_MATRIX = re.compile(r"^(?:const\s+)?(?:__\w+\s+)*(?:const\s+)?(?:metal::)?simdgroup_matrix<")
_MULTIPLY = 3  # clang's CXBinaryOperatorKind for `*`


def _is_matrix(expression) -> bool:
    return bool(_MATRIX.match(expression.type.get_canonical().spelling))


def operands(cursor) -> Optional[Tuple[object, object]]:
    """(a, b) if ``cursor`` is a product ``a * b`` of two simdgroup matrices, else None."""
    cindex = _cindex()
    k = cindex.CursorKind
    if cursor.kind == k.CALL_EXPR and cursor.spelling == "operator*":
        target = cursor.referenced
        if target is None or target.semantic_parent is None or target.semantic_parent.spelling != "metal":
            return None  # a class's own operator*, or the code's
        args, matrices = list(cursor.get_arguments()), 2
    elif cursor.kind == k.CALL_EXPR and not cursor.spelling:  # unresolved: dependent operands
        kids = list(cursor.get_children())  # a, the reference to the operator, b
        if len(kids) != 3 or kids[1].kind == k.CALL_EXPR or not any(
                d.kind == k.OVERLOADED_DECL_REF and d.spelling == "operator*" for d in kids[1].walk_preorder()):
            return None
        args, matrices = [kids[0], kids[2]], 1
    elif cursor.kind == k.BINARY_OPERATOR and cindex.conf.lib.clang_getCursorBinaryOperatorKind(cursor) == _MULTIPLY:
        args, matrices = list(cursor.get_children()), 1
    else:
        return None
    if len(args) != 2 or sum(_is_matrix(a) for a in args) < matrices:
        return None
    return args[0], args[1]


def contains(cursor) -> bool:
    """Whether a product of simdgroup matrices is anywhere under ``cursor``."""
    return any(operands(c) is not None for c in cursor.walk_preorder())
