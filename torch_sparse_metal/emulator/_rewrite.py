"""From preprocessed Metal Shading Language to C++ the emulator compiles.

Layer: emit. Imports the parse layer (_msl_text) and the sanitized build's rewrites
(_access_rewrite, emit too); nothing else of the translator.

Input is the output of the C preprocessor run over the user's source with the emulated
``<metal_stdlib>`` empty (so only user code is in it), with the edits of the lowering and
planning passes applied. The kernels were found by _msl_text.find_kernels. This module

* rewrites what C++ cannot express: attributes and ``kernel`` are removed, threadgroup
  variables declared in a function body become storage shared by the threads of one
  threadgroup (``static thread_local``: one worker runs a threadgroup's fibers) and are
  registered for the 32 KB check, ``1.5h`` half literals become ``half(1.5f)``;
* writes the binding table the runtime dispatches through.

It knows the shape of declarations, not the C++ grammar: what it cannot parse it reports
as a compile error naming the line, rather than guessing.
"""
from __future__ import annotations

import bisect
import re
from dataclasses import replace
from typing import Iterator, List, Set, Tuple

from ._access_rewrite import checked_members, marked_stores
from ._msl_text import (Kernel, ParseError, _ATTRIBUTE, _TYPE, _apply, _block_end, _call_pattern, _function_definitions,
                        _head_start, _mask_strings_and_directives, _match_close, _match_open, _source_lines, _split_top_level,
                        bare_coherent_edits, blank, collective_names, declarator, function_name, semicolon_end,
                        stage_function_edits)
# (the Metal backend and its tests take the binding table's parameter kinds from here)
from ._msl_text import P_BUFFER, P_THREADGROUP  # noqa: F401


_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)[hH]\b")


# Qualifiers before a pointee type; Metal 3.2's `coherent(device)` among them.
_QUALIFIERS = r"((?:(?:const|volatile|coherent\s*\([^()]*\))\s*)*)"
_ADDRESS_SPACE_POINTER = re.compile(
    r"(?<![\w:])" + _QUALIFIERS + r"(?:device|constant|threadgroup)\s+" + _QUALIFIERS +
    r"(" + _TYPE + r")\s*((?:(?:const|volatile)\b\s*)*)\*")


def _cv(*qualifiers: str) -> str:
    """The const and volatile of qualifier texts (coherence is the GPU's business)."""
    return " ".join(re.sub(r"coherent\s*\([^()]*\)", " ", " ".join(qualifiers)).split())


def _checked_pointee(quals: str, pointee: str) -> str:
    """What ``ptr<...>`` holds for a pointee with qualifiers ``quals``: a volatile one through
    ``tsm_emu::volatile_t``, which keeps volatile on scalars only (a volatile vector or
    struct would have no assignment in C++; SPIRV-Cross's coherent blocks are
    ``volatile device SSBO&``); a volatile atomic as it is, whose functions take it."""
    cv = quals.split()
    if "volatile" in cv and not re.search(r"\batomic", pointee):  # (atomics take volatile)
        rest = " ".join(q for q in cv if q != "volatile")
        return f"::tsm_emu::volatile_t<{rest + ' ' if rest else ''}{pointee}>"
    return f"{quals + ' ' if quals else ''}{pointee}"


# A buffer of pointers, `device T* device const* p`: the pointers in it are its elements.
_POINTER_TO_POINTER = re.compile(
    _ADDRESS_SPACE_POINTER.pattern + r"\s*((?:(?:const|volatile)\s+)*)(?:device|constant|threadgroup)\b\s*"
    r"((?:(?:const|volatile)\b\s*)*)\*")


# `constant const int64_t strides[2]` as a parameter (MLX's elem_to_loc_2): a pointer.
_ADDRESS_SPACE_ARRAY_PARAMETER = re.compile(
    r"(?<=[(,])\s*" + _QUALIFIERS + r"(?:device|constant|threadgroup|thread)\s+" + _QUALIFIERS + r"(" + _TYPE +
    r")\s*(\w+)\s*\[[^\[\];{}]*\](?=\s*[,)])")
_ADDRESS_SPACE_ARRAYS_PARAMETER = re.compile(
    r"(?<=[(,])\s*" + _QUALIFIERS + r"(device|constant|threadgroup)\s+" + _QUALIFIERS + r"(" + _TYPE +
    r")\s*(\w+)\s*\[[^\[\];{}]*\]((?:\s*\[[^\[\];{}]*\])+)(?=\s*[,)])")
_THREAD_POINTER = re.compile(
    r"(?<![\w:])" + _QUALIFIERS + r"thread\s+" + _QUALIFIERS + r"(" + _TYPE + r")\s*((?:(?:const|volatile)\b\s*)*)\*")
_CLOSERS = {")": "(", "]": "[", "}": "{", ">": "<"}


