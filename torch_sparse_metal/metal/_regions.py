"""Threadgroups as loops between stops: the emulator's translation of kernels whose
synchronisation (barriers, SIMD-group and quad-group functions, simdgroup_matrix products,
``a * b`` of two matrices included) is all in their own body (the runtime side is
csrc/emulator/include/tsm_emu/regions.h).

Layer: plan (the layers are in the package's docstring). Imports the parse layer, the
analyses, _designators (to know the declarations it lowers) and _lanes; _schedule decides
which kernels get a group function.

Fibers give every Metal thread a stack and switch between them at each barrier; PoCL-style
emulators instead run the code between two barriers as a loop over the threads. This module
does the latter at the source level, from clang's AST of the emulator's view. A kernel
qualifies when every barrier is a statement of its own body, and every SIMD-group function
is evaluated unconditionally by a statement of its own body (at any depth of blocks,
``if``s and loops; not in a ``switch``, a range-``for``, a loop's header or a statement
whose condition declares a variable), and nothing it calls synchronises. Its translation
keeps the kernel and adds, right after it::

    inline void <kernel>__tsm_group(tsm_emu::Group& g, <the kernel's parameters>)

which runs one whole threadgroup. Its heart is the kernel's body made resumable, as a
lambda ``(thread, where) -> where next`` that the scheduler calls for each thread in turn
(``run_regions<stops>``: told how many stops there are, it calls the lambda with ``where``
a constant when all threads resume at one, and the compiler keeps only that stop's code):

* ``switch (where) { case 0: <body> }``; each barrier statement becomes
  ``{ g.arrive(t, <loop iterations>, <flags>); return k; case k:; }``, and each
  ``return;`` becomes ``return -1;``. Every other statement, ``break``, ``continue`` and
  ``if`` stays as it was: a thread runs from where it waits to its next barrier exactly as
  its fiber would, so the order of execution, the memory the sanitizer sees and every
  fault are those of the fiber scheduler, without a context switch.
* A jump to ``case k`` may not skip a declaration with an initialiser: the variables
  declared before a barrier in a block that encloses it (and in a ``for``'s
  initialisation) live in per-thread slots instead, constructed where they were declared
  and bound by reference at the top of the lambda. Their types come from type probes:
  lambdas, never called, that repeat the declarations and return their ``decltype``.
  ``static``, ``constexpr``, ``threadgroup`` and constant declarations (and local types)
  there move to the group function, where they are one per threadgroup.
* Built-in arguments, and arguments the kernel may modify, get per-thread slots too; the
  others are shared by the threadgroup's threads, which only read them.
* A ``simdgroup_barrier`` becomes ``{ g.wait(t, <flags>, <path>); return k; case k:; }``.
  A statement that calls a SIMD-group function gets, before it,
  ``{ <posting> (void)(<the call>); g.wait(t, mem_none, <path>); return k; case k:; <replaying> }``:
  the call runs once to hand over the lane's value, and once the SIMD-group's lanes met,
  the statement runs, the call computing its result from the values handed over (so its
  arguments must have no effects, and the statement may not read memory beside it: the
  sanitizer sees the arguments' reads only in the first run). ``<path>`` is the site and
  iteration of each loop around the call, then its site: the fiber scheduler's call path.
* Each loop around a stop counts its iterations per thread, so the same barrier reached
  in two different iterations is divergence, and the same SIMD-group function two
  places, as under fibers.

* ``run_regions<stops, uniform>``: ``uniform`` says that every thread of a threadgroup
  takes the same way from stop to stop (_uniformity.py); the scheduler then records where
  a round's threads wait once for all of them. Such a kernel's variables with one value in
  every thread, and its loops' iteration counters, are one copy for the threadgroup
  (``Slots<T, true>``), which the lambda after the body (``commit``) carries from one
  round to the next.

* A kernel with SIMD-group functions gets a second body in its group function, for plain
  dispatches: its threadgroup lanes at once (_lanes), the control flow around its stops
  once for all threads (each thread evaluating the conditions that may differ) and the code
  between them as loops over the threads.

Whatever does not qualify runs as fibers, as before; so does every kernel when
``TSM_EMU_REGIONS=0``.
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from . import _bounds_probe, _clang, _designators, _lanes, _matrix_products, _msl_text, _tensor_ops
from ._uniformity import (SCALAR_KINDS, analyse, binds_reference, in_metal, is_reference, mutable_reference,
                          node_key, only_constructs, runs_own_code)

Edit = Tuple[int, int, str]


class _Unsupported(Exception):
    """The kernel's structure defeats the transformation: it runs as fibers."""


# ---- the group function of one kernel ------------------------------------------------------------

_ASSIGNMENTS = _clang.ASSIGNMENT_OPERATORS
_MODIFYING_UNARY = _clang.INC_DEC_OPERATORS | {_clang.ADDRESS_OF}
_LIBRARY_HEADERS = str(_clang.FRONTEND_INCLUDE_DIR)
_UNRESOLVED_KINDS = ("Unexposed", "TemplateTypeParm", "Dependent", "Auto", "Invalid", "Unknown")
_HOISTED_KINDS = ("TYPEDEF_DECL", "TYPE_ALIAS_DECL", "STRUCT_DECL", "CLASS_DECL", "UNION_DECL", "ENUM_DECL",
                  "STATIC_ASSERT", "TYPE_ALIAS_TEMPLATE_DECL", "USING_DECLARATION", "USING_DIRECTIVE")
_CONSTANT_KINDS = ("INTEGER_LITERAL", "FLOATING_LITERAL", "CXX_BOOL_LITERAL_EXPR", "CHARACTER_LITERAL",
                   "UNEXPOSED_EXPR", "PAREN_EXPR", "BINARY_OPERATOR", "UNARY_OPERATOR", "CONDITIONAL_OPERATOR",
                   "CSTYLE_CAST_EXPR", "CXX_FUNCTIONAL_CAST_EXPR", "CXX_STATIC_CAST_EXPR", "TYPE_REF",
                   "TEMPLATE_REF", "NAMESPACE_REF", "CXX_UNARY_EXPR", "DECL_REF_EXPR")


@dataclass
class _Frame:
    """A kernel variable that lives in a per-thread slot."""
    var: object         # its VAR_DECL
    statement: object   # the DECL_STMT declaring it
    scope: object       # the COMPOUND_STMT, or the FOR_STMT whose initialisation declares it
    index: int          # among the slots
    name: str           # the unique name its uses are renamed to


@dataclass
class _Point:
    """A place where a thread stops: a barrier, or a statement with a SIMD-group function."""
    kind: int           # W_BARRIER, W_COLLECTIVE or W_SIMDGROUP_BARRIER (regions.h)
    call: object        # the barrier's or the SIMD-group function's CALL_EXPR
    statement: object   # the statement it stops before (the barrier call's own)
    ancestors: list     # the statements around that statement, outermost first
    pairs: list = field(default_factory=list)  # see chain()
    loops: list = field(default_factory=list)  # counters of the loops around it, outermost first


W_BARRIER, W_COLLECTIVE, W_SIMDGROUP_BARRIER = 0, 1, 2  # regions.h's WaitKind
_MAX_WAIT_PATH = 16  # regions.h's kMaxWaitPath
_LOGICAL = _clang.LOGICAL_OPERATORS
_INC_DEC = _clang.INC_DEC_OPERATORS


