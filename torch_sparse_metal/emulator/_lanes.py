"""Lanes at once: a barrier-region kernel's threadgroup run statement by statement, the code
between two stops a loop over its threads, as a GPU runs a SIMD-group's lanes (the runtime
side is csrc/emulator/include/tsm_emu/lanes.h).

Layer: plan (the layers are in the package's docstring). Imports the parse layer and
_uniformity's analysis; _regions asks it for a group function's second body.

Barrier regions (_regions) run each thread from where it waits to its next stop before the
next thread. Every stop costs each thread a resumption: its variables copied out of their
slots and stored back, its built-ins, the round's bookkeeping. A kernel with a SIMD-group
function every few instructions pays it all the time: ``matmul_shuffle`` resumes each lane
for four FMAs per broadcast. Here the control flow around the stops runs once for the whole
threadgroup, and only the code between them per thread. The kernel's group function gets a
second body, used in plain dispatches (sanitized ones keep the regions' rounds):

* A *structural* statement (one that holds a stop, or a ``break`` or ``continue`` of a
  loop that does) stays a statement of the group function. Where its conditions have one
  value in every thread (_uniformity's ``decisions``) they run once, and may read only
  *scalar* variables (one C++ local for the threadgroup): variables the analysis found
  uniform whose every assignment is a statement of its own beside the stops (or a loop
  header), which runs once. Where they may differ, each thread evaluates them and the
  threads that go elsewhere *wait* (a code per nesting level in the thread's state): an
  ``if``'s branches run in turn, each for its threads, and a loop iterates while a thread
  is in it, a thread that leaves it (its condition, ``break``) waiting at its end and one
  that ``continue``s at its next iteration. That is the order fibers release a SIMD-group's
  lanes in (the function first in the source, then by iteration), so the same lanes meet
  at each SIMD-group function. A barrier must be where every thread goes alike.
* Every other statement between two stops of one block is *per thread*: a run of them is
  one loop over the threads still running there, in thread order, each thread running the
  run as its fiber would. A statement with a SIMD-group function ends the loop before it
  with each thread handing over its value, and starts the loop after it with each thread
  replaying it (regions' protocol, regions.h), the lanes that wait elsewhere inactive at
  it; a barrier has nothing to wait for.
* A variable declared beside the stops lives in a slot per thread (a regions frame), and
  a loop binds the slots it uses; a variable declared in a run is a local of its loop.
* ``return`` ends the thread: it is skipped by the loops after, and inactive at the
  SIMD-group functions after (as a fiber that returned); a barrier after it is what fibers
  make of it (resolve_regions). When no thread is left the group function returns.

For code the C++ compiler vectorises across the threads:

* An array declared beside the stops and used only through subscripts, an element at a
  time, lives in element-major slots (``LaneSlots``: element i of thread t at i * n + t), so
  one statement's access of it by consecutive threads is contiguous; its binding in a loop
  is a view whose subscripts give the elements.
* A run of element-major arrays without a SIMD-group function whose every statement can
  fault only alike in all threads (``faults_alike``: each access with one index, and a
  pointer's one pointer, in every thread, under conditions with one value in every thread;
  only Metal's functions without effects) gets a second loop, taken when every thread runs:
  without each thread's test, its entering and its catch. Only the first thread can be the
  first to fault there, where it is entered before the loop, and the fault leaves at once, as
  the fibers' would (they run that thread first); the test, the store of the running thread
  (which with -fno-strict-aliasing may alias the slots) and the catch each kept g++ from
  vectorising the loop. Floating point is the kernel's: each thread's operations stay its
  own (no value of two threads is combined in a loop), under -ffp-contract=off and no
  fast-math.
* Each item's text starts with a line marker for its line, so __LINE__ in an array's check,
  and a fault's report, say the source's line.

What can differ from fibers, which run a thread to its next stop before the next thread:

* The order of two threads' effects between the same two stops. Only a data race (which
  the sanitizer reports; sanitized dispatches never run this way), an atomic or a message
  could tell. Atomics of different threads are unordered in Metal (relaxed, the only order
  it has), so the loops' order is one a GPU may take as well as the fibers' is: a float
  sum of atomic adds may differ in its last bits, an atomic's old value may go to another
  thread. A kernel with ``os_log``, whose messages would come in another order, keeps the
  rounds.
* A fault: each thread's first fault stops that thread and is raised at the next stop, the
  first in thread order, which is the fault fibers raise. The threads after it have run
  their code up to there, though, so memory may hold their writes. Where threads part, a
  branch runs past its stops before the other starts, so a fault there may be raised where
  fibers would have raised the other branch's, met in an earlier round.

Whatever does not qualify keeps the regions' rounds; ``TSM_EMU_LANES=0`` turns this off.
"""
from __future__ import annotations

import itertools
import re
from typing import Dict, List, Optional, Set, Tuple

from . import _clang, _msl_text
from ._clang import _ARRAY_KINDS
from ._uniformity import UNIFORM_BUILTINS, decisions, jump_target, node_key

