"""Array designators in initialisers, lowered for the emulator's C++.

Layer: lower (the layers are in the package's docstring). Imports only the parse layer
(_clang); _translation takes its edits, _regions asks :func:`lowers`.

``float s[N] = { [0 ... N-1] = 0.0f };`` (ggml) is valid Metal: Apple's compiler is clang,
which takes C's designators, and GNU's ranges, in C++ too. g++ has them in C only. The
emulator's view of a local array declared with them becomes, from clang's AST::

    float s[N] = { <the elements before the first designator> };
    ::tsm_emu::designated(s).range(0, N-1, 0.0f);

``[i] = v`` becomes ``.at(i, v)``, ``[a ... b] = v`` ``.range(a, b, v)`` (``v`` evaluated
once, as GNU C does) and an element without a designator after one ``.next(v)``, the
element after the previous one, as in C; the elements no initialiser names stay
value-initialised. The source's text stays where it is (only tokens change), so the other
edits inside it (integer division) still apply. Not lowered, and so left to the C++
compiler's error: designators outside a local declaration of one variable (program scope,
a return, a member), designators of nested arrays (``[0][1] = v``) and of fields. A kernel
that keeps a designated array across a barrier runs as fibers, not as barrier regions
(whose per-thread slot would rename the variable the lowering names).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ._clang import _cindex

Edit = Tuple[int, int, str]


def edits(tu, path: str, source, preprocessed: str) -> List[Edit]:
    """Edits of ``preprocessed`` (clang parsed it as ``path``; ``source`` maps clang's
    offsets back to it) that lower the array designators of local declarations."""
    k = _cindex().CursorKind
    out: List[Edit] = []
    for top in tu.cursor.get_children():
        if top.location.file is None or top.location.file.name != path:
            continue
        for statement in top.walk_preorder():
            if statement.kind != k.DECL_STMT:
                continue
            variables = list(statement.get_children())
            if len(variables) != 1 or variables[0].kind != k.VAR_DECL:
                continue
            init = next((c for c in variables[0].get_children() if c.kind == k.INIT_LIST_EXPR), None)
            if init is not None:
                out += _lowered(init, variables[0].spelling, source)
    return out


def lowers(variable) -> bool:
    """Whether the declaration of ``variable`` (a VAR_DECL) gets lowered designators."""
    k = _cindex().CursorKind
    init = next((c for c in variable.get_children() if c.kind == k.INIT_LIST_EXPR), None)
    return init is not None and any(map(_designator, init.get_children()))


def _lowered(init, name: str, source) -> List[Edit]:
    """The edits for one initialiser list of the array ``name``, or none."""
    elements = list(init.get_children())
    kinds = [_designator(e) for e in elements]
    if not any(kinds) or "unsupported" in kinds:
        return []
    tokens = list(init.get_tokens())
    offset = lambda t, end=False: source.original(t.extent.end.offset if end else t.extent.start.offset, end=end)
    first = next(i for i, kind in enumerate(kinds) if kind)
    # Commas between elements, from the one before the first designated element on.
    commas = []
    depth = 0
    for token in tokens[1:-1]:
        if token.spelling in ("(", "[", "{"):
            depth += 1
        elif token.spelling in (")", "]", "}"):
            depth -= 1
        elif token.spelling == "," and depth == 0:
            commas.append(token)
    edits: List[Edit] = []
    for index, comma in enumerate(commas):
        if index >= first - 1:
            edits.append((offset(comma), offset(comma, True), " " if index >= first else ""))
    head = f"}}; ::tsm_emu::designated({name})"  # closes the list before the first designated element
    for element, kind in zip(elements[first:], kinds[first:]):
        e_start = source.original(element.extent.start.offset)
        e_end = source.original(element.extent.end.offset, end=True)
        if kind is None:
            edits += [(e_start, e_start, ".next("), (e_end, e_end, ")")]
            continue
        *indices, _value = element.get_children()
        parts = list(element.get_tokens())
        after = lambda cursor, spelling: next(t for t in parts if t.spelling == spelling
                                              and t.extent.start.offset >= cursor.extent.end.offset)
        closing, equals = after(indices[-1], "]"), after(indices[-1], "=")
        edits.append((offset(parts[0]), offset(parts[0], True), head + (".range(" if kind == "range" else ".at(")))
        head = ""
        if kind == "range":
            dots = after(indices[0], "...")
            edits.append((offset(dots), offset(dots, True), ","))
        edits += [(offset(closing), offset(closing, True), ","), (offset(equals), offset(equals, True), ""),
                  (e_end, e_end, ")")]
    closing_brace = tokens[-1]
    edits.append((offset(closing_brace), offset(closing_brace, True), ""))
    return edits


def _designator(element) -> Optional[str]:
    """"at" for ``[i] = v``, "range" for ``[a ... b] = v``, None for an element without a
    designator, "unsupported" for other designators (nested arrays, fields)."""
    tokens = [t.spelling for t in element.get_tokens()]
    if not tokens or tokens[0] not in ("[", "."):
        return None
    if tokens[0] == ".":
        return "unsupported"
    children = list(element.get_children())
    # [i] = v has two children (index, value), [a ... b] = v three; [i][j] = v three too.
    if len(children) == 2:
        return "at"
    if len(children) == 3:
        between = [t.spelling for t in element.get_tokens()
                   if children[0].extent.end.offset <= t.extent.start.offset < children[1].extent.start.offset]
        return "range" if between == ["..."] else "unsupported"
    return "unsupported"