class _GroupFunction:
    def __init__(self, kernel, entry: _msl_text.Kernel, prepared, original: str, base_edits: Sequence[Edit]):
        self.cindex = _clang._cindex()
        self.k = self.cindex.CursorKind
        self.kernel = kernel
        self.entry = entry
        self.source = prepared.source
        self.original = original
        self.masked = _msl_text._mask_strings_and_directives(original)
        body = [c for c in kernel.get_children() if c.kind == self.k.COMPOUND_STMT]
        if len(body) != 1:
            raise _Unsupported("no body")
        self.body = body[0]
        self.body_start, self.body_end = self.span(self.body)
        self.base_edits = [e for e in base_edits if self.body_start <= e[0] and e[1] <= self.body_end]
        self.params = [c for c in kernel.get_children() if c.kind == self.k.PARM_DECL]
        if len(self.params) != len(entry.params):
            raise _Unsupported("parameters")
        self.not_lanes: Optional[str] = "not translated"  # why it does not run lanes at once (lanes())

    # ---- positions -------------------------------------------------------------------------
    def span(self, cursor) -> Tuple[int, int]:
        return (self.source.original(cursor.extent.start.offset),
                self.source.original(cursor.extent.end.offset, end=True))

    def statement_end(self, cursor) -> int:
        """Just past the statement ``cursor`` (its ``;`` included)."""
        k = self.k
        kind = cursor.kind
        if kind in (k.IF_STMT, k.FOR_STMT, k.WHILE_STMT):
            return self.statement_end(list(cursor.get_children())[-1])
        start, end = self.span(cursor)
        if kind in (k.COMPOUND_STMT, k.DECL_STMT):
            return end
        m = re.match(r"\s*;", self.masked[end:])
        if not m:
            raise _Unsupported("statement end")
        return end + m.end()

    def where(self, cursor) -> Tuple[str, int]:
        file, line, _ = _clang.presumed_location(cursor.extent.start)
        return file, line

    def line_marker(self, cursor) -> str:
        """A line marker for the line ``cursor`` begins on (a line of its own)."""
        file, line = self.where(cursor)
        return _line_marker(line, file)

    # ---- the walk ----------------------------------------------------------------------------
    def walk(self) -> None:
        k = self.k
        collectives = set(_msl_text.collective_names())
        calls: List[Tuple[object, List[object]]] = []
        self.returns: List[object] = []
        self.refs: List[Tuple[object, List[object]]] = []
        stop = {k.STRUCT_DECL, k.CLASS_DECL, k.UNION_DECL, k.CLASS_TEMPLATE}

        def visit(node, ancestors):
            for child in node.get_children():
                kind = child.kind
                if kind == k.LAMBDA_EXPR:
                    raise _Unsupported("lambda")
                if kind in stop:
                    continue
                if ((kind == k.CALL_EXPR and _callee_name(child) in collectives)
                        or _matrix_products.operands(child) is not None):
                    calls.append((child, ancestors + [node]))
                elif kind == k.RETURN_STMT:
                    self.returns.append(child)
                elif kind == k.DECL_REF_EXPR:
                    self.refs.append((child, ancestors + [node]))
                visit(child, ancestors + [node])

        visit(self.body, [])
        if _tensor_ops.contains(self.body):
            raise _Unsupported("a tensor operation (its exchange takes several rounds)")
        if not calls:
            raise _Unsupported("no barrier or SIMD-group function")
        # Where the products of simdgroup matrices start: collectives the call pattern of
        # site() does not see.
        self.products = [self.span(c)[0] for c, _ in calls if _matrix_products.operands(c) is not None]
        if re.search(r"\bdecltype\b", self.masked[self.body_start:self.body_end]):
            raise _Unsupported("decltype")  # of a variable turned into a reference
        self.points: List[_Point] = []
        for call, ancestors in calls:
            if _callee_name(call) == "threadgroup_barrier":
                self.points.append(_Point(W_BARRIER, call, call, ancestors))
            elif _callee_name(call) == "simdgroup_barrier":
                self.points.append(_Point(W_SIMDGROUP_BARRIER, call, call, ancestors))
            else:
                statement, around = self.statement_of(call, ancestors)
                if not self.pure(call):
                    raise _Unsupported("a SIMD-group function's arguments may have effects")
                if self.reads_beside(call, statement):
                    raise _Unsupported("a statement that reads memory beside its SIMD-group function")
                if self.sets_beside(call, statement):
                    raise _Unsupported("a statement that sets something before its SIMD-group function")
                self.points.append(_Point(W_COLLECTIVE, call, statement, around))
        statements = [self.span(p.statement)[0] for p in self.points]
        if len(set(statements)) != len(statements):
            raise _Unsupported("two stops in one statement")

    def statement_of(self, call, ancestors) -> Tuple[object, List[object]]:
        """The statement that evaluates a SIMD-group function unconditionally (its
        ``if``'s condition included), and the statements around it."""
        k = self.k
        lib = self.cindex.conf.lib
        child = call
        for i in range(len(ancestors) - 1, -1, -1):
            node = ancestors[i]
            kids = list(node.get_children())
            if node.kind == k.COMPOUND_STMT:
                return child, ancestors[:i + 1]
            if node.kind == k.IF_STMT:
                if any(c.kind in (k.VAR_DECL, k.DECL_STMT) for c in kids):
                    raise _Unsupported("if with a declaration")
                return (node, ancestors[:i]) if kids[0] == child else (child, ancestors[:i + 1])
            if node.kind in (k.FOR_STMT, k.WHILE_STMT, k.DO_STMT):
                body = kids[0] if node.kind == k.DO_STMT else kids[-1]
                if body != child:
                    raise _Unsupported("a SIMD-group function in a loop's header")
                return child, ancestors[:i + 1]
            if node.kind == k.CONDITIONAL_OPERATOR or (
                    node.kind == k.BINARY_OPERATOR and lib.clang_getCursorBinaryOperatorKind(node) in _LOGICAL):
                raise _Unsupported("a SIMD-group function evaluated conditionally")
            if node.kind.is_statement() and node.kind not in (k.DECL_STMT, k.RETURN_STMT):
                raise _Unsupported(node.kind.name)
            child = node
        raise _Unsupported("no statement")

    def pure(self, call) -> bool:
        """Whether evaluating the call's arguments twice does what evaluating them once does."""
        return all(self.sets_nothing(arg, None, set()) for arg in _arguments(call))

    def sets_nothing(self, root, function, seen: Set[str]) -> bool:
        """Whether evaluating ``root`` changes nothing but the locals of ``function`` (a
        user's method whose body ``root`` is; None: nothing at all). A user's const method
        may still write through a pointer member, or a `mutable` one: its body is read too."""
        k = self.k
        lib = self.cindex.conf.lib
        for c in root.walk_preorder():
            if c.kind == k.LAMBDA_EXPR:
                return False
            if c.kind == k.COMPOUND_ASSIGNMENT_OPERATOR or (
                    c.kind == k.BINARY_OPERATOR and lib.clang_getCursorBinaryOperatorKind(c) in _ASSIGNMENTS) or (
                    c.kind == k.UNARY_OPERATOR and lib.clang_getCursorUnaryOperatorKind(c) in _INC_DEC):
                if not self.local_of(next(iter(c.get_children()), None), function):
                    return False
            if c.kind.is_expression() and runs_own_code(c.type):
                return False  # a temporary's destructor, a member's default initialiser
            if c.kind == k.CALL_EXPR:
                target = c.referenced
                operator = _clang.dependent_operator(c)
                if operator is not None and not _clang.MODIFYING_OPERATOR.fullmatch(operator[0]) and \
                        operator[0] not in self.user_operators:
                    continue
                if target is None:
                    return False
                if _effect_free(c):
                    continue
                if not (target.kind == k.CXX_METHOD and target.is_const_method()):
                    return False
                if not in_metal(target) and not self.method_sets_nothing(target, seen):
                    return False
        return True

    @functools.cached_property
    def user_operators(self) -> Set[str]:
        """The operators the kernel's source declares (Metal's library aside): what a
        template's unresolved operator may call."""
        names: Set[str] = set()

        def visit(node) -> None:
            for c in node.get_children():
                if c.location.file is not None and c.location.file.name.startswith(_LIBRARY_HEADERS):
                    continue
                if c.kind.name in ("NAMESPACE", "STRUCT_DECL", "CLASS_DECL", "CLASS_TEMPLATE", "UNION_DECL"):
                    visit(c)
                elif c.spelling.startswith("operator"):
                    names.add(c.spelling)

        visit(self.kernel.translation_unit.cursor)
        return names

    def method_sets_nothing(self, method, seen: Set[str]) -> bool:
        definition = method.get_definition()
        key = definition.get_usr() if definition is not None else None
        if key is None or key in seen:  # no body to read, or a recursion
            return False
        seen.add(key)
        body = [c for c in definition.get_children() if c.kind == self.k.COMPOUND_STMT]
        return len(body) == 1 and self.sets_nothing(body[0], definition, seen)

    def local_of(self, target, function) -> bool:
        """Whether the assigned ``target`` is a local (or a parameter) of ``function``, by
        value: the only writes a method's body may make and still change nothing."""
        k = self.k
        while target is not None and target.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR):
            target = next(iter(target.get_children()), None)
        if function is None or target is None or target.kind != k.DECL_REF_EXPR:
            return False
        var = target.referenced
        if var is None or var.kind not in (k.VAR_DECL, k.PARM_DECL) or var.storage_class.name == "STATIC":
            return False
        if is_reference(var.type):
            return False
        start, end, at = function.extent.start, function.extent.end, var.extent.start
        return at.file is not None and start.file is not None and at.file.name == start.file.name and \
            start.offset <= at.offset < end.offset

    def reads_beside(self, call, statement) -> bool:
        """Whether the statement may read memory before its SIMD-group function, in the
        order the compiler picks: the sanitizer must see such a read once, when the
        statement first runs, but the statement runs again after the stop."""
        k = self.k
        lib = self.cindex.conf.lib
        region = next(iter(statement.get_children())) if statement.kind == k.IF_STMT else statement

        def reads(node) -> bool:
            if node == call:
                return False
            kids = list(node.get_children())
            if node.kind == k.ARRAY_SUBSCRIPT_EXPR:
                return True
            if node.kind == k.UNARY_OPERATOR and lib.clang_getCursorUnaryOperatorKind(node) == _clang.DEREFERENCE:
                return True
            if node.kind == k.MEMBER_REF_EXPR and kids:
                if "->" in self.masked[self.span(kids[0])[1]:self.span(node)[1]]:
                    return True
                if node.referenced is not None and is_reference(node.referenced.type):
                    return True  # a reference member
            operator = _clang.dependent_operator(node) if node.kind == k.CALL_EXPR else None
            if operator is not None:
                if operator[0] in ("operator[]", "operator->", "operator()") or operator == ("operator*", 1):
                    return True
            elif node.kind == k.CALL_EXPR and node.referenced is not None:
                if not _effect_free(node):
                    return True
            elif node.kind == k.CALL_EXPR:
                return True
            if node.kind == k.DECL_REF_EXPR and node.referenced is not None:
                target = node.referenced
                if is_reference(target.type):
                    return True
                if target.kind == k.VAR_DECL and re.match(r"\s*threadgroup\b", self.masked[self.span(target)[0]:]):
                    return True
            if node.kind in (k.BINARY_OPERATOR, k.COMPOUND_ASSIGNMENT_OPERATOR) and len(kids) == 2 and \
                    lib.clang_getCursorBinaryOperatorKind(node) in _ASSIGNMENTS and self.holds(kids[1], call):
                return reads(kids[1])  # C++17: the right operand before the left
            return any(reads(c) for c in kids)

        return reads(region)

    def sets_beside(self, call, statement) -> bool:
        """Whether the statement may set something before its SIMD-group function runs: its
        first run evaluates the call alone, so what comes before it in the statement (left
        of a comma, an earlier declarator of the declaration) would come after. An
        assignment's left operand comes after its right (C++17)."""
        k = self.k
        lib = self.cindex.conf.lib
        region = next(iter(statement.get_children())) if statement.kind == k.IF_STMT else statement
        if region.kind == k.DECL_STMT:
            declarators = [c for c in region.get_children() if c.kind == k.VAR_DECL]
            if len(declarators) != 1:
                return True
            region = declarators[0]
        while region.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR) and len(list(region.get_children())) == 1:
            region = next(iter(region.get_children()))
        kids = list(region.get_children())
        if region.kind in (k.BINARY_OPERATOR, k.COMPOUND_ASSIGNMENT_OPERATOR) and len(kids) == 2 and \
                lib.clang_getCursorBinaryOperatorKind(region) in _ASSIGNMENTS and self.holds(kids[1], call):
            region = kids[1]

        def sets(node) -> bool:
            if node == call:
                return False
            if node.kind == k.COMPOUND_ASSIGNMENT_OPERATOR or (
                    node.kind == k.BINARY_OPERATOR and lib.clang_getCursorBinaryOperatorKind(node) in
                    _ASSIGNMENTS | {_clang.COMMA_OPERATOR}) or (
                    node.kind == k.UNARY_OPERATOR and lib.clang_getCursorUnaryOperatorKind(node) in _INC_DEC):
                return True
            return any(sets(c) for c in node.get_children())

        return sets(region)

    def holds(self, node, inner) -> bool:
        a, b = self.span(node)
        c, d = self.span(inner)
        return a <= c and d <= b

    def chain(self, barrier, ancestors) -> List[Tuple[object, object]]:
        """(enclosing statement, its child towards the barrier), outermost first; raises
        _Unsupported unless the barrier is a statement in a structured position."""
        k = self.k
        pairs = []
        for i, node in enumerate(ancestors):
            child = ancestors[i + 1] if i + 1 < len(ancestors) else barrier
            children = list(node.get_children())
            if node.kind == k.COMPOUND_STMT:
                pass
            elif node.kind == k.IF_STMT:
                if any(c.kind in (k.VAR_DECL, k.DECL_STMT) for c in children) or children[0] == child:
                    raise _Unsupported("if")
            elif node.kind in (k.FOR_STMT, k.WHILE_STMT):
                if any(c.kind == k.VAR_DECL for c in children) or children[-1] != child:
                    raise _Unsupported("loop condition")
            elif node.kind == k.DO_STMT:
                if children[0] != child:
                    raise _Unsupported("do")
            else:
                raise _Unsupported(node.kind.name)
            pairs.append((node, child))
        return pairs

    # ---- declarations --------------------------------------------------------------------------
    def hoistable(self, statement) -> bool:
        """A declaration that is one per threadgroup (or a constant): it moves to the group
        function."""
        k = self.k
        children = list(statement.get_children())
        kinds = {c.kind.name for c in children}
        if kinds & set(_HOISTED_KINDS):
            if not kinds <= set(_HOISTED_KINDS):
                raise _Unsupported("a type and a variable in one declaration")
            return True
        start, end = self.span(statement)
        text = self.masked[start:end]
        if re.search(r"\b(?:static|constexpr)\b", text):
            return True
        # A threadgroup (or constant) variable is one per threadgroup; a pointer to one, or
        # a reference, is each thread's own.
        # (The emulator's view declares threadgroup variables as references: the
        # declarator's own `*` or `&` tells.)
        if re.match(r"\s*(?:threadgroup|constant)\b", text) and not any(
                _clang._type_kind(c.type) == "Pointer" or
                "&" in self.masked[start:self.source.original(c.location.offset)]
                for c in children if c.kind == k.VAR_DECL):
            return True
        return all(c.kind == k.VAR_DECL and self.constant(c) for c in children)

    def constant(self, var) -> bool:
        if not var.type.is_const_qualified() or is_reference(var.type):
            return False
        inits = [c for c in var.get_children() if c.kind not in (self.k.TYPE_REF, self.k.TEMPLATE_REF,
                                                                   self.k.NAMESPACE_REF)]
        if len(inits) != 1:
            return False
        for c in inits[0].walk_preorder():
            if c.kind.name not in _CONSTANT_KINDS:
                return False
            if c.kind == self.k.DECL_REF_EXPR:
                target = c.referenced
                if target is None:
                    return False
                if target.kind in (self.k.ENUM_CONSTANT_DECL, self.k.TEMPLATE_NON_TYPE_PARAMETER):
                    continue
                # A hoisted constant, not a threadgroup variable (a reference to its storage
                # in the emulator's view), which the threads write between barriers.
                if target.kind == self.k.VAR_DECL and ((target.canonical.hash in self.hoisted_vars and
                                                        target.type.is_const_qualified() and
                                                        not is_reference(target.type)) or
                                                       target.semantic_parent.kind in (
                                                           self.k.TRANSLATION_UNIT, self.k.NAMESPACE)):
                    continue
                return False
        return True

    def analyse(self) -> None:
        k = self.k
        self.walk()
        self.loops: Dict[int, Tuple[object, int]] = {}  # loop offset -> (loop, counter)
        bypassed: Dict[int, Tuple[object, object]] = {}  # statement offset -> (DECL_STMT, scope)
        for point in self.points:
            point.pairs = self.chain(point.statement, point.ancestors)
            for node, child in point.pairs:
                child_start = self.span(child)[0]
                if node.kind == k.COMPOUND_STMT:
                    for s in node.get_children():
                        if self.span(s)[0] >= child_start:
                            break
                        if s.kind == k.DECL_STMT:
                            bypassed[self.span(s)[0]] = (s, node)
                elif node.kind == k.FOR_STMT:
                    for s in node.get_children():
                        if s.kind == k.DECL_STMT:
                            bypassed[self.span(s)[0]] = (s, node)
                if node.kind in (k.FOR_STMT, k.WHILE_STMT, k.DO_STMT):
                    at = self.span(node)[0]
                    if at not in self.loops:
                        self.loops[at] = (node, len(self.loops))
                    point.loops.append(self.loops[at][1])
            if point.kind != W_BARRIER and 2 * len(point.loops) + 1 > _MAX_WAIT_PATH:
                raise _Unsupported("loops nested too deep")
        self.loop_of = {counter: loop for loop, counter in self.loops.values()}
        self.hoisted: List[object] = []
        self.hoisted_vars: Set[int] = set()
        self.shared_vars: List[Tuple[str, bool]] = []  # hoisted variables the threads write, and
        # whether each is a threadgroup array (else static)
        self.frames: List[_Frame] = []
        self.frame_of: Dict[int, _Frame] = {}   # VAR_DECL canonical hash -> frame
        self.frame_statements: Dict[int, Tuple[object, object, List[_Frame]]] = {}
        for offset in sorted(bypassed):
            statement, scope = bypassed[offset]
            if scope.kind == k.COMPOUND_STMT and self.hoistable(statement):
                self.hoisted.append(statement)
                variables = [c for c in statement.get_children() if c.kind == k.VAR_DECL]
                self.hoisted_vars.update(c.canonical.hash for c in variables)
                start, end = self.span(statement)
                text = self.masked[start:end]
                if re.match(r"\s*threadgroup\b", text) or (re.search(r"\bstatic\b", text) and
                                                            not re.search(r"\bconst(?:expr)?\b", text)):
                    # Not threadgroup scalars: the rewriter turns each use of one, a
                    # declaration's name included, into an access through its checked wrapper.
                    # (Told by type: in the view clang parsed, a threadgroup declaration is a
                    # reference to its storage, and its declarators' offsets map to its start.)
                    threadgroup = bool(re.match(r"\s*threadgroup\b", text))
                    self.shared_vars += [(c.spelling, threadgroup) for c in variables
                                         if not threadgroup or _threadgroup_array(c)]
                continue
            frames = []
            for var in statement.get_children():
                if var.kind != k.VAR_DECL:
                    raise _Unsupported("declaration")
                if is_reference(var.type):
                    raise _Unsupported("reference across a barrier")
                if _designators.lowers(var):  # its lowering names the variable the slot renames
                    raise _Unsupported("array designators across a barrier")
                f = _Frame(var, statement, scope, len(self.frames), f"{var.spelling}__tsm{len(self.frames)}")
                self.frames.append(f)
                self.frame_of[var.canonical.hash] = f
                frames.append(f)
            self.frame_statements[offset] = (statement, scope, frames)
        self.uses: Dict[int, List[int]] = defaultdict(list)  # slot variable -> offsets of its uses
        for ref, _ in self.refs:
            target = ref.referenced
            if target is not None and target.canonical.hash in self.frame_of:
                self.uses[target.canonical.hash].append(self.span(ref)[0])
        # Variables (and parameters) whose address the kernel takes: a pointer to one may
        # outlive the segment that took it.
        self.pinned: Set[int] = set()
        for ref, ancestors in self.refs:
            target = ref.referenced
            if target is None or (target.canonical.hash not in self.frame_of and target.kind != k.PARM_DECL):
                continue
            if self.addressed(ref, ancestors):
                self.pinned.add(target.canonical.hash)
        # A const object whose constancy only the instantiation could vouch for (a field of
        # a template parameter's type, or a `mutable` member) would be copied out of its slot
        # at every resumption and stored back at every stop: it stays in its slot instead,
        # as a variable whose address is taken does (the GEMMs' epilogue, 80 bytes, at each
        # of matmul_shuffle's 256 broadcasts per K step: 15% of its time).
        self.objects_in_slots = {f.var.canonical.hash for f in self.frames if _const_object(f.var)}
        self.pinned |= self.objects_in_slots
        # Parameters each thread needs its own copy of: built-ins, and what the kernel may modify.
        self.thread_params: List[Tuple[object, Optional[int], bool]] = []  # (param, built-in, modified)
        used: Dict[int, List[List[object]]] = defaultdict(list)
        for ref, ancestors in self.refs:
            target = ref.referenced
            if target is not None and target.kind == k.PARM_DECL:
                used[target.canonical.hash].append(ancestors + [ref])
        for param, spec in zip(self.params, self.entry.params):
            paths = used.get(param.canonical.hash)
            if not paths:
                continue
            modified = any(self.modifies(path, param) for path in paths)
            if spec.kind == _msl_text.P_BUILTIN or modified:
                self.thread_params.append((param, spec.index if spec.kind == _msl_text.P_BUILTIN else None,
                                           modified))

    def addressed(self, ref, ancestors: List[object]) -> bool:
        """Whether a use of a variable (or of a member or element of it) may give its
        address away: `&v.a`, a reference variable or member bound to it, or a reference
        parameter of a function of the kernel's that may hand the address back (by its
        result, or through a reference or pointer parameter)."""
        k = self.k
        lib = self.cindex.conf.lib
        child = ref
        for node in reversed(ancestors):
            kids = list(node.get_children())
            if node.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR):
                pass
            elif node.kind == k.MEMBER_REF_EXPR and kids and kids[0] == child and \
                    "->" not in self.masked[self.span(child)[1]:self.span(node)[1]]:
                pass
            elif node.kind == k.ARRAY_SUBSCRIPT_EXPR and kids and kids[0] == child and \
                    _clang._type_kind(child.type.get_canonical()).endswith("Array"):
                pass
            elif node.kind == k.UNARY_OPERATOR:
                return lib.clang_getCursorUnaryOperatorKind(node) == _clang.ADDRESS_OF
            elif node.kind == k.VAR_DECL:
                return is_reference(node.type)
            elif node.kind == k.INIT_LIST_EXPR:
                return binds_reference(node.type)
            elif node.kind == k.CALL_EXPR:
                callee = node.referenced
                at = _argument_at(node, child)
                if callee is None or in_metal(callee) or at is None:
                    return False
                params = [c for c in callee.get_children() if c.kind == k.PARM_DECL]
                if at >= len(params) or not is_reference(params[at].type):
                    return False
                result = callee.result_type.get_canonical()
                return is_reference(result) or _clang._type_kind(result) == "Pointer" or any(
                    i != at and _clang._type_kind(p.type.get_canonical()) in ("Pointer", "LValueReference")
                    for i, p in enumerate(params))
            else:
                return False
            child = node
        return False

    def modifies(self, path: List[object], param) -> bool:
        """Whether the use of ``param`` at the end of ``path`` (its ancestors) may change it.

        A kernel's parameters are buffers and threadgroup memory (pointers and references),
        built-ins (values, each thread's own anyway) and their like. A reference cannot be
        reseated; a pointer changes by assignment, increment, through its address, or bound
        to a non-const reference: a call the AST leaves unresolved (a template's dependent
        call) is taken to copy it, as Metal's helpers take pointers by value."""
        k = self.k
        lib = self.cindex.conf.lib
        kind = _clang._type_kind(param.type.get_canonical())
        if kind in ("LValueReference", "RValueReference"):
            return False
        pointer = kind == "Pointer"
        i = len(path) - 1
        rvalue = False
        while i > 0:
            child, parent = path[i], path[i - 1]
            first = next(iter(parent.get_children()), None)
            if parent.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR):
                # A conversion to its value has no address space; one that keeps it an object
                # (binding `p` to a reference) has (as _clang._only_read tells them apart).
                rvalue |= parent.kind == k.UNEXPOSED_EXPR and parent.type.get_address_space() == 0
                i -= 1
                continue
            if parent.kind == k.MEMBER_REF_EXPR and first == child:
                target = parent.referenced
                if pointer:
                    return False
                if target is not None and target.kind == k.CXX_METHOD:
                    return not target.is_const_method()
                i -= 1
                continue
            if parent.kind == k.ARRAY_SUBSCRIPT_EXPR and first == child:
                if pointer:
                    return False
                i -= 1
                continue
            if parent.kind in (k.BINARY_OPERATOR, k.COMPOUND_ASSIGNMENT_OPERATOR):
                return first == child and lib.clang_getCursorBinaryOperatorKind(parent) in _ASSIGNMENTS
            if parent.kind == k.UNARY_OPERATOR:
                return lib.clang_getCursorUnaryOperatorKind(parent) in _MODIFYING_UNARY
            if parent.kind == k.CALL_EXPR:
                # `p += n` with `n` of a template parameter's type: an operator clang left unresolved
                operator = _clang.dependent_operator(parent)
                if operator in (("operator++", 1), ("operator--", 1), ("operator&", 1)):
                    return True
                if operator is not None and first == child and _clang.MODIFYING_OPERATOR.fullmatch(operator[0]):
                    return True
                if rvalue:
                    return False
                callee = parent.referenced
                at = _argument_at(parent, child)
                if callee is None or at is None:
                    return callee is None and not pointer
                formals = list(callee.get_arguments())
                if at >= len(formals):
                    return False
                # (A template's parameter of a type it names: `bump<device float* thread&>(p)`.)
                t = formals[at].type.get_canonical()
                return mutable_reference(t) or _clang._type_kind(t) in _UNRESOLVED_KINDS
            if parent.kind == k.VAR_DECL:
                return mutable_reference(parent.type)
            if parent.kind == k.INIT_LIST_EXPR:
                return not rvalue and binds_reference(parent.type)  # a reference member's binding
            return False
        return False

    # ---- the text --------------------------------------------------------------------------------
    def edits(self) -> List[Edit]:
        self.analyse()
        k = self.k
        fine: List[Tuple[int, int, str, Tuple[int, int]]] = []  # (start, end, text, order)

        def insert(at: int, text: str, order: Tuple[int, int]) -> None:
            fine.append((at, at, text, order))

        def replace(start: int, end: int, text: str) -> None:
            fine.append((start, end, text, (0, 0)))

        fine += self.renaming_edits()

        # Declarations of slot variables: into temporaries (renaming_edits), then constructed
        # in the slots.
        moved: Dict[int, Tuple[int, int, str]] = {}  # for-initialisations, by their loop's offset
        for offset, (statement, scope, frames) in self.frame_statements.items():
            s_start, s_end = self.span(statement)
            # A variable that cannot change is stored into its slot where it is declared, and
            # never at a stop (see group_text).
            constructs = " ".join(f"::tsm_emu::construct({f.name}, __tsm_d{f.index});" +
                                  (f" ::tsm_emu::store_declared(__tsm_m, __tsm_s{f.index}.out(__tsm_t), {f.name});"
                                   if _never_changes(f.var) else "")
                                  for f in frames)
            if scope.kind == k.FOR_STMT:
                moved[self.span(scope)[0]] = (s_start, s_end, constructs)
            else:
                depth = self.depth(scope) + 1
                insert(s_start, "{ ", (1, depth))
                insert(s_end, f" {constructs} }}", (-1, depth))

        blocks = self.hoisted_blocks()

        # Loops around barriers count their iterations; a for's slot variables are declared
        # before it.
        for at, (loop, counter) in self.loops.items():
            depth = self.depth(loop)
            end = self.statement_end(loop)
            opener = f"{{ __tsm_it{counter} = 0; "
            if at in moved:
                s_start, s_end, constructs = moved[at]
                opener += "{ " + self.edited(fine, s_start, s_end) .replace("\n", " ") + f" {constructs} }} "
                blocks.append((s_start, s_end, ";" + _msl_text.blank(self.original[s_start + 1:s_end])))
            insert(at, opener, (1, depth))
            insert(end, " }", (-1, depth))
            children = list(loop.get_children())
            body = children[0] if loop.kind == k.DO_STMT else children[-1]
            b_start, _ = self.span(body)
            if body.kind == k.COMPOUND_STMT:
                insert(b_start + 1, f" ++__tsm_it{counter};", (1, depth))
            else:
                insert(b_start, f"{{ ++__tsm_it{counter}; ", (1, depth))
                insert(self.statement_end(body), " }", (-1, depth))

        # Stops: wait, return, resume here.
        self.sites = []
        lines_start, lines = _msl_text._source_lines(self.original)
        for number, point in enumerate(self.points, start=1):
            call = point.call
            c_start, c_end = self.span(call)
            product = _matrix_products.operands(call) is not None
            open_paren = c_start if product else self.masked.find("(", self.span(next(iter(call.get_children())))[1])
            if open_paren < 0 or open_paren >= c_end:
                raise _Unsupported("call")
            args = list(call.get_arguments())
            resume = f" __tsm_save{number}(); return {number}; case {number}:;"
            depth = len(point.pairs)
            where = "".join(f", {self.loop_site(self.loop_of[c], lines_start, lines)}u, __tsm_it{c}"
                            for c in point.loops)
            site = self.site(call, lines_start, lines)
            if point.kind == W_BARRIER:
                key = f"::tsm_emu::iteration_key({', '.join(f'__tsm_it{c}' for c in point.loops)})"
                replace(c_start, open_paren + 1, f"{{ __tsm_g.arrive(__tsm_t, {key}{', ' if args else ''}")
                insert(self.statement_end(call), resume + " }", (-1, depth + 1))
            elif point.kind == W_SIMDGROUP_BARRIER:
                flags = "" if args else "::metal::mem_flags::mem_none"
                replace(c_start, open_paren + 1, f"{{ __tsm_g.wait(__tsm_t, {flags}")
                replace(c_end - 1, c_end, f"{where}, {site}u)")
                insert(self.statement_end(call), resume + " }", (-1, depth + 1))
            else:
                # The call once to hand over its value; then, when the lanes met, the
                # statement again (the call now reads the values handed over).
                text = self.call_text(call, fine)
                parent = point.ancestors[-1]
                wrap = parent.kind != k.COMPOUND_STMT
                opener = (("{ " if wrap else "") +
                          f"{{ __tsm_g.set_mode(::tsm_emu::kPosting); (void)({text}); "
                          f"__tsm_g.set_mode(::tsm_emu::kOrdinary); "
                          f"__tsm_g.wait(__tsm_t, ::metal::mem_flags::mem_none{where}, {site}u);"
                          f"{resume} __tsm_g.set_mode(::tsm_emu::kReplaying); }} ")
                s_start = self.span(point.statement)[0]
                insert(s_start, opener, (1, depth - 0.5))
                if wrap:
                    insert(self.statement_end(point.statement), " }", (-1, depth - 0.5))
            self.sites.append(site)

        # Returns leave the thread's loop for good.
        for ret in self.returns:
            start, end = self.span(ret)
            value = list(ret.get_children())
            if value:
                v_start, v_end = self.span(value[0])
                insert(v_start, "(", (1, 99))
                insert(v_end, "), -1", (-1, 99))
            else:
                insert(end, " -1", (-1, 99))

        body = self.apply(fine, blocks, self.body_start, self.body_end)
        return [(self.end_of_kernel(), self.end_of_kernel(), self.group_text(fine, body))]

    def renaming_edits(self, in_place: Set[int] = frozenset()) -> List[Tuple[int, int, str, Tuple[int, int]]]:
        """The other edits of the kernel (base_edits), and its slot variables' names: each use
        renamed to its frame's unique name, and each declarator, with the uses inside its own
        declaration, to a temporary its slot is constructed from; or, for a variable in
        ``in_place`` (by hash: _lanes' scalars), declared under its frame's name."""
        fine = []
        for start, end, text in self.base_edits:
            # The other edits' insertions (integer division's calls) are innermost.
            fine.append((start, end, text, (1 if text.endswith("(") else -1, 1000) if start == end else (0, 0)))
        for ref, _ in self.refs:
            target = ref.referenced
            f = self.frame_of.get(target.canonical.hash) if target is not None else None
            if f is None:
                continue
            start, end = self.span(ref)
            if self.original[start:end] != target.spelling:
                raise _Unsupported("reference spelling")
            s_start, s_end = self.span(f.statement)
            inside = s_start <= start < s_end and f.var.canonical.hash not in in_place
            fine.append((start, end, f"__tsm_d{f.index}" if inside else f.name, (0, 0)))
        for f in self.frames:
            at = self.source.original(f.var.location.offset)
            if self.original[at:at + len(f.var.spelling)] != f.var.spelling:
                raise _Unsupported("declarator spelling")
            name = f.name if f.var.canonical.hash in in_place else f"__tsm_d{f.index}"
            fine.append((at, at + len(f.var.spelling), name, (0, 0)))
        return fine

    def hoisted_blocks(self) -> List[Tuple[int, int, str]]:
        """Hoisted declarations leave the body (for the group function's top)."""
        blocks = []
        for statement in self.hoisted:
            start, end = self.span(statement)
            blocks.append((start, end, _msl_text.blank(self.original[start:end])))
        return blocks

    def call_text(self, call, fine) -> str:
        """A SIMD-group function's call alone, with the edits inside it: what hands over its
        value. (A product's own call, its lowering, opens and closes at its ends.)"""
        c_start, c_end = self.span(call)
        own = {(c_start, _matrix_products.LOWERED), (c_end, ")")} if _matrix_products.operands(call) is not None \
            else set()
        inner = [e for e in fine if c_start <= e[0] and e[1] <= c_end
                 and not (e[0] == e[1] and e[0] in (c_start, c_end) and (e[0], e[2]) not in own)]
        return self.apply(inner, [], c_start, c_end).replace("\n", " ")

    def live(self, frame: _Frame, point: _Point) -> bool:
        """Whether a thread resuming at ``point`` may read ``frame``'s variable before its
        declaration runs again: a use at or after the stop in the variable's scope, or one in a
        loop of that scope around the stop (a later iteration's). A variable dead at a stop is
        not stored back there (its slot keeps a stale value nobody reads). Consistent as
        over-approximations go: a variable live at a stop is live at every stop that reaches
        it without passing the declaration, so what is stored was loaded or computed."""
        s_start, s_end = self.span(frame.scope)
        at = self.span(point.statement)[0]
        if not s_start <= at < s_end:
            return False
        uses = self.uses.get(frame.var.canonical.hash, ())
        if any(u >= at for u in uses):
            return True
        loops = (self.span(a) for a in point.ancestors if a.kind in (self.k.FOR_STMT, self.k.WHILE_STMT, self.k.DO_STMT))
        return any(s_start <= l_start and l_end <= s_end and any(l_start <= u < l_end for u in uses)
                   for l_start, l_end in loops)

    def depth(self, node) -> int:
        """How many statements enclose ``node`` on the way to a stop."""
        for point in self.points:
            for i, a in enumerate(point.ancestors):
                if a == node:
                    return i
        return 0

    def loop_site(self, loop, starts: List[int], lines: List[int]) -> int:
        """A loop's Site as the rewriter numbers the fiber kernel's LoopFrames: line << 12 | k,
        after the collective calls on its line (the k of two loops on one line, and of a
        line the group function's own calls share, may differ from the fiber kernel's:
        only the order and equality of paths within a dispatch matter)."""
        import bisect
        start = self.span(loop)[0]
        row = bisect.bisect_right(starts, start) - 1
        calls = self.collectives_on(starts, row, len(self.masked))
        before = sum(1 for node, _ in self.loops.values() if starts[row] <= self.span(node)[0] <= start)
        return (lines[row] << 12) | max(1, min(calls + before, 0xFFF))

    def site(self, call, starts: List[int], lines: List[int]) -> int:
        """The barrier's Site as the rewriter numbers the fiber kernel's: line << 12 | k, the
        k-th collective call on its line."""
        import bisect
        start = self.span(call)[0]
        row = bisect.bisect_right(starts, start) - 1
        return (lines[row] << 12) | max(1, min(self.collectives_on(starts, row, start), 0xFFF))

    def collectives_on(self, starts: List[int], row: int, upto: int) -> int:
        """How many barrier and SIMD-group calls (products of simdgroup matrices included)
        start on text line ``row`` at or before offset ``upto``."""
        row_end = starts[row + 1] if row + 1 < len(starts) else len(self.masked)
        pattern = _msl_text._call_pattern(_msl_text.collective_names())
        return (sum(1 for m in pattern.finditer(self.masked, starts[row], row_end) if m.start() <= upto) +
                sum(1 for at in self.products if starts[row] <= at <= upto))

    def edited(self, fine, start: int, end: int) -> str:
        return self.apply(fine, [], start, end)

    def apply(self, fine, blocks: List[Tuple[int, int, str]], start: int, end: int) -> str:
        """original[start:end] with the edits inside it; ``blocks`` replace whole spans
        (their own edits already applied)."""
        def inside_block(e) -> bool:
            return any(b0 <= e[0] and e[1] <= b1 and not (e[0] == e[1] and e[0] in (b0, b1)) for b0, b1, _ in blocks)

        edits = [e for e in fine if start <= e[0] and e[1] <= end and not (e[0] == e[1] == end and e[3][0] > 0)
                 and not (e[0] == e[1] == start and e[3][0] < 0 and start != end)]
        edits = [e for e in edits if not inside_block(e)]
        edits += [(b0, b1, text, (0, 0)) for b0, b1, text in blocks if start <= b0 and b1 <= end]

        def order(e):
            opener, depth = e[3]
            if e[0] == e[1]:
                return (e[0], 0 if opener >= 0 else 2, depth if opener >= 0 else -depth)
            return (e[0], 1, 0)

        out, last = [], start
        for s, e, text, _ in sorted(edits, key=order):
            if s < last:
                raise _Unsupported("overlapping edits")
            out.append(self.original[last:s])
            out.append(text)
            last = e
        out.append(self.original[last:end])
        return "".join(out)

    def end_of_kernel(self) -> int:
        return self.span(self.kernel)[1]

    def parameter_text(self) -> str:
        start = self.source.original(self.kernel.location.offset) + len(self.kernel.spelling)
        m = re.match(r"\s*\(", self.masked[start:])
        if not m:
            raise _Unsupported("parameter list")
        open_paren = start + m.end() - 1
        close = _msl_text._match_close(self.masked, open_paren, "(", ")")
        return " ".join(self.original[open_paren + 1:close].split())

    def template_header(self) -> str:
        if self.kernel.kind != self.k.FUNCTION_TEMPLATE:
            return ""
        start = self.span(self.kernel)[0]
        m = re.match(r"\s*template\s*<", self.masked[start:])
        if not m:
            raise _Unsupported("template header")
        depth, paren = 0, 0
        i = start + m.end() - 1
        while i < len(self.masked):
            c = self.masked[i]
            if c in "([":
                paren += 1
            elif c in ")]":
                paren -= 1
            elif paren == 0 and c == "<":
                depth += 1
            elif paren == 0 and c == ">":
                depth -= 1
                if depth == 0:
                    return " ".join(self.original[start:i + 1].split())
            i += 1
        raise _Unsupported("template header")

    def probes(self, fine) -> Tuple[List[str], Dict[int, str]]:
        """Type probes, one per block that declares slot variables, and each slot's type."""
        k = self.k
        scopes: Dict[int, Tuple[object, List[_Frame]]] = {}
        for f in self.frames:
            at = self.span(f.scope)[0]
            scopes.setdefault(at, (f.scope, []))[1].append(f)
        # The path of enclosing blocks (and for-initialisations) down to each scope.
        paths: Dict[int, List[Tuple[object, object]]] = {}
        for point in self.points:
            pairs = point.pairs
            for i, (node, _) in enumerate(pairs):
                paths.setdefault(self.span(node)[0], pairs[:i + 1])
        statements_in: Dict[int, List[Tuple[object, List[_Frame]]]] = defaultdict(list)
        for offset in sorted(self.frame_statements):
            statement, scope, frames = self.frame_statements[offset]
            statements_in[self.span(scope)[0]].append((statement, frames))
        texts, types = [], {}
        for number, (at, (scope, frames)) in enumerate(sorted(scopes.items())):
            pieces = []
            for node, child in paths[at]:
                node_at = self.span(node)[0]
                limit = self.span(child)[0] if node_at != at else self.span(node)[1]
                decls = [self.base_text(s) for s, _ in statements_in.get(node_at, ())
                         if self.span(s)[0] < limit]
                pieces.append("{ " + " ".join(decls))
            listed = ", ".join(f"decltype({f.var.spelling})" for f in frames)
            body = " ".join(pieces) + f" return ::tsm_emu::type_list<{listed}>{{}}; " + "}" * len(pieces)
            texts.append(f"auto __tsm_probe{number} = [&]() {body};")
            for i, f in enumerate(frames):
                types[f.index] = f"::tsm_emu::type_at<{i}, decltype(__tsm_probe{number}())>"
        return texts, types

    def base_text(self, statement) -> str:
        start, end = self.span(statement)
        return self.apply([(s, e, t, (0, 0)) for s, e, t in self.base_edits], [], start, end).replace("\n", " ")

    def group_text(self, fine, body: str) -> str:
        name = self.kernel.spelling
        params = self.parameter_text()
        signature = "::tsm_emu::Group& __tsm_g" + (", " + params if params.strip() and params.strip() != "void" else "")
        head = [f"{self.template_header()} inline void {name}__tsm_group({signature}) {{"]
        head += [self.base_text(s) for s in self.hoisted]
        bindings = []
        stops = {node_key(p.call) for p in self.points}
        uniformity = analyse(self.body, self.params, self.entry.params, lambda c: node_key(c) in stops)
        # Probed rounds (probe.h) need the analysis' verdict and a uniform kernel; a kernel
        # that is not probed keeps the text it had (its speed moved with it).
        probe = self.probe(stops)
        why_not = probe.why_not or ("" if uniformity.control else "not uniform") or ("" if probe.views else "no memory")
        views = () if why_not else probe.views
        # Threadgroup and static variables are thread_local storage of the worker: found
        # once here, not at each use in the threads' loop (a call in a loaded library). An
        # array's view is made here too: from a reference, the compiler may find the variable
        # again at each thread rather than keep its address (tiled matmul: 8% slower).
        # A threadgroup array's checked pointer is copied into the thread's segment, where the
        # compiler keeps its bounds in registers (through a reference, it reloads them at each
        # access of a loop: an access before may have left it).
        elements: List[str] = []  # the probed views' types (checked in C++, below)
        for i, (name, array) in enumerate(self.shared_vars):
            head.append(f"const auto __tsm_h{i} = ::tsm_emu::view_of({name});" if array else f"auto& __tsm_h{i} = {name};")
            view = f"__tsm_h{i}"
            if name in views:  # (a checked pointer, or the probe's or an unchecked one)
                view = f"::tsm_emu::access_view(__tsm_m, {view}, __tsm_bad)"
                elements.append(f"decltype(__tsm_h{i})")
            bindings.append(f"auto {name} = {view};" if array else f"auto& {name} = __tsm_h{i};")
        for i, param in enumerate(p for p in self.params if p.spelling in views):
            head.append(f"auto& __tsm_v{i} = {param.spelling};")
            bindings.append(f"auto {param.spelling} = ::tsm_emu::access_view(__tsm_m, __tsm_v{i}, __tsm_bad);")
            elements.append(f"decltype(__tsm_v{i})")
        # A thread's variables are copied out of their slots into locals when it resumes
        # (registers, for the compiler) and back when it reaches a barrier; a variable whose
        # address the kernel takes stays in its slot, where pointers to it stay valid.
        # At each stop only what a thread may read after it is stored (see live()).
        saves: List[Tuple[str, Callable[[_Point], bool]]] = []
        copied: List[str] = []  # the slots whose thread's value is a local (checked for a probe)

        def per_thread(name: str, slot: str, pinned: bool = False, saved: bool = True,
                       live: Callable[[_Point], bool] = lambda point: True) -> None:
            if pinned:
                bindings.append(f"auto& {name} = {slot}[__tsm_t];")
                return
            local = f"::tsm_emu::local_t<decltype({slot}.in(0))>"
            copied.append(f"decltype({slot}.in(0))")
            if not saved:  # never written: read, never stored back
                bindings.append(f"{local} {name} = {slot}.in(__tsm_t);")
                return
            n = len(saves)
            bindings.append(f"auto& __tsm_r{n} = {slot}.out(__tsm_t); {local} {name} = {slot}.in(__tsm_t);")
            saves.append((f"::tsm_emu::store_local(__tsm_r{n}, {name});", live))
        for i, (param, builtin, modified) in enumerate(self.thread_params):
            p = param.spelling
            head.append(f"using __tsm_pt{i} = std::remove_cv_t<decltype({p})>;")
            pinned = param.canonical.hash in self.pinned
            if builtin is not None and not modified and not pinned:
                # Computed from the thread's index (Group::builtin), where the thread runs.
                mode = "__tsm_m, " if views else ""
                bindings.append(f"__tsm_pt{i} {p} = ::tsm_emu::builtin_arg<__tsm_pt{i}>({mode}{builtin}, "
                                f"__tsm_g, __tsm_t);")
                continue
            value = (f"::tsm_emu::builtin_arg<__tsm_pt{i}>({builtin}, __tsm_g, __tsm_i)"
                     if builtin is not None else p)
            head.append(f"static thread_local ::tsm_emu::SlotBuffer __tsm_pb{i}; "
                        f"::tsm_emu::Slots<__tsm_pt{i}> __tsm_p{i}(__tsm_pb{i}, __tsm_g.n); "
                        f"for (unsigned __tsm_i = 0; __tsm_i < __tsm_g.n; ++__tsm_i) {{ "
                        f"__tsm_pt{i} __tsm_v = {value}; ::tsm_emu::construct(__tsm_p{i}[__tsm_i], __tsm_v); }}")
            per_thread(p, f"__tsm_p{i}", pinned, saved=modified)
        probes, types = self.probes(fine)
        head += probes
        sites = ", ".join(["0u"] + [f"{s}u" for s in self.sites])
        kinds = ", ".join(["0"] + [str(p.kind) for p in self.points])
        head.append(f"static const unsigned __tsm_sites[] = {{{sites}}};")
        head.append(f"static const unsigned char __tsm_kinds[] = {{{kinds}}};")
        # Lanes at once (_lanes), for plain dispatches of the kernels it suits; the rounds
        # below for the others, and for sanitized dispatches.
        file, line = self.where(self.body)
        lanes = self.lanes(types)
        if self.not_lanes:  # (for a reader of the translation, and the tests)
            head.append(f"static constexpr const char* __tsm_not_lanes = {_c_string(self.not_lanes)};")
        if lanes:
            head.append(f"\n#if !defined(__TSM_SANITIZE__) && !defined(__TSM_EMU_NO_LANES__)\n"
                        f"{_line_marker(line, file)}\n{lanes}\n#else\n{_line_marker(line, file)}\n")
        # Variables with one value in every thread, and the loops' counters of a uniform
        # kernel: one copy for the threadgroup (Slots<T, true>, regions.h), which
        # run_regions' commit carries from round to round.
        shared: List[str] = []
        for f in self.frames:
            pinned = f.var.canonical.hash in self.pinned
            one = not pinned and f.var.canonical.hash in uniformity.variables
            head.append(f"static thread_local ::tsm_emu::SlotBuffer __tsm_sb{f.index}; "
                        f"::tsm_emu::Slots<{types[f.index]}, {str(one).lower()}> "
                        f"__tsm_s{f.index}(__tsm_sb{f.index}, __tsm_g.n, \"{f.var.spelling}\");")
            shared += [f"__tsm_s{f.index}"] if one else []
            # (One that cannot change is in its slot from its declaration on.)
            live = (lambda point: False) if _never_changes(f.var) else (lambda point, f=f: self.live(f, point))
            per_thread(f.name, f"__tsm_s{f.index}", pinned, live=live)
        for counter in range(len(self.loops)):
            head.append(f"static thread_local ::tsm_emu::SlotBuffer __tsm_cb{counter}; "
                        f"::tsm_emu::Slots<unsigned, {str(uniformity.control).lower()}> "
                        f"__tsm_c{counter}(__tsm_cb{counter}, __tsm_g.n, \"(the iterations of a loop)\");")
            shared += [f"__tsm_c{counter}"] if uniformity.control else []
            per_thread(f"__tsm_it{counter}", f"__tsm_c{counter}", live=lambda point, c=counter: c in point.loops)
        commit = " ".join(f"{slots}.commit();" for slots in shared)
        # What C++ checks of a probed kernel: its memory's elements, and every thread's
        # variables in locals (a type that does not copy as bytes stays in its slot, which
        # the probe would write).
        probed = "false"
        if why_not:  # (for a reader of the translation, and the tests; a string the rewriter leaves)
            head.append(f"static constexpr const char* __tsm_not_probed = {_c_string(why_not)};")
        else:
            probed = f"::tsm_emu::probe_elements<{', '.join(elements)}>"
            if copied:
                probed += f" && ::tsm_emu::locals_are_copies<{', '.join(copied)}>"
        head.append(f"::tsm_emu::run_regions<{len(self.points)}, {str(uniformity.control).lower()}, {probed}>("
                    "__tsm_g, __tsm_sites, __tsm_kinds, [&](auto __tsm_m, unsigned& __tsm_bad, "
                    "::tsm_emu::Group& __tsm_g, unsigned __tsm_t, int __tsm_at) -> int {")
        if any(p.kind == W_COLLECTIVE for p in self.points):
            # The collectives' sites carry the thread (the rewriter passes `__tsm_lane`): a
            # call hands over and reads its values inline (lane_exchange, runtime.h).
            head.append("const ::tsm_emu::LaneRef __tsm_lane{&__tsm_g.home->lanes, __tsm_t};")
        head += bindings
        for number, point in enumerate(self.points, start=1):
            stored = " ".join(text for text, live in saves if live(point))
            if views:  # (A probe stores nothing.)
                stored = f"if constexpr (!decltype(__tsm_m)::probe) {{ {stored} }}"
            head.append(f"auto __tsm_save{number} = [&]() {{ {stored} }};")
        head.append("switch (__tsm_at) { case 0:")
        end_file, end_line = _clang.presumed_location(self.kernel.extent.end)[:2]
        return (f"\n{_line_marker(line, file)}\n" + " ".join(head) + " " + body +
                f" }} return -1; }}, [&] {{ {commit} }});" + ("\n#endif\n" if lanes else " ") +
                f"}}\n{_line_marker(end_line, end_file)}\n")

    def lanes(self, types: Dict[int, str]) -> Optional[str]:
        """The group function's body that runs the threadgroup lanes at once (_lanes), for a
        kernel with SIMD-group functions (barrier-only kernels resume a thread only at each
        barrier: the rounds serve them as well); None where the rounds serve, and
        ``not_lanes`` says why."""
        self.not_lanes = "no SIMD-group function"
        if not any(p.kind == W_COLLECTIVE for p in self.points):
            return None
        try:
            text = _lanes.body(self, types)
        except _lanes.Unsupported as e:
            self.not_lanes = str(e)
            return None
        self.not_lanes = None
        return text


    def probe(self, stops: Set[Tuple[str, int, int]]) -> _bounds_probe.Probe:
        """Whether the kernel's rounds may be probed (_bounds_probe), with what only the
        translation knows: its stops' kinds, its pinned variables, its static ones."""
        why_not = None
        if any(p.kind != W_BARRIER for p in self.points):
            why_not = "a SIMD-group function"
        elif self.pinned - self.objects_in_slots:
            why_not = "a variable whose address is taken"
        elif self.pinned:
            why_not = "a const object kept in its slot"
        elif any(not array for _, array in self.shared_vars):
            why_not = "a static variable"
        return _bounds_probe.probe(self.body, self.params, self.entry.params,
                                   {name for name, array in self.shared_vars if array},
                                   lambda c: node_key(c) in stops, why_not)