def _array_parameters_as_pointers(src: str) -> str:
    """``constant T name[N]`` (and thread, ...) in a parameter list -> ``constant T* name``,
    as C++ adjusts it, so that the pointer rewrites below check it like any other; and
    ``threadgroup T name[N][M]`` (device, constant) -> ``::tsm_emu::ptr<T[M]> name``, a
    checked pointer to its rows, what such an array is passed as (PyTorch's LinearAlgebra.metal
    ``threadgroup T A_tile[TILE_DIM][TILE_DIM]``)."""
    masked = _mask_strings_and_directives(src)
    edits = [(m.end(3), m.end(), f"* {m.group(4)}") for m in _ADDRESS_SPACE_ARRAY_PARAMETER.finditer(masked)]
    for m in _ADDRESS_SPACE_ARRAYS_PARAMETER.finditer(masked):
        cv = _cv(m.group(1), m.group(3), "const" if m.group(2) == "constant" else "")
        pointee = " ".join(f"{cv} {src[m.start(4):m.end(4)]}".split())
        rows = "".join(re.findall(r"\[[^\[\]]*\]", src[m.start(6):m.end(6)]))
        edits.append((m.start(1), m.end(), f"::tsm_emu::ptr<{pointee}{rows}> {m.group(5)}"))
    return _apply(src, edits)


def _class_scope_specialisations(src: str) -> str:
    """``template <>`` before a member function in a class (MLX's FloorDivide: an explicit
    specialisation of a member template, which clang takes and g++ does not) is dropped: the
    member becomes a plain overload, which overload resolution prefers over the template for
    those argument types, as the specialisation was chosen. One with explicit template
    arguments (``f<int>(...)``) is left to the C++ compiler."""
    masked = _mask_strings_and_directives(src)
    edits = []
    for m in re.finditer(r"\btemplate\s*<\s*>", masked):
        depth, i = 0, m.start() - 1
        while i >= 0 and not (masked[i] == "{" and depth == 0):
            depth += {"}": 1, "{": -1}.get(masked[i], 0)
            i -= 1
        if i < 0 or not re.search(r"\b(?:struct|class|union)\s+[\w:]+[^;{}()]*$", masked[:i]):
            continue
        head = re.match(r"[^;{]*", masked[m.end():]).group()
        if "(" in head and not re.search(r">\s*\(", head):
            edits.append((m.start(), m.end(), blank(m.group())))
    return _apply(src, edits)


def _checked_pointers(src: str) -> str:
    """``device const T*`` (and constant, threadgroup) -> ``::tsm_emu::ptr<const T>``.

    The pointers a buffer holds (``device T* device* p``) stay raw, the size the buffer's
    elements have: only ``p`` is checked."""
    masked = _mask_strings_and_directives(src)
    # reinterpret_cast<ulong>(p) of what is now a class: its address (tsm_emu::integer_cast).
    edits = [(m.start(), m.end(), f"::tsm_emu::integer_cast<{m.group(1)}>(") for m in re.finditer(
        r"\breinterpret_cast\s*<\s*((?:metal::)?(?:ulong|long|size_t|uintptr_t|intptr_t|uint64_t|int64_t|"
        r"ptrdiff_t|unsigned\s+long))\s*>\s*\(", masked)]
    for m in _POINTER_TO_POINTER.finditer(masked):
        inner = _cv(m.group(2), src[m.start(3):m.end(3)], m.group(4))
        quals = _cv(m.group(1), m.group(5), m.group(6))
        edits.append((m.start(), m.end(), f"::tsm_emu::ptr<{inner}* {quals}>".replace(" >", ">")))
    return _address_space_pointers(_apply(src, edits))


def _address_space_pointers(src: str) -> str:
    """Each ``device``, ``constant`` and ``threadgroup`` pointer of ``src`` as a checked
    pointer; the pointers named in its pointee's template arguments too
    (``const device spvBufferDescriptor<device T*>*``, SPIRV-Cross's descriptors), so that
    they match partial specialisations on ``ptr<T>``."""
    masked = _mask_strings_and_directives(src)
    out, last = [], 0
    for m in _ADDRESS_SPACE_POINTER.finditer(masked):
        quals = _cv(m.group(1), m.group(2), m.group(4))
        # What a constant pointer designates is read-only whether it says const or not (a
        # `constexpr constant` table is passed for `constant T*`).
        if "const" not in quals.split() and re.search(r"\bconstant\b", masked[m.start():m.start(3)]):
            quals = _cv("const", quals)
        pointee = " ".join(src[m.start(3):m.end(3)].split())
        if "<" in pointee and _ADDRESS_SPACE_POINTER.search(pointee):
            pointee = _address_space_pointers(pointee)
        # `const device auto* p = q + i;` (MLX's gemv): the initialiser is a checked pointer.
        checked = "auto" if pointee == "auto" else f"::tsm_emu::ptr<{_checked_pointee(quals, pointee)}>"
        start, end = m.start(), m.end()
        # reinterpret_cast<device T*>(p) cannot name a class type: use ptr_cast<T>(p).
        cast = re.search(r"\b(?:reinterpret|static|const)_cast\s*<\s*$", masked[max(0, start - 40):start])
        close = re.match(r"\s*>", masked[end:])
        if cast and close and last <= start - len(cast.group()):
            start -= len(cast.group())
            end += close.end()
            checked = f"::tsm_emu::ptr_cast<{quals + ' ' if quals else ''}{pointee}>"
        out.append(src[last:start])
        out.append(checked)
        last = end
    out.append(src[last:])
    return "".join(out)


