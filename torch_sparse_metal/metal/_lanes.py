"""Lanes at once: a uniform barrier-region kernel's threadgroup run statement by statement,
the code between two stops a loop over its threads (the runtime side is
csrc/emulator/include/tsm_emu/lanes.h).

Barrier regions (_regions) run each thread from where it waits to its next stop before the
next thread. Every stop costs each thread a resumption: its variables copied out of their
slots and stored back, its built-ins, the round's bookkeeping. A kernel with a SIMD-group
function every few instructions pays it all the time: ``matmul_shuffle`` resumes each lane
for four FMAs per broadcast. When every thread of a threadgroup takes the same way from
stop to stop (_uniformity, a thread that returns early being gone rather than elsewhere),
the control flow around the stops can run once for the whole threadgroup, and only the code
between them per thread. The kernel's group function gets a second body (used in plain
dispatches; sanitized ones keep the regions' rounds):

* A *structural* statement (one that holds a stop, or a ``break`` or ``continue`` of a
  loop that does) stays as written: its conditions and loop headers run once, and may
  read only *scalar* variables (one C++ local for the threadgroup) and values the same in
  every thread. A scalar variable is one the analysis found uniform whose every
  assignment is a statement of its own beside the stops (or a loop header), which runs once.
* Every other statement between two stops of one block is *per thread*: a run of them is
  one loop over the threads, in thread order, each thread running the run as its fiber
  would. A statement with a SIMD-group function ends the loop before it with each thread
  handing over its value, and starts the loop after it with each thread replaying it
  (regions' protocol, regions.h); a barrier has nothing to wait for.
* A variable declared beside the stops lives in a slot per thread (a regions frame), and
  a loop binds the slots it uses; a variable declared in a run is a local of its loop.
* ``return`` ends the thread: it is skipped by the loops after, and inactive at the
  SIMD-group functions after (as a fiber that returned); a barrier after it is what fibers
  make of it (resolve_regions). When no thread is left the group function returns.

What can differ from fibers, which run a thread to its next stop before the next thread:

* The order of two threads' effects from different runs between the same two stops. Only
  a data race (which the sanitizer reports; sanitized dispatches never run this way) or an
  atomic could tell: a kernel with atomics (or ``os_log``) does not run lanes at once.
* A fault: each thread's first fault stops that thread and is raised at the next stop, the
  first in thread order, which is the fault fibers raise. The threads after it have run
  their code up to there, though, so memory may hold their writes.

Whatever does not qualify keeps the regions' rounds; ``TSM_EMU_LANES=0`` turns this off.
"""
from __future__ import annotations

import itertools
import re
from typing import Dict, List, Set, Tuple

from . import _frontend
from ._uniformity import UNIFORM_BUILTINS, analyse, node_key

_ASSIGNMENTS = _frontend.ASSIGNMENT_OPERATORS
_INC_DEC = _frontend.INC_DEC_OPERATORS
_LOOPS = ("FOR_STMT", "WHILE_STMT", "DO_STMT")
# What a kernel (or a function it calls) may not do to run lanes at once: an atomic, whose
# threads' order the loops change, or a message, whose order they would change too.
_ORDERED = re.compile(r"\b(?:atomic_\w+|os_log\w*|printf)\s*\(|\.\s*log\w*\s*\(")

W_COLLECTIVE = 1  # regions.h's WaitKind of a SIMD-group function


class Unsupported(Exception):
    """The kernel keeps the regions' rounds."""


