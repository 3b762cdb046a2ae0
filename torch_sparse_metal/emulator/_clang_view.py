"""The source as clang parses it: preprocessed MSL rewritten, line for line, into C++ for
OpenCL, with the way back from clang's offsets to the source's (:class:`_Text`), and parsed.

Layer: parse (the layers are in the package's docstring). Imports the rest of the parse
layer (_clang, _msl_text).

clang's C++ for OpenCL is not Metal: vector constructors, ``thread``, literals with Metal's
suffixes, explicit instantiations libclang does not show... are spelled here the way clang
takes them, without moving a line, so every location clang gives is the source's line.
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Set, Tuple

from . import _msl_text
from ._clang import _CLANG_ARGS, FRONTEND_INCLUDE_DIR, _index


_VECTOR_BASES = r"(?:bool|char|uchar|short|ushort|int|uint|long|ulong|half|float|bfloat)"
_VECTOR_TYPE = r"(?:metal::)?(?:packed_)?" + _VECTOR_BASES + r"[234]"
_VEC_TEMPLATE_TYPE = r"(?:metal::)?vec\s*<[^<>;{}()]*>"
_VECTOR_CALL = re.compile(r"(?<![\w.:>])(" + _VECTOR_TYPE + r")\s*\(")
_VEC_TEMPLATE_CALL = re.compile(r"(?<![\w.>])(" + _VEC_TEMPLATE_TYPE + r")\s*\(")
# `thread` qualifying a member function (`T f() const thread {`, `S() thread : x(0) {}`).
_THREAD_METHOD = re.compile(r"\)\s*(?:const\s+)?(thread)\b(?=\s*(?:const\b|volatile\b|noexcept\b|->|[{;:=&]))")
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)[hH]\b")
# An unsuffixed floating literal, which is a float in Metal (there is no double); clang's
# OpenCL mode makes it one too, but not in template instantiations.
_DOUBLE_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(?![\w.])")
_BFLOAT_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(?:bf|BF)\b")


class _Text:
    """A text rewritten in steps, and the way back from offsets of the result to offsets of
    the text it started as (a source map: clang's locations are in the result, the
    emulator's edits go into the original)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._steps: List[List[Tuple[int, int, int, int]]] = []  # (new start, new end, old start, old end)

    def apply(self, edits: Iterable[Tuple[int, int, str]]) -> None:
        """Replace non-overlapping [start, end) spans of the current text."""
        pieces, spans, last, delta = [], [], 0, 0
        for start, end, replacement in sorted(edits, key=lambda e: (e[0], e[1])):
            pieces += [self.text[last:start], replacement]
            spans.append((start + delta, start + delta + len(replacement), start, end))
            delta += len(replacement) - (end - start)
            last = end
        pieces.append(self.text[last:])
        self.text = "".join(pieces)
        self._steps.append(spans)

    def original(self, offset: int, *, end: bool = False) -> int:
        """The offset in the first text of ``offset`` in the current one; inside replaced
        text, the start of what it replaced (or its end, with ``end``)."""
        for spans in reversed(self._steps):
            delta = 0
            for new_start, new_end, old_start, old_end in spans:
                if offset < new_start or (offset == new_start and not end):
                    break
                if offset < new_end or (offset == new_end and end and new_start < new_end):
                    offset = old_end if end else old_start
                    delta = None
                    break
                delta = new_end - old_end
            if delta is not None:
                offset -= delta
        return offset


@dataclass
class _Prepared:
    source: _Text
    kernel_names: Set[str]
    lints: List[Tuple[int, str]]  # (offset in the original text, message)

    @property
    def text(self) -> str:
        return self.source.text


def _vector_aliases(masked: str) -> List[str]:
    """Names the source gives vector types (``typedef float4 vt;``, ``using v2 = vec<T, 2>;``)."""
    alias = re.compile(r"\busing\s+(\w+)\s*=\s*(?:metal::)?(?:vec\s*<|(?:packed_)?" + _VECTOR_BASES + r"[234]\b)")
    typedef = re.compile(r"\btypedef\s+(?:metal::)?(?:vec\s*<[^;]*>|(?:packed_)?" + _VECTOR_BASES +
                         r"[234])\s+(\w+)\s*;")
    return sorted(set(alias.findall(masked)) | set(typedef.findall(masked)))


def _vector_constructors(src: str) -> List[Tuple[int, int, str]]:
    """``float4(a, b)``, ``vec<T, 4>(x)`` -> ``::metal::__tsm_make_vector<float4>(a, b)``:
    MSL's vector constructors, which C++ has no syntax for. A vector variable initialised
    directly in a function body (MLX's ``const int2 offsets(0, row);``, which clang takes
    for a scalar's initialisation) becomes ``const int2 offsets = ...make_vector<int2>(0, row);``."""
    masked = _msl_text._mask_strings_and_directives(src)
    patterns = [_VECTOR_CALL, _VEC_TEMPLATE_CALL]
    aliases = _vector_aliases(masked)
    type_names = [_VECTOR_TYPE, _VEC_TEMPLATE_TYPE]
    if aliases:
        alias_names = "|".join(map(re.escape, aliases))
        patterns.append(re.compile(r"(?<![\w.:>])(" + alias_names + r")\s*\("))
        type_names.append(alias_names)
    edits = []
    for pattern in patterns:
        for m in pattern.finditer(masked):
            before = masked[:m.start()].rstrip()
            if re.search(r"(?:\boperator|\btypedef|\busing|\bstruct|\bclass)$", before):
                continue
            if _FUNCTION_POINTER_DECLARATOR.match(masked, m.end() - 1):
                continue  # `float2 (*f)(...)`: a type, not a construction (PyTorch's Quantized.metal)
            edits.append((m.start(), m.end(), f"::metal::__tsm_make_vector<{src[m.start(1):m.end(1)]}>("))
    declaration = re.compile(r"(?<![\w.:>])(" + "|".join(type_names) + r")\s+(\w+)(\s*\()")
    bodies = [(d.body_open, d.body_close) for d in _msl_text._function_definitions(masked)]
    for m in declaration.finditer(masked):
        # At statement start in a body: a variable (a local function declaration would
        # also match, and Metal code has none).
        before = masked[max(0, m.start() - 64):m.start()].rstrip()
        statement_start = before.endswith(tuple(";{}(")) or re.search(r"\b(?:const|constexpr|thread|static)$", before)
        if statement_start and any(a < m.start() < b for a, b in bodies):
            edits.append((m.start(3), m.end(3),
                          f" = ::metal::__tsm_make_vector<{src[m.start(1):m.end(1)]}>("))
    return edits


def _template_scopes(masked: str) -> List[Tuple[List[str], int, int]]:
    """The type parameters of each template and the body they are in scope in."""
    scopes = []
    for m in re.finditer(r"\btemplate\s*<", masked):
        try:
            close = _msl_text._match_close(masked, m.end() - 1, "<", ">")
        except _msl_text.ParseError:
            continue
        names = re.findall(r"\b(?:typename|class)\s*(?:\.\.\.\s*)?(\w+)", masked[m.end():close])
        brace = re.compile(r"[{;]").search(masked, close + 1)
        if not names or brace is None or brace.group() != "{":
            continue
        try:
            scopes.append((names, brace.start(), _msl_text._match_close(masked, brace.start(), "{", "}")))
        except _msl_text.ParseError:
            continue
    return scopes


def _call_arguments(masked: str, open_paren: int) -> List[str]:
    """The top-level arguments of the parenthesis at ``open_paren`` (none if unbalanced)."""
    try:
        close = _msl_text._match_close(masked, open_paren, "(", ")")
    except _msl_text.ParseError:
        return []
    return _msl_text._split_top_level(masked[open_paren + 1:close])


def _dependent_constructions(src: str) -> List[Tuple[int, int, str]]:
    """``T(a, b)`` of a template's type parameter T -> ``::metal::__tsm_construct<T>(a, b)``,
    which builds a vector as a vector constructor does and calls a class's constructor
    otherwise (PyTorch's c10/metal/utils.h makes a ``float2`` so): clang reads a multi-argument
    functional cast to a vector type as a scalar's initialisation."""
    masked = _msl_text._mask_strings_and_directives(src)
    edits = {}
    for names, body_open, body_close in _template_scopes(masked):
        call = re.compile(r"(?<![\w.:>~])(" + "|".join(map(re.escape, names)) + r")\s*\(")
        for c in call.finditer(masked, body_open, body_close):
            if re.search(r"\boperator\s*$", masked[max(0, c.start() - 16):c.start()]):
                continue
            if len(_call_arguments(masked, c.end() - 1)) > 1:
                edits[c.start()] = (c.start(), c.end(), f"::metal::__tsm_construct<{c.group(1)}>(")
    return list(edits.values())


def _explicit_conversions(src: str) -> List[Tuple[int, int, str]]:
    """Explicit conversions that Metal has and clang does not: between half and bfloat
    (``static_cast<half>(x)``, ``half(x)``, and bfloat), and between vectors
    (``static_cast<float2>(h)``, c10/metal/special_math.h); also ``static_cast<T>(x)`` of a
    template's type parameter or local alias T, which may be either (PyTorch's
    c10/metal/utils.h ``cast_to``) -> ``::metal::__tsm_convert<...>(x)``, which converts
    half and bfloat through float (exact: both are rounded once, as a direct conversion is)
    and vectors element by element. A C-style ``(half)x`` is not rewritten."""
    masked = _msl_text._mask_strings_and_directives(src)
    edits = {}
    spelled = r"(?:::)?(?:metal::)?(?:half|bfloat)"
    for m in re.finditer(r"\bstatic_cast\s*<\s*(" + spelled + r")\s*>\s*\(", masked):
        edits[m.start()] = (m.start(), m.end(), f"::metal::__tsm_convert<{m.group(1)}>(")
    for m in re.finditer(r"(?<![\w.:>~])(" + spelled + r")\s*\((?!\s*[*&^])", masked):  # not `half (*f)(...)`
        if re.search(r"\b(?:operator|typedef|using)\s*$", masked[max(0, m.start() - 16):m.start()]):
            continue
        arguments = _call_arguments(masked, m.end() - 1)
        if len(arguments) == 1 and arguments[0].strip():  # a conversion, not `half()`
            edits[m.start()] = (m.start(), m.end(), f"::metal::__tsm_convert<{m.group(1)}>(")
    vectors = "|".join([_VECTOR_TYPE, _VEC_TEMPLATE_TYPE] + list(map(re.escape, _vector_aliases(masked))))
    for m in re.finditer(r"\bstatic_cast\s*<\s*(" + vectors + r")\s*>\s*\(", masked):
        edits[m.start()] = (m.start(), m.end(), f"::metal::__tsm_convert<{m.group(1)}>(")
    for names, body_open, body_close in _template_scopes(masked):
        # and the aliases the body declares (c10/metal/indexing.h: `using res_t = result_of<F, T, T>;`)
        body = masked[body_open:body_close]
        names = names + re.findall(r"\busing\s+(\w+)\s*=", body) + re.findall(r"\btypedef\b[^;{}]*?(\w+)\s*;", body)
        cast = re.compile(r"\bstatic_cast\s*<\s*(" + "|".join(map(re.escape, names)) + r")\s*>\s*\(")
        for m in cast.finditer(masked, body_open, body_close):
            edits[m.start()] = (m.start(), m.end(), f"::metal::__tsm_convert<{m.group(1)}>(")
    return list(edits.values())


def _typedef_vectors(src: str) -> List[Tuple[int, int, str]]:
    """``typedef vec<T, 2> t;`` and ``using t = vec<T, 2>;`` (not an alias template) ->
    ``...::metal::__tsm_vector_type<T, 2>::type``, where ``vec<bool, N>`` is a vector of
    int: clang's C++ for OpenCL has no bool vectors, and MLX's steel attention makes its
    fragment typedefs with T = bool. ``vec`` elsewhere stays clang's vector, through which
    function templates deduce (``thread dtype_frag_t<Atype>& A``); ``vec<bool, N>`` spelled
    out is ``vec<int, N>``."""
    masked = _msl_text._mask_strings_and_directives(src)
    # Spelled out, `vec<bool, N>` deduces nothing: it can be the vector of int anywhere.
    edits = [(m.start(1), m.end(1), "int") for m in re.finditer(r"\bvec\s*<\s*(bool)\b", masked)]
    for m in re.finditer(r"\b(?:typedef|using\s+\w+\s*=)\s*(?:typename\s+)?((?:metal::)?vec\s*<)(?!\s*bool\b)", masked):
        if m.group().startswith("using") and masked[max(0, m.start() - 64):m.start()].rstrip().endswith(">"):
            continue  # an alias template: its parameters are deduced through it
        try:
            close = _msl_text._match_close(masked, m.end(1) - 1, "<", ">")
        except _msl_text.ParseError:
            continue
        arguments = src[m.end(1):close]
        edits.append((m.start(1), close + 1, f"typename ::metal::__tsm_vector_type<{arguments}>::type"))
    return edits


def _threadgroup_declarations(src: str, kernel_bodies: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, str]]:
    """``threadgroup T a[N];`` in a kernel body -> a reference to storage in __local (clang
    allows __local variables only in OpenCL kernels); one outside a kernel is left for clang."""
    masked = _msl_text._mask_strings_and_directives(src)
    edits = []
    for m in re.finditer(r"\bthreadgroup\b(?!_)", masked):
        if not any(a < m.start() < b for a, b in kernel_bodies):
            continue
        i = m.start() - 1
        while i >= 0 and masked[i].isspace():
            i -= 1
        if i >= 0 and masked[i] not in ";{}":
            continue  # a qualifier inside a declaration or a cast
        end = masked.find(";", m.start())
        if end < 0:
            continue
        decl = masked[m.end():end]
        head = decl.split("[", 1)[0]
        if re.search(r"[*&(]", head):
            continue  # pointers and references to threadgroup memory
        # An initialiser (MLX's layer_norm: `threadgroup float b[32] = {0};`) is accepted by
        # Apple's compiler, and does not initialise the memory in the emulator (it stays
        # uninitialised, as every threadgroup variable is): it is not part of the check.
        parts = [_msl_text.declarator(part) for part in _msl_text._split_top_level(src[m.end():end])]
        names = [re.search(r"(\w+)\s*((?:\[[^\]]*\]\s*)*)$", p.strip()) for p in parts]
        if not names or not all(names):
            continue
        type_text = parts[0].strip()[:names[0].start(1)].strip()
        out = []
        for name in names:
            dims = name.group(2).strip()
            target = f"{type_text} {dims}" if dims else type_text
            declarator = f"(&{name.group(1)}){dims}" if dims else f"&{name.group(1)}"
            out.append(f"__local {type_text} {declarator} = "
                       f"::metal::__tsm_threadgroup_storage<{target}>();")
        edits.append((m.start(), end + 1, " ".join(out)))
    return edits