def _thread_pointers(src: str) -> str:
    """``thread T*`` -> ``::tsm_emu::thread_ptr<T>`` (tsm_emu/thread_array.h), a pointer that
    carries the bounds of the thread array it was taken from.

    It stays a raw ``T*`` where a class cannot stand for it: a template argument, a C-style
    cast, and a parameter of a function (or alias) template whose pointee names one of the
    template's parameters, which a call may deduce from the pointer (``template <typename T>
    void f(thread T* p)`` called with ``f(x)``); ``reinterpret_cast<thread T*>(e)`` becomes
    ``thread_cast<T>(e)``, raw too; ``thread auto*`` becomes ``auto``."""
    masked = _mask_strings_and_directives(src)
    edits = []
    for m in _THREAD_POINTER.finditer(masked):
        pointee = " ".join(src[m.start(3):m.end(3)].split())
        typed = " ".join(f"{_cv(m.group(1), m.group(2), m.group(4))} {pointee}".split())
        start, end = m.start(), m.end()
        cast = re.search(r"\b(?:reinterpret|static|const)_cast\s*<\s*$", masked[max(0, start - 40):start])
        close = re.match(r"\s*>", masked[end:])
        if cast and close:
            edits.append((start - len(cast.group()), end + close.end(), f"::tsm_emu::thread_cast<{typed}>"))
        elif pointee == "auto":
            edits.append((start, end, "auto"))
        elif not _raw_thread_pointer(masked, start, end, pointee):
            edits.append((start, end, f"::tsm_emu::thread_ptr<{typed}>"))
    return _apply(src, edits)


def _raw_thread_pointer(masked: str, start: int, end: int, pointee: str) -> bool:
    """Whether the ``thread T*`` at [start, end) of ``masked`` must stay a raw pointer (see
    _thread_pointers)."""
    stack, i = [], start - 1
    while i >= 0:  # the bracket the type is in
        c = masked[i]
        if c in _CLOSERS and not (c == ">" and masked[i - 1:i] == "-"):
            stack.append(c)
        elif c in "([{<" and not (c == "<" and masked[i - 1:i] == "<"):
            if not stack:
                break
            if _CLOSERS[stack[-1]] == c:
                stack.pop()
        elif c == ";" and not stack:
            return False
        i -= 1
    if i < 0 or masked[i] in "{[":
        return False
    if masked[i] == "<":
        return True  # a template argument
    if re.match(r"\s*\)", masked[end:]) and not re.search(r"[\w\]]\s*$", masked[:i]):
        return True  # (thread T*)e
    head = i - 1  # the declaration the parameter list belongs to
    depth = 0
    while head >= 0 and not (depth == 0 and masked[head] in ";{}"):
        depth += {")": 1, "(": -1}.get(masked[head], 0)
        head -= 1
    names = set()
    for header in re.finditer(r"\btemplate\s*<", masked[head + 1:i]):
        try:
            close = _match_close(masked, head + 1 + header.end() - 1, "<", ">")
        except ParseError:
            return True
        names.update(re.findall(r"\b(?:typename|class)\s+(?:\.\.\.\s*)?(\w+)", masked[head + 1 + header.end():close]))
    return any(re.search(rf"\b{re.escape(n)}\b", pointee) for n in names)


def _uses(masked: str, name: str, start: int, end: int) -> List[int]:
    """Offsets of the uses of identifier ``name`` in [start, end), members excluded."""
    return [m.start() for m in re.finditer(r"(?<![\w.:])(?<!->)" + re.escape(name) + r"\b(?!\s*::)",
                                           masked[:end]) if m.start() >= start]


_REFERENCE_PARAM = re.compile(
    r"(?<![\w:])" + _QUALIFIERS + r"(?:device|threadgroup)\s+" + _QUALIFIERS + r"(" + _TYPE +
    r")\s*&\s*(?:(\w+)|(?=[,)]))")


_CONSTANT_REFERENCE = re.compile(
    r"(?<![\w:])((?:const\s+)?)constant\s+((?:const\s+)?)(" + _TYPE + r")\s*\(?\s*&")


def _read_only_constant_references(src: str) -> str:
    """``constant T& x`` -> ``const constant T& x``: what it designates is read-only whether
    it says const or not (MLX passes a kernel's ``const constant int&`` on to a helper's
    ``constant int&``), as for constant pointers; a reference to an array too, ``constant T
    (&src)[N]`` (SPIRV-Cross's array copies), where ``T`` deduces the same from a constant
    array as from a thread one."""
    masked = _mask_strings_and_directives(src)
    return _apply(src, [(m.start(), m.start(), "const ") for m in _CONSTANT_REFERENCE.finditer(masked)
                        if not (m.group(1) or m.group(2))])


