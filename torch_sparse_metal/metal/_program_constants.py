"""Program-scope ``constant`` variables as regions of the emulator's checked pointers.

A ``constant T*`` may point into a lookup table the shader declares at program scope
(ggml's ``kvalues_iq4nl_f``, passed to ``best_index_int8``). Checked pointers find their
region by address (tsm_emu/sanitize.h), so each such variable gets, right after its
declaration statement, a ``tsm_emu::program_constant`` that registers its bytes as the
library loads. Found from clang's AST: arrays and structs in the constant address space at
file or namespace scope (scalars, function constants among them, are not: a pointer to one
is rare); static data members and variable templates are not registered either (a pointer
into one is reported as pointing into no region).
"""
from __future__ import annotations

from typing import List, Tuple

from ._rewrite import semicolon_end

Edit = Tuple[int, int, str]


def registrations(tu, path: str, source, preprocessed: str) -> List[Edit]:
    """Insertions into ``preprocessed`` (clang parsed it as ``path``; ``source`` maps clang's
    offsets back to it) that register its program-scope ``constant`` variables."""
    from ._frontend import _cindex, _type_kind
    k = _cindex().CursorKind
    tables = ("ConstantArray", "Record")
    out: List[Edit] = []

    def visit(scope) -> None:
        for cursor in scope.get_children():
            if cursor.location.file is None or cursor.location.file.name != path:
                continue
            if cursor.kind == k.NAMESPACE:
                visit(cursor)
            elif (cursor.kind == k.VAR_DECL and _type_kind(cursor.type.get_canonical()) in tables
                  and "__constant" in cursor.type.spelling):
                end = semicolon_end(preprocessed, source.original(cursor.extent.end.offset, end=True))
                if end is not None:
                    name = cursor.spelling
                    out.append((end, end, f" static const ::tsm_emu::program_constant __tsm_constant_{len(out)}_"
                                          f"{name}(&{name}, sizeof({name}), \"{name}\");"))

    visit(tu.cursor)
    return out