def _braced_arguments(src: str) -> List[Tuple[int, int, str]]:
    """``f({a, b, c})`` -> ``f(::metal::__tsm_braced(a, b, c))``: clang does not list-
    initialise a vector parameter from a braced list in a call, which Metal does (MLX's
    ``elem_to_loc({N * index.x, index.y, index.z}, ...)`` for a uint3). The stand-in
    converts to a vector of as many components, or to an aggregate class."""
    masked = _msl_text._mask_strings_and_directives(src)
    edits = []
    for m in re.finditer(r"([(,])\s*\{", masked):
        open_brace = m.end() - 1
        try:
            close = _msl_text._match_close(masked, open_brace, "{", "}")
        except _msl_text.ParseError:
            continue
        inner = masked[open_brace + 1:close]
        if "{" in inner or not re.match(r"\s*[,)]", masked[close + 1:]) or not inner.strip():
            continue
        depth, i = 0, open_brace - 1  # the call's "(": an identifier or `>` before it
        while i >= 0:
            if masked[i] in ")]}":
                depth += 1
            elif masked[i] in "([{":
                if depth == 0:
                    break
                depth -= 1
            i -= 1
        if i < 0 or masked[i] != "(":
            continue
        callee = re.search(r"(\w+)\s*(?:<[^;{}]*>)?\s*$", masked[:i])
        if not callee or callee.group(1) in _msl_text._NOT_FUNCTIONS or masked[:i].rstrip().endswith("]]"):
            continue
        edits.append((open_brace, open_brace + 1, "::metal::__tsm_braced("))
        edits.append((close, close + 1, ")"))
    return edits