def _checked_references(src: str) -> str:
    """``device T& x`` (and threadgroup) -> ``ptr<T> x`` and each later use of ``x`` ->
    ``(*x)``, so accesses through a reference are checked at every use, not only where it
    was bound: parameters (a buffer bound by reference) and local references
    (``device float& r = out[i];`` becomes ``ptr<float> r = &out[i];``); an unnamed one in a
    function type becomes ``ptr<T>`` too, so that the functions it is matched with fit."""
    masked = _mask_strings_and_directives(src)
    edits = []
    for m in _REFERENCE_PARAM.finditer(masked):
        quals = _cv(m.group(1), m.group(2))  # (`volatile device T&`: SPIRV-Cross's coherent blocks)
        pointee = " ".join(src[m.start(3):m.end(3)].split())
        name = m.group(4)
        checked = f"::tsm_emu::ptr<{_checked_pointee(quals, pointee)}>"
        if name is None:
            if re.search(r"\(\s*$", masked[:m.start()]) and re.match(r"\s*\)\s*[\w(*&:]", masked[m.end():]):
                # a C-style cast, `(device float&)v.f4[0]` (SPIRV-Cross's std140 arrays):
                # the same object read as another type, as a C++ reference cast does
                edits.append((m.start(), m.end(), f"{quals + ' ' if quals else ''}{pointee}&"))
            else:  # a function type's parameter (ggml: `void (*q)(device block &)`)
                edits.append((m.start(), m.end(), checked))
            continue
        local = re.match(r"\s*=", masked[m.end():])
        if local and pointee == "auto":  # `threadgroup const auto& id = rowids[i];` (candle): deduced
            checked = "auto"
        checked += f" {name}"
        if local:  # a local reference: point at what it binds, in the rest of its block
            end = masked.find(";", m.end())
            simple = re.fullmatch(r"\s*\w+\s*\[.*\]\s*", masked[m.end() + local.end():end], re.S)
            # `&p[i]` is then rewritten as pointer arithmetic (no access recorded)
            edits.append((m.start(), m.end() + local.end(), checked + (" = &" if simple else " = &(")))
            if not simple:
                edits.append((end, end, ")"))
            scope = (end, _block_end(masked, end))
        else:
            depth, close = 0, None
            for i in range(m.end(), len(masked)):  # the end of the parameter list
                if masked[i] in "([":
                    depth += 1
                elif masked[i] in ")]":
                    if depth == 0:
                        close = i
                        break
                    depth -= 1
            if close is None or masked[close] != ")":
                continue
            edits.append((m.start(), m.end(), checked))
            body = re.match(r"\s*\{", masked[close + 1:])
            if not body:
                continue  # a declaration without a body
            open_brace = close + 1 + body.end() - 1
            scope = (open_brace, _match_close(masked, open_brace, "{", "}"))
        for use in _uses(masked, name, *scope):
            edits.append((use, use + len(name), f"(*{name})"))
    return _apply(src, edits)


_SUBSCRIPTED_NAME = re.compile(r"&\s*(\w+)\s*\[")


def _threadgroup_array_sizes(src: str) -> str:
    """``sizeof(t...)`` of a threadgroup array -> ``sizeof(t.storage()...)``: sanitized, the
    array is a tg_var (a checked pointer in front of the storage) and ``t[0]`` a pointer."""
    masked = _mask_strings_and_directives(src)
    names = {name for _, _, _, declarators in _threadgroup_declarations(masked)
             for name, dims in declarators if dims}
    if not names:
        return src
    pattern = re.compile(r"\bsizeof\s*\(\s*(" + "|".join(map(re.escape, sorted(names))) + r")\b(?!\s*\.)")
    return _apply(src, [(m.end(1), m.end(1), ".storage()") for m in pattern.finditer(masked)])


def _threadgroup_arrays_in_conditionals(src: str) -> str:
    """A threadgroup array as an operand of ``?:`` -> a pointer to its first element, to
    which it decays in Metal (MLX's gemv: ``n == 0 ? nullptr : tgp_memory``); the
    emulator's array is a class, which C++ does not convert to the other operand's type."""
    masked = _mask_strings_and_directives(src)
    names = {name for _, _, _, declarators in _threadgroup_declarations(masked)
             for name, dims in declarators if dims}
    if not names:
        return src
    operand = re.compile(r"(?:\?|(?<!:):(?!:))\s*(" + "|".join(map(re.escape, sorted(names))) +
                         r")\b(?=\s*(?:[:),;]|$))")
    return _apply(src, [(m.start(1), m.end(1), f"::tsm_emu::element_address({m.group(1)}, 0)")
                        for m in operand.finditer(masked)
                        if masked[m.start()] == "?" or _closes_conditional(masked, m.start())])


def _closes_conditional(masked: str, colon: int) -> bool:
    """Whether the ``:`` at ``colon`` is a conditional's (not a range-for's, a label's...):
    a ``?`` precedes it in the same expression."""
    depth, i = 0, colon - 1
    while i >= 0:
        c = masked[i]
        if c in ")]":
            depth += 1
        elif c in "([":
            if depth == 0:
                return False
            depth -= 1
        elif depth == 0 and c in ";{},":
            return False
        elif depth == 0 and c == "?":
            return True
        i -= 1
    return False


def _unary_ampersand(masked: str, pos: int) -> bool:
    """Whether the ``&`` at ``pos`` takes an address (rather than being a binary and)."""
    i = pos - 1
    while i >= 0 and masked[i].isspace():
        i -= 1
    if i < 0 or masked[i] in "(,=;{}?:!~+-*/%<>|^[":
        return True
    if masked[i] == "&":
        return False  # the second & of &&
    if masked[i] == ")":  # a cast, (device uint*)&p[i], ends in *; an operand does not
        return masked[_match_open(masked, i) + 1:i].strip().endswith("*")
    word = re.search(r"(\w+)$", masked[:i + 1])
    return bool(word) and word.group(1) in ("return", "case")