_ASSIGNMENTS = _clang.ASSIGNMENT_OPERATORS
_INC_DEC = _clang.INC_DEC_OPERATORS
_LOOPS = ("FOR_STMT", "WHILE_STMT", "DO_STMT")
# What a kernel (or a function it calls) may not do to run lanes at once: log a message,
# which the loops over the threads would log in another order.
_MESSAGE = re.compile(r"\b(?:os_log\w*|printf)\s*\(|\.\s*log\w*\s*\(")
# Where a thread jumps out of a run's code: the end of its loop's iteration (a label
# threads_loop names).
_NEXT = "__TSM_NEXT_THREAD__"
_MAX_DEPTH = 100  # nested structures where threads may part (two codes each, see lanes.h)

W_COLLECTIVE = 1  # regions.h's WaitKind of a SIMD-group function
# What a statement run without each thread's entering may not hold (faults_alike): what
# leaves the thread's code, or what the analysis does not see into.
_UNSEEN = frozenset(("LAMBDA_EXPR", "GOTO_STMT", "INDIRECT_GOTO_STMT", "RETURN_STMT", "CXX_TRY_STMT",
                     "CXX_THROW_EXPR", "GCC_ASM_STMT", "MS_ASM_STMT", "CXX_NEW_EXPR", "CXX_DELETE_EXPR"))
# (Not && and ||, which decide whether their right operand runs: as calls, the analysis does
# not see them as conditions.)
_ARITHMETIC = frozenset("+ - * / % & | ^ ~ ! << >> < > <= >= == != = += -= *= /= %= &= |= ^= <<= >>= ++ --".split())
_OWN_ELEMENTS = _ARRAY_KINDS + ("ExtVector", "Vector")
Key = Tuple[str, int, int]


class Unsupported(Exception):
    """The kernel keeps the regions' rounds."""


class _Demote(Exception):
    """Scalar variables a per-thread statement assigns: they are per thread after all."""
    def __init__(self, keys: Set[int]) -> None:
        super().__init__()
        self.keys = keys


class _Part(Exception):
    """A structure whose conditions read a thread's own variable: each thread evaluates
    them, as where the threads' ways may part."""
    def __init__(self, key: Key) -> None:
        super().__init__()
        self.key = key


def body(group, types: Dict[int, str]) -> str:
    """The lanes-at-once body of ``group``'s group function (a ``_regions._GroupFunction``
    whose analysis ran), or raise Unsupported. ``types``: each frame's slot type, by index."""
    return _LanesAtOnce(group, types).text()


