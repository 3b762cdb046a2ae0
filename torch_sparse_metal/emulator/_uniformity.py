"""Whether a kernel's threads all take the same way from stop to stop.

Layer: analyse (the layers are in the package's docstring). Imports only the parse layer
(_clang, _msl_text); the planners (_regions, _lanes) and _bounds_probe ask it.

A barrier-region kernel (``_regions``) whose every decision about where a thread goes next
(the conditions of the ``if``s, loops and ``switch``es around its stops and returns) has
the same value in all threads of a threadgroup is *uniform*: a round that starts with every
thread at one stop, in one iteration of the loops around it, ends with every thread at one
stop, in one iteration. The scheduler (``run_regions`` in regions.h) then records where
the threadgroup waits once for all its threads, instead of per thread.

A value is uniform when it is made, by operators, casts and calls of Metal's library's
functions (SIMD-group ones aside), only of literals, enumerators, built-ins that are the
same for the whole threadgroup (``threadgroup_position_in_grid``, ``threads_per_threadgroup``,
...), the kernel's parameters' values (a pointer's, not what it points to; a ``constant``
reference's, which no thread can write) and uniform variables. A kernel variable is uniform
when its address is never taken and every assignment to it (its initialiser, ``=``, ``op=``,
``++``, ``--``) assigns a uniform value in a uniform context, outside any condition that is
not; the variables start assumed uniform and lose it until nothing changes (a loop's
``stride /= 2`` keeps ``stride`` uniform). Memory is never uniform: another thread may
write it between two threads' reads.

A condition that is not uniform is allowed around code that cannot take a thread elsewhere:
no stop, no ``return``, no ``goto``, no ``break`` or ``continue`` out of it. Such code
rejoins where it started (``if (lid < stride) scratch[lid] += ...``).

In a uniform kernel every round runs all threads from one stop, so a uniform variable has
one value in all of them whenever they stop: the translation keeps one copy of it for the
threadgroup instead of a slot per thread (``Slots<T, true>``, regions.h), and the loops
around stops (whose conditions are uniform, or the kernel would not be) count their
iterations once for all too.

The analysis is a promise the sanitized runs check: there, ``run_regions`` verifies that
every round of a kernel said to be uniform runs every thread from where the first starts
and ends with them all where the first stops (regions.h), so each sanitized test of such a
kernel tests this module.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from . import _clang, _msl_text

# Built-ins with one value for all threads of a threadgroup.
UNIFORM_BUILTINS = frozenset((
    "threadgroup_position_in_grid", "threads_per_threadgroup", "dispatch_threads_per_threadgroup",
    "threadgroups_per_grid", "threads_per_grid", "threads_per_simdgroup", "thread_execution_width",
    "simdgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup", "quadgroups_per_threadgroup",
    "dispatch_quadgroups_per_threadgroup", "grid_origin", "grid_size",
))

_LITERALS = ("INTEGER_LITERAL", "FLOATING_LITERAL", "CXX_BOOL_LITERAL_EXPR", "CHARACTER_LITERAL",
             "CXX_NULL_PTR_LITERAL_EXPR", "CXX_UNARY_EXPR")  # (sizeof, alignof)
_VALUE_OF_OPERANDS = ("UNEXPOSED_EXPR", "PAREN_EXPR", "CSTYLE_CAST_EXPR", "CXX_STATIC_CAST_EXPR",
                      "CXX_FUNCTIONAL_CAST_EXPR", "BINARY_OPERATOR", "COMPOUND_ASSIGNMENT_OPERATOR",
                      "CONDITIONAL_OPERATOR", "UNARY_OPERATOR", "INIT_LIST_EXPR")
_SKIPPED = ("TYPE_REF", "TEMPLATE_REF", "NAMESPACE_REF")
_LVALUE_PARTS = ("MEMBER_REF_EXPR", "ARRAY_SUBSCRIPT_EXPR")
_CASTS = ("CSTYLE_CAST_EXPR", "CXX_STATIC_CAST_EXPR", "CXX_REINTERPRET_CAST_EXPR", "CXX_CONST_CAST_EXPR",
          "CXX_FUNCTIONAL_CAST_EXPR", "CXX_DYNAMIC_CAST_EXPR")
_CONTROL = ("IF_STMT", "FOR_STMT", "WHILE_STMT", "DO_STMT", "SWITCH_STMT")
_LOOPS = ("FOR_STMT", "WHILE_STMT", "DO_STMT")
# What only reads a variable that is a direct operand (an assignment's or ++'s, a call's, a
# declaration's and an initialiser list's are told apart in use()).
_READS = ("BINARY_OPERATOR", "COMPOUND_ASSIGNMENT_OPERATOR", "CONDITIONAL_OPERATOR", "ARRAY_SUBSCRIPT_EXPR",
          "IF_STMT", "WHILE_STMT", "DO_STMT", "FOR_STMT", "SWITCH_STMT", "CASE_STMT", "RETURN_STMT",
          "COMPOUND_STMT", "LABEL_STMT", "DEFAULT_STMT", "CXX_UNARY_EXPR")
# Metal functions whose result differs between the lanes or groups that call them.
_NOT_UNIFORM_CALL = re.compile(r"(?:simd|quad|simdgroup|atomic)_\w*|\w*_(?:load|store|read|write|fetch)\w*")


class _Kernel:
    """``builtins``: the built-ins whose values count (all of them, when None: a kernel's
    values that do not come from memory, _bounds_probe)."""
    def __init__(self, body, params: Sequence[object], entries: Sequence[_msl_text.Param],
                 is_stop: Callable[[object], bool], builtins: Optional[FrozenSet[str]] = UNIFORM_BUILTINS) -> None:
        self.cindex = _clang._cindex()
        self.lib = self.cindex.conf.lib
        self.body = body
        self.is_stop = is_stop
        # The kernel's parameters and own variables, each with the expressions assigned to
        # it and where; None once it is not uniform (a parameter that starts so, or a
        # variable one of whose uses might change it unseen). A kernel may assign its
        # parameters (`x += i`, `gid.x += 1`): they are variables that start uniform or not.
        self.assignments: Dict[int, Optional[List[tuple]]] = {}
        for param, entry in zip(params, entries):
            if entry.kind == _msl_text.P_BUILTIN:
                uniform = builtins is None or entry.builtin in builtins
            else:  # a pointer's value, or a reference to what no thread writes
                uniform = not is_reference(param.type) or \
                    bool(re.match(r"\s*(?:const\s+)?constant\b", entry.text))
            self.assignments[param.canonical.hash] = [] if uniform else None
        declared = [c for c in body.walk_preorder() if c.kind.name == "VAR_DECL"]
        self.assignments.update({c.canonical.hash: [] for c in declared})
        self.constants: Set[int] = {c.canonical.hash for c in list(params) + declared
                                    if c.type.is_const_qualified() and not has_mutable_member(c.type)}
        self.controls: List[tuple] = []  # (control node, its conditions, ancestors)
        self.collect(body, [])
        self.decided = {node_key(c): conds for c, conds, _ in self.controls}
        # Per loop, the control structures between each of its jumps and it (see parted).
        self.jumps: Dict[Tuple[str, int, int], List[List[object]]] = {}
        self.collect_jumps(body, [])
        self.uniform: Set[int] = {v for v, a in self.assignments.items() if a is not None}

    # ---- the walk: assignments and control structures ----------------------------------------
    def collect(self, node, ancestors: List[object]) -> None:
        kind = node.kind.name
        kids = list(node.get_children())
        if kind == "VAR_DECL":
            key = node.canonical.hash
            init = [c for c in kids if c.kind.name not in _SKIPPED]
            words = {t.spelling for t in node.get_tokens()}
            if is_reference(node.type) or words & {"threadgroup", "__local", "static"}:
                # A reference reads memory (a threadgroup variable is one in the emulator's
                # view, `__local T& v = <its storage>`); a static is shared.
                self.assignments[key] = None
            elif "constexpr" in words:
                pass  # a constant expression: the same in every thread
            elif self.assignments[key] is not None:
                self.assignments[key].append((init[-1] if init else None, ancestors + [node], False))
        elif kind == "DECL_REF_EXPR":
            target = node.referenced
            if target is not None and target.kind.name in ("VAR_DECL", "PARM_DECL"):
                self.use(target.canonical.hash, node, ancestors)
        elif kind in _CONTROL or kind == "CONDITIONAL_OPERATOR" or (
                kind == "BINARY_OPERATOR" and self.lib.clang_getCursorBinaryOperatorKind(node) in _clang.LOGICAL_OPERATORS):
            self.controls.append((node, self.conditions(node, kids), list(ancestors)))
        for c in kids:
            self.collect(c, ancestors + [node])

    def collect_jumps(self, node, ancestors: List[object]) -> None:
        for c in node.get_children():
            kind = c.kind.name
            if kind in ("LAMBDA_EXPR", "STRUCT_DECL", "CLASS_DECL"):
                continue
            if kind in ("BREAK_STMT", "CONTINUE_STMT"):
                path = ancestors + [node]
                i = jump_target(c, path)
                if i >= 0 and path[i].kind.name in _LOOPS:
                    between = [a for a in path[i + 1:] if node_key(a) in self.decided]
                    self.jumps.setdefault(node_key(path[i]), []).append(between)
            self.collect_jumps(c, ancestors + [node])

    def conditions(self, node, kids: List[object]) -> List[object]:
        """The expressions that decide which of a control structure's parts run. (A for's
        initialisation counts too: clang does not say which header part a child is.)"""
        kind = node.kind.name
        if kind == "FOR_STMT":
            return kids[:-1]
        if kind == "DO_STMT":
            return kids[1:]
        if kind in ("IF_STMT", "WHILE_STMT", "SWITCH_STMT"):
            declared = [c for c in kids if c.kind.name in ("VAR_DECL", "DECL_STMT")]
            return declared + [kids[len(declared)]]
        return kids[:1]  # ?: and && || : the first operand decides

    def use(self, key: int, ref, ancestors: List[object]) -> None:
        """A use of a variable: a read, an assignment of the whole (recorded), or what may
        change it unseen (an assignment of a part, its address, a reference bound to it: a
        call's argument, a method's object, a reference variable or member; any use not
        known to read), which makes it not uniform. A const variable's uses are reads."""
        if self.assignments.get(key) is None or key in self.constants:
            return  # not the kernel's own (program scope), not uniform already, or const
        node, i, whole = ref, len(ancestors) - 1, True
        # Up through what may keep it an lvalue: a field, an element, a branch of ?:, a
        # cast (to a reference), the right of a comma (then what is assigned may be only a
        # part of it, or it); clang's unexposed implicit conversions, which may be a
        # reference's binding (an address space's in the emulator's view: `thread uint&`).
        while i >= 0:
            a = ancestors[i]
            ak = a.kind.name
            if ak in ("PAREN_EXPR", "UNEXPOSED_EXPR") and _first(a) == node:
                pass
            elif (ak in _LVALUE_PARTS and _first(a) == node) or ak in _CASTS or \
                    (ak == "CONDITIONAL_OPERATOR" and _first(a) != node) or \
                    (ak == "BINARY_OPERATOR" and _first(a) != node and
                     self.lib.clang_getCursorBinaryOperatorKind(a) == _clang.COMMA_OPERATOR):
                whole = False
            else:
                break
            node, i = a, i - 1
        parent = ancestors[i] if i >= 0 else None
        pk = parent.kind.name if parent is not None else ""
        where = ancestors[:i + 1]
        if pk in ("BINARY_OPERATOR", "COMPOUND_ASSIGNMENT_OPERATOR") and _first(parent) == node and \
                self.lib.clang_getCursorBinaryOperatorKind(parent) in _clang.ASSIGNMENT_OPERATORS:
            if whole:
                rhs = list(parent.get_children())[1]
                self.assignments[key].append((rhs, where, pk == "COMPOUND_ASSIGNMENT_OPERATOR"))
                return
        elif pk == "UNARY_OPERATOR":
            op = self.lib.clang_getCursorUnaryOperatorKind(parent)
            if op in _clang.INC_DEC_OPERATORS and whole:
                self.assignments[key].append((None, where, True))
                return
            if op not in _clang.INC_DEC_OPERATORS and op != _clang.ADDRESS_OF:
                return
        elif pk == "CALL_EXPR":
            if self.call_reads(parent, node):
                return
        elif pk == "VAR_DECL":
            if not mutable_reference(parent.type):
                return  # a copy, or a const reference
        elif pk == "INIT_LIST_EXPR":
            if not binds_reference(parent.type):
                return  # a copy into an aggregate, not a reference member's binding
        elif pk in _READS:
            return
        # Anything else might change it unseen (a structured binding, say).
        self.assignments[key] = None

    def call_reads(self, call, operand) -> bool:
        """Whether a call only reads one of its operands: an operator other than an
        assignment or ++/-- (a template's too, unresolved), or a function whose parameter
        there is not a reference to non-const."""
        target = call.referenced
        operator = _clang.dependent_operator(call)
        name = operator[0] if operator else target.spelling if target is not None else ""
        if name.startswith("operator"):
            args = list(call.get_arguments())
            operands = operator[1] if operator else len(args)
            if _clang.MODIFYING_OPERATOR.fullmatch(name) or (name == "operator&" and operands == 1):
                return False
            if target is not None and not in_metal(target):
                # A user's operator: what its parameters say (its object: may be written,
                # through a non-const method or a `mutable` member).
                keys = [node_key(a) for a in args]
                at = keys.index(node_key(operand)) if node_key(operand) in keys else -1
                if target.kind.name == "CXX_METHOD":
                    return at > 0 and _reads_parameter(target, at - 1)
                return at >= 0 and _reads_parameter(target, at)
            if target is not None and target.kind.name == "CXX_METHOD" and target.is_const_method():
                return True
            # What may return a reference into its object (`p[i] = v`, `*p = v`): the
            # object is not only read; an index is.
            object_ = node_key(args[0]) == node_key(operand) if args else True
            return not (object_ and (name in ("operator[]", "operator()", "operator->") or
                                     (name == "operator*" and operands == 1)))
        # (By extent: a cursor of get_arguments() never compares equal to the same one
        # reached through get_children().)
        keys = [node_key(a) for a in call.get_arguments()]
        if node_key(operand) not in keys:  # the object of a method: Metal's const ones only read it
            return target is not None and target.kind.name == "CXX_METHOD" and target.is_const_method() \
                and in_metal(target)
        at = keys.index(node_key(operand))
        # The function called, or in a template every one the call may resolve to.
        candidates = [target] if target is not None else self.overloads(call)
        return bool(candidates) and all(_reads_parameter(f, at) for f in candidates)

    def overloads(self, call) -> List[object]:
        callee = _first(call)
        for c in callee.walk_preorder() if callee is not None else ():
            if c.kind.name == "OVERLOADED_DECL_REF":
                return [self.lib.clang_getOverloadedDecl(c, i) for i in range(self.lib.clang_getNumOverloadedDecls(c))]
        return []

    # ---- values ------------------------------------------------------------------------------
    def value(self, node) -> bool:
        """Whether an expression has one value in all threads (given `self.uniform`)."""
        kind = node.kind.name
        kids = [c for c in node.get_children() if c.kind.name not in _SKIPPED]
        if kind in _LITERALS:
            return True
        if kind == "DECL_REF_EXPR":
            target = node.referenced
            if target is None:
                return False
            tk = target.kind.name
            if tk in ("ENUM_CONSTANT_DECL", "TEMPLATE_NON_TYPE_PARAMETER"):
                return True
            if tk in ("VAR_DECL", "PARM_DECL"):
                key = target.canonical.hash
                if key in self.assignments:
                    return key in self.uniform
                # program scope: `constant` in Metal, which no thread writes
                return target.semantic_parent is not None and \
                    target.semantic_parent.kind.name in ("TRANSLATION_UNIT", "NAMESPACE")
            return False
        if kind == "UNARY_OPERATOR" and self.lib.clang_getCursorUnaryOperatorKind(node) in (
                _clang.ADDRESS_OF, _clang.DEREFERENCE):
            return False
        if kind == "INIT_LIST_EXPR" and initialises_members(node.type):
            return False  # what a member's own initialiser gives (an atomic) is not seen here
        if kind in _VALUE_OF_OPERANDS:
            return bool(kids) and all(self.value(c) for c in kids)
        if kind == "MEMBER_REF_EXPR":  # a field of a uniform value (not through ->)
            return len(kids) == 1 and self.value(kids[0]) and not self.arrow(node, kids[0])
        if kind == "CALL_EXPR":
            return self.pure_call(node) and all(self.value(a) for a in node.get_arguments())
        return False

    def arrow(self, member, base) -> bool:
        return any(t.spelling == "->" for t in member.get_tokens()
                   if t.extent.start.offset >= base.extent.end.offset)

    def pure_call(self, call) -> bool:
        """A constructor, a conversion, or a function of Metal's library that gives every
        thread the same result for the same arguments."""
        target = call.referenced
        if target is None:
            return False
        if target.kind.name in ("CONSTRUCTOR", "CONVERSION_FUNCTION"):
            return only_constructs(call)
        return target.kind.name == "FUNCTION_DECL" and in_metal(target) and \
            not _NOT_UNIFORM_CALL.fullmatch(target.spelling)

    def effect_free_call(self, call) -> bool:
        """A call with no effect but its result (``pure_call``); in a template, one left
        unresolved whose every candidate is a function of Metal's so."""
        if call.referenced is not None:
            return self.pure_call(call)
        candidates = self.overloads(call)
        return bool(candidates) and all(
            c.kind.name in ("FUNCTION_DECL", "FUNCTION_TEMPLATE") and in_metal(c) and
            not _NOT_UNIFORM_CALL.fullmatch(c.spelling) for c in candidates)

    # ---- the fixed point -----------------------------------------------------------------------
    def context(self, chain: Sequence[object]) -> bool:
        """Whether what the innermost of these nested nodes does runs in all threads or in
        none: every control structure around it decides uniformly (where it is part of that
        structure's condition, decided before the choice, no matter; but a loop's condition
        runs once per iteration, so what it does depends on the loop)."""
        for outer, inner in zip(chain, chain[1:]):
            conds = self.decided.get(node_key(outer))
            if conds is None:
                continue
            if outer.kind.name not in _LOOPS and any(node_key(inner) == node_key(c) for c in conds):
                continue  # (a loop's condition runs as often as the loop: not exempt)
            if not all(self.condition(c) for c in conds):
                return False
            if self.parted(outer):
                return False
        return True

    def parted(self, loop) -> bool:
        """Whether a `break` or `continue` of ``loop`` lies under a condition that is not
        uniform: then the threads' iterations part too (what follows it in the body runs in
        some threads only). (A kernel with one is not uniform: ``leaves``; this matters to
        ``decisions``, where threads may part.)"""
        jumps = self.jumps.get(node_key(loop))
        if not jumps:
            return False
        return any(not all(self.condition(c) for control in path for c in self.decided[node_key(control)])
                   for path in jumps)

    def condition(self, node) -> bool:
        if node.kind.name == "DECL_STMT":
            return all(self.declared(v) for v in node.get_children() if v.kind.name == "VAR_DECL")
        if node.kind.name == "VAR_DECL":
            return self.declared(node)
        return self.value(node)

    def declared(self, var) -> bool:
        return var.canonical.hash in self.uniform

    def solve(self) -> None:
        changed = True
        while changed:
            changed = False
            for key in list(self.uniform):
                for rhs, ancestors, _ in self.assignments[key]:
                    if (rhs is not None and not self.value(rhs)) or not self.context(ancestors):
                        self.uniform.discard(key)
                        changed = True
                        break

    # ---- the verdict ---------------------------------------------------------------------------
    def uniform_control(self) -> bool:
        self.solve()
        deciding = {node_key(c) for c, conds, _ in self.controls if not all(self.condition(x) for x in conds)}
        for control, _, ancestors in self.controls:
            # The outermost structures that do not decide uniformly: code in one rejoins
            # where it started unless something takes a thread out of it.
            if node_key(control) in deciding and not any(node_key(a) in deciding for a in ancestors):
                if self.leaves(control):
                    return False
        return True

    def leaves(self, control) -> bool:
        """Whether code in a control structure can take a thread out of it: a stop, a
        return, a goto, a break or continue of a loop or switch around it."""
        own_loop = control.kind.name in _LOOPS
        own_switch = control.kind.name == "SWITCH_STMT"

        def walk(node, loops: int, switches: int) -> bool:
            for c in node.get_children():
                kind = c.kind.name
                if self.is_stop(c) or kind in ("RETURN_STMT", "GOTO_STMT", "INDIRECT_GOTO_STMT"):
                    return True
                if kind == "BREAK_STMT" and loops + switches == 0:
                    return True
                if kind == "CONTINUE_STMT" and loops == 0:
                    return True
                if kind in ("LAMBDA_EXPR", "STRUCT_DECL", "CLASS_DECL"):
                    continue
                if walk(c, loops + (kind in _LOOPS), switches + (kind == "SWITCH_STMT")):
                    return True
            return False

        return walk(control, int(own_loop), int(own_switch))