def _addresses_without_access(src: str) -> str:
    """``&p[i]`` (and ``&t[i][j]``) -> ``tsm_emu::element_address(p, i)``: for a checked
    pointer or threadgroup array, taking an element's address is pointer arithmetic, not an
    access the sanitizer should record (and one past the end is a valid address)."""
    masked = _mask_strings_and_directives(src)
    edits = []
    for m in _SUBSCRIPTED_NAME.finditer(masked):
        # `[[` opens an attribute, never a subscript: `MLXConvParams<2>& params [[buffer(3)]]`.
        if masked.startswith("[[", m.end() - 1) or not _unary_ampersand(masked, m.start()):
            continue
        groups = []  # the [...] subscripts, in order
        pos = m.end() - 1
        while pos < len(masked) and masked[pos] == "[":
            close = _match_close(masked, pos, "[", "]")
            groups.append((pos, close))
            nxt = re.match(r"\s*", masked[close + 1:])
            pos = close + 1 + nxt.end()
        if re.match(r"\.|->|\(", masked[pos:pos + 2]):
            continue  # &p[i].field, &p[i]->f, &p[i](...): not the element's own address
        last_open, last_close = groups[-1]
        prefix = src[m.start() + 1:last_open].strip()
        index = src[last_open + 1:last_close]
        edits.append((m.start(), last_close + 1, f"::tsm_emu::element_address({prefix}, {index})"))
    return _apply(src, edits)


def _checked_threadgroup_scalars(src: str) -> str:
    """Uses of a threadgroup scalar (``threadgroup float m;``) -> ``m.ref()``, which checks
    them; the declaration itself becomes a ``tg_scalar`` in the declaration rewrite."""
    masked = _mask_strings_and_directives(src)
    edits = []
    for m in re.finditer(r"\bthreadgroup\b(?!_)", masked):
        i = m.start() - 1
        while i >= 0 and masked[i].isspace():
            i -= 1
        if i >= 0 and masked[i] not in ";{}":
            continue
        end = masked.find(";", m.start())
        decl = masked[m.end():end]
        if end < 0 or re.search(r"[*&(=\[]", decl):
            continue  # arrays and pointers are handled elsewhere
        for part in _split_top_level(decl):
            name = re.search(r"(\w+)\s*$", part.strip())
            if name:
                for use in _uses(masked, name.group(1), end, _block_end(masked, end)):
                    after = use + len(name.group(1))
                    # bound to a `threadgroup T&` parameter (the front end marks it): its
                    # address, with no access (see tsm_emu::reference_argument)
                    wrapper = re.search(r"::tsm_emu::reference_argument\(\s*$", masked[max(0, use - 40):use])
                    close = re.match(r"\s*\)", masked[after:])
                    if wrapper and close:
                        edits.append((use - len(wrapper.group()), after + close.end(), f"{name.group(1)}.pointer()"))
                    else:
                        edits.append((use, after, f"{name.group(1)}.ref()"))
    return _apply(src, edits)


def _threadgroup_declarations(masked: str) -> Iterator[Tuple[int, int, str, List[Tuple[str, str]]]]:
    """(start, end of the `;`, element type, [(name, array dimensions or "")]) of each
    ``threadgroup T a[N], b;`` declaration statement of ``masked`` (not pointers,
    references, parameters or casts)."""
    for m in re.finditer(r"\bthreadgroup\b(?!_)", masked):
        start = m.start()
        i = start - 1
        while i >= 0 and masked[i].isspace():
            i -= 1
        if i >= 0 and masked[i] not in ";{}":
            continue  # a parameter, a cast or a pointer declaration's qualifier mid-statement
        end = masked.find(";", start)
        if end < 0:
            continue
        decl = masked[m.end():end]
        if re.search(r"[*&(=]", decl.split("[", 1)[0]):
            continue  # pointer/reference/function: only the qualifier goes (macro)
        # An initialiser (accepted by Apple's compiler: MLX's layer_norm) is dropped: the
        # memory starts uninitialised, as every threadgroup variable's does.
        parts = [declarator(part) for part in _split_top_level(decl)]
        names = [re.search(r"(\w+)\s*(?:\[|$)", part.strip()) for part in parts]
        if not names or not all(names):
            continue
        type_text = parts[0].strip()[:names[0].start(1)].strip()
        yield start, end, type_text, [(name.group(1), part.strip()[name.end(1):].strip())
                                      for part, name in zip(parts, names)]


def _rewrite_threadgroup_declarations(src: str, masked: str) -> str:
    """``threadgroup T name[N];`` in a body -> storage shared by one threadgroup: a
    ``tsm_emu::tg_var`` per array, whose accesses are checked, a ``tg_scalar`` per scalar."""
    out, last = [], 0
    for start, end, type_text, declarators in _threadgroup_declarations(masked):
        out.append(src[last:start])
        # `float a[4], b[8]` -> one checked array per declarator.
        for name, dims in declarators:
            if dims:
                out.append(f"static thread_local ::tsm_emu::tg_var<{type_text}{dims}> {name};")
            else:
                out.append(f"static thread_local ::tsm_emu::tg_scalar<{type_text}> {name};")
        for name, _ in declarators:  # every declarator counts towards the 32 KB
            out.append(f" ::tsm_emu::register_static_threadgroup_memory(&{name}, sizeof({name}), \"{name}\");")
        last = end + 1
    out.append(src[last:])
    return "".join(out)