def _argument_at(call, operand) -> Optional[int]:
    """Which of the call's arguments ``operand`` is, or None. (By extent: a cursor of
    get_arguments() never compares equal to the same one reached through get_children().)"""
    keys = [node_key(a) for a in call.get_arguments()]
    return keys.index(node_key(operand)) if node_key(operand) in keys else None


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _threadgroup_array(var) -> bool:
    """Whether a threadgroup variable of the emulator's view (a reference to its storage) is an array."""
    t = var.type
    if is_reference(t):
        t = t.get_canonical().get_pointee()
    return _clang._type_kind(t).endswith("Array")


def _arguments(call) -> List[object]:
    """A call's arguments; a product of simdgroup matrices' operands."""
    product = _matrix_products.operands(call)
    return list(product) if product is not None else list(call.get_arguments())


def _callee_name(call) -> str:
    """The called function's name; in a template, also of a call its arguments leave
    unresolved (clang names those only through the callee's reference)."""
    if call.spelling:
        return call.spelling
    for c in call.walk_preorder():
        if c.kind.name in ("OVERLOADED_DECL_REF", "DECL_REF_EXPR", "MEMBER_REF_EXPR") and c.spelling:
            return c.spelling
    return ""


def _effect_free(call) -> bool:
    """A call of a constructor or conversion that only constructs, or of a function of
    Metal's library other than an atomic: it has no effect but its result and reads no
    memory of the kernel's."""
    function = call.referenced
    if function.kind.name in ("CONSTRUCTOR", "CONVERSION_FUNCTION"):
        return only_constructs(call)
    # (Not one that writes through a parameter: modf, frexp, sincos.)
    return in_metal(function) and not function.spelling.startswith("atomic") and not any(
        c.kind.name == "PARM_DECL" and (mutable_reference(c.type) or _points_to_mutable(c.type))
        for c in function.get_children())