_TEMPLATE_ID = r"\w+(?:\s*<[^;{}()=]*?>)?"
# `constant constexpr const float W<6, 3, 8>::wt_transform[8][8];` (MLX's conv) after a
# statement or a brace: an out-of-class declaration of a static data member, no initialiser.
_MEMBER_REDECLARATION = re.compile(
    r"(?<=[;{}])\s*(?P<qualifiers>(?:(?:static|constant|constexpr|const|inline)\s+)+)(?:metal::)?" + _TEMPLATE_ID +
    r"\s+(?P<scope>" + _TEMPLATE_ID + r"(?:\s*::\s*" + _TEMPLATE_ID + r")*)\s*::\s*\w+\s*(?:\[[^\];]*\]\s*)*;")


def _constexpr_member_redeclarations(src: str) -> List[Tuple[int, int, str]]:
    """Out-of-class redeclarations of ``static constexpr`` data members, blanked. A constexpr
    member is initialised in its class, so the redeclaration (C++11's definition, valid
    and redundant since C++17) adds nothing; clang's OpenCL mode takes it for a constant
    without an initialiser. Of a member of a class template's specialisation only when
    that specialisation is explicit (``template <> struct W<6, 3, 8>``): otherwise C++
    wants ``template <>`` before it, and clang's error stands."""
    masked = _msl_text._mask_strings_and_directives(src)
    squeezed = re.sub(r"\s+", "", masked)
    edits = []
    for m in _MEMBER_REDECLARATION.finditer(masked):
        if not re.search(r"\bconstexpr\b", m.group("qualifiers")):
            continue
        scope = re.sub(r"\s+", "", m.group("scope")).rsplit("::", 1)[-1]
        if "<" in scope and not re.search(r"template<>(?:struct|class)" + re.escape(scope) + r"[{:]", squeezed):
            continue
        edits.append((m.start(), m.end(), _msl_text.blank(m.group())))
    return edits