def _statement_end(masked: str, pos: int) -> int:
    """The offset just past the statement that starts at (or after blanks from) ``pos``."""
    i = pos
    while i < len(masked) and masked[i].isspace():
        i += 1
    if masked[i] == "{":
        return _match_close(masked, i, "{", "}") + 1
    m = re.match(r"(if|for|while|switch)\s*\(", masked[i:])
    if m:
        close = _match_close(masked, i + m.end() - 1, "(", ")")
        end = _statement_end(masked, close + 1)
        if m.group(1) == "if":
            other = re.match(r"\s*else\b", masked[end:])
            if other:
                end = _statement_end(masked, end + other.end())
        return end
    if re.match(r"do\b", masked[i:]):
        end = _statement_end(masked, i + 2)
        tail = re.match(r"\s*while\s*\(", masked[end:])
        close = _match_close(masked, end + tail.end() - 1, "(", ")")
        return close + 1 + re.match(r"\s*;", masked[close + 1:]).end()
    end = semicolon_end(masked, i)
    if end is None:
        raise ParseError("cannot find the end of a statement", pos)
    return end


def _braced_loops(src: str) -> str:
    """Give every loop body braces, and move a collective out of a ``while`` condition:
    ``while (c) {b}`` -> ``for (;;) { if (!(c)) break; b }``. Loop frames then cover the
    whole of each iteration, the condition's collectives included."""
    masked = _mask_strings_and_directives(src)
    bodies = [(d.body_open, d.body_close) for d in _function_definitions(masked)]
    collective = _call_pattern(collective_names())
    edits = []
    for m in re.finditer(r"\b(for|while)\s*\(", masked):
        if not any(a < m.start() < b for a, b in bodies):
            continue
        close = _match_close(masked, m.end() - 1, "(", ")")
        after = re.match(r"\s*", masked[close + 1:]).end() + close + 1
        if masked[after] == ";":
            continue  # the `while (...);` of a do-while
        braced = masked[after] == "{"
        end = _statement_end(masked, after)
        condition = masked[m.end():close]
        if m.group(1) == "while" and collective.search(condition):
            cond_src = src[m.end():close]
            edits.append((m.start(), after + (1 if braced else 0),
                          f"for (;;) {{ if (!({cond_src})) break;"))
            if not braced:
                edits.append((end, end, " }"))
        elif not braced:
            edits.append((after, after, "{ "))
            edits.append((end, end, " }"))
    return _apply(src, edits)


def _loop_frames(masked: str, bodies, reaches, lines, starts, per_line) -> List[Tuple[int, int, str]]:
    """Loops whose body reaches a collective get a ``tsm_emu::LoopFrame`` per iteration
    (the loop's site and the iteration's number), so the same collective in two iterations
    is two sites, and lanes that skip ahead wait for the iteration before. Bodies have
    braces by now (``_braced_loops``)."""
    edits = []
    number = 0
    for m in re.finditer(r"\b(?:for|while)\s*\(|\bdo\s*\{", masked):
        if not any(a < m.start() < b for a, b in bodies):
            continue
        if masked[m.end() - 1] == "(":
            close = _match_close(masked, m.end() - 1, "(", ")")
            brace = re.match(r"\s*\{", masked[close + 1:])
            if not brace:
                continue  # the `while (...);` of a do-while
            body_open = close + 1 + brace.end() - 1
            body_close = _match_close(masked, body_open, "{", "}")
            end = body_close + 1
        else:  # do { ... } while (...);
            body_open = m.end() - 1
            body_close = _match_close(masked, body_open, "{", "}")
            tail = re.match(r"\s*while\s*\(", masked[body_close + 1:])
            if not tail:
                continue
            cond_close = _match_close(masked, body_close + 1 + tail.end() - 1, "(", ")")
            semicolon = re.match(r"\s*;", masked[cond_close + 1:])
            if not semicolon:
                continue
            end = cond_close + 1 + semicolon.end()
        if not reaches.search(masked[body_open:body_close]):
            continue
        line = lines[bisect.bisect_right(starts, m.start()) - 1]
        per_line[line] = per_line.get(line, 0) + 1
        site = (line << 12) | min(per_line[line], 0xFFF)
        counter = f"tsm_emu_iteration_{number}_"
        number += 1
        edits.append((m.start(), m.start(), f"{{ unsigned {counter} = 0; "))
        edits.append((end, end, " }"))
        edits.append((body_open + 1, body_open + 1,
                      f" ::tsm_emu::LoopFrame tsm_emu_loop_frame_(::tsm_emu::Site{{{site}u}}, {counter}++);"))
    return edits


def _named_as_value(masked: str, name: str) -> bool:
    """Whether ``name`` (with or without template arguments) occurs other than called or
    declared: followed by anything but ``(``."""
    for m in re.finditer(r"(?<![\w.])" + re.escape(name) + r"\b", masked):
        i = m.end()
        while i < len(masked) and masked[i].isspace():
            i += 1
        if i < len(masked) and masked[i] == "<":  # its template arguments
            depth = 0
            while i < len(masked):
                depth += {"<": 1, ">": -1}.get(masked[i], 0)
                i += 1
                if depth == 0 or masked[i - 1] in ";{}":
                    break
            while i < len(masked) and masked[i].isspace():
                i += 1
        if i < len(masked) and masked[i] != "(":
            return True
    return False