def _points_to_mutable(t) -> bool:
    t = t.get_canonical()
    return _clang._type_kind(t) == "Pointer" and not t.get_pointee().is_const_qualified()


RECORD_KINDS = ("STRUCT_DECL", "CLASS_DECL", "CLASS_TEMPLATE", "CLASS_TEMPLATE_PARTIAL_SPECIALIZATION")


def _never_changes(var) -> bool:
    """Whether a variable keeps the value its declaration gives it: declared const, of a
    scalar, vector or pointer type, or of a struct (a template's too) with no `mutable`
    member at any depth. Not one of a template parameter's type, which the instantiation
    decides."""
    t = var.type.get_canonical()
    if not t.is_const_qualified():
        return False
    return _plain_const(t)


def _const_object(var) -> bool:
    """Whether a variable is a const struct (or array of them) that _never_changes cannot
    vouch for."""
    t = var.type.get_canonical()
    if not t.is_const_qualified() or _plain_const(t):
        return False
    declaration = _clang.element_type(t).get_declaration()
    return declaration is not None and declaration.kind.name in RECORD_KINDS


def _plain_const(t) -> bool:
    t = _clang.element_type(t)
    if _clang._type_kind(t) in SCALAR_KINDS:
        return True
    declaration = t.get_declaration()
    if declaration is None or declaration.kind.name not in RECORD_KINDS:
        return False
    for c in declaration.get_children():
        if c.kind.name == "FIELD_DECL" and (c.is_mutable_field() or not _plain_const(c.type.get_canonical())):
            return False
        if c.kind.name == "CXX_BASE_SPECIFIER" and not _plain_const(c.type.get_canonical()):
            return False
    return True


def _line_marker(line: int, file: str) -> str:
    return '# {} "{}"'.format(line, file.replace("\\", "\\\\").replace('"', '\\"'))