_FUNCTION_POINTER_DECLARATOR = re.compile(r"\(\s*\*(\s*\w+\s*)\)(?=\s*\()")


def _template_function_pointers(src: str) -> List[Tuple[int, int, str]]:
    """``template <void (*f)(...)>`` -> ``template <void (&f)(...)>``: Metal takes function
    pointers as template arguments (ggml's dequantisers), but clang's OpenCL mode gives
    such a parameter a ``__generic`` pointee that no function's address converts to. A
    reference to a function binds the same arguments and is called the same way. So does
    an alias of a function pointer type that a template parameter is declared with (MLX's
    fft: ``using RadixFunc = void (*)(...);`` and ``template <..., RadixFunc<T> f>``).

    A static member function given as such an argument (PyTorch's ScatterGather.metal:
    ``scatter_reduce<T, IT, ScatterReduceOp::prod<T>>``) has a ``__generic``-qualified
    type in clang's OpenCL mode, like every member function, which neither binds: where
    the source gives one, such parameters are ``auto`` (the emulator's C++ build, and
    Apple's compiler, still check the function's type against the parameter's)."""
    masked = _msl_text._mask_strings_and_directives(src)
    statics = set(re.findall(r"\bstatic\s+(?:inline\s+|constexpr\s+)*[\w:<>]+\s+(\w+)\s*\(", masked))
    member_arguments = statics and re.search(r"\w+\s*::\s*(?:" + "|".join(sorted(statics)) +
                                             r")\b\s*(?:<[^<>;()]*>)?\s*[,>]", masked)
    edits = []
    parameter_lists = []
    for m in re.finditer(r"\btemplate\s*<", masked):
        depth, i = 1, m.end()
        while i < len(masked) and depth:
            depth += {"<": 1, ">": -1}.get(masked[i], 0)
            i += 1
        parameter_lists.append(masked[m.end():i - 1])
        for p in _FUNCTION_POINTER_DECLARATOR.finditer(masked, m.end(), i - 1):
            if member_arguments:
                # `T (*f)(T, T)` -> `auto f`, from the start of the parameter's type
                start, depth = p.start(), 0
                while start > m.end() and (depth or masked[start - 1] != ","):
                    depth += {">": 1, "<": -1, ")": 1, "(": -1}.get(masked[start - 1], 0)
                    start -= 1
                end = _msl_text._match_close(masked, p.end(), "(", ")") + 1
                edits.append((start, end, f" auto {p.group(1).strip()}"))
            else:
                edits.append((p.start(), p.end(), f"(&{p.group(1)})"))
    for m in re.finditer(r"\busing\s+(\w+)\s*=[^;{}]*?(\(\s*\*\s*\))\s*\(", masked):
        if any(re.search(r"\b" + m.group(1) + r"\b", parameters) for parameters in parameter_lists):
            edits.append((m.start(2), m.end(2), "(&)"))
    return edits