def is_reference(t) -> bool:
    """Through typedefs and aliases (`typedef thread uint& uref`)."""
    return _clang._type_kind(t.get_canonical()).endswith("Reference")


def mutable_reference(t) -> bool:
    t = t.get_canonical()
    return is_reference(t) and not t.get_pointee().is_const_qualified()


# Clang's type kinds of the values with no members: scalars, enums, pointers, vectors.
SCALAR_KINDS = ("Int", "UInt", "Float", "Double", "Bool", "Half", "Short", "UShort", "Char_S", "Char_U", "SChar",
                "UChar", "Long", "ULong", "LongLong", "ULongLong", "Enum", "Pointer", "ExtVector", "Vector", "Float16")


def binds_reference(t) -> bool:
    """Whether a braced initialiser of this type may bind a reference: a struct (or an
    array of them) with a reference member, or a type clang does not resolve."""
    t = _clang.element_type(t)
    kind = _clang._type_kind(t)
    if kind != "Record":
        return kind not in SCALAR_KINDS
    return any(c.kind.name == "FIELD_DECL" and (is_reference(c.type) or binds_reference(c.type))
               for c in t.get_declaration().get_children())


def _reads_parameter(function, at: int) -> bool:
    """Whether a function only reads what it is passed as its parameter `at`: a value or
    a reference to const."""
    if function.kind.name not in ("FUNCTION_DECL", "CXX_METHOD", "FUNCTION_TEMPLATE"):
        return False
    params = [c for c in function.get_children() if c.kind.name == "PARM_DECL"]
    return at < len(params) and not mutable_reference(params[at].type)


