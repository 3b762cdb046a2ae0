"""Bounds checks of arrays outside threadgroup memory, for the emulator's C++.

Layer: lower (the layers are in the package's docstring). Imports only the parse layer
(_clang, _msl_text); _translation takes its edits.

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
source line (tsm_emu/thread_array.h), in every build. Not checked: ``&x[i]``, an address
(one past the end is one), and a member array whose length depends on a template
parameter.

Pointers into such an array are checked where they are used: ``x + i`` becomes
``::tsm_emu::bounded(x) + i``, a ``thread_ptr`` with the array's bounds (the rewriter makes
every ``thread T*`` one, and ``&x[i]`` one through ``element_address``), and the index of
each subscript of a thread pointer, ``p[i]``, becomes ``::tsm_emu::located(i, "p[i]",
__FILE__, __LINE__)``, so that a fault names the subscript and its line.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ._clang import _ARRAY_KINDS, _cindex, _type_kind
from ._msl_text import ParseError, _match_close

Edit = Tuple[int, int, str]


def edits(tu, path: str, source, preprocessed: str) -> List[Edit]:
    """Edits of ``preprocessed`` (clang parsed it as ``path``; ``source`` maps clang's
    offsets back to it) that check the index of every subscript of an array that is not in
    threadgroup memory, bound ``x + i`` of one, and locate each subscript of a thread
    pointer."""
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
            if cursor.kind == k.BINARY_OPERATOR and _span(cursor) not in seen:
                seen.add(_span(cursor))
                out += _bounded_arithmetic(cursor, source, preprocessed)
            if cursor.kind != k.ARRAY_SUBSCRIPT_EXPR:
                continue
            span = _span(cursor)
            if span in seen:
                continue
            seen.add(span)
            out += _checked_subscript(cursor, source, preprocessed)
    return out


def _bounded_arithmetic(cursor, source, preprocessed: str) -> List[Edit]:
    """``x + i`` (and ``i + x``, ``x - i``) of an array in thread memory ->
    ``::tsm_emu::bounded(x) + i``: a thread_ptr that keeps the array's bounds, as ``&x[i]``
    does (tsm_emu/thread_array.h)."""
    operands = list(cursor.get_children())
    if len(operands) != 2:
        return []
    lhs, rhs = operands
    operator = [t.spelling for t in cursor.get_tokens()
                if lhs.extent.end.offset <= t.extent.start.offset < rhs.extent.start.offset]
    if operator not in (["+"], ["-"]):
        return []
    for operand in operands:
        array = _array_of(operand)
        if array is None or not _in_thread_memory(array.type.spelling):
            continue  # not thread memory: a device or constant array is checked by its region
        start = source.original(operand.extent.start.offset)
        end = source.original(operand.extent.end.offset, end=True)
        if start < end and "__tsm" not in preprocessed[start:end]:
            return [(start, start, "::tsm_emu::bounded("), (end, end, ")")]
    return []


def _span(cursor) -> Tuple[int, int]:
    return cursor.extent.start.offset, cursor.extent.end.offset


def _is_address_of(unary) -> bool:
    tokens = list(unary.get_tokens())
    return bool(tokens) and tokens[0].spelling == "&"


def _array_of(base):
    """The expression of array type under ``base`` (the decay to a pointer clang adds), or
    None when the subscript is of a pointer."""
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
    operands = list(cursor.get_children())
    if len(operands) != 2:
        return []
    base, index = operands
    span = _brackets(cursor, base, index, source, preprocessed)
    if span is None:
        return []  # text the check wrote itself, or a subscript a macro spelled
    open_, close = span
    array = _array_of(base)
    if array is None:
        return _located_subscript(base, open_, close, source, preprocessed) if _is_thread_pointer(base.type) else []
    if "__local" in array.type.spelling:
        return []  # a threadgroup array (checked as a tg_var)
    if _type_kind(array.type) == "ConstantArray":
        length = str(array.type.get_array_size())
    else:
        length = _declared_bound(array, source, preprocessed)
        if length is None:
            return []
    # `[` is replaced, so an insertion at the index's start (an integer division's call)
    # nests inside the check; the check closes after the insertions at the index's end,
    # as its edits come after theirs (emulator_edits) and sort after `)`.
    return [(open_, open_ + 1, f"[::tsm_emu::in_bounds<{length}>("),
            (close, close, f', "{_text(base, open_, source, preprocessed)}", __FILE__, __LINE__)')]


def _brackets(cursor, base, index, source, preprocessed: str) -> Optional[Tuple[int, int]]:
    """The offsets of the ``[`` and ``]`` of a subscript in ``preprocessed``, or None."""
    base_end = source.original(base.extent.end.offset, end=True)
    index_start = source.original(index.extent.start.offset)
    index_end = source.original(index.extent.end.offset, end=True)
    close = source.original(cursor.extent.end.offset, end=True) - 1
    open_ = preprocessed.rfind("[", base_end, index_start)
    if (open_ < 0 or preprocessed[close:close + 1] != "]" or not base_end <= open_ < index_start <= index_end <= close
            or "__tsm" in preprocessed[source.original(base.extent.start.offset):close]):
        return None
    return open_, close


def _text(node, end: int, source, preprocessed: str) -> str:
    """The source text from ``node`` to ``end``, as a C string literal's contents."""
    text = preprocessed[source.original(node.extent.start.offset):end]
    return " ".join(text.split()).replace("\\", "\\\\").replace('"', '\\"')


def _is_thread_pointer(type_) -> bool:
    """A pointer into thread memory (clang's generic or private address space)."""
    if _type_kind(type_) != "Pointer":
        return False
    return _in_thread_memory(type_.get_pointee().spelling)


def _in_thread_memory(spelling: str) -> bool:
    """Whether a type clang spells so is in thread memory (its generic or private address
    space): not device, threadgroup or constant."""
    return not any(space in spelling for space in ("__global", "__local", "__constant"))


def _located_subscript(base, open_: int, close: int, source, preprocessed: str) -> List[Edit]:
    """``p[i]`` of a thread pointer -> ``p[::tsm_emu::located(i, "p[i]", __FILE__, __LINE__)]``:
    a thread_ptr checks the access against the array it points into and names the
    subscript and the line in the fault; a raw pointer takes the index as it was."""
    return [(open_, open_ + 1, "[::tsm_emu::located("),
            (close, close, f', "{_text(base, close + 1, source, preprocessed)}", __FILE__, __LINE__)')]


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