def _pointer_or_reference_at(masked: str, start: int) -> Optional[int]:
    """The offset of the ``*`` or ``&`` that ends the type beginning at ``start`` (after an
    address-space qualifier), past template argument lists (MLX's ``thread MMATile<T, M,
    N>& D``); None when what is declared there is no pointer or reference."""
    depth = 0
    for i in range(start, len(masked)):
        c = masked[i]
        if c == "<":
            depth += 1
        elif c == ">":
            if depth == 0:
                return None
            depth -= 1
        elif c in ";{}":
            return None
        elif depth == 0 and c in "*&":
            return i
        elif depth == 0 and c in ",()=[]":
            return None
    return None


def _thread_const_casts(src: str) -> List[Tuple[int, int, str]]:
    """``const_cast<T thread &>(e)`` -> ``((T thread &)(e))``. Metal's thread is one address
    space; here a reference says generic and a local variable is private, and const_cast
    cannot change an address space (Tint's `const_cast<texture1d<float> thread &>(vars.t)`),
    which the cast notation does with the const_cast."""
    masked = _msl_text._mask_strings_and_directives(src)
    edits = []
    for m in re.finditer(r"\bconst_cast\s*<", masked):
        try:
            close = _msl_text._match_close(masked, m.end() - 1, "<", ">")
        except _msl_text.ParseError:
            continue
        target = masked[m.end():close]
        paren = close + 1
        while paren < len(masked) and masked[paren].isspace():
            paren += 1
        if not re.search(r"\bthread\b", target) or paren >= len(masked) or masked[paren] != "(":
            continue
        try:
            end = _msl_text._match_close(masked, paren, "(", ")")
        except _msl_text.ParseError:
            continue
        edits += [(m.start(), close + 1, f"(({src[m.end():close]})"), (end + 1, end + 1, ")")]
    return edits