def _record(t):
    """The user's struct a type names (through arrays), or None."""
    t = _clang.element_type(t)
    if _clang._type_kind(t) != "Record":
        return None
    declaration = t.get_declaration()
    return None if declaration is None or in_metal(declaration) else declaration


def has_mutable_member(t) -> bool:
    """Whether a const object of this type may still change: a `mutable` member (a const
    method may set it)."""
    record = _record(t)
    return record is not None and any(
        c.kind.name == "FIELD_DECL" and (c.is_mutable_field() or has_mutable_member(c.type))
        for c in record.get_children())


def runs_own_code(t) -> bool:
    """Whether making (and ending) an object of this type runs code of the user's: a
    member's default initialiser, or a destructor."""
    record = _record(t)
    return record is not None and (initialises_members(t) or any(c.kind.name == "DESTRUCTOR"
                                                                  for c in record.get_children()))


def initialises_members(t) -> bool:
    """Whether making an object of this type runs code of its own: a member's default
    initialiser (`uint v = atomic_fetch_add_explicit(...)`), in it or a member."""
    record = _record(t)
    return record is not None and any(
        c.kind.name == "FIELD_DECL" and (any(k.kind.is_expression() for k in c.get_children()) or
                                         initialises_members(c.type))
        for c in record.get_children())


