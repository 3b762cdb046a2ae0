"""The plan of one barrier-region kernel's group function: where its threads stop, and
where its variables live (the group function itself is written by _regions).

Layer: plan (the layers are in the package's docstring). Imports the parse layer, the
analyses (_uniformity, _matrix_products, _tensor_ops) and _designators (to know the
declarations it lowers).

A stop is a barrier statement, or a statement of the kernel's own body that evaluates a
SIMD-group function unconditionally (_Point). A variable declared before a stop in a block
that encloses it lives in a per-thread slot (_Frame); ``static``, ``constexpr``,
``threadgroup`` and constant declarations are hoisted to the group function; parameters the
kernel may modify are per thread, the others shared. What defeats the transformation raises
:class:`_Unsupported`, and the kernel runs as fibers.
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from . import _clang, _designators, _matrix_products, _msl_text, _tensor_ops
from ._uniformity import (SCALAR_KINDS, binds_reference, in_metal, is_reference, mutable_reference, node_key,
                          only_constructs, runs_own_code)

Edit = Tuple[int, int, str]


class _Unsupported(Exception):
    """The kernel's structure defeats the transformation: it runs as fibers."""


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


class _GroupPlan:
    """One kernel read for its group function: where its threads stop (walk), and where each
    of its variables and parameters lives (analyse): in a per-thread slot, hoisted to the
    group, or shared. _GroupFunction writes the group function from it."""

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


def _argument_at(call, operand) -> Optional[int]:
    """Which of the call's arguments ``operand`` is, or None. (By extent: a cursor of
    get_arguments() never compares equal to the same one reached through get_children().)"""
    keys = [node_key(a) for a in call.get_arguments()]
    return keys.index(node_key(operand)) if node_key(operand) in keys else None


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