def _braced_copies(src: str) -> List[Tuple[int, int, str]]:
    """``S<...>({a, b})`` -> ``S<...>{{a, b}}`` for a struct of the source: the copy of an
    aggregate built from the braced list, which is ambiguous here between the copies from a
    thread and from a constant object that _special_members declares (SPIRV-Cross's
    ``spvUnsafeArray<Data, 2>({ Data{1.0, 2.0}, Data{3.0, 4.0} })``)."""
    masked = _msl_text._mask_strings_and_directives(src)
    names = {m.group(2) for m in _RECORD.finditer(masked)}
    if not names:
        return []
    edits = []
    for m in re.finditer(r"\b(?:" + "|".join(map(re.escape, sorted(names))) + r")\b\s*", masked):
        paren = m.end()
        try:
            if masked.startswith("<", paren):  # template arguments, nested ones too
                paren = _msl_text._match_close(masked, paren, "<", ">") + 1
                while paren < len(masked) and masked[paren].isspace():
                    paren += 1
            if not masked.startswith("(", paren):
                continue
            brace = paren + 1
            while brace < len(masked) and masked[brace].isspace():
                brace += 1
            if not masked.startswith("{", brace):
                continue
            brace_end = _msl_text._match_close(masked, brace, "{", "}")
            paren_end = _msl_text._match_close(masked, paren, "(", ")")
        except _msl_text.ParseError:
            continue
        if masked[brace_end + 1:paren_end].strip():
            continue  # more than the braced list
        edits += [(paren, paren + 1, "{"), (paren_end, paren_end + 1, "}")]
    return edits


def _constant_pointees_const(src: str) -> List[Tuple[int, int, str]]:
    """``constant T *p`` -> ``constant const T *p``: what a pointer or reference into the
    constant address space designates is read-only in Metal whether or not it says const,
    so such a pointer takes a ``constexpr constant`` table (ggml's ``kvalues_iq4nl_f``)."""
    masked = _msl_text._mask_strings_and_directives(src)
    edits = []
    for m in re.finditer(r"\bconstant\b(?!\s*\()", masked):
        after = _pointer_or_reference_at(masked, m.end())
        if after is None:
            continue
        start = max(masked.rfind(c, 0, m.start()) for c in ";,(){}<>")
        if re.search(r"\bconst\b", masked[start + 1:after]):
            continue
        edits.append((m.end(), m.end(), " const"))
    return edits


_RECORD = re.compile(r"\b(struct|class)\s+(\w+)\s*(?:<[^{};]*>\s*)?(?:final\s*)?(?::[^{};]*)?\{")
_SCOPED_ENUM = re.compile(r"\benum\s+$")  # `enum class E : int {`: no record


def _special_members(src: str) -> List[Tuple[int, int, str]]:
    """Declare, in every struct and class, the copies from, into and of objects in the
    constant address space that Metal provides and OpenCL does not (OpenCL's generic
    address space covers device, threadgroup and thread, not constant), and the generic
    copies that declaring those would suppress. Defaulted, so aggregates stay aggregates."""
    masked = _msl_text._mask_strings_and_directives(src)
    edits = []
    for m in _RECORD.finditer(masked):
        kind, name = m.group(1), m.group(2)
        if name.startswith("__tsm") or _SCOPED_ENUM.search(masked, max(0, m.start() - 16), m.start()):
            continue
        body_open = m.end() - 1
        body_close = _msl_text._match_close(masked, body_open, "{", "}")
        top, depth = [], 0
        for c in masked[body_open + 1:body_close]:
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            elif depth == 0:
                top.append(c)
        top = "".join(top)
        # (a class template's constructor may be spelled with its arguments: candle's `RMS<T>()`)
        n = re.escape(name)
        ctor = r"(?<![~\w])" + n + r"\s*(?:<[^<>]*>)?\s*\("
        has_ctor = re.search(ctor, top)
        has_copy = re.search(ctor + r"\s*(?:const\s+)?(?:(?:thread|__generic)\s+)?" + n +
                             r"\s*(?:<[^>]*>)?\s*&(?!&)", top)
        has_constant_copy = re.search(ctor + r"\s*(?:const\s+)?constant\b", top)
        has_assign = re.search(r"\boperator\s*=\s*\(", top)
        if not has_ctor and re.search(r"[\w>&*\s]\s" + n + r"\s*(?:\[[^\]]*\]\s*)*;", top):
            # A data member named like its struct (Tint's `struct a { int a; };`), which C++
            # allows only in a class without user-declared constructors.
            has_ctor = has_copy = has_constant_copy = True
        members = []
        if not has_ctor:
            members.append(f"{name}() = default;")
        if not has_copy:
            # Qualified __constant: a copy that constructs an object in the constant address
            # space (MLX's `constant T init = Limits<T>::max;`), which clang's generic
            # constructors cannot.
            members.append(f"{name}(const {name}&) = default; {name}(const {name}&) __constant = default;")
        if not has_constant_copy:
            members.append(f"{name}(const __constant {name}&) = default; "
                           f"{name}(const __constant {name}&) __constant = default;")
        if not has_assign:
            # The copy from constant takes only a constant `name` (a template: no conversion
            # into a constant temporary, which would make `x = 1u` ambiguous for a class
            # with constructors from integers qualified thread and constant, MLX's complex_t).
            members.append(f"{name}& operator=(const {name}&) = default; "
                           f"template <typename __tsm_U, typename = ::metal::__tsm_enable_if_t<__is_same(__tsm_U, {name})>> "
                           f"{name}& operator=(const __constant __tsm_U&);")
        text = " ".join(members)
        if kind == "class":
            text = f"public: {text} private:"
        edits.append((body_open + 1, body_open + 1, " " + text + " "))
    return edits


