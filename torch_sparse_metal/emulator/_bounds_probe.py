"""Whether a barrier-region kernel's rounds may be probed: their bounds checks made for the
whole round before it runs, so that the round itself runs unchecked (probe.h).

Layer: analyse (the layers are in the package's docstring). Imports the parse layer and
_uniformity's analysis; _regions asks it of each kernel's group function.

``run_regions`` (regions.h) runs a round as a loop over the threads of the code between two
stops. A checked access branches to a fault, and the C++ compiler vectorises no loop with
such a branch. A probed round first runs every thread's code with each access replaced by a
bounds test that touches no memory and gives a dummy value, and with the thread's stores to
its slots skipped; only if every access was in bounds does it run the round unchecked
(else checked, as before, faulting at the same thread and access). That is exact only when
the probe tests the indices the round will use, in the same threads: when nothing an index
or a branch depends on is read from memory (the probe's reads give dummies, and the round's
own stores may change memory between the probe and the round), and when the probe has no
effect but its flag. This module says whether a kernel is so; when in doubt, it is not:

* its stops are all threadgroup barriers (a SIMD-group function's rounds run differently);
* its memory is reached only by indexing (``p[i]``, ``*p``, ``tile[i][j]``) the kernel's
  pointer parameters and threadgroup arrays (the *views*), whose elements are scalars or
  vectors: no pointer arithmetic, no address taken, no ``->``, no pointer or reference
  variable, no static or threadgroup scalar, no reference parameter but ``constant`` ones
  (which nothing writes), no local that is not a scalar or a vector (arrays have checks of
  their own);
* it calls only Metal's functions that have no effect but their result, and constructors
  that only construct;
* every index into a view, and every condition of an ``if``, loop, ``switch``, ``?:``,
  ``&&`` and ``||``, is made only of literals, built-ins, parameters' values, ``constant``
  references and variables assigned only such values (``_uniformity``'s analysis, with
  every built-in counting);
* no variable's address is taken (a pinned slot is the slot itself, which the probe would
  write).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Set, Tuple

from . import _clang, _msl_text
from ._uniformity import _Kernel, is_reference, node_key

# Canonical type kinds of the scalars and vectors a view's element or a local may be.
_VALUE_KINDS = frozenset((
    "Bool", "Char_S", "Char_U", "SChar", "UChar", "Short", "UShort", "Int", "UInt", "Long", "ULong",
    "LongLong", "ULongLong", "Half", "Float16", "Float", "Double", "ExtVector", "Vector",
))
# A template's types, which the translation's C++ checks once instantiated
# (tsm_emu::probe_elements and locals_are_copies, probe.h and regions.h).
_DEPENDENT_KINDS = frozenset(("Unexposed", "TemplateTypeParm", "Dependent", "DependentSizedArray"))


@dataclass(frozen=True)
class Probe:
    """``views``: the names of the parameters and threadgroup arrays a probed body accesses
    through its mode (probe.h); ``why_not``: None when the kernel may be probed, else the
    first reason found that it may not."""
    views: Tuple[str, ...]
    why_not: Optional[str]


def _value_type(t) -> bool:
    t = _clang.element_type(t)
    return _clang._type_kind(t) in _VALUE_KINDS | _DEPENDENT_KINDS


def probe(body, params: Sequence[object], entries: Sequence[_msl_text.Param], threadgroup_arrays: Set[str],
          is_stop: Callable[[object], bool], why_not: Optional[str] = None) -> Probe:
    """The verdict for a kernel (see the module's docstring). ``body``: its COMPOUND_STMT;
    ``params``: its PARM_DECLs and ``entries`` what the binding says of each;
    ``threadgroup_arrays``: the names of the threadgroup arrays it declares; ``is_stop``:
    whether a cursor is one of its stops; ``why_not``: a reason the caller already has."""
    if why_not is not None:
        return Probe((), why_not)
    lib = _clang._cindex().conf.lib
    kernel = _Kernel(body, params, entries, is_stop, builtins=None)
    kernel.solve()
    views: Set[int] = set()
    names = []
    referenced = {c.referenced.canonical.hash for c in body.walk_preorder()
                  if c.kind.name == "DECL_REF_EXPR" and c.referenced is not None}
    for param, entry in zip(params, entries):
        if param.canonical.hash not in referenced:
            continue
        t = param.type.get_canonical()
        if _clang._type_kind(t) == "Pointer":
            if not _value_type(t.get_pointee()):
                return Probe((), f"pointer `{param.spelling}` to {t.get_pointee().spelling}")
            views.add(param.canonical.hash)
            names.append(param.spelling)
        elif is_reference(t) and not re.match(r"\s*(?:const\s+)?constant\b", entry.text):
            return Probe((), f"reference parameter `{param.spelling}` outside constant memory")

    def walk(node, ancestors: list) -> Optional[str]:
        kind = node.kind.name
        if kind == "VAR_DECL":
            if node.spelling in threadgroup_arrays and is_reference(node.type):
                if not _value_type(node.type.get_canonical().get_pointee()):
                    return f"threadgroup array `{node.spelling}` of {node.type.spelling}"
                views.add(node.canonical.hash)
                names.append(node.spelling)
            elif not _value_type(node.type) or _clang._type_kind(node.type.get_canonical()).endswith("Array"):
                return f"variable `{node.spelling}` of type {node.type.spelling}"
            elif {t.spelling for t in node.get_tokens()} & {"static", "threadgroup", "__local"}:
                return f"static or threadgroup variable `{node.spelling}`"
        elif kind == "DECL_REF_EXPR":
            target = node.referenced
            if target is not None and target.canonical.hash in views:
                _, i = _clang.operand_parent(node, ancestors)
                parent = ancestors[i] if i >= 0 else None
                indexed = parent is not None and (
                    (parent.kind.name == "ARRAY_SUBSCRIPT_EXPR" and
                     node_key(_clang.stripped(next(iter(parent.get_children())))) == node_key(node))
                    or (parent.kind.name == "UNARY_OPERATOR" and
                        lib.clang_getCursorUnaryOperatorKind(parent) == _clang.DEREFERENCE))
                if not indexed:
                    return f"`{node.spelling}` used other than by an index"
        elif kind == "ARRAY_SUBSCRIPT_EXPR":
            base, index = list(node.get_children())[:2]
            base = _clang.stripped(base)
            inner = base
            while inner is not None and inner.kind.name == "ARRAY_SUBSCRIPT_EXPR":
                inner = _clang.stripped(next(iter(inner.get_children())))
            if inner is None or inner.kind.name != "DECL_REF_EXPR" or inner.referenced is None or \
                    inner.referenced.canonical.hash not in views:
                return "an index into something other than a buffer or a threadgroup array"
            if not kernel.value(index):
                return "an index that depends on memory"
        elif kind == "UNARY_OPERATOR":
            operator = lib.clang_getCursorUnaryOperatorKind(node)
            if operator == _clang.ADDRESS_OF:
                return "an address taken"
            if operator == _clang.DEREFERENCE:
                operand = _clang.stripped(next(iter(node.get_children())))
                if operand is None or operand.kind.name != "DECL_REF_EXPR" or operand.referenced is None or \
                        operand.referenced.canonical.hash not in views:
                    return "a dereference of something other than a buffer"
        elif kind == "MEMBER_REF_EXPR":
            base = next(iter(node.get_children()), None)
            if base is not None and kernel.arrow(node, base):
                return "a member through `->`"
        elif kind == "CALL_EXPR" and not is_stop(node):
            if not kernel.effect_free_call(node):
                return f"a call of `{node.spelling or ' '.join(t.spelling for t in node.get_tokens())[:60]}`"
        elif kind in ("FOR_STMT", "WHILE_STMT", "DO_STMT") and not any(is_stop(c) for c in node.walk_preorder()):
            # A thread's loop between two stops: the probe would run it again for its indices
            # (the tiled matmul's K loop: 45 -> 63 ms), and the threads' loop around it does
            # not vectorise.
            return "a loop between two barriers"
        elif kind in ("LAMBDA_EXPR", "GOTO_STMT", "INDIRECT_GOTO_STMT", "CXX_TRY_STMT", "CXX_THROW_EXPR",
                      "GCC_ASM_STMT", "MS_ASM_STMT"):
            return f"a {kind.lower()}"
        for c in node.get_children():
            reason = walk(c, ancestors + [node])
            if reason is not None:
                return reason
        return None

    reason = walk(body, [])
    if reason is None:
        for control, conditions, _ in kernel.controls:
            if not all(kernel.condition(c) for c in conditions):
                reason = "a condition that depends on memory"
                break
    return Probe(tuple(names) if reason is None else (), reason)
