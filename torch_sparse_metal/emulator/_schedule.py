"""How each kernel's threadgroup runs, chosen once per kernel: as fibers, as barrier
regions' rounds (_regions), or lanes at once in plain dispatches (_lanes).

Layer: plan (the layers are in the package's docstring). Imports the parse layer, the
analyses (_matrix_products, _tensor_ops) and the other planners (_group_plan, _regions);
_translation calls it once per shader.

A kernel that synchronises nowhere runs as fibers, which then never switch. One that
synchronises only in its own body (every barrier, SIMD-group function and simdgroup matrix
product a statement of it, none reached through a helper) gets a group function
(:class:`_regions._GroupFunction`), unless its structure defeats the transformation; that
group function has a lanes-at-once body when _lanes can write one. Everything else runs as
fibers; so does every kernel when ``TSM_EMU_REGIONS=0``. The runtime then picks, at each
dispatch, the lanes-at-once body for a plain dispatch and the rounds for a sanitized one.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Set

from . import _clang, _matrix_products, _msl_text, _tensor_ops
from ._clang import _dependent_name
from ._group_plan import Edit, _Unsupported
from ._regions import _GroupFunction


@dataclass
class Translation:
    """What the emulator's translation of a shader needs from this module."""
    edits: List[Edit] = field(default_factory=list)
    grouped: Set[str] = field(default_factory=set)        # kernel functions with a group function
    lanes: Set[str] = field(default_factory=set)          # of those, the ones run lanes at once (_lanes)
    synchronising: Set[str] = field(default_factory=set)  # kernel functions that synchronise


def plan(tu, path: str, prepared, original: str, base_edits: Sequence[Edit],
         kernels: Sequence[_msl_text.Kernel], enabled: bool = True) -> Translation:
    """The group functions for the qualifying kernels of the parsed emulator view
    (``original``; ``base_edits`` are the other edits of it, applied inside copies too)."""
    cindex = _clang._cindex()
    k = cindex.CursorKind
    out = Translation()
    functions = list(_clang._user_functions(tu, path))
    by_name: Dict[str, List[object]] = defaultdict(list)
    for f in functions:
        by_name[f.spelling].append(f)
    masked = _msl_text._mask_strings_and_directives(original)
    source = prepared.source

    def text_of(cursor) -> str:
        return masked[source.original(cursor.extent.start.offset):
                      source.original(cursor.extent.end.offset, end=True)]

    names_cache: Dict[int, Set[str]] = {}

    def referenced_names(f) -> Set[str]:
        key = f.hash
        if key not in names_cache:
            names = set()
            for c in f.walk_preorder():
                if c.kind in (k.CALL_EXPR, k.DECL_REF_EXPR, k.OVERLOADED_DECL_REF, k.MEMBER_REF_EXPR):
                    names.add(c.spelling or _dependent_name(c))
                elif c.kind in (k.TYPE_REF, k.TEMPLATE_REF):
                    # a class it uses: its member functions, which a call through an object
                    # reaches unnamed (candle's `block_reducer<...> reducer; reducer(value)`,
                    # whose operator() waits at barriers)
                    record = c.referenced
                    if record is not None and record.kind in (k.STRUCT_DECL, k.CLASS_DECL, k.CLASS_TEMPLATE,
                                                              k.CLASS_TEMPLATE_PARTIAL_SPECIALIZATION):
                        names.update(m.spelling for m in record.get_children()
                                     if m.kind in (k.CXX_METHOD, k.FUNCTION_TEMPLATE, k.CONSTRUCTOR))
            names_cache[key] = names
        return names_cache[key]

    # Where clang's parse of the emulator's view has errors (a simdgroup_matrix<double>, which
    # Metal's declarations reject, inside #ifdef __METAL_EMULATOR__): there it drops what it
    # could not make sense of, references included, so a kernel's group function would lose
    # some. (A template's errors are its instantiations', kmeans<double>'s: its own AST, the
    # one translated, is whole.)
    troubled = [n.location.offset for d in tu.diagnostics if d.severity >= cindex.Diagnostic.Error
                for n in (d, *d.children) if n.location.file is not None and n.location.file.name == path]
    instantiated: Dict[str, List[_msl_text.Kernel]] = defaultdict(list)
    for kernel in kernels:
        instantiated[_msl_text.function_name(kernel.cxx)].append(kernel)
    for name, entries in instantiated.items():
        definitions = [f for f in by_name.get(name, ()) if f.kind in (k.FUNCTION_DECL, k.FUNCTION_TEMPLATE)]
        reached: Dict[int, object] = {}
        frontier = list(definitions)
        while frontier:
            f = frontier.pop()
            for n in referenced_names(f):
                for g in by_name.get(n, ()):
                    # (not into other kernels; a member named like one is a helper: MLX's sort)
                    kernel = g.spelling in instantiated and g.kind in (k.FUNCTION_DECL, k.FUNCTION_TEMPLATE)
                    if g.hash not in reached and not kernel:
                        reached[g.hash] = g
                        frontier.append(g)
        own = set()
        for d in definitions:
            own.update(m.group(1) for m in _msl_text._SYNC_CALL.finditer(text_of(d)))
            if _matrix_products.contains(d):
                own.add("operator*")
            if _tensor_ops.contains(d):
                own.add("matmul2d::run")
        helpers = any(_msl_text._SYNC_CALL.search(text_of(g)) or _matrix_products.contains(g)
                      or _tensor_ops.contains(g) for g in reached.values())
        if not definitions:  # not found in the AST: assume the worst
            out.synchronising.add(name)
            continue
        if own or helpers:
            out.synchronising.add(name)
        if not enabled or helpers or not own or len(definitions) != 1:
            continue
        if definitions[0].kind == k.FUNCTION_TEMPLATE and any("<" not in e.cxx for e in entries):
            continue  # instantiated by deduction: no template arguments to name the copy with
        extent = definitions[0].extent
        if definitions[0].kind == k.FUNCTION_DECL and any(extent.start.offset <= at < extent.end.offset
                                                          for at in troubled):
            continue  # runs as fibers, which need no AST
        group = _GroupFunction(definitions[0], entries[0], prepared, original, base_edits)
        try:
            out.edits += group.edits()
        except _Unsupported:
            continue
        out.grouped.add(name)
        if group.not_lanes is None:
            out.lanes.add(name)
    return out
