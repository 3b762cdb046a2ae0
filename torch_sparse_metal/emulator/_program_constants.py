"""Program-scope ``constant`` variables in the emulator's C++: regions of its checked
pointers, and ``const``.

Layer: lower (the layers are in the package's docstring). Imports only the parse layer
(_clang, _msl_text); _translation takes its edits.

A ``constant T*`` may point into a lookup table the shader declares at program scope
(ggml's ``kvalues_iq4nl_f``, passed to ``best_index_int8``). Checked pointers find their
region by address (tsm_emu/sanitize.h), so each such variable gets, right after its
declaration statement, a ``tsm_emu::program_constant`` that registers its bytes as the
library loads. Found from clang's AST: arrays and structs in the constant address space at
file or namespace scope (scalars, function constants among them, are not: a pointer to one
is rare); static data members and variable templates are not registered either (a pointer
into one is reported as pointing into no region). Every such variable not declared const
becomes ``const`` there, as it is in Metal (:func:`made_const`).
"""
from __future__ import annotations

import re
from typing import List, Tuple

from ._clang import _cindex, _type_kind
from ._msl_text import semicolon_end

Edit = Tuple[int, int, str]


def variables(tu, path: str):
    """The program-scope ``constant`` variables (at file or namespace scope) of the file
    clang parsed as ``path``."""
    k = _cindex().CursorKind

    def visit(scope):
        for cursor in scope.get_children():
            if cursor.location.file is None or cursor.location.file.name != path:
                continue
            if cursor.kind == k.NAMESPACE:
                yield from visit(cursor)
            elif cursor.kind == k.VAR_DECL and "__constant" in cursor.type.spelling:
                yield cursor

    yield from visit(tu.cursor)


def registrations(tu, path: str, source, preprocessed: str) -> List[Edit]:
    """Insertions into ``preprocessed`` (clang parsed it as ``path``; ``source`` maps clang's
    offsets back to it) that register its program-scope ``constant`` variables."""
    out: List[Edit] = []
    for cursor in variables(tu, path):
        if _type_kind(cursor.type.get_canonical()) in ("ConstantArray", "Record"):
            end = semicolon_end(preprocessed, source.original(cursor.extent.end.offset, end=True))
            if end is not None:
                name = cursor.spelling
                out.append((end, end, f" static const ::tsm_emu::program_constant __tsm_constant_{len(out)}_"
                                      f"{name}(&{name}, sizeof({name}), \"{name}\");"))
    return out


def made_const(tu, path: str, source, preprocessed: str) -> List[Edit]:
    """A program-scope ``constant`` variable is read-only, and one of an integer type
    initialised with a constant is a constant expression, as a ``const`` one is in C++
    (PyTorch's LinearAlgebra.metal: ``constant uint TILE_DIM = 16;`` then ``float
    t[TILE_DIM]``): in the emulator's C++, where ``constant`` means nothing, each not
    declared const becomes ``const``."""
    out: List[Edit] = []
    for cursor in variables(tu, path):
        if not cursor.type.is_const_qualified():
            start = source.original(cursor.extent.start.offset)
            if re.match(r"(?:static\s+)?constant\b", preprocessed[start:start + 20]):
                out.append((start, start, "const "))
    return out