_ARRAY_PARAMETER = re.compile(r"\s+(?:const\s+)?[\w:]+(?:\s*<[^<>()]*>)?\s+\w+\s*\[")


def _generic_thread(masked: str) -> List[Tuple[int, int, str]]:
    """Edits that make Metal's ``thread`` clang's generic address space where it qualifies
    a member function or what a pointer or reference designates.

    A member function qualified ``thread`` also serves temporaries (``return {a, b};`` of a
    class whose constructors are all ``thread``, as MLX's complex_t), which clang puts in
    its generic address space. So ``thread`` pointers and references are generic too (what
    ``this`` of such a function designates converts to them: MLX's ``thread T& frag_at()
    thread``), and ``const thread T&`` binds temporaries as in Metal. Generic is what the
    AST walk checks conversions into; objects declared ``thread`` stay __private."""
    methods = [(m.start(1), m.end(1)) for m in _THREAD_METHOD.finditer(masked)]
    edits = [(a, b, "__generic") for a, b in methods]
    for m in re.finditer(r"\bthread\b", masked):
        at = _pointer_or_reference_at(masked, m.end())
        if at is None and _ARRAY_PARAMETER.match(masked, m.end()) and \
                re.sub(r"\bconst$", "", masked[:m.start()].rstrip()).rstrip().endswith(("(", ",")):
            # `thread T pos[N]` as a parameter is a pointer (PyTorch's pos_from_thread_index)
            edits.append((m.start(), m.end(), "__generic"))
            continue
        if at is None or (m.start(), m.end()) in methods:
            continue
        # A class template's specialisation goes unqualified: clang makes it generic all
        # the same, and deduces its arguments from an object in __private (a local) as from
        # one in __generic (a member, through `this`), which `__generic X<T>&` does not.
        edits.append((m.start(), m.end(), " " * len("thread") if "<" in masked[m.end():at] else "__generic"))
    return edits


@functools.lru_cache(maxsize=None)
def _library() -> Tuple[str, str]:
    """(path, text) of the check's metal_stdlib, with ``thread`` as in user code."""
    path = FRONTEND_INCLUDE_DIR / "metal_stdlib"
    text = _Text(path.read_text())
    text.apply(_generic_thread(_msl_text._mask_strings_and_directives(text.text)))
    return str(path), text.text