class _LanesAtOnce:
    def __init__(self, group, types: Dict[int, str]) -> None:
        self.g = group
        self.k = group.k
        self.lib = group.cindex.conf.lib
        self.types = types
        self.labels = itertools.count()

    # ---- what qualifies ------------------------------------------------------------------------
    def text(self) -> str:
        g = self.g
        k = self.k
        if _MESSAGE.search(self.masked_text(g.kernel)) or any(
                _MESSAGE.search(self.masked_text(f)) for f in self.called_functions()):
            raise Unsupported("a message, whose order the threads' loops would change")
        stops = {node_key(p.call) for p in g.points}
        decided = decisions(g.body, g.params, g.entry.params, lambda c: node_key(c) in stops)
        self.uniform = decided.uniform
        self.analysis = decided.kernel
        for c in g.body.walk_preorder():
            if c.kind in (k.GOTO_STMT, k.INDIRECT_GOTO_STMT, k.LABEL_STMT, k.SWITCH_STMT) and \
                    self.encloses_stop(c):
                raise Unsupported(c.kind.name)
        self.stops = {node_key(p.statement): (number, p) for number, p in enumerate(g.points, start=1)}
        self.structural: Set[Key] = {node_key(a) for p in g.points for a in p.ancestors}
        # Where threads may part: a structure holding a stop whose conditions may differ
        # between threads, or a loop one of whose jumps lies where they may.
        self.parting: Set[Key] = {key for key in self.structural if self.is_control(key) and key not in self.uniform}
        self.jumps: Set[Key] = set()  # break and continue run once for all threads
        self.lane_jumps: Dict[Key, Key] = {}  # those each thread takes on its own: -> its loop
        self.mark_jumps(g.body, [])
        self.hoisted = {node_key(s) for s in g.hoisted}
        self.frame_keys = {f.var.canonical.hash: f for f in g.frames}
        self.scalar: Set[int] = {f.var.canonical.hash for f in g.frames
                                 if f.var.canonical.hash in decided.variables and
                                 f.var.canonical.hash not in g.pinned}
        self.blocks = g.hoisted_blocks()
        self.lane_major = self.lane_major_frames()
        while True:
            if any(p.kind != W_COLLECTIVE and any(node_key(a) in self.parting for a in p.ancestors)
                   for p in g.points):
                raise Unsupported("a barrier where threads may go different ways")
            self.depth = self.parting_depths()
            try:
                self.edits = g.renaming_edits(self.scalar) + self.leaving_edits()
                main = self.block(g.body)
                break
            except _Demote as d:
                self.scalar -= d.keys
            except _Part as p:
                self.parting.add(p.key)
        # (A block of its own: its views of threadgroup arrays take the arrays' names.)
        return "{ " + self.head() + " " + main + " __tsm_lanes.settle(); }"

    def is_control(self, key: Key) -> bool:
        return key[0] in ("IF_STMT",) + _LOOPS

    def masked_text(self, cursor) -> str:
        start, end = self.g.span(cursor)
        return self.g.masked[start:end] if cursor.location.file is not None and \
            cursor.location.file.name == self.g.kernel.location.file.name else ""

    def called_functions(self) -> List[object]:
        """The user's functions the kernel calls, directly or not, with their bodies."""
        k = self.k
        seen: Dict[str, object] = {}
        frontier = [self.g.kernel]
        while frontier:
            node = frontier.pop()
            for c in node.walk_preorder():
                if c.kind != k.CALL_EXPR or c.referenced is None:
                    continue
                target = c.referenced.get_definition()
                if target is None or _in_library(target):
                    continue
                usr = target.get_usr()
                if usr and usr not in seen:
                    seen[usr] = target
                    frontier.append(target)
        return list(seen.values())

    def encloses_stop(self, node) -> bool:
        a, b = self.g.span(node)
        return any(a <= self.g.span(p.call)[0] < b for p in self.g.points)

    def mark_jumps(self, node, ancestors: List[object]) -> None:
        """``break`` and ``continue`` of loops that hold a stop. Where every thread takes them
        alike (the loop and what lies between decide uniformly) they and what is between
        them and their loop are structural, run once; elsewhere each thread takes its own,
        and its loop is where threads part."""
        k = self.k
        for c in node.get_children():
            if c.kind in (k.LAMBDA_EXPR, k.STRUCT_DECL, k.CLASS_DECL):
                continue
            if c.kind in (k.BREAK_STMT, k.CONTINUE_STMT):
                path = ancestors + [node]
                i = jump_target(c, path)
                target = path[i] if i >= 0 else None
                if target is not None and node_key(target) in self.structural:
                    if target.kind == k.SWITCH_STMT:
                        raise Unsupported("a switch around a stop")
                    between = [a for a in path[i + 1:] if self.is_control(node_key(a))]
                    if node_key(target) in self.uniform and all(node_key(a) in self.uniform for a in between):
                        self.jumps.add(node_key(c))
                        self.structural.update(node_key(a) for a in path[i + 1:])
                    else:
                        self.lane_jumps[node_key(c)] = node_key(target)
                        self.parting.add(node_key(target))
            self.mark_jumps(c, ancestors + [node])

    def parting_depths(self) -> Dict[Key, int]:
        """Each structure where threads may part: how many such structures enclose it, itself
        included (its codes in a thread's state, lanes.h)."""
        depth: Dict[Key, int] = {}

        def walk(node, level: int) -> None:
            for c in node.get_children():
                key = node_key(c)
                inner = level
                if key in self.parting:
                    inner = level + 1
                    if inner > _MAX_DEPTH:
                        raise Unsupported("structures where threads may part nested too deep")
                    depth[key] = inner
                walk(c, inner)

        walk(self.g.body, 0)
        return depth

    def leaving_edits(self) -> List[tuple]:
        """A thread's ``return``, and its own ``break`` or ``continue`` of a loop where threads
        part: it stops running the run's code (goto the end of its iteration of the run's
        loop) and waits (lanes.h: returned; at the loop's end; at its next iteration)."""
        g = self.g
        k = self.k
        out = []
        for c in g.body.walk_preorder():
            key = node_key(c)
            if c.kind == k.RETURN_STMT:
                if list(c.get_children()):
                    raise Unsupported("a return with a value")
                code = "::tsm_emu::Lanes::kReturned"
            elif key in self.lane_jumps:
                loop = self.depth[self.lane_jumps[key]]
                code = str(_leave_code(loop) if c.kind == k.BREAK_STMT else _next_code(loop))
            else:
                continue
            start = g.span(c)[0]
            out.append((start, g.statement_end(c),
                        f"{{ __tsm_state[__tsm_t] = {code}; goto {_NEXT}; }}", (0, 0)))
        return out

    def edited(self, start: int, end: int, at) -> str:
        """The kernel's text [start, end) with the translation's edits, after a line marker for
        the line of ``at`` (the cursor it begins with): what it says of its lines (__LINE__ in
        an array's check, so a fault's report) is the source's. Its lines stay lines where the
        edits kept their number; else it is one line, its first."""
        text = self.g.apply(self.edits, self.blocks, start, end)
        if text.count("\n") != self.g.original[start:end].count("\n"):
            text = text.replace("\n", " ")
        return f"\n{self.g.line_marker(at)}\n{text}"

    # ---- statements ------------------------------------------------------------------------------
    def block(self, node) -> str:
        """A structural statement's branch or body, as a block."""
        statements = list(node.get_children()) if node.kind == self.k.COMPOUND_STMT else [node]
        return "{ " + self.sequence(statements) + " }"

    def sequence(self, statements: List[object]) -> str:
        out: List[str] = []
        run: List[Tuple[str, object]] = []  # see threads_loop

        def flush() -> None:
            if run:
                out.append(self.threads_loop(run))
                run.clear()

        for s in statements:
            kind = self.kind(s)
            if kind == "hoisted":
                continue
            if kind == "per thread":
                run.append(("statement", s))
            elif kind == "collective":
                run.append(("post", s))
                flush()
                out.append("__tsm_lanes.release();")
                run.append(("replay", s))
            elif kind == "barrier":
                flush()
                out.append(f"__tsm_lanes.barrier({self.stops[node_key(s)][0]});")
            elif kind in ("scalar", "jump"):
                flush()
                out.append(self.scalar_text(s))
            else:
                flush()
                out.append(self.structure(s))
        flush()
        return " ".join(out)

    def kind(self, s) -> str:
        k = self.k
        key = node_key(s)
        if key in self.stops:
            if key in self.structural:  # (its branches would run per thread)
                raise Unsupported("a stop, or a break or continue, inside a statement with a SIMD-group function")
            if self.assigned(s) & self.scalar:
                raise _Demote(self.assigned(s) & self.scalar)
            return "collective" if self.stops[key][1].kind == W_COLLECTIVE else "barrier"
        if key in self.jumps:
            return "jump"
        if key in self.structural:
            return "structural"
        if s.kind == k.DECL_STMT:
            if key in self.hoisted:
                return "hoisted"
            declared = [c.canonical.hash for c in s.get_children() if c.kind == k.VAR_DECL]
            scalar = [v for v in declared if v in self.scalar]
            if scalar and len(scalar) != len(declared):
                raise _Demote(set(scalar))  # (one declaration declares them all, per thread)
            if scalar:
                if not self.scalar_only(s):
                    raise _Demote(set(scalar))
                return "scalar"
        assigned = self.assigned(s) & self.scalar
        if assigned:
            if not self.assigns_only(s, assigned) or not self.scalar_only(s):
                raise _Demote(assigned)
            return "scalar"
        return "per thread"

    def assigned(self, node) -> Set[int]:
        """The kernel's variables that ``node`` assigns (=, op=, ++, --), by their hash."""
        k = self.k
        out: Set[int] = set()
        for c in node.walk_preorder():
            target = None
            if c.kind == k.COMPOUND_ASSIGNMENT_OPERATOR or (
                    c.kind == k.BINARY_OPERATOR and self.lib.clang_getCursorBinaryOperatorKind(c) in _ASSIGNMENTS):
                target = next(iter(c.get_children()), None)
            elif c.kind == k.UNARY_OPERATOR and self.lib.clang_getCursorUnaryOperatorKind(c) in _INC_DEC:
                target = next(iter(c.get_children()), None)
            while target is not None and target.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR):
                target = next(iter(target.get_children()), None)
            if target is not None and target.kind == k.DECL_REF_EXPR and target.referenced is not None:
                out.add(target.referenced.canonical.hash)
        return out

    def assigns_only(self, s, keys: Set[int]) -> bool:
        """Whether statement ``s`` is one assignment of a scalar variable, nothing else."""
        k = self.k
        node = s
        while node.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR):
            node = next(iter(node.get_children()))
        if node.kind == k.COMPOUND_ASSIGNMENT_OPERATOR or (
                node.kind == k.BINARY_OPERATOR and self.lib.clang_getCursorBinaryOperatorKind(node) in _ASSIGNMENTS):
            kids = list(node.get_children())
            return len(self.assigned(kids[1])) == 0 and self.assigned(kids[0]) <= keys
        if node.kind == k.UNARY_OPERATOR and self.lib.clang_getCursorUnaryOperatorKind(node) in _INC_DEC:
            return True
        return False

    def scalar_only(self, node) -> bool:
        """Whether what would run once for the threadgroup (a condition, a loop's
        initialisation or increment, a statement assigning scalar variables) reads and
        declares only what is the same in every thread."""
        k = self.k
        g = self.g
        if node.kind == k.DECL_STMT and any(
                v.kind == k.VAR_DECL and v.canonical.hash not in self.scalar for v in node.get_children()):
            return False
        for c in node.walk_preorder():
            if c.kind != k.DECL_REF_EXPR or c.referenced is None:
                continue
            target = c.referenced
            key = target.canonical.hash
            if key in self.frame_keys and key not in self.scalar:
                return False
            if target.kind == k.PARM_DECL:
                for param, builtin, modified in g.thread_params:
                    if param.canonical.hash == key and (
                            modified or builtin is None or key in g.pinned or
                            g.entry.params[g.params.index(param)].builtin not in UNIFORM_BUILTINS):
                        return False
            elif target.kind == k.VAR_DECL and key not in self.frame_keys and not self.shared(target):
                return False
        return True

    def shared(self, var) -> bool:
        """A variable one for the threadgroup: hoisted (static, constexpr, threadgroup, a
        constant) or at program scope."""
        parent = var.semantic_parent
        if parent is not None and parent.kind in (self.k.TRANSLATION_UNIT, self.k.NAMESPACE):
            return True
        return var.canonical.hash in self.g.hoisted_vars

    def scalar_text(self, s) -> str:
        return self.edited(self.g.span(s)[0], self.g.statement_end(s), s)

    def structure(self, s) -> str:
        """A structural statement: its conditions once, its parts in turn; or, where threads
        may part, for each thread (parted)."""
        k = self.k
        g = self.g
        kids = list(s.get_children())
        if s.kind == k.COMPOUND_STMT:
            return self.block(s)
        if s.kind in (k.IF_STMT, k.FOR_STMT, k.WHILE_STMT) and any(c.kind == k.VAR_DECL for c in kids):
            raise Unsupported("a condition with a declaration")
        if s.kind == k.IF_STMT and any(c.kind == k.DECL_STMT for c in kids):
            raise Unsupported("if with an initialiser")
        if s.kind not in (k.IF_STMT,) + tuple(getattr(k, name) for name in _LOOPS):
            raise Unsupported(s.kind.name)
        if node_key(s) in self.parting:
            return self.parted(s)
        # Conditions the same in every thread, but reading a thread's own variable (one
        # per-thread code assigns too): each thread evaluates them.
        header = [kids[0]] if s.kind == k.IF_STMT else kids[1:] if s.kind == k.DO_STMT else kids[:-1]
        if not all(self.scalar_only(part) for part in header):
            raise _Part(node_key(s))
        if s.kind == k.IF_STMT:
            text = f"if ({self.edited(*g.span(kids[0]), kids[0])}) {self.block(kids[1])}"
            return text + (f" else {self.block(kids[2])}" if len(kids) > 2 else "")
        if s.kind == k.DO_STMT:
            body = kids[0]
            return "do " + self.block(body) + " " + self.edited(g.span(body)[1], g.statement_end(s), kids[-1])
        body = kids[-1]
        start, body_start = g.span(s)[0], g.span(body)[0]
        return self.edited(start, body_start, s) + " " + self.block(body)


    def parted(self, s) -> str:
        """A structure where threads may part. Each thread evaluates its conditions; one that
        goes elsewhere waits at a code of this nesting level (lanes.h) until the structure
        ends, as the others run on: an if's branches in turn; a loop's body while a thread is
        in it."""
        k = self.k
        kids = list(s.get_children())
        level = self.depth[node_key(s)]
        leave, again = _leave_code(level), _next_code(level)
        if s.kind == k.IF_STMT:
            out = [self.threads_loop([("test", kids[0], leave)]),
                   f"if (__tsm_lanes.any_running()) {self.block(kids[1])}"]
            if len(kids) > 2:
                out.append(f"__tsm_lanes.flip({leave}); if (__tsm_lanes.any_running()) {self.block(kids[2])}")
            out.append(f"__tsm_lanes.unpark({leave});")
            return "{ " + " ".join(out) + " }"
        if s.kind == k.DO_STMT:
            body, condition = kids[0], kids[1]
            return ("{ while (true) { " + self.block(body) + f" __tsm_lanes.unpark({again}); " +
                    self.threads_loop([("test", condition, leave)]) +
                    f" if (!__tsm_lanes.any_running()) break; }} __tsm_lanes.unpark({leave}); }}")
        init, condition, step = self.header(s)
        if init is not None and init[1].kind == k.DECL_STMT:
            declared = {c.canonical.hash for c in init[1].get_children() if c.kind == k.VAR_DECL}
            if declared & self.scalar:  # (each thread runs the initialisation: its own copy)
                raise _Demote(declared & self.scalar)
        body = kids[-1]
        out = ["{"]
        if init is not None:
            out.append(self.threads_loop([init]))
        out.append("while (true) {")
        if condition is not None:
            out.append(self.threads_loop([("test", condition, leave)]))
        out.append("if (!__tsm_lanes.any_running()) break;")
        out.append(self.block(body))
        out.append(f"__tsm_lanes.unpark({again});")
        if step is not None:
            out.append(self.threads_loop([step]))
        out.append(f"}} __tsm_lanes.unpark({leave}); }}")
        return " ".join(out)

    def header(self, s) -> Tuple[Optional[tuple], Optional[object], Optional[tuple]]:
        """A loop's initialisation (a run item), condition and increment (a run item), each
        None where it has none."""
        k = self.k
        g = self.g
        kids = list(s.get_children())
        if s.kind == k.WHILE_STMT:
            return None, kids[0], None
        # A for's parts, from its text: clang's children do not say which of them are there.
        start, end = g.span(s)
        open_paren = g.masked.index("(", start)
        try:
            close = _msl_text._match_close(g.masked, open_paren, "(", ")")
        except _msl_text.ParseError:
            raise Unsupported("unbalanced parentheses") from None
        semicolons, depth = [], 0
        for i in range(open_paren + 1, close):
            ch = g.masked[i]
            depth += ch in "([{"
            depth -= ch in ")]}"
            if ch == ";" and depth == 0:
                semicolons.append(i)
        if len(semicolons) != 2:
            raise Unsupported("a for header")
        spans = [(open_paren + 1, semicolons[0] + 1), (semicolons[0] + 1, semicolons[1]), (semicolons[1] + 1, close)]
        parts: List[Optional[object]] = [None, None, None]
        for c in kids[:-1]:
            at = g.span(c)[0]
            for i, (a, b) in enumerate(spans):
                if a <= at < b:
                    parts[i] = c
        init, condition, step = parts
        return (("statement", init) if init is not None else None, condition,
                ("expression", step) if step is not None else None)

    # ---- a loop over the threads -----------------------------------------------------------------
    def threads_loop(self, run: List[tuple]) -> str:
        """One loop over the threads running here (state 0, lanes.h), each running the run's
        items in turn: ("statement", s); ("expression", e), e as a statement; ("test", c,
        code): the thread waits at ``code`` unless condition c holds; ("post", s) and
        ("replay", s): s's SIMD-group function handing over the thread's value, s replaying it."""
        g = self.g
        k = self.k
        pieces: List[str] = []
        spans: List[Tuple[int, int]] = []
        leaving = 0  # the run's returns and its threads' own jumps (leaving_edits)
        declared_only: List[str] = []  # the types of variables declared without a value ("": others)
        for item in run:
            what, s = item[0], item[1]
            if what == "post":
                call = self.stops[node_key(s)][1].call
                text = f"\n{g.line_marker(call)}\n{g.call_text(call, self.edits)}"
                # (its own lane: the thread's, posting; see bindings)
                pieces.append(f"{{ const ::tsm_emu::LaneRef __tsm_lane{{&__tsm_g.home->lanes, __tsm_t, "
                              f"::tsm_emu::kPosting}}; (void)({text}); }}")
                spans.append(g.span(call))
                declared_only.append("")
                continue
            if what in ("test", "expression"):
                start, end = g.span(s)
                text = self.edited(start, end, s)
                text = f"if (!({text})) __tsm_state[__tsm_t] = {item[2]};" if what == "test" else f"{text};"
                pieces.append(text)
                spans.append((start, end))
                declared_only.append("")
                continue
            start, end = g.span(s)[0], g.statement_end(s)
            text = self.edited(start, end, s)
            variables = [c for c in s.get_children() if c.kind == k.VAR_DECL] if s.kind == k.DECL_STMT else []
            frames = [g.frame_of[v.canonical.hash] for v in variables if v.canonical.hash in g.frame_of]
            if what == "statement" and variables and len(frames) == len(variables) and \
                    all(self.uninitialised(v) for v in variables):
                # (`Acc4 ar;`: nothing to construct for most types, see declared_only)
                text = " ".join(f"::tsm_emu::construct_default(__tsm_l{f.index}[__tsm_t]);" for f in frames)
                declared_only.extend(self.types[f.index] for f in frames)
            else:
                declared_only.append("")
                if frames:  # into temporaries, then constructed in the thread's slots
                    constructs = " ".join(f"::tsm_emu::construct(__tsm_l{f.index}[__tsm_t], __tsm_d{f.index});"
                                          for f in frames)
                    text = f"{{ {text} {constructs} }}"
            pieces.append(text)
            spans.append((start, end))
            leaving += sum(c.kind == k.RETURN_STMT or node_key(c) in self.lane_jumps for c in s.walk_preorder())
        self.check_locals(run, spans)
        collective = any(item[0] in ("post", "replay") for item in run)
        label = f"__tsm_next{next(self.labels)}"
        body = " ".join(pieces)
        if body.count(_NEXT) != leaving:
            raise Unsupported("a return, break or continue the translation does not read")
        body = body.replace(_NEXT, label)
        bound = self.bindings(spans, collective)
        loop = (f"for (unsigned __tsm_t = 0; __tsm_t < __tsm_n; ++__tsm_t) {{ if (__tsm_state[__tsm_t]) continue; "
                f"__tsm_g.enter(__tsm_t, false); try {{ {bound} {{ {body} }} }} "
                f"catch (...) {{ __tsm_lanes.fault(__tsm_t); }} {label}:; }}")
        if not leaving and self.element_major_in(spans) and all(
                item[0] in ("statement", "expression") and self.faults_alike(item[1]) for item in run):
            # Every thread running, what can fault faults in all or none: the first thread's
            # fault is the one to raise, where it is raised, so the loop needs neither each
            # thread's test nor its entering (the running thread's store, which may alias the
            # slots, kept the compiler from vectorising the loop) nor its catch. Only for a run
            # of element-major arrays without a SIMD-group function, which the compiler may
            # vectorise: a second copy of every run that qualifies, those with the functions'
            # inlined protocol too, tripled the C++ compiler's time on the lanes tests' kernels
            # (CI 734 -> 854 s) for a few percent of tsm.mm[shuffle]'s instructions.
            loop = (f"if (__tsm_lanes.all_running()) {{ __tsm_g.enter(0, false); "
                    f"for (unsigned __tsm_t = 0; __tsm_t < __tsm_n; ++__tsm_t) {{ {bound} {{ {body} }} }} }} "
                    f"else {{ {loop} }}")
        if any(c.kind == k.RETURN_STMT for item in run for c in item[1].walk_preorder()):
            loop += " if (__tsm_lanes.all_gone()) { __tsm_lanes.settle(); return; }"
        if all(declared_only):
            # A loop that only declares variables without a value, of types whose default
            # construction does nothing, does nothing (matmul_shuffle's `Acc4 ar;` at each of its
            # broadcasts).
            loop = f"if constexpr (!::tsm_emu::trivially_declared<{', '.join(declared_only)}>) {{ {loop} }}"
        return loop

    def element_major_in(self, spans: List[Tuple[int, int]]) -> bool:
        """Whether code in these spans uses an array in element-major slots."""
        return any(index in self.lane_major for index in self.thread_own(spans)[0])

    def faults_alike(self, statement) -> bool:
        """Whether a per-thread statement can fault only alike in all threads: every access
        it makes of memory or of an array has one index in all threads (and a pointer's one
        pointer), under conditions with one value in all threads, and it calls only Metal's
        functions without effects (which raise nothing in a plain dispatch)."""
        kernel = self.analysis
        lib = self.lib

        def alike(node, chain: List[object]) -> bool:
            kind = node.kind.name
            here = chain + [node]
            if kind in _UNSEEN:
                return False
            if kind == "ARRAY_SUBSCRIPT_EXPR":
                base, index = list(node.get_children())[:2]
                # (an array's or a vector's elements are its own; a pointer's, the pointer's)
                own = _clang._type_kind(_clang.stripped(base).type.get_canonical()) in _OWN_ELEMENTS
                if not (kernel.value(index) and (own or kernel.value(base)) and kernel.context(here)):
                    return False
            elif kind == "UNARY_OPERATOR":
                operator = lib.clang_getCursorUnaryOperatorKind(node)
                if operator == _clang.ADDRESS_OF:
                    return False
                if operator == _clang.DEREFERENCE and not (
                        kernel.value(next(node.get_children())) and kernel.context(here)):
                    return False
            elif kind == "MEMBER_REF_EXPR":
                base = next(iter(node.get_children()), None)
                if base is not None and kernel.arrow(node, base):
                    return False
            elif kind == "CALL_EXPR" and not (kernel.effect_free_call(node) or _dependent_arithmetic(node)):
                return False
            return all(alike(c, here) for c in node.get_children())

        return alike(statement, [])

    def lane_major_frames(self) -> Set[int]:
        """The slots (frame indices) of arrays the kernel uses only through subscripts, an
        element at a time, and never by address: element-major slots (lanes.h's LaneSlots),
        which a loop over the threads reads and writes contiguously."""
        g = self.g
        ranks = {f.index: _rank(f.var.type) for f in g.frames if f.var.canonical.hash not in g.pinned}
        out = {i for i, rank in ranks.items() if rank}
        for ref, ancestors in g.refs:
            f = g.frame_of.get(ref.referenced.canonical.hash) if ref.referenced is not None else None
            if f is None or f.index not in out:
                continue
            node, around = ref, list(ancestors)
            for _ in range(ranks[f.index]):  # subscripted as deep as the array is
                node, i = _clang.operand_parent(node, around)
                parent = around[i] if i >= 0 else None
                if parent is None or parent.kind.name != "ARRAY_SUBSCRIPT_EXPR" or \
                        node_key(_clang.stripped(next(parent.get_children()))) != node_key(_clang.stripped(node)):
                    out.discard(f.index)
                    break
                node, around = parent, around[:i]
        return out

    def uninitialised(self, var) -> bool:
        """Whether a declarator gives its variable no value (`Acc4 ar;`, `float a[8];`)."""
        g = self.g
        at = g.source.original(var.location.offset) + len(var.spelling)
        rest = re.sub(r"\[[^\]]*\]", "", g.masked[at:g.span(var)[1]])
        return not rest.strip()

    def check_locals(self, run, spans: List[Tuple[int, int]]) -> None:
        """A variable declared by a statement of the run (not in a slot) is the loop's local:
        no statement after the loop may read it."""
        g = self.g
        k = self.k
        declared = {c.canonical.hash for item in run if item[1].kind == k.DECL_STMT and item[0] != "post"
                    for c in item[1].get_children() if c.kind == k.VAR_DECL and c.canonical.hash not in g.frame_of}
        if not declared:
            return
        for ref, _ in g.refs:
            target = ref.referenced
            if target is not None and target.canonical.hash in declared:
                at = g.span(ref)[0]
                if not any(a <= at < b for a, b in spans):
                    raise Unsupported(f"{target.spelling} is read beyond the statements around it")

    def thread_own(self, spans: List[Tuple[int, int]]) -> Tuple[Dict[int, object], Dict[int, int]]:
        """The slots (frames, by index) and per-thread parameters (by index in
        ``thread_params``) that code in these spans uses."""
        g = self.g
        frames: Dict[int, object] = {}
        params: Dict[int, int] = {}
        thread_param = {p.canonical.hash: i for i, (p, _, _) in enumerate(g.thread_params)}
        for ref, _ in g.refs:
            at = g.span(ref)[0]
            if not any(a <= at < b for a, b in spans) or ref.referenced is None:
                continue
            key = ref.referenced.canonical.hash
            f = g.frame_of.get(key)
            if f is not None and key not in self.scalar:
                frames[f.index] = f
            elif ref.referenced.kind == self.k.PARM_DECL and key in thread_param:
                params[thread_param[key]] = key
        return frames, params

    def bindings(self, spans: List[Tuple[int, int]], collective: bool) -> str:
        """What the loop's statements use of a thread's own: its slots, its built-ins, and
        for a SIMD-group function its lane (the rewriter passes `__tsm_lane` to each)."""
        g = self.g
        frames, params = self.thread_own(spans)
        out = []
        if collective:  # (replaying; a handing over has its own, see threads_loop)
            out.append("const ::tsm_emu::LaneRef __tsm_lane{&__tsm_g.home->lanes, __tsm_t, ::tsm_emu::kReplaying};")
        for i in sorted(params):
            param, builtin, modified = g.thread_params[i]
            p = param.spelling
            if builtin is not None and not modified and param.canonical.hash not in g.pinned:
                out.append(f"__tsm_pt{i} {p} = ::tsm_emu::builtin_arg<__tsm_pt{i}>({builtin}, __tsm_g, __tsm_t);")
            else:
                out.append(f"auto& {p} = __tsm_p{i}[__tsm_t];")
        for index in sorted(frames):
            out.append(f"auto&& {frames[index].name} = __tsm_l{index}[__tsm_t];")  # (a view: lanes.h)
        return " ".join(out)

    # ---- the group function's part ---------------------------------------------------------------
    def head(self) -> str:
        g = self.g
        out = ["::tsm_emu::Lanes __tsm_lanes(__tsm_g, __tsm_sites, __tsm_kinds);",
               "::uint8_t* const __tsm_state = __tsm_lanes.state; const unsigned __tsm_n = __tsm_g.n;"]
        for i, (name, array) in enumerate(g.shared_vars):
            out.append(f"auto {name} = __tsm_h{i};" if array else f"auto& {name} = __tsm_h{i};")
        for f in g.frames:
            if f.var.canonical.hash not in self.scalar:
                slots = "LaneSlots" if f.index in self.lane_major else "Slots"
                out.append(f"static thread_local ::tsm_emu::SlotBuffer __tsm_lb{f.index}; "
                           f"::tsm_emu::{slots}<{self.types[f.index]}> __tsm_l{f.index}(__tsm_lb{f.index}, __tsm_g.n);")
        return " ".join(out)