def _add_collective_sites(src: str) -> str:
    """Give every barrier and SIMD-group call its own site: line << 12 | k, the k-th such
    call on its line, so two collectives on one line stay apart even without a column.

    Helper functions that reach a collective get a trailing ``tsm_emu::Site`` parameter and
    a ``tsm_emu::CallFrame`` at the top of their body, and every call to them a site of its
    own: a collective reached through two different calls is then two different sites.
    """
    masked = _mask_strings_and_directives(src)
    defs = _function_definitions(masked)
    # A group function (_regions) is a kernel's second translation, not a helper it calls.
    helpers = [d for d in defs if not d.is_kernel and not d.name.endswith("__tsm_group")]
    # A helper the source also names as a value (ggml: `mmv_fn<kernel_mul_mv_t_t_disp<half,
    # half>>`, a template argument of a function type it spells) keeps its type: its
    # collectives get their own sites, but not one per call.
    valued = {d.name for d in helpers if _named_as_value(masked, d.name)}
    reaching = set()
    while True:  # helpers that reach a collective, directly or through other helpers
        pattern = _call_pattern(set(collective_names()) | reaching)
        grown = {d.name for d in helpers
                 if d.name not in valued and pattern.search(masked[d.body_open:d.body_close])} | reaching
        if grown == reaching:
            break
        reaching = grown
    starts, lines = _source_lines(src)
    per_line = {}
    inserts = []
    definitions = {d.open_paren for d in defs}
    bodies = [(d.body_open, d.body_close) for d in defs]
    # A helper with default arguments keeps its calls as they are (an added site would bind
    # to a defaulted parameter): they get the site's default, the call's line.
    defaulted = {d.name for d in helpers if d.name in reaching and
                 any("=" in p for p in _split_top_level(masked[d.open_paren + 1:d.close_paren]))}
    # Prototypes of the helpers take the added parameter too, with its default there only.
    prototypes = []
    for m in _call_pattern(reaching).finditer(masked) if reaching else ():  # (an empty pattern matches any `(`)
        open_paren = m.end() - 1
        if open_paren in definitions or any(a < m.start() < b for a, b in bodies):
            continue
        close = _match_close(masked, open_paren, "(", ")")
        # (a call in a body this scan does not see, an operator's: candle's
        # `return OP::simd_op(value);`, is no prototype)
        if re.match(r"\s*;", masked[close + 1:]) and \
                not re.search(r"(?:\breturn|::|[=(,?])\s*$", masked[max(0, m.start() - 40):m.start()]):
            prototypes.append((m.group(1), open_paren, close))
    declared = {name for name, _, _ in prototypes}
    for m in _call_pattern((set(collective_names()) | reaching) - defaulted).finditer(masked):
        open_paren = m.end() - 1
        if open_paren in definitions or not any(a < m.start() < b for a, b in bodies):
            continue  # a definition or a declaration, not a call
        close = _match_close(masked, open_paren, "(", ")")
        line = lines[bisect.bisect_right(starts, m.start()) - 1]
        per_line[line] = per_line.get(line, 0) + 1
        site = (line << 12) | min(per_line[line], 0xFFF)
        empty = not masked[open_paren + 1:close].strip()
        # (`__tsm_lane`: the calling thread in a region body, which declares it; else none)
        inserts.append((close, close, f"{'' if empty else ', '}::tsm_emu::Site{{{site}u, __tsm_lane}}"))
    # Group functions (_regions) keep their own loop iterations, in slots.
    fibered = [(d.body_open, d.body_close) for d in defs if not d.name.endswith("__tsm_group")]
    inserts += _loop_frames(masked, fibered, _call_pattern(set(collective_names()) | reaching),
                            lines, starts, per_line)
    def add_parameter(open_paren: int, close_paren: int, param: str) -> None:
        params = masked[open_paren + 1:close_paren]
        if not params.strip() or params.strip() == "void":
            inserts.append((open_paren + 1, close_paren, param))
        else:
            inserts.append((close_paren, close_paren, ", " + param))

    with_default = "::tsm_emu::Site caller_site_ = TSM_EMU_SITE_HERE"
    for name, open_paren, close in prototypes:
        add_parameter(open_paren, close, with_default)
    for d in helpers:
        if d.name not in reaching:
            continue
        # An explicit specialisation (`template<> bool f(bool v)`, SPIRV-Cross's) may not
        # repeat the default: it takes its primary template's.
        specialisation = re.search(r"\btemplate\s*<\s*>\s*(?:inline\s+|static\s+)*[^;{}()]*$",
                                   masked[_head_start(masked, d.open_paren):d.open_paren])
        add_parameter(d.open_paren, d.close_paren, "::tsm_emu::Site caller_site_"
                      if d.name in declared or specialisation else with_default)
        inserts.append((d.body_open + 1, d.body_open + 1,
                        " ::tsm_emu::CallFrame tsm_emu_call_frame_(caller_site_);"))
    return _apply(src, inserts)


def restrict_edits(src: str) -> List[Tuple[int, int, str]]:
    """Edits that blank ``__restrict__``: a promise to the optimiser, which a checked pointer
    (a class) cannot carry."""
    masked = _mask_strings_and_directives(src)
    return [(m.start(), m.end(), " " * len(m.group())) for m in re.finditer(r"\b__restrict(?:__)?\b", masked)]


