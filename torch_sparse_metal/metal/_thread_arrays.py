"""Bounds checks of arrays outside threadgroup memory, for the emulator's C++.

Threadgroup arrays become checked ``tg_var`` objects (tsm_emu/sanitize.h); every other
array -- a kernel's or function's thread-private ``float x[N]``, multi-dimensional ones,
array members of structs, ``thread T (&a)[N]`` parameters, program-scope ``constant``
arrays -- stays a C array, and the index of each subscript clang's AST shows on it is
wrapped in a check against the array's length::

    x[i]     ->  x[::tsm_emu::in_bounds<N>(i, "x", __FILE__, __LINE__)]
    x[i][j]  ->  each of the two subscripts against its own dimension

(a length that depends on a template parameter, MLX's ``thread_x[N_READS]``, is the text of
the declaration's bound, which names it where the array is declared and used). Being a C
array still, the array initialises, copies (into a barrier region's slot too), decays to a
``thread T*`` and passes to a ``thread T (&)[N]`` parameter as before; ``sizeof`` is
unchanged. An index outside the array raises
``KernelFault("out_of_bounds")`` naming the array, the element, its length and the
source line (tsm_emu/thread_array.h), in every build. Not checked: accesses through a
pointer into such an array (``thread float* p = x; p[5]``), which are raw pointers;
``&x[i]``, an address (one past the end is one); and a member array whose length depends on
a template parameter.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ._rewrite import ParseError, _match_close

Edit = Tuple[int, int, str]

_ARRAY_KINDS = ("ConstantArray", "DependentSizedArray")


def edits(tu, path: str, source, preprocessed: str) -> List[Edit]:
    """Edits of ``preprocessed`` (clang parsed it as ``path``; ``source`` maps clang's
    offsets back to it) that check the index of every subscript of an array that is not in
    threadgroup memory."""
    from ._frontend import _cindex
    k = _cindex().CursorKind
    out: List[Edit] = []
    seen = set()  # a typedef'd anonymous struct is visited twice
    for top in tu.cursor.get_children():
        if top.location.file is None or top.location.file.name != path:
            continue
        for cursor in top.walk_preorder():
            # `&x[i]` (in a template, an operator call on a dependent operand)
            if cursor.kind in (k.UNARY_OPERATOR, k.CALL_EXPR) and _is_address_of(cursor):
                seen.update(_span(c) for c in cursor.get_children() if c.kind == k.ARRAY_SUBSCRIPT_EXPR)
            if cursor.kind != k.ARRAY_SUBSCRIPT_EXPR:
                continue
            span = _span(cursor)
            if span in seen:
                continue
            seen.add(span)
            out += _checked_subscript(cursor, source, preprocessed)
    return out


def _span(cursor) -> Tuple[int, int]:
    return cursor.extent.start.offset, cursor.extent.end.offset


def _is_address_of(unary) -> bool:
    tokens = list(unary.get_tokens())
    return bool(tokens) and tokens[0].spelling == "&"


def _array_of(base):
    """The expression of array type under ``base`` (the decay to a pointer clang adds), or
    None when the subscript is of a pointer."""
    from ._frontend import _type_kind
    node = base
    while node is not None:
        if _type_kind(node.type) in _ARRAY_KINDS:
            return node
        if _type_kind(node.type) not in ("Pointer", "Unexposed") or node.kind.name != "UNEXPOSED_EXPR":
            return None
        children = list(node.get_children())
        node = children[0] if len(children) == 1 else None
    return None


def _checked_subscript(cursor, source, preprocessed: str) -> List[Edit]:
    from ._frontend import _type_kind
    operands = list(cursor.get_children())
    if len(operands) != 2:
        return []
    base, index = operands
    array = _array_of(base)
    if array is None or "__local" in array.type.spelling:
        return []  # a pointer's subscript, or a threadgroup array (checked as a tg_var)
    base_start = source.original(base.extent.start.offset)
    base_end = source.original(base.extent.end.offset, end=True)
    index_start = source.original(index.extent.start.offset)
    index_end = source.original(index.extent.end.offset, end=True)
    close = source.original(cursor.extent.end.offset, end=True) - 1
    open_ = preprocessed.rfind("[", base_end, index_start)
    text = preprocessed[base_start:base_end]
    if (open_ < 0 or preprocessed[close:close + 1] != "]" or not base_end <= open_ < index_start <= index_end <= close
            or "__tsm" in preprocessed[base_start:close]):
        return []  # text the check wrote itself, or a subscript a macro spelled
    if _type_kind(array.type) == "ConstantArray":
        length = str(array.type.get_array_size())
    else:
        length = _declared_bound(array, source, preprocessed)
        if length is None:
            return []
    name = " ".join(text.split()).replace("\\", "\\\\").replace('"', '\\"')
    # `[` is replaced, so an insertion at the index's start (an integer division's call)
    # nests inside the check; the check closes after the insertions at the index's end,
    # as its edits come after theirs (emulator_edits) and sort after `)`.
    return [(open_, open_ + 1, f"[::tsm_emu::in_bounds<{length}>("),
            (close, close, f', "{name}", __FILE__, __LINE__)')]


def _declared_bound(array, source, preprocessed: str) -> Optional[str]:
    """The text of the bound in the declaration of ``array`` (a variable or parameter, or a
    row of one) for the dimension it is, or None. Not ``decltype`` of the expression: a
    barrier region renames the variables it keeps in slots, in the kernel's text only."""
    depth = 0
    while array.kind.name == "ARRAY_SUBSCRIPT_EXPR":
        array = _array_of(next(array.get_children()))
        if array is None:
            return None
        depth += 1
    declaration = array.referenced if array.kind.name == "DECL_REF_EXPR" else None
    if declaration is None or declaration.kind.name not in ("VAR_DECL", "PARM_DECL"):
        return None
    at = source.original(declaration.location.offset)
    name = declaration.spelling
    if preprocessed[at:at + len(name)] != name:
        return None
    pos, bounds = at + len(name), []
    while pos < len(preprocessed) and (preprocessed[pos].isspace() or preprocessed[pos] == ")"):
        pos += 1  # `thread T (&a)[N]`
    while pos < len(preprocessed) and preprocessed[pos] == "[":
        try:
            end = _match_close(preprocessed, pos, "[", "]")
        except ParseError:
            return None
        bounds.append(preprocessed[pos + 1:end].strip())
        pos = end + 1
        while pos < len(preprocessed) and preprocessed[pos].isspace():
            pos += 1
    return f"({bounds[depth]})" if depth < len(bounds) and bounds[depth] else None