def node_key(cursor) -> Tuple[str, int, int]:
    """A cursor's identity that compares by value: its kind and extent."""
    return cursor.kind.name, cursor.extent.start.offset, cursor.extent.end.offset


def _first(node):
    return next(iter(node.get_children()), None)


@dataclass(frozen=True)
class Uniformity:
    """``control``: every thread of a threadgroup takes the same way between the kernel's
    stops. ``variables``: then, the kernel's own variables (their declarations' canonical
    cursors' hashes) that have one value in all threads; empty when not."""
    control: bool
    variables: FrozenSet[int]


def jump_target(jump, path: Sequence[object]) -> int:
    """Where in ``path`` (a ``break`` or ``continue``'s ancestors, outermost first) is the
    structure it jumps out of: its innermost loop, or for a ``break`` a switch inside that;
    -1 if none."""
    for i in range(len(path) - 1, -1, -1):
        kind = path[i].kind.name
        if kind in _LOOPS or (jump.kind.name == "BREAK_STMT" and kind == "SWITCH_STMT"):
            return i
    return -1


def analyse(body, params: Sequence[object], entries: Sequence[_msl_text.Param],
            is_stop: Callable[[object], bool]) -> Uniformity:
    """The kernel's uniformity (see the module's docstring). ``body``: the kernel's
    COMPOUND_STMT; ``params``: its PARM_DECLs, ``entries`` what the binding says of each;
    ``is_stop(cursor)``: whether a cursor is one of its barriers or SIMD-group function
    calls."""
    kernel = _Kernel(body, params, entries, is_stop)
    if not kernel.uniform_control():
        return Uniformity(False, frozenset())
    own = {c.canonical.hash for c in body.walk_preorder() if c.kind.name == "VAR_DECL"}
    return Uniformity(True, frozenset(kernel.uniform & own))