def rewrite(src: str, *, sanitize: bool = False) -> str:
    """The C++ translation of preprocessed MSL ``src`` (line structure preserved).

    In every build, address-space pointers and references and threadgroup variables become
    checked types (tsm_emu/sanitize.h), so that no access leaves its buffer or variable;
    ``sanitize`` also marks stores and field accesses for the sanitizer.
    """
    src = _apply(src, stage_function_edits(src))
    src = _apply(src, bare_coherent_edits(src) + restrict_edits(src))
    src = _add_collective_sites(_braced_loops(_class_scope_specialisations(src)))
    src = _checked_threadgroup_scalars(src)
    src = _checked_references(_read_only_constant_references(src))
    src = _threadgroup_arrays_in_conditionals(_threadgroup_array_sizes(src))
    src = _addresses_without_access(src)
    if sanitize:
        src = marked_stores(checked_members(src))
    src = _checked_pointers(_thread_pointers(_array_parameters_as_pointers(src)))
    masked = _mask_strings_and_directives(src)
    src = _rewrite_threadgroup_declarations(src, masked)
    masked = _mask_strings_and_directives(src)
    pieces, last = [], 0
    for m in _ATTRIBUTE.finditer(masked):
        pieces.append(src[last:m.start()])
        pieces.append(blank(m.group()))
        last = m.end()
    pieces.append(src[last:])
    src = "".join(pieces)
    masked = _mask_strings_and_directives(src)
    pieces, last = [], 0
    for m in re.finditer(r"\bkernel\b", masked):
        pieces.append(src[last:m.start()])
        pieces.append(" " * len(m.group()))
        last = m.end()
    pieces.append(src[last:])
    src = "".join(pieces)
    return _HALF_LITERAL.sub(lambda m: f"half({m.group(1)}f)", src)


def group_function_name(cxx: str) -> str:
    """The barrier-region copy of the kernel ``cxx`` names (``ns::k__tsm_group<float>``)."""
    base = cxx.split("<", 1)[0]
    return base + "__tsm_group" + cxx[len(base):]


def _address(kernel: Kernel) -> str:
    """C++ for the address of ``kernel``'s function; the specialisation an instantiation
    with a signature selects is named through its parameters' emulated types."""
    if kernel.signature is None:
        return f"&{kernel.cxx}"
    declaration = rewrite(f"void f({kernel.signature});")
    types = declaration[declaration.index("(") + 1:declaration.rindex(")")]
    return f"static_cast<void (*)({' '.join(types.split())})>(&{kernel.cxx})"


def binding_table(kernels: List[Kernel], grouped: Set[str] = frozenset(),
                  synchronising: Set[str] = frozenset(), straight: bool = False) -> str:
    """C++ that registers ``kernels`` with the runtime (appended to the rewritten source):
    those whose function is in ``grouped`` by their group function (barrier regions, see
    _regions); with ``straight``, those that do not synchronise by a loop over a
    threadgroup's threads calling the function (``tsm_emu::invoke_straight``); the others
    by the function itself, called once per thread, as fibers if in ``synchronising``.

    An instantiation in a namespace is bound in that namespace, where the names among its
    template arguments are (PyTorch's Gemm.metal: ``gemm<..., GemmEpilogue::None>`` in
    ``at_gemm``); every other kernel at global scope."""
    lines = ["", "// ---- generated by torch_sparse_metal.emulator: kernel binding table ----"]
    entries = []
    for i, k in enumerate(kernels):
        scope = "::".join(filter(None, [k.namespace, "tsm_emu_generated"]))
        if not k.namespace and not k.cxx.startswith("::"):
            # Qualified, so a kernel named like a Metal library function (`divide`, `clamp`)
            # is not ambiguous with it under `using namespace metal`.
            k = replace(k, cxx="::" + k.cxx)
        specs = ", ".join(f"{{{p.kind}, {p.index}}}" for p in k.params) or "{0, 0}"
        body = [f"static const ::tsm_emu::ParamSpec params_{i}[] = {{{specs}}};",
                f"using function_{i} = decltype({_address(k)});"]
        name = function_name(k.cxx)
        if name in grouped:
            body.append(f"static void group_{i}(const ::tsm_emu::DispatchArgs& d, ::tsm_emu::Group& g) "
                        f"{{ ::tsm_emu::invoke_group(&{group_function_name(k.cxx)}, params_{i}, d, g); }}")
            invoke, group = "nullptr", f"::{scope}::group_{i}"
        elif straight and name not in synchronising:
            body.append(f"static void group_{i}(const ::tsm_emu::DispatchArgs& d, ::tsm_emu::Group& g) "
                        f"{{ ::tsm_emu::invoke_straight({_address(k)}, params_{i}, d, g); }}")
            invoke, group = "nullptr", f"::{scope}::group_{i}"
        else:
            body.append(f"static void invoke_{i}(const ::tsm_emu::DispatchArgs& d, const ::tsm_emu::ThreadInfo& t) "
                        f"{{ ::tsm_emu::invoke({_address(k)}, params_{i}, d, t); }}")
            invoke, group = f"::{scope}::invoke_{i}", "nullptr"
        lines.append(f"namespace {scope} {{ " + " ".join(body) + f" }}  // namespace {scope}")
        entries.append(f'  {{"{k.host_name}", {invoke}, ::tsm_emu::fn_params<::{scope}::function_{i}>::count, '
                       f"::{scope}::params_{i}, ::tsm_emu::fn_params<::{scope}::function_{i}>::types, "
                       f"{group}, {int(name in synchronising)}}}")
    if not entries:
        entries = ["  {nullptr, nullptr, 0, nullptr, nullptr, nullptr, 0}"]
    lines += ['extern "C" {',
              "extern const ::tsm_emu::KernelEntry tsm_kernel_table[];",
              "extern const int tsm_kernel_count;",
              "const ::tsm_emu::KernelEntry tsm_kernel_table[] = {",
              ",\n".join(entries), "};",
              f"const int tsm_kernel_count = {len(kernels)};", "}", ""]
    return "\n".join(lines)