def _prepare(preprocessed: str) -> _Prepared:
    """The preprocessed MSL, rewritten (line for line) into C++ for OpenCL that clang parses."""
    lints: List[Tuple[int, str]] = []
    source = _Text(preprocessed)
    masked = _msl_text._mask_strings_and_directives(preprocessed)
    try:
        kernels = _msl_text.find_kernels(preprocessed)
    except _msl_text.ParseError:
        kernels = []  # the emulator's parser reports it with its own words
    names = {k.cxx.split("<", 1)[0].lstrip(":") for k in kernels}
    for pattern, what in ((r"\blong\s+long\b", "`long long` (Metal's long is 64 bits; there is no long long)"),
                          (r"\blong\s+double\b", "`long double` (Metal has no double)"),
                          (r"\bgoto\b", "`goto`")):
        for m in re.finditer(pattern, masked):
            lints.append((m.start(), f"Metal does not support {what}"))
    source.apply(_msl_text.marked_include_edits(source.text))
    source.apply(_msl_text.bare_coherent_edits(source.text))
    source.apply(_vector_constructors(source.text))  # first: the declarations below look like calls
    source.apply(_dependent_constructions(source.text))
    source.apply(_explicit_conversions(source.text))
    source.apply(_typedef_vectors(source.text))
    source.apply(_braced_arguments(source.text))
    source.apply(_template_function_pointers(source.text))
    source.apply(_constexpr_member_redeclarations(source.text))
    source.apply(_constant_pointees_const(source.text))
    source.apply(_thread_const_casts(source.text))
    source.apply(_braced_copies(source.text))
    masked = _msl_text._mask_strings_and_directives(source.text)
    bodies = [(d.body_open, d.body_close) for d in _msl_text._function_definitions(masked) if d.is_kernel]
    source.apply(_threadgroup_declarations(source.text, bodies))
    masked = _msl_text._mask_strings_and_directives(source.text)
    edits = [(m.start(), m.end(), f"((_Float16){m.group(1)}f)") for m in _HALF_LITERAL.finditer(masked)]
    edits += [(m.start(), m.end(), f"((__bf16){m.group(1)}f)") for m in _BFLOAT_LITERAL.finditer(masked)]
    edits += [(m.end(), m.end(), "f") for m in _DOUBLE_LITERAL.finditer(masked)]
    attributes = [(m.start(), m.end()) for m in _msl_text._ATTRIBUTE.finditer(masked)]
    edits += [(a, b, _msl_text.blank(masked[a:b])) for a, b in attributes]
    edits += [(m.start(), m.end(), " " * len(m.group()))
              for m in re.finditer(r"\b(?:kernel|vertex|fragment)\b", masked)
              if not any(a <= m.start() < b for a, b in attributes)]
    edits += _generic_thread(masked)
    # The C preprocessor that made `preprocessed` leaves pragmas' arguments unexpanded;
    # Apple's expands a loop count's macros (ggml's `#pragma unroll (MIN(a, b))`). A count
    # that calls one is left out here (it is only a hint).
    edits += [(m.start(1), m.end(1), " " * len(m.group(1))) for m in re.finditer(
        r"^[ \t]*#[ \t]*pragma[ \t]+unroll[ \t]*(\(.*\w[ \t]*\(.*\))[ \t]*$", source.text, re.M)]
    source.apply(edits)
    source.apply(_special_members(source.text))
    # libclang does not show explicit instantiations: a call of each instantiated kernel
    # template, in a function of its own, makes the walk below visit the instantiated body.
    # The function is in the namespaces the instantiation is in, where its template
    # arguments' names are (PyTorch's Gemm.metal: `gemm<..., GemmEpilogue::None>` in at_gemm).
    calls = " ".join(
        _in_namespace(k.namespace, f"inline void __tsm_instantiation_{i}() {{ {k.cxx}"
                                   f"({', '.join(['::metal::__tsm_any()'] * len(k.params))}); }}")
        for i, k in enumerate(kernels) if "<" in k.cxx)
    end = len(source.text)
    source.apply([(end, end, "\n" + calls + "\n")])
    return _Prepared(source, names, lints)


def _in_namespace(name: str, text: str) -> str:
    return f"namespace {name} {{ {text} }}" if name else text


def _parse(preprocessed: str, version: int, main_file: str, *, emulator: bool = False,
           prepared: Optional[_Prepared] = None):
    """(prepared text, clang translation unit, the path clang knows it by). ``emulator``:
    the emulator's view, where double is allowed (its emulator-only kernels). ``prepared``:
    ``preprocessed`` as :func:`_prepare` made it and edited since."""
    prepared = prepared or _prepare(preprocessed)
    path = f"/{hashlib.sha256(preprocessed.encode()).hexdigest()[:16]}/{Path(main_file).name}.msl"
    args = [*_CLANG_ARGS, "-isystem", str(FRONTEND_INCLUDE_DIR), "-include", "tsm_msl_prelude.h",
            "-include", "metal_stdlib", f"-D__METAL_VERSION__={version}", "-D__METAL_MACOS__=1",
            "-D__METAL__=1"]
    if emulator:
        args += ["-Xclang", "-cl-ext=+cl_khr_fp64,+__opencl_c_fp64", "-D__METAL_EMULATOR__=1"]
    tu = _index().parse(path, args=args, unsaved_files=[(path, prepared.text), _library()])
    return prepared, tu, path
