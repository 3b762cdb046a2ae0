"""Threadgroups as loops between stops: the emulator's translation of kernels whose
synchronisation (barriers, SIMD-group and quad-group functions, simdgroup_matrix products,
``a * b`` of two matrices included) is all in their own body (the runtime side is
csrc/emulator/include/tsm_emu/regions.h).

Layer: plan (the layers are in the package's docstring). Imports the parse layer, the
analyses (_uniformity, _bounds_probe, _matrix_products), the plan it writes from
(_group_plan) and _lanes; _schedule decides which kernels get a group function.

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

import re
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Set, Tuple

from . import _bounds_probe, _clang, _lanes, _matrix_products, _msl_text
from ._group_plan import (W_BARRIER, W_COLLECTIVE, W_SIMDGROUP_BARRIER, Edit, _Frame, _GroupPlan, _line_marker,
                          _plain_const, _Point, _Unsupported)
from ._uniformity import analyse, node_key


class _GroupFunction(_GroupPlan):
    """The group function of a kernel _GroupPlan read: its text, and the edits of the kernel's
    source that insert it (see the module's docstring)."""

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


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _never_changes(var) -> bool:
    """Whether a variable keeps the value its declaration gives it: declared const, of a
    scalar, vector or pointer type, or of a struct (a template's too) with no `mutable`
    member at any depth. Not one of a template parameter's type, which the instantiation
    decides."""
    t = var.type.get_canonical()
    if not t.is_const_qualified():
        return False
    return _plain_const(t)