def _dependent_arithmetic(call) -> bool:
    """A template's call that clang leaves unresolved for a type it depends on: a conversion
    (`T(0)`, `Acc(x)`) or an arithmetic, comparison or assignment operator (`acc += x`).
    Taken to only compute, as Metal's scalars and vectors do, the template arguments of
    kernels; its operands are seen as the call's children. (Not a subscript, a dereference,
    an address, ->, a call, a construction from several values.)"""
    if call.referenced is not None:
        return False
    kids = list(call.get_children())
    if kids and kids[0].kind.name == "TYPE_REF":
        return len(kids) <= 2
    operators = [c for c in kids if c.kind.name == "DECL_REF_EXPR" and not c.spelling]
    if len(operators) != 1 or len(kids) not in (2, 3):
        return False
    spelling = "".join(t.spelling for t in operators[0].get_tokens())
    return spelling in _ARITHMETIC and not (len(kids) == 2 and spelling in ("*", "&"))


def _rank(t) -> int:
    """How many arrays deep a type is (0: not an array)."""
    t = t.get_canonical()
    rank = 0
    while _clang._type_kind(t) in _ARRAY_KINDS:
        t = t.get_array_element_type().get_canonical()
        rank += 1
    return rank


def _leave_code(level: int) -> int:
    """A thread's state while it waits for the end of a structure at nesting ``level``: the
    branch it did not take, the loop it left."""
    return 2 * level - 1


def _next_code(level: int) -> int:
    """A thread's state while it waits for a loop's next iteration (`continue`)."""
    return 2 * level


def _in_library(cursor) -> bool:
    location = cursor.location
    return location.file is None or location.file.name.startswith(str(_clang.FRONTEND_INCLUDE_DIR))