class _Demote(Exception):
    """Scalar variables a per-thread statement assigns: they are per thread after all."""
    def __init__(self, keys: Set[int]) -> None:
        super().__init__()
        self.keys = keys


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
        if _ORDERED.search(self.masked_text(g.kernel)) or any(
                _ORDERED.search(self.masked_text(f)) for f in self.called_functions()):
            raise Unsupported("an atomic or a message, whose order the threads' loops would change")
        stops = {node_key(p.call) for p in g.points}
        uniformity = analyse(g.body, g.params, g.entry.params, lambda c: node_key(c) in stops,
                             returns_leave=False)
        if not uniformity.control:
            raise Unsupported("not uniform")
        for c in g.body.walk_preorder():
            if c.kind in (k.GOTO_STMT, k.INDIRECT_GOTO_STMT, k.LABEL_STMT, k.SWITCH_STMT) and \
                    self.encloses_stop(c):
                raise Unsupported(c.kind.name)
        self.stops = {node_key(p.statement): (number, p) for number, p in enumerate(g.points, start=1)}
        self.structural: Set[Tuple[str, int, int]] = {node_key(a) for p in g.points for a in p.ancestors}
        self.jumps: Set[Tuple[str, int, int]] = set()
        self.mark_jumps(g.body, [])
        self.hoisted = {node_key(s) for s in g.hoisted}
        self.frame_keys = {f.var.canonical.hash: f for f in g.frames}
        self.scalar: Set[int] = {f.var.canonical.hash for f in g.frames
                                 if f.var.canonical.hash in uniformity.variables and
                                 f.var.canonical.hash not in g.pinned}
        while True:
            try:
                self.edits = g.renaming_edits(self.scalar)
                self.blocks = g.hoisted_blocks()
                main = self.block(g.body)
                break
            except _Demote as d:
                self.scalar -= d.keys
        # (A block of its own: its views of threadgroup arrays take the arrays' names.)
        return "{ " + self.head() + " " + main + " __tsm_lanes.settle(); }"

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
        """``break`` and ``continue`` of loops that hold a stop: they and what is between them
        and their loop are structural (they run once, for every thread alike)."""
        k = self.k
        for c in node.get_children():
            if c.kind in (k.LAMBDA_EXPR, k.STRUCT_DECL, k.CLASS_DECL):
                continue
            if c.kind in (k.BREAK_STMT, k.CONTINUE_STMT):
                path = ancestors + [node]
                for i in range(len(path) - 1, -1, -1):
                    target = path[i]
                    if target.kind.name in _LOOPS or (c.kind == k.BREAK_STMT and target.kind == k.SWITCH_STMT):
                        if node_key(target) in self.structural:
                            if target.kind == k.SWITCH_STMT:
                                raise Unsupported("a switch around a stop")
                            self.jumps.add(node_key(c))
                            self.structural.update(node_key(a) for a in path[i + 1:])
                        break
            self.mark_jumps(c, ancestors + [node])

    def edited(self, start: int, end: int) -> str:
        return self.g.apply(self.edits, self.blocks, start, end).replace("\n", " ")

    # ---- statements ------------------------------------------------------------------------------
    def block(self, node) -> str:
        """A structural statement's branch or body, as a block."""
        statements = list(node.get_children()) if node.kind == self.k.COMPOUND_STMT else [node]
        return "{ " + self.sequence(statements) + " }"

    def sequence(self, statements: List[object]) -> str:
        out: List[str] = []
        run: List[Tuple[str, object]] = []  # ("statement" | "post" | "replay", statement)

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
                self.check_scalar(s)
                return "scalar"
        assigned = self.assigned(s) & self.scalar
        if assigned:
            if not self.assigns_only(s, assigned):
                raise _Demote(assigned)
            self.check_scalar(s)
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

    def check_scalar(self, node) -> None:
        """What runs once for the threadgroup reads no thread's own value."""
        k = self.k
        g = self.g
        for c in node.walk_preorder():
            if c.kind != k.DECL_REF_EXPR or c.referenced is None:
                continue
            target = c.referenced
            key = target.canonical.hash
            if key in self.frame_keys and key not in self.scalar:
                raise Unsupported(f"a condition or scalar statement reads {target.spelling}, a thread's own")
            if target.kind == k.PARM_DECL:
                for param, builtin, modified in g.thread_params:
                    if param.canonical.hash == key and (
                            modified or builtin is None or key in g.pinned or
                            g.entry.params[g.params.index(param)].builtin not in UNIFORM_BUILTINS):
                        raise Unsupported(f"a condition or scalar statement reads {target.spelling}, a thread's own")
            elif target.kind == k.VAR_DECL and key not in self.frame_keys and not self.shared(target):
                raise Unsupported(f"a condition or scalar statement reads {target.spelling}, a thread's own")

    def shared(self, var) -> bool:
        """A variable one for the threadgroup: hoisted (static, constexpr, threadgroup, a
        constant) or at program scope."""
        parent = var.semantic_parent
        if parent is not None and parent.kind in (self.k.TRANSLATION_UNIT, self.k.NAMESPACE):
            return True
        return var.canonical.hash in self.g.hoisted_vars

    def scalar_text(self, s) -> str:
        return self.edited(self.g.span(s)[0], self.g.statement_end(s))

    def structure(self, s) -> str:
        """A structural statement: its conditions once, its parts in turn."""
        k = self.k
        g = self.g
        kids = list(s.get_children())
        if s.kind == k.COMPOUND_STMT:
            return self.block(s)
        if s.kind == k.IF_STMT:
            if any(c.kind in (k.VAR_DECL, k.DECL_STMT) for c in kids):
                raise Unsupported("if with a declaration")
            self.check_scalar(kids[0])
            text = f"if ({self.edited(*g.span(kids[0]))}) {self.block(kids[1])}"
            return text + (f" else {self.block(kids[2])}" if len(kids) > 2 else "")
        if s.kind in (k.FOR_STMT, k.WHILE_STMT):
            if any(c.kind == k.VAR_DECL for c in kids):
                raise Unsupported("a loop condition with a declaration")
            for init in kids[:-1]:
                for var in init.get_children() if init.kind == k.DECL_STMT else ():
                    if var.kind == k.VAR_DECL and var.canonical.hash not in self.scalar:
                        raise Unsupported(f"a loop around a stop declares {var.spelling}, a thread's own")
            body = kids[-1]
            for part in kids[:-1]:
                self.check_scalar(part)
            start, body_start = g.span(s)[0], g.span(body)[0]
            return self.edited(start, body_start) + " " + self.block(body)
        if s.kind == k.DO_STMT:
            body = kids[0]
            for part in kids[1:]:
                self.check_scalar(part)
            return "do " + self.block(body) + " " + self.edited(g.span(body)[1], g.statement_end(s))
        raise Unsupported(s.kind.name)

    # ---- a loop over the threads -----------------------------------------------------------------
    def threads_loop(self, run: List[Tuple[str, object]]) -> str:
        g = self.g
        k = self.k
        pieces: List[str] = []
        spans: List[Tuple[int, int]] = []
        returns = 0  # the run's return statements
        declared_only: List[str] = []  # the types of variables declared without a value ("": others)
        for what, s in run:
            start, end = g.span(s)[0], g.statement_end(s)
            if what == "post":
                call = self.stops[node_key(s)][1].call
                text = g.call_text(call, self.edits)
                pieces.append(f"__tsm_g.set_mode(::tsm_emu::kPosting); (void)({text}); "
                              f"__tsm_g.set_mode(::tsm_emu::kOrdinary);")
                spans.append(g.span(call))
                continue
            text = self.edited(start, end)
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
            if what == "replay":
                text = f"__tsm_g.set_mode(::tsm_emu::kReplaying); {text}"
            pieces.append(text)
            spans.append((start, end))
            returns += sum(c.kind == k.RETURN_STMT for c in s.walk_preorder())
        self.check_locals(run, spans)
        collective = any(what != "statement" for what, _ in run)
        label = f"__tsm_next{next(self.labels)}"
        body = " ".join(pieces)
        if returns:
            body, replaced = re.subn(r"\breturn\s*;",
                                     f"{{ __tsm_gone[__tsm_t] = ::tsm_emu::Lanes::kReturned; goto {label}; }}", body)
            if replaced != returns:
                raise Unsupported("a return the translation does not read")
        loop = (f"for (unsigned __tsm_t = 0; __tsm_t < __tsm_n; ++__tsm_t) {{ if (__tsm_gone[__tsm_t]) continue; "
                f"__tsm_g.enter(__tsm_t, false); try {{ {self.bindings(spans, collective)} {{ {body} }} }} "
                f"catch (...) {{ __tsm_lanes.fault(__tsm_t); }} {label}:; }}")
        if returns:
            loop += " if (__tsm_lanes.all_gone()) { __tsm_lanes.settle(); return; }"
        if declared_only and all(declared_only):
            # A loop that only declares variables without a value, of types whose default
            # construction does nothing, does nothing (matmul_shuffle's `Acc4 ar;` at each of its
            # broadcasts).
            loop = f"if constexpr (!::tsm_emu::trivially_declared<{', '.join(declared_only)}>) {{ {loop} }}"
        return loop

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
        declared = {c.canonical.hash for what, s in run if s.kind == k.DECL_STMT and what != "post"
                    for c in s.get_children() if c.kind == k.VAR_DECL and c.canonical.hash not in g.frame_of}
        if not declared:
            return
        for ref, _ in g.refs:
            target = ref.referenced
            if target is not None and target.canonical.hash in declared:
                at = g.span(ref)[0]
                if not any(a <= at < b for a, b in spans):
                    raise Unsupported(f"{target.spelling} is read beyond the statements around it")

    def bindings(self, spans: List[Tuple[int, int]], collective: bool) -> str:
        """What the loop's statements use of a thread's own: its slots, its built-ins, and
        for a SIMD-group function its lane (the rewriter passes `__tsm_lane` to each)."""
        g = self.g
        k = self.k
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
            elif ref.referenced.kind == k.PARM_DECL and key in thread_param:
                params[thread_param[key]] = key
        out = []
        if collective:
            out.append("const ::tsm_emu::LaneRef __tsm_lane{&__tsm_g.home->lanes, __tsm_t};")
        for i in sorted(params):
            param, builtin, modified = g.thread_params[i]
            p = param.spelling
            if builtin is not None and not modified and param.canonical.hash not in g.pinned:
                out.append(f"__tsm_pt{i} {p} = ::tsm_emu::builtin_arg<__tsm_pt{i}>({builtin}, __tsm_g, __tsm_t);")
            else:
                out.append(f"auto& {p} = __tsm_p{i}[__tsm_t];")
        for index in sorted(frames):
            out.append(f"auto& {frames[index].name} = __tsm_l{index}[__tsm_t];")
        return " ".join(out)

    # ---- the group function's part ---------------------------------------------------------------
    def head(self) -> str:
        g = self.g
        out = ["::tsm_emu::Lanes __tsm_lanes(__tsm_g, __tsm_sites, __tsm_kinds);",
               "::uint8_t* const __tsm_gone = __tsm_lanes.gone; const unsigned __tsm_n = __tsm_g.n;"]
        for i, (name, array) in enumerate(g.shared_vars):
            out.append(f"auto {name} = __tsm_h{i};" if array else f"auto& {name} = __tsm_h{i};")
        for f in g.frames:
            if f.var.canonical.hash not in self.scalar:
                out.append(f"static thread_local ::tsm_emu::SlotBuffer __tsm_lb{f.index}; "
                           f"::tsm_emu::Slots<{self.types[f.index]}> __tsm_l{f.index}(__tsm_lb{f.index}, __tsm_g.n);")
        return " ".join(out)


def _in_library(cursor) -> bool:
    location = cursor.location
    return location.file is None or location.file.name.startswith(str(_frontend.FRONTEND_INCLUDE_DIR))