@dataclass(frozen=True)
class Decisions:
    """Where a kernel's threads may part (_lanes). ``variables``: its own variables with one
    value in every thread that runs the code assigning them (a thread that returned early
    is gone, not elsewhere); ``uniform``: the control structures (node_key) whose
    conditions have one value in all threads, loops with no `break` or `continue` under a
    condition that has not (the others may send threads different ways); ``kernel``: the
    solved analysis, for what else _lanes asks of it (``value``, ``context``)."""
    variables: FrozenSet[int]
    uniform: FrozenSet[Tuple[str, int, int]]
    kernel: _Kernel = field(compare=False, repr=False)


def decisions(body, params: Sequence[object], entries: Sequence[_msl_text.Param],
              is_stop: Callable[[object], bool]) -> Decisions:
    """The kernel's ``Decisions``, whether or not its control is uniform (``analyse``)."""
    kernel = _Kernel(body, params, entries, is_stop)
    kernel.solve()
    own = {c.canonical.hash for c in body.walk_preorder() if c.kind.name == "VAR_DECL"}
    uniform = {node_key(c) for c, conds, _ in kernel.controls
               if all(kernel.condition(x) for x in conds) and not
               (c.kind.name in _LOOPS and kernel.parted(c))}
    return Decisions(frozenset(kernel.uniform & own), frozenset(uniform), kernel)


def only_constructs(call) -> bool:
    """A call of a constructor or conversion that does nothing but make its result:
    Metal's, or a copy the compiler writes (an implicit or defaulted copy or move). A
    user's may do anything (an atomic)."""
    target = call.referenced
    return target is not None and target.kind.name in ("CONSTRUCTOR", "CONVERSION_FUNCTION") and \
        (in_metal(target) or _clang._is_exempt_copy(call))


def in_metal(cursor) -> bool:
    """Declared in Metal's library (namespace metal): its functions have no effects but
    their results, atomics aside."""
    parent = cursor.semantic_parent
    while parent is not None and parent.kind.name != "TRANSLATION_UNIT":
        if parent.kind.name == "NAMESPACE" and parent.spelling == "metal":
            return True
        parent = parent.semantic_parent
    return False
