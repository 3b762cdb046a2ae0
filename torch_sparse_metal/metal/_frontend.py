"""Metal's language rules, checked on any machine by clang's front end.

The emulator compiles kernels as C++, which accepts much that Apple's Metal compiler
rejects. Before a shader is compiled for the emulator, this module parses it the way
Metal's compiler would see it (``__METAL_VERSION__`` of the chosen language version, no
``__METAL_EMULATOR__``) with clang (the ``libclang`` wheel: no Mac tool needed), in C++ for
OpenCL mode, where address spaces are part of the type system as in Metal, against
declarations of Metal's standard library (``csrc/emulator/frontend/include``). It reports,
as :class:`MetalCompileError` naming the user's file and line:

* clang's own errors (types, overloads, what Metal's library does not declare), in Metal's
  words (``__global`` is ``device``, ``__local`` ``threadgroup``);
* every implicit conversion of a ``device``, ``threadgroup`` or ``constant`` pointer,
  reference or object into the ``thread`` address space (Metal has no generic address
  space: an unqualified pointer or reference is ``thread``, and so is ``this`` of a member
  function without an address-space qualifier), found in clang's AST, in template
  instantiations too;
* C++ that Metal does not have: ``goto``, ``new``/``delete``, recursion, lambdas (before
  MSL 4.0), ``long long``/``long double``, unqualified kernel pointer parameters,
  threadgroup variables outside kernels or with initialisers.

Known to be permissive: what clang accepts in C++ for OpenCL and Metal may not (reported
as found, from real kernels); the emulator's own C++ compile then rejects what it does
not implement.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .._paths import EMULATOR_DIR
from . import _rewrite
from ._errors import MetalCompileError

FRONTEND_INCLUDE_DIR = EMULATOR_DIR / "frontend" / "include"

# MSL versions compile_shader accepts, and the value of __METAL_VERSION__ for each.
LANGUAGE_VERSIONS: Dict[str, int] = {"3.0": 300, "3.1": 310, "3.2": 320, "4.0": 400}
# What the Metal launcher picks on the newest macOS it supports (csrc/metal/launcher.mm).
DEFAULT_LANGUAGE_VERSION = "4.0"
# What the launcher can pick on the systems torch's MPS backend runs on (macOS 14+).
LAUNCHER_LANGUAGE_VERSIONS = ("3.1", "3.2", "4.0")

# C++ for OpenCL with the generic address space, no fp64 (Metal has no double), no
# program-scope variables outside `constant`. The x86-64 target gives __bf16 (bfloat).
_CL_EXTENSIONS = ("+__opencl_c_generic_address_space,+__cl_clang_function_pointers,-__opencl_c_pipes,-__opencl_c_device_enqueue,"
                  "-__opencl_c_program_scope_global_variables,-cl_khr_fp64,-__opencl_c_fp64")
_CLANG_ARGS = ("-x", "clcpp", "-cl-std=clc++2021", "-cl-no-stdinc", "-nostdinc", "-nostdinc++",
               "-target", "x86_64-unknown-linux-gnu", "-Xclang", "-cl-ext=" + _CL_EXTENSIONS,
               "-Wno-unknown-attributes", "-Wno-unused-value", "-ferror-limit=0")


def language_version_number(version: str) -> int:
    """``__METAL_VERSION__`` for ``version`` ("3.0" ... "4.0"); ValueError for others."""
    try:
        return LANGUAGE_VERSIONS[version]
    except KeyError:
        raise ValueError(f"language_version {version!r} is not one the emulator knows; "
                         f"choose one of {', '.join(LANGUAGE_VERSIONS)}") from None


# ---- libclang -------------------------------------------------------------------------------

class FrontendUnavailable(RuntimeError):
    """The libclang wheel is not installed (``pip install libclang``)."""


@functools.lru_cache(maxsize=None)
def _cindex():
    try:
        import clang.cindex as cindex
    except ImportError as exc:
        raise FrontendUnavailable(
            "the Metal front-end check needs clang's Python bindings and library: "
            "pip install libclang (the README's set-up command installs it)") from exc
    lib = cindex.conf.lib
    # Entry points the bundled bindings do not wrap.
    lib.clang_getSpecializedCursorTemplate.argtypes = [cindex.Cursor]
    lib.clang_getSpecializedCursorTemplate.restype = cindex.Cursor
    lib.clang_getSpecializedCursorTemplate.errcheck = cindex.Cursor.from_result
    lib.clang_getPresumedLocation.argtypes = [cindex.SourceLocation, ctypes.POINTER(cindex._CXString),
                                             ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint)]
    lib.clang_getPresumedLocation.restype = None
    lib.clang_getCursorBinaryOperatorKind.argtypes = [cindex.Cursor]
    lib.clang_getCursorBinaryOperatorKind.restype = ctypes.c_int
    lib.clang_getCursorUnaryOperatorKind.argtypes = [cindex.Cursor]
    lib.clang_getCursorUnaryOperatorKind.restype = ctypes.c_int
    return cindex


@functools.lru_cache(maxsize=None)
def _index():
    index = _cindex().Index.create()
    # Dispose of it while clang's bindings still exist (their __del__ fails at shutdown).
    atexit.register(_index.cache_clear)
    return index


def presumed_location(location) -> Tuple[str, int, int]:
    """(file, line, column) of a clang location, after ``#line`` markers."""
    cindex = _cindex()
    name = cindex._CXString()
    line, column = ctypes.c_uint(), ctypes.c_uint()
    cindex.conf.lib.clang_getPresumedLocation(location, ctypes.byref(name), ctypes.byref(line),
                                              ctypes.byref(column))
    return cindex._CXString.from_result(name), line.value, column.value


# ---- from MSL to what clang parses ----------------------------------------------------------

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
    masked = _rewrite._mask_strings_and_directives(src)
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
    bodies = [(d.body_open, d.body_close) for d in _rewrite._function_definitions(masked)]
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
            close = _rewrite._match_close(masked, m.end() - 1, "<", ">")
        except _rewrite.ParseError:
            continue
        names = re.findall(r"\b(?:typename|class)\s*(?:\.\.\.\s*)?(\w+)", masked[m.end():close])
        brace = re.compile(r"[{;]").search(masked, close + 1)
        if not names or brace is None or brace.group() != "{":
            continue
        try:
            scopes.append((names, brace.start(), _rewrite._match_close(masked, brace.start(), "{", "}")))
        except _rewrite.ParseError:
            continue
    return scopes


def _call_arguments(masked: str, open_paren: int) -> List[str]:
    """The top-level arguments of the parenthesis at ``open_paren`` (none if unbalanced)."""
    try:
        close = _rewrite._match_close(masked, open_paren, "(", ")")
    except _rewrite.ParseError:
        return []
    return _rewrite._split_top_level(masked[open_paren + 1:close])


def _dependent_constructions(src: str) -> List[Tuple[int, int, str]]:
    """``T(a, b)`` of a template's type parameter T -> ``::metal::__tsm_construct<T>(a, b)``,
    which builds a vector as a vector constructor does and calls a class's constructor
    otherwise (PyTorch's c10/metal/utils.h makes a ``float2`` so): clang reads a multi-argument
    functional cast to a vector type as a scalar's initialisation."""
    masked = _rewrite._mask_strings_and_directives(src)
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
    masked = _rewrite._mask_strings_and_directives(src)
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
    masked = _rewrite._mask_strings_and_directives(src)
    # Spelled out, `vec<bool, N>` deduces nothing: it can be the vector of int anywhere.
    edits = [(m.start(1), m.end(1), "int") for m in re.finditer(r"\bvec\s*<\s*(bool)\b", masked)]
    for m in re.finditer(r"\b(?:typedef|using\s+\w+\s*=)\s*(?:typename\s+)?((?:metal::)?vec\s*<)(?!\s*bool\b)", masked):
        if m.group().startswith("using") and masked[max(0, m.start() - 64):m.start()].rstrip().endswith(">"):
            continue  # an alias template: its parameters are deduced through it
        try:
            close = _rewrite._match_close(masked, m.end(1) - 1, "<", ">")
        except _rewrite.ParseError:
            continue
        arguments = src[m.end(1):close]
        edits.append((m.start(1), close + 1, f"typename ::metal::__tsm_vector_type<{arguments}>::type"))
    return edits


def _threadgroup_declarations(src: str, kernel_bodies: Sequence[Tuple[int, int]]) -> List[Tuple[int, int, str]]:
    """``threadgroup T a[N];`` in a kernel body -> a reference to storage in __local (clang
    allows __local variables only in OpenCL kernels); one outside a kernel is left for clang."""
    masked = _rewrite._mask_strings_and_directives(src)
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
        parts = [_rewrite.declarator(part) for part in _rewrite._split_top_level(src[m.end():end])]
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
    masked = _rewrite._mask_strings_and_directives(src)
    edits = []
    for m in re.finditer(r"([(,])\s*\{", masked):
        open_brace = m.end() - 1
        try:
            close = _rewrite._match_close(masked, open_brace, "{", "}")
        except _rewrite.ParseError:
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
        if not callee or callee.group(1) in _rewrite._NOT_FUNCTIONS or masked[:i].rstrip().endswith("]]"):
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
    masked = _rewrite._mask_strings_and_directives(src)
    squeezed = re.sub(r"\s+", "", masked)
    edits = []
    for m in _MEMBER_REDECLARATION.finditer(masked):
        if not re.search(r"\bconstexpr\b", m.group("qualifiers")):
            continue
        scope = re.sub(r"\s+", "", m.group("scope")).rsplit("::", 1)[-1]
        if "<" in scope and not re.search(r"template<>(?:struct|class)" + re.escape(scope) + r"[{:]", squeezed):
            continue
        edits.append((m.start(), m.end(), _rewrite.blank(m.group())))
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
    masked = _rewrite._mask_strings_and_directives(src)
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
                end = _rewrite._match_close(masked, p.end(), "(", ")") + 1
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


def _constant_pointees_const(src: str) -> List[Tuple[int, int, str]]:
    """``constant T *p`` -> ``constant const T *p``: what a pointer or reference into the
    constant address space designates is read-only in Metal whether or not it says const,
    so such a pointer takes a ``constexpr constant`` table (ggml's ``kvalues_iq4nl_f``)."""
    masked = _rewrite._mask_strings_and_directives(src)
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
    masked = _rewrite._mask_strings_and_directives(src)
    edits = []
    for m in _RECORD.finditer(masked):
        kind, name = m.group(1), m.group(2)
        if name.startswith("__tsm") or _SCOPED_ENUM.search(masked, max(0, m.start() - 16), m.start()):
            continue
        body_open = m.end() - 1
        body_close = _rewrite._match_close(masked, body_open, "{", "}")
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
    text.apply(_generic_thread(_rewrite._mask_strings_and_directives(text.text)))
    return str(path), text.text


def _prepare(preprocessed: str) -> _Prepared:
    """The preprocessed MSL, rewritten (line for line) into C++ for OpenCL that clang parses."""
    lints: List[Tuple[int, str]] = []
    source = _Text(preprocessed)
    masked = _rewrite._mask_strings_and_directives(preprocessed)
    try:
        kernels = _rewrite.find_kernels(preprocessed)
    except _rewrite.ParseError:
        kernels = []  # the emulator's parser reports it with its own words
    names = {k.cxx.split("<", 1)[0].lstrip(":") for k in kernels}
    for pattern, what in ((r"\blong\s+long\b", "`long long` (Metal's long is 64 bits; there is no long long)"),
                          (r"\blong\s+double\b", "`long double` (Metal has no double)"),
                          (r"\bgoto\b", "`goto`")):
        for m in re.finditer(pattern, masked):
            lints.append((m.start(), f"Metal does not support {what}"))
    source.apply(_vector_constructors(source.text))  # first: the declarations below look like calls
    source.apply(_dependent_constructions(source.text))
    source.apply(_explicit_conversions(source.text))
    source.apply(_typedef_vectors(source.text))
    source.apply(_braced_arguments(source.text))
    source.apply(_template_function_pointers(source.text))
    source.apply(_constexpr_member_redeclarations(source.text))
    source.apply(_constant_pointees_const(source.text))
    masked = _rewrite._mask_strings_and_directives(source.text)
    bodies = [(d.body_open, d.body_close) for d in _rewrite._function_definitions(masked) if d.is_kernel]
    source.apply(_threadgroup_declarations(source.text, bodies))
    masked = _rewrite._mask_strings_and_directives(source.text)
    edits = [(m.start(), m.end(), f"((_Float16){m.group(1)}f)") for m in _HALF_LITERAL.finditer(masked)]
    edits += [(m.start(), m.end(), f"((__bf16){m.group(1)}f)") for m in _BFLOAT_LITERAL.finditer(masked)]
    edits += [(m.end(), m.end(), "f") for m in _DOUBLE_LITERAL.finditer(masked)]
    attributes = [(m.start(), m.end()) for m in _rewrite._ATTRIBUTE.finditer(masked)]
    edits += [(a, b, _rewrite.blank(masked[a:b])) for a, b in attributes]
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


# ---- diagnostics -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Diagnostic:
    file: str
    line: int
    column: int
    message: str
    text: str = ""  # the source line, as preprocessed

    def format(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: error: {self.message}"


_TERMS = ((r"__global\b", "device"), (r"__local\b", "threadgroup"), (r"__constant\b", "constant"),
          (r"__private\b", "thread"), (r"__generic\b", "thread"), (r"\b_Float16\b", "half"),
          (r"\b__bf16\b", "bfloat"), (r"::metal::__tsm_make_vector<([^>]*)>", r"\1"),
          (r"__tsm_msl_(\w+)", r"\1"), (r"\bC\+\+ for OpenCL( version 2021)?", "Metal"),
          (r"\bOpenCL( C)?( version \S+)?", "Metal"), (r"\bcl_khr_fp64 and __opencl_c_fp64( support)?",
                                                   "double support, which Metal does not have"))
# clang's C++ for OpenCL rules that are not Metal's.
_NOT_METAL_RULES = (
    re.compile(r"too few elements in vector initialization"),  # Metal zero-fills the rest
    re.compile(r"double precision constant requires"),         # a warning; Metal's literals are float
    re.compile(r"cannot (increment|decrement) value of type .*vec<"),  # ++ and -- work on vectors
    # A float scalar with a half vector (ggml's `slope*pmask4[i]`).
    re.compile(r"scalar operand type has greater rank than the type of the vector element\. "
               r"\(('float' and .*_Float16.*|.*_Float16.* and 'float')\)$"),
    # clang has no conversion between _Float16 and __bf16; Metal converts half and bfloat
    # explicitly (MLX's fp8.h: static_cast<bfloat16_t>(half)).
    re.compile(r"(static_cast|C-style cast|functional-style cast) from .*\b(_Float16|__bf16)\b.* to "
               r".*\b(_Float16|__bf16)\b.* is not allowed"),
    # A const thread reference bound to a temporary of another type, which Metal makes in
    # thread (PyTorch's UnaryKernel.metal: `static_cast<decltype(x.y)>(precise::sqrt(...))`,
    # decltype of a vector component being a reference); clang's OpenCL mode gives the
    # temporary no address space. A value in another address space is named with it.
    re.compile(r"^binding reference of type 'const __private [^']*' to value of type '(?![^']*__)[^']*' "
               r"changes address space$"),
)


_VECTOR_COUNT = re.compile(r"vector of (\d+) |vec<[^<>]*, (\d+)>|ext_vector_type\((\d+)\)|'[a-z]+([234])'")


def _same_length_vector_cast(message: str) -> bool:
    """clang's casts between vectors of different element types are bit casts, rejected
    when the sizes differ; Metal's convert each component (ggml's ``(float4) h4``), which
    needs only the same number of them."""
    m = re.search(r"from vector (.*) to vector (.*) of different size", message)
    if not m:
        return False
    counts = []
    for side in m.groups():
        found = _VECTOR_COUNT.search(side)
        counts.append(next(g for g in found.groups() if g) if found else None)
    return counts[0] is not None and counts[0] == counts[1]


def _thread_spaces_only(message: str) -> bool:
    """An address-space error between ``__private`` and ``__generic``, which are both
    Metal's thread here (``this`` of a member function qualified ``thread`` is generic: see
    _THREAD_METHOD); MLX's ``thread frag_type& frag_at() thread { return val_frags[i]; }``."""
    if not re.search(r"changes address space|^reinterpret_cast from .* is not allowed", message):
        return False
    spaces = set(re.findall(r"\b__(global|local|constant|private|generic)\b", message))
    return spaces == {"private", "generic"}


def _same_class_in_two_spaces(message: str) -> bool:
    """``c ? a : b`` with ``a`` and ``b`` of one class in different address spaces: clang
    finds conversions both ways; Metal copies the operands (MLX's
    ``lid.x < n ? shared_vals[lid.x] : op.init`` of threadgroup and constant complex_t)."""
    m = re.match(r"conditional expression is ambiguous; '(.*)' and '(.*)' can be converted|"
                 r"incompatible operand types \('(.*)' and '(.*)'\)$", message)
    if not m:
        return False
    bare = [" ".join(w for w in side.split() if w not in _QUALIFIERS) for side in m.groups() if side]
    return bare[0] == bare[1]


def _constructs_a_constant_object(diagnostic) -> bool:
    """A constructor that is not qualified ``constant`` initialising an object in the
    constant address space directly (``constant constexpr cplx c(1, 2);``): clang's OpenCL
    rules refuse it, though they take ``= cplx(1, 2)``, the same call since C++17, which is
    how Apple's compiler builds MLX's ``static constexpr constant complex_t<T> max``.
    clang's note says the candidate fit but for the object's address space (it was not
    viable for its arguments otherwise)."""
    return bool(re.match(r"no matching constructor for initialization of '.*\b__constant\b", diagnostic.spelling)) \
        and any("cannot be used to construct an object in address space '__constant'" in n.spelling
                for n in diagnostic.children)


_DEDUCTION_MISMATCH = re.compile(r"candidate template ignored: cannot deduce a type for '(\w+)' that would make "
                                 r"'(?:const )?__generic \1' equal '(?:const )?__private ")


_DEDUCTION_CONFLICT = re.compile(r"candidate template ignored: deduced conflicting types for parameter '\w+' "
                                 r"\((.*)\)$")


def _thread_space_conflict(note: str) -> bool:
    """``A`` deduced as ``__private float`` from a local array or pointer passed to ``A v[4]``
    and as ``float`` from a value (PyTorch's ScanKernel ``load_safe(values, in, ..., init)``):
    in Metal a local is in thread, the default address space, so both deduce ``float``."""
    m = _DEDUCTION_CONFLICT.match(note)
    sides = m.group(1).split(" vs. ") if m else []
    if len(sides) != 2:
        return False
    # each side as its canonical type: `'float'`, `'__private acc_t' (aka '__private float')`
    canonical = [re.findall(r"'([^']*)'", side)[-1] for side in sides]
    bare = [re.sub(r"\b__(private|generic)\s+", "", side) for side in canonical]
    return bare[0] == bare[1]


_FUNCTION_POINTER_ARGUMENT = re.compile(
    r"candidate function not viable: no known conversion from '(.*)' to '(.*\(__generic \*.*)' for \w+ argument$|"
    r"candidate function not viable: no overload of '[\w:]+' matching '.*\(__generic \*.*' for \w+ argument$|"
    r"candidate template ignored: could not match '.*' against '.*\) __generic'$")


_FUNCTION_POINTER_INITIALISATION = re.compile(
    r"cannot initialize a parameter of type '(.*)' with an [lr]value of type '(.*)': different qualifiers "
    r"\(unqualified vs '__generic'\)$")


def _function_space_only(note: str) -> bool:
    """A static member function (PyTorch's ``IndexReduceOp::amax<T>``, c10/metal/atomic.h's
    ``T (*op)(T, T)`` parameter), or an ``auto`` template parameter holding one (see
    _template_function_pointers), refused by a function-pointer parameter: clang's OpenCL
    mode qualifies every member function's type ``__generic`` and a function pointer's
    pointee too, so no member function converts. Metal's function types have no address
    space; the emulator's C++ build still checks the function's type against the parameter's."""
    note = re.sub(r"'[^']*' \(aka '([^']*)'\)", r"'\1'", note)  # canonical types
    m = _FUNCTION_POINTER_ARGUMENT.match(note) or _FUNCTION_POINTER_INITIALISATION.match(note)
    if not m:
        return False
    if m.group(1) is None:  # (a template's name or parameter: the type is not spelled out)
        return True
    bare = [re.sub(r"\b__(?:private|generic)\b|\s", "", side) for side in (m.group(1), m.group(2))]
    return bare[0] == bare[1]


def _fails_by_thread_spaces_only(diagnostic) -> bool:
    """Overload resolution that failed where a candidate ``f(thread T& x)`` (T a template
    parameter; clang's __generic) was not deduced from an object in __private (a local,
    MLX's ``thread_swap(a, b)``), or deduced for it a type that differs from another
    argument's by __private alone: both are Metal's thread, where it deduces. clang deduces
    only from the same address space; the arguments after the one refused go unchecked."""
    return any(_DEDUCTION_MISMATCH.match(n.spelling) or _thread_space_conflict(n.spelling)
               or _function_space_only(n.spelling) for n in diagnostic.children)


def _not_metal(message: str) -> bool:
    """Whether clang's error ``message`` is a rule of C++ for OpenCL that Metal does not have."""
    return (any(rule.search(message) for rule in _NOT_METAL_RULES) or _same_length_vector_cast(message)
            or _thread_spaces_only(message) or _same_class_in_two_spaces(message)
            or _function_space_only(message))


def _in_metal_words(message: str) -> str:
    for pattern, replacement in _TERMS:
        message = re.sub(pattern, replacement, message)
    return message


def _explain(message: str) -> str:
    """clang's message, plus what construct Metal rejects where clang's words hide it."""
    explanations = (
        ("cannot use 'throw' with exceptions disabled", "Metal has no exceptions"),
        ("cannot use 'try' with exceptions disabled", "Metal has no exceptions"),
        ("virtual functions are not supported", "Metal has no virtual functions"),
        ("pointers to functions are not allowed", "Metal has no function pointers (outside "
                                                  "[[visible]] functions and function tables)"),
        ("variable length arrays are not supported", "Metal has no variable-length arrays"),
        ("array size is not a constant expression", "Metal has no variable-length arrays"),
        ("use of type 'double'", "Metal has no double (the emulator has it only inside "
                                 "#ifdef __METAL_EMULATOR__)"),
        ("program scope variable must reside in constant address space",
         "Metal: a program-scope variable must be declared in the constant address space"),
        ("static local variable must reside in constant address space",
         "Metal: a static local variable must be constant"),
        ("non-kernel function variable cannot be declared in local address space",
         "Metal: threadgroup variables may be declared only in a kernel function's scope"),
        ("thread-local storage is not supported", "Metal has no thread_local"),
    )
    for needle, explanation in explanations:
        if needle in message:
            return f"{explanation} ({_in_metal_words(message)})"
    return _in_metal_words(message)


# ---- the address-space walk ----------------------------------------------------------------

_AS_WORDS = {"__global": "device", "__local": "threadgroup", "__constant": "constant",
             "__generic": "thread", "__private": "thread"}
_QUALIFIERS = {"const", "volatile", "restrict", *_AS_WORDS}


def _address_space(type_) -> Optional[str]:
    """The address space of what a pointer or reference points at, or of an object: the
    outermost qualifiers of its spelling (clang prints them first)."""
    if _type_kind(type_) in ("Pointer", "LValueReference", "RValueReference"):
        type_ = type_.get_pointee()
    for word in type_.spelling.split():
        if word in _AS_WORDS:
            return word
        if word not in _QUALIFIERS:
            return None
    return None


def _type_kind(type_) -> str:
    try:
        return type_.kind.spelling
    except ValueError:  # a kind newer than the Python bindings (clang's _Float16, say)
        return "Unknown"


_TRANSPARENT = ("UNEXPOSED_EXPR", "PAREN_EXPR")  # implicit conversions and parentheses


def operand_parent(node, ancestors: Sequence[object]) -> Tuple[object, int]:
    """Where the expression ``node`` (``ancestors``: the nodes around it, outermost first)
    is an operand: the node it is, past implicit conversions and parentheses, and the index
    in ``ancestors`` of the node it is an operand of (-1: none)."""
    i = len(ancestors) - 1
    while i >= 0 and ancestors[i].kind.name in _TRANSPARENT:
        node, i = ancestors[i], i - 1
    return node, i


def stripped(node):
    """An expression past its implicit conversions and parentheses."""
    while node is not None and node.kind.name in _TRANSPARENT:
        node = next(iter(node.get_children()), None)
    return node


def element_type(type_):
    """The canonical type of ``type_``'s elements through any arrays (``type_``'s own if it
    is not an array)."""
    t = type_.get_canonical()
    while _type_kind(t) in ("ConstantArray", "IncompleteArray"):
        t = t.get_array_element_type().get_canonical()
    return t


def _is_exempt_copy(call) -> bool:
    """An implicit (or defaulted) copy or move constructor or assignment: Metal provides
    them for objects in every address space."""
    target = call.referenced
    if target is None:
        return False
    special = (target.is_copy_constructor() or target.is_move_constructor() or
               target.is_copy_assignment_operator_method() or target.is_move_assignment_operator_method())
    if not special:
        # or the copy assignment from a constant object _special_members declares, a template
        template = _cindex().conf.lib.clang_getSpecializedCursorTemplate(target)
        return template is not None and not template.kind.is_invalid() and any(
            c.spelling == "__tsm_U" for c in template.get_children())
    return target.is_default_method() or not target.extent.start.file or \
        target.location == target.semantic_parent.location


class _Walker:
    """Walks the user's functions, and the template instantiations they call, for what the
    type system does not reject. Hot on large shaders: kinds are compared as clang's ids."""

    def __init__(self, cindex, main_file: str, version: int) -> None:
        k = cindex.CursorKind
        self.k = k
        self.main_file = main_file
        self.version = version
        self.found: List[Tuple[object, str]] = []
        self.seen_functions: Set[str] = set()
        self.calls: Dict[str, Set[str]] = {}  # callee graph of user functions, for recursion
        self.lambdas: List[object] = []
        self.new_delete: List[object] = []
        self.specialized = cindex.conf.lib.clang_getSpecializedCursorTemplate
        # An implicit conversion inside one of these is part of the explicit cast.
        self.explicit_casts = {c.value for c in (k.CSTYLE_CAST_EXPR, k.CXX_FUNCTIONAL_CAST_EXPR,
                                                 k.CXX_STATIC_CAST_EXPR, k.CXX_REINTERPRET_CAST_EXPR,
                                                 k.CXX_CONST_CAST_EXPR)}
        self.unexposed = k.UNEXPOSED_EXPR.value
        self.lambda_ = k.LAMBDA_EXPR.value
        self.allocation = {k.CXX_NEW_EXPR.value, k.CXX_DELETE_EXPR.value}
        self.references = {k.CALL_EXPR.value, k.MEMBER_REF_EXPR.value, k.DECL_REF_EXPR.value}
        self.call = k.CALL_EXPR.value
        self.functions = {k.FUNCTION_DECL, k.CXX_METHOD, k.CONSTRUCTOR, k.CONVERSION_FUNCTION,
                          k.FUNCTION_TEMPLATE}
        self.variables = {k.VAR_DECL.value, k.PARM_DECL.value, k.FIELD_DECL.value}
        self.conditional = k.CONDITIONAL_OPERATOR.value
        self.copied: Set[int] = set()  # hashes of conversions that are copies in Metal

    def user(self, cursor) -> bool:
        f = cursor.location.file
        return f is not None and f.name == self.main_file

    def walk_function(self, fn, via: str = "") -> None:
        key = fn.get_usr() + "|" + str(fn.hash)
        if key in self.seen_functions:
            return
        self.seen_functions.add(key)
        self._walk(fn, fn, via)

    def _walk(self, node, fn, via: str) -> None:
        in_cast = node._kind_id in self.explicit_casts
        for child in node.get_children():
            kind = child._kind_id
            if kind == self.unexposed:
                if not in_cast:
                    self._check_conversion(child, node, via)
            elif kind in self.explicit_casts:
                self._check_explicit_cast(child, via)
            elif kind == self.conditional:
                self.note_conditional_copies(child)
            elif kind == self.lambda_:
                self.lambdas.append(child)
            elif kind in self.allocation:
                self.new_delete.append(child)
            elif kind in self.variables:
                self.check_variable(child, via, fn)
            elif kind in self.references:
                if kind == self.call:
                    self.check_function_arguments(child, via)
                target = child.referenced
                if target is not None and target.kind in self.functions and self.user(target):
                    self.calls.setdefault(fn.get_usr(), set()).add(target.get_usr())
                    instantiated = self.specialized(target)
                    if instantiated is not None and not instantiated.kind.is_invalid():
                        where = presumed_location(child.location)
                        self.walk_function(target, via + f", instantiated from line {where[1]}")
            self._walk(child, fn, via)

    def note_conditional_copies(self, conditional) -> None:
        """``c ? p[i] : S(0)`` with ``p`` a device pointer to class ``S``: clang's OpenCL
        rules find no common class type (a thread object cannot become a device one, nor the
        reverse) and convert both operands through a conversion operator of ``S``, called on
        the device object. Metal copies the device operand instead, as in ``S s = p[i];``:
        PyTorch's ScaledMM.metal (``cond ? args.a[i] : float8_e4m3fn(0.0f)``) is built by
        Apple's compiler. The operands' address-space conversions are those copies."""
        arms = list(conditional.get_children())[1:]
        objects = [_converted_object(arm, self.k) for arm in arms]
        if len(objects) != 2 or any(o is None for o in objects):
            return
        classes = [o.type.get_canonical().get_declaration() for o in objects]
        if any(c is None for c in classes) or classes[0] != classes[1]:
            return
        self.copied.update(o.hash for o in objects)

    def check_variable(self, variable, via: str = "", function=None) -> None:
        """Function pointers are template arguments only in Metal (clang's extension that
        parses them has no such limit), unless Apple's compiler can tell which function one
        is. Public code it builds names a function through a local it then calls (MLX's nax
        GEMMs, MSL 4.0: ``auto do_gemm = gemm_loop<...>;``) and passes one as an argument
        (PyTorch's c10/metal/atomic.h, MSL 3.1+: ``T (*op)(T, T)``): a local initialised
        with a function, or a parameter, only read or called, is accepted there, each
        argument for such a parameter naming a function (:meth:`check_function_arguments`)."""
        if _holds_function_address(variable.type):
            if function is not None and self.version >= 400 and _names_one_function(variable, function):
                return
            if function is not None and self.version >= 310 and variable.kind == self.k.PARM_DECL \
                    and _only_read(variable, function):
                return
            self.found.append((variable, f"Metal has no function pointers (`{variable.spelling}`): a function "
                                         f"is passed only as a template argument, or as a [[visible]] "
                                         f"function through a function table{via}"))

    def check_function_arguments(self, call, via: str = "") -> None:
        """An argument for a function-pointer parameter names a function, or is a local or
        parameter the rules above accept: what the function is, is known where it is called."""
        callee = call.referenced
        if callee is None or self.version < 310:
            return
        # (a callee that is not a function, a call through an object, has no arguments)
        for parameter, argument in zip(callee.get_arguments(), call.get_arguments()):
            if parameter is None or not _holds_function_address(parameter.type):
                continue
            named = _strip_to_reference(argument)
            target = named.referenced if named is not None and named.kind == self.k.DECL_REF_EXPR else None
            if target is not None and (target.kind in (self.k.FUNCTION_DECL, self.k.FUNCTION_TEMPLATE) or
                                       _holds_function_address(target.type)):
                continue
            self.found.append((argument, f"Metal has no function pointers: the argument for `{parameter.spelling}` "
                                         f"must name a function (one known where the call is compiled){via}"))

    def _check_explicit_cast(self, cast, via: str) -> None:
        """Metal converts between address spaces with no cast at all."""
        if "__generic" not in cast.type.spelling:
            return
        operands = [c for c in cast.get_children() if c.kind != self.k.TYPE_REF]
        if not operands:
            return
        from_space = _address_space(operands[-1].type)
        if _address_space(cast.type) == "__generic" and from_space in ("__global", "__local", "__constant") \
                and _type_kind(cast.type) == "Pointer":
            self.found.append((cast, f"cannot cast a {_AS_WORDS[from_space]} pointer to a thread pointer "
                                     f"(Metal has no conversion between address spaces, explicit or not): "
                                     f"{_in_metal_words(operands[-1].type.spelling)} -> "
                                     f"{_in_metal_words(cast.type.spelling)}{via}"))

    def _check_conversion(self, cast, parent, via: str) -> None:
        to_type = cast.type
        to_spelling = to_type.spelling
        generic = "__generic" in to_spelling
        if not generic and "bf" not in to_spelling:  # neither rule can apply (fast path)
            return
        children = list(cast.get_children())
        if len(children) != 1:
            return
        from_type = children[0].type
        rule = _bfloat_conversion(from_type, to_type)
        if rule:
            self.found.append((cast, rule + via))
            return
        if not generic or _address_space(to_type) != "__generic":
            return
        from_space = _address_space(from_type)
        if from_space not in ("__global", "__local", "__constant"):
            return
        if parent is not None and parent._kind_id == self.call and _is_exempt_copy(parent) or \
                cast.hash in self.copied:
            return
        self.found.append((cast, f"cannot convert a {_AS_WORDS[from_space]} "
                                 f"{_describe(from_type)} to the thread address space "
                                 f"(Metal has no implicit conversion between address spaces; "
                                 f"a pointer, reference or `this` without one is `thread`): "
                                 f"{_in_metal_words(from_type.spelling)} -> "
                                 f"{_in_metal_words(to_spelling)}{via}"))


def _converted_object(expression, k):
    """The object a conversion-operator call converts (``expression`` is the call, as an
    implicit conversion), or None."""
    children = list(expression.get_children())
    if expression.kind == k.UNEXPOSED_EXPR and len(children) == 1:
        expression = children[0]
    if expression.kind != k.CALL_EXPR or expression.referenced is None or \
            expression.referenced.kind != k.CONVERSION_FUNCTION:
        return None
    member = next(iter(expression.get_children()), None)
    if member is None or member.kind != k.MEMBER_REF_EXPR:
        return None
    return next(iter(member.get_children()), None)


def _strip_to_reference(e):
    """An expression without its implicit conversions, parentheses and `&`; in a template's
    instantiation, a non-type template parameter's argument for the parameter (libclang
    shows such a substitution as a reference to nothing, the argument its child)."""
    k = _cindex().CursorKind
    lib = _cindex().conf.lib
    while e is not None and (e.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR) or (
            e.kind == k.UNARY_OPERATOR and lib.clang_getCursorUnaryOperatorKind(e) == _ADDRESS_OF) or (
            e.kind == k.DECL_REF_EXPR and e.referenced is None and next(e.get_children(), None) is not None)):
        e = next(iter(e.get_children()), None)
    return e


def _names_one_function(variable, function) -> bool:
    """Whether ``variable`` (a local) is initialised with a function and ``function``, its
    scope, only reads it (:func:`_only_read`)."""
    k = _cindex().CursorKind
    if variable.kind != k.VAR_DECL:
        return False
    init = _strip_to_reference(next((c for c in variable.get_children() if c.kind.is_expression()), None))
    target = init.referenced if init is not None and init.kind == k.DECL_REF_EXPR else None
    if target is None or target.kind not in (k.FUNCTION_DECL, k.FUNCTION_TEMPLATE):
        return False
    return _only_read(variable, function)


def _only_read(variable, function) -> bool:
    """Whether each use of ``variable`` in ``function`` converts it to its value (clang's
    implicit cast) or calls it. An assignment, `&f`, a reference bound to it (`auto& r = f`,
    an argument for a `thread F&` parameter) could change what it names."""
    k = _cindex().CursorKind

    def only_read(node) -> bool:
        for i, c in enumerate(node.get_children()):
            if c.kind == k.DECL_REF_EXPR and c.referenced is not None and c.referenced == variable:
                # A conversion to its value has no address space; one that keeps it an object
                # (thread -> generic, binding a reference) has.
                read = node.kind == k.UNEXPOSED_EXPR and node.type.get_address_space() == 0
                # In a template, a call clang leaves unresolved passes it on as it is (a
                # helper forwarding `op`, PyTorch's AtomicType): taken for a copy.
                called = node.kind == k.CALL_EXPR and (i == 0 or node.referenced is None)
                if not read and not called:
                    return False
            elif not only_read(c):
                return False
        return True

    return only_read(function)


_ADDRESS_OF = 5  # CXUnaryOperatorKind for `&x`


def _holds_function_address(type_) -> bool:
    """A pointer or reference to a function, or an array of them."""
    type_ = type_.get_canonical()  # through aliases (`Scale<float> f`, MLX's RadixFunc)
    if "(" not in type_.spelling:  # fast path: a function type is spelled with its parameters
        return False
    while _type_kind(type_) in ("ConstantArray", "IncompleteArray"):
        type_ = type_.element_type.get_canonical()
    if _type_kind(type_) not in ("Pointer", "LValueReference", "RValueReference"):
        return False
    return _type_kind(type_.get_pointee().get_canonical()) in ("FunctionProto", "FunctionNoProto")


def _scalar_name(type_) -> str:
    """The canonical spelling of a type without qualifiers (for the bfloat rules)."""
    words = [w for w in type_.get_canonical().spelling.split() if w not in _QUALIFIERS]
    return " ".join(words)


def _bfloat_conversion(from_type, to_type) -> Optional[str]:
    """Metal's bfloat converts implicitly only to float: nothing converts implicitly to
    bfloat, and bfloat not to half (MSL 3.1, "bfloat" in the scalar types)."""
    source, target = _scalar_name(from_type), _scalar_name(to_type)
    if source == target:
        return None
    # MSL 3.1: "neither float nor half can be implicitly converted to bfloat"; integers
    # can (MLX's arange computes `start + index * step` in bfloat with an integer index).
    if target == "__bf16" and source in ("float", "_Float16", "double"):
        return (f"no implicit conversion from {_in_metal_words(source)} to bfloat in Metal "
                f"(write bfloat(x); bfloat converts implicitly only to float)")
    if source == "__bf16" and target in _ARITHMETIC and target != "float":
        return (f"no implicit conversion from bfloat to {_in_metal_words(target)} in Metal "
                f"(bfloat converts implicitly only to float)")
    return None


_ARITHMETIC = {"bool", "char", "signed char", "unsigned char", "short", "unsigned short", "int",
               "unsigned int", "long", "unsigned long", "float", "_Float16", "double"}


def _describe(type_) -> str:
    kind = _type_kind(type_)
    return "pointer" if kind == "Pointer" else "reference" if "Reference" in kind else "object"


# ---- the check ---------------------------------------------------------------------------------

def check(preprocessed: str, *, language_version: str, origin: str,
          main_file: str = "<msl>") -> None:
    """Raise :class:`MetalCompileError` if Apple's compiler would reject ``preprocessed``.

    ``preprocessed`` is the user's source after the C preprocessor ran with Metal's view of
    the macros (``__METAL_VERSION__`` for ``language_version``, no ``__METAL_EMULATOR__``),
    with line markers naming the user's files.
    """
    diagnostics = diagnose(preprocessed, language_version=language_version, main_file=main_file)
    if diagnostics:
        raise MetalCompileError.from_diagnostics(
            f"{origin}: the Metal check (MSL {language_version}) rejected the shader",
            [(d.file, d.line, d.message, d.text) for d in diagnostics])


_BOOL_VECTOR = "invalid vector element type 'bool'"


def _bool_vector_instantiations(tu, path: str, text: str) -> List[Tuple[int, int, str]]:
    """Edits that blank the instantiations with ``bool`` arguments of the kernel templates
    whose instantiation made a vector of bool.

    Metal has bool vectors of every length; C++ for OpenCL has none. The rewrite of
    ``vec<bool, N>`` into a vector of int (:func:`_typedef_vectors`) cannot reach one made
    through an alias template's parameter (MLX's nax attention instantiates its tiles with
    ``bool`` masks, ``dtype_frag_t<bool>`` being ``metal::vec<bool, 8>``) without making that
    parameter undeducible for every type. Such instantiations are not type-checked here: the
    kernel's explicit instantiations with ``bool`` (and the calls :func:`_prepare` adds for
    them) are blanked, and the template is checked through its other instantiations."""
    cindex = _cindex()
    templates = set()
    for d in tu.diagnostics:
        if d.severity < cindex.Diagnostic.Error or _BOOL_VECTOR not in d.spelling:
            continue
        kernels = [m.group(1) for n in d.children
                   for m in [re.match(r"in instantiation of function template specialization '([\w:]+)<", n.spelling)]
                   if m]
        if kernels:
            templates.add(kernels[-1].split("::")[-1])  # the outermost: the kernel instantiated
    edits = []
    for name in templates:
        with_bool = name + r"\s*<[^;{}]*\bbool\b"
        for pattern in (r"inline void __tsm_instantiation_\d+\(\) \{[^{}]*\b" + with_bool + r"[^{}]*\}",
                        r"\btemplate\b[^;{}]*\b" + with_bool + r"[^;{}]*;"):
            edits += [(m.start(), m.end(), re.sub(r"[^\n]", " ", m.group()))
                      for m in re.finditer(pattern, text)]
    return edits


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


def diagnose(preprocessed: str, *, language_version: str, main_file: str = "<msl>") -> List[Diagnostic]:
    """Every error the check finds in ``preprocessed`` (see :func:`check`), in source order."""
    cindex = _cindex()
    version = language_version_number(language_version)
    prepared, tu, path = _parse(preprocessed, version, main_file)
    for _ in range(8):  # (an instantiation set aside may leave another template's the first)
        aside = _bool_vector_instantiations(tu, path, prepared.text)
        if not aside:
            break
        prepared.source.apply(aside)
        prepared, tu, path = _parse(preprocessed, version, main_file, prepared=prepared)
    out: List[Diagnostic] = []

    lines = preprocessed.splitlines()

    def add(location, message: str) -> None:
        file, line, column = presumed_location(location)
        physical = location.line if location.file is not None and location.file.name == path else 0
        out.append(Diagnostic(file, line, column, message,
                              lines[physical - 1] if 0 < physical <= len(lines) else ""))

    errors = [d for d in tu.diagnostics if d.severity >= cindex.Diagnostic.Error]
    not_metal = [_not_metal(d.spelling) or _constructs_a_constant_object(d) or _fails_by_thread_spaces_only(d)
                 for d in errors]
    # clang's error, though not Metal's, still makes the template specialisation it is in
    # invalid; calls of that specialisation then fail for no reason of Metal's.
    forgiven = {m.group(1) for d, skip in zip(errors, not_metal) if skip for n in d.children
                for m in [re.match(r"in instantiation of function template specialization '([\w:]+)<", n.spelling)]
                if m}
    for d, skip in zip(errors, not_metal):
        if skip:
            continue
        called = re.match(r"no matching function for call to '([\w:]+)'", d.spelling)
        if called and called.group(1).split("::")[-1] in {f.split("::")[-1] for f in forgiven} and \
                d.children and all("substitution failure" in n.spelling for n in d.children):
            continue
        location = d.location
        if location.file is None or location.file.name != path:
            # Inside Metal's library (a static_assert in a template, say): point at the
            # user's line that instantiated it.
            location = next((n.location for n in d.children
                             if n.location.file is not None and n.location.file.name == path), location)
        add(location, _explain(d.spelling))
    for offset, message in prepared.lints:
        file, line = _presumed_line(preprocessed, offset)
        physical = preprocessed.count("\n", 0, offset)
        out.append(Diagnostic(file, line, 0, message, lines[physical] if physical < len(lines) else ""))

    walker = _Walker(cindex, path, version)
    kernels = []
    functions = []
    for cursor in _user_declarations(tu, path):
        if cursor.kind in (cindex.CursorKind.VAR_DECL, cindex.CursorKind.FIELD_DECL):
            walker.check_variable(cursor)
            continue
        if cursor.kind in (cindex.CursorKind.CXX_METHOD, cindex.CursorKind.DESTRUCTOR) and cursor.is_virtual_method():
            # (clang's function-pointer extension, on for template arguments, allows them)
            add(cursor.location, f"Metal has no virtual functions (`{cursor.spelling}`)")
        if not cursor.is_definition():
            continue
        functions.append(cursor)
        walker.walk_function(cursor)
        if cursor.spelling in prepared.kernel_names:
            kernels.append(cursor)
    for cast, message in walker.found:
        add(cast.location, message)
    for kernel in kernels:
        for param in kernel.get_arguments():
            kind = _type_kind(param.type)
            if kind in ("Pointer", "LValueReference", "RValueReference") and \
                    _address_space(param.type) in (None, "__generic", "__private"):
                add(param.location, f"kernel {kernel.spelling}: pointer or reference parameter "
                                    f"`{param.spelling}` must be declared in the device, constant "
                                    f"or threadgroup address space")
    if version < 400:
        for lam in walker.lambdas:
            add(lam.location, f"Metal {language_version} has no lambda expressions (MSL 4.0 has them)")
    for expr in walker.new_delete:
        add(expr.location, "Metal has no new or delete (no dynamic allocation in a kernel)")
    for cycle_at in _recursive(walker.calls):
        cursor = next((f for f in functions if f.get_usr() == cycle_at), None)
        if cursor is not None:
            add(cursor.location, f"Metal does not support recursion: {cursor.spelling} calls itself "
                                 f"(directly or through other functions)")
    unique = sorted(set(out), key=lambda d: (d.file, d.line, d.column, d.message))
    return unique


def _user_declarations(tu, path: str):
    """Function definitions, variables outside functions and fields written in the user's
    file: a walk of its own declarations, into namespaces and classes, that never enters
    Metal's library (most of a small shader's AST)."""
    k = _cindex().CursorKind
    functions = (k.FUNCTION_DECL, k.CXX_METHOD, k.CONSTRUCTOR, k.FUNCTION_TEMPLATE,
                 k.CONVERSION_FUNCTION, k.DESTRUCTOR)
    scopes = (k.NAMESPACE, k.STRUCT_DECL, k.CLASS_DECL, k.UNION_DECL, k.CLASS_TEMPLATE,
              k.CLASS_TEMPLATE_PARTIAL_SPECIALIZATION, k.LINKAGE_SPEC, k.UNEXPOSED_DECL)
    stack = [c for c in reversed(list(tu.cursor.get_children()))
             if c.location.file is not None and c.location.file.name == path]
    while stack:
        cursor = stack.pop()
        if cursor.kind in functions:
            if cursor.is_definition() or (cursor.kind in (k.CXX_METHOD, k.DESTRUCTOR) and cursor.is_virtual_method()):
                yield cursor
        elif cursor.kind in (k.VAR_DECL, k.FIELD_DECL):
            yield cursor
        elif cursor.kind in scopes:
            stack.extend(c for c in reversed(list(cursor.get_children()))
                         if c.location.file is not None and c.location.file.name == path)


def _user_functions(tu, path: str):
    """The function definitions of :func:`_user_declarations`."""
    k = _cindex().CursorKind
    return (c for c in _user_declarations(tu, path)
            if c.kind not in (k.VAR_DECL, k.FIELD_DECL) and c.is_definition())


def _presumed_line(text: str, offset: int) -> Tuple[str, int]:
    """(file, line) of ``offset`` in preprocessed text, from its line markers."""
    file, line = "<source>", 0
    for text_line in text[:offset].splitlines(keepends=True)[:-1] if offset else []:
        m = re.match(r'#\s*(\d+)\s+"([^"]*)"', text_line)
        if m:
            file, line = m.group(2), int(m.group(1)) - 1
        else:
            line += 1
    return file, line + 1


def _recursive(calls: Dict[str, Set[str]]) -> List[str]:
    """Functions on a cycle of the call graph."""
    on_cycle = []
    for start in calls:
        stack, seen = list(calls.get(start, ())), set()
        while stack:
            f = stack.pop()
            if f == start:
                on_cycle.append(start)
                break
            if f in seen:
                continue
            seen.add(f)
            stack.extend(calls.get(f, ()))
    return on_cycle


# ---- what the emulator's C++ needs from the AST ------------------------------------------------

_DIVISIONS = {4: "div", 5: "rem", 24: "div_assign", 25: "rem_assign"}  # clang's CXBinaryOperatorKind
_INTEGERS = {"bool", "char", "signed char", "unsigned char", "short", "unsigned short", "int", "unsigned int",
             "long", "unsigned long", "long long", "unsigned long long"}


def emulator_edits(preprocessed: str, *, language_version: str, main_file: str = "<msl>",
                   kernels: Sequence["_rewrite.Kernel"] = (), regions: bool = True):
    """Edits of the emulator's view of a shader (offsets into ``preprocessed``) that give its
    C++ Metal's meaning where C++ differs, and how each of ``kernels`` runs (a
    ``_regions.Translation``):

    * every integer (or type-dependent) ``/``, ``%``, ``/=`` and ``%=`` becomes a call of
      ``tsm_emu::div``/``rem``/... (integer division by zero, and INT_MIN / -1, are undefined
      in Metal: the emulator gives one documented result on every architecture, and the
      sanitizer reports them);
    * every ``a * b`` of two simdgroup matrices becomes a call, a SIMD-group function with
      a site (see _matrix_products);
    * functions and member functions overloaded on address space (which the emulator's C++
      erases) get a name per overload, and each call the overload clang chose; constructors,
      conversion functions and operators, which have no name to call, keep one definition
      when the overloads' bodies are the same (MLX's pattern), and are an error otherwise;
    * array designators in local initialisers (``float s[N] = { [0 ... N-1] = 0 };``,
      which g++ has in C only) become calls after the declaration (see _designators);
    * program-scope ``constant`` arrays and structs are registered as regions for the
      checked pointers that point into them (see _program_constants);
    * with ``regions``, kernels whose only synchronisation is threadgroup barriers in their
      own bodies get a group function that runs a threadgroup as a loop (see _regions).
    """
    # (they build on this module)
    from . import _designators, _matrix_products, _program_constants, _regions, _thread_arrays
    cindex = _cindex()
    prepared, tu, path = _parse(preprocessed, language_version_number(language_version), main_file,
                                emulator=True)
    source = prepared.source
    edits = _address_space_overloads(tu, path, prepared, preprocessed)
    k = cindex.CursorKind
    found = _main_file_cursors(tu, path, (k.CALL_EXPR, k.CONDITIONAL_OPERATOR, k.UNEXPOSED_EXPR))
    edits += _void_pointer_conversions(found[k.CALL_EXPR], prepared, preprocessed)
    edits += _threadgroup_array_arguments(found[k.CALL_EXPR], prepared, preprocessed)
    edits += _thread_pointer_arguments(found[k.CALL_EXPR], found[k.UNEXPOSED_EXPR], prepared, preprocessed)
    edits += _threadgroup_reference_arguments(found[k.CALL_EXPR], prepared, preprocessed)
    edits += _bfloat_conditional_conversions(found[k.CONDITIONAL_OPERATOR], prepared, preprocessed)
    edits += _address_space_specialisations(tu, path, prepared, preprocessed)
    edits += _designators.edits(tu, path, source, preprocessed)
    edits += _program_constants.registrations(tu, path, source, preprocessed)
    edits += _program_constants.made_const(tu, path, source, preprocessed)
    kind_of = cindex.conf.lib.clang_getCursorBinaryOperatorKind
    binary = (cindex.CursorKind.BINARY_OPERATOR, cindex.CursorKind.COMPOUND_ASSIGNMENT_OPERATOR)
    openers: Dict[int, List[Tuple[int, str]]] = {}
    seen: Set[Tuple[int, int]] = set()  # a typedef'd anonymous struct is visited twice: itself, its typedef
    for top in tu.cursor.get_children():
        if top.location.file is None or top.location.file.name != path:
            continue
        for cursor in top.walk_preorder():
            product = _matrix_products.operands(cursor)
            span = (cursor.extent.start.offset, cursor.extent.end.offset)
            if product is not None:
                opener, operators = _matrix_products.LOWERED, ("*",)
                operands = list(product)
            elif cursor.kind in binary and kind_of(cursor) in _DIVISIONS and _integer_or_dependent(cursor.type):
                opener, operators = f"::tsm_emu::{_DIVISIONS[kind_of(cursor)]}(", ("/", "%", "/=", "%=")
                operands = list(cursor.get_children())
            else:
                continue
            if span in seen or len(operands) != 2:
                continue
            seen.add(span)
            lhs, rhs = operands
            lhs_end, rhs_start = lhs.extent.end.offset, rhs.extent.start.offset
            token = next((t for t in cursor.get_tokens()
                          if lhs_end <= t.extent.start.offset < rhs_start and t.spelling in operators), None)
            if token is None:
                continue
            start = source.original(lhs.extent.start.offset)
            end = source.original(rhs.extent.end.offset, end=True)
            if "__tsm" in preprocessed[start:end] or start >= end:
                continue
            o_start = source.original(token.extent.start.offset)
            o_end = source.original(token.extent.end.offset, end=True)
            if preprocessed[o_start:o_end] != token.spelling:
                # Text the check wrote itself, such as the two copies of a threadgroup
                # array's size in its declaration for clang: the emulator's C++ has the
                # declaration's own text, whose size is a constant expression (its `/`
                # needs no call: division by zero is a compile error there, as in Metal).
                continue
            openers.setdefault(start, []).append((end - start, opener))
            edits.append((o_start, o_end, ","))
            edits.append((end, end, ")"))
    # Nested divisions open at one offset: the outer call first.
    for offset, calls in openers.items():
        edits.append((offset, offset, "".join(text for _, text in sorted(calls, reverse=True))))
    edits += _thread_arrays.edits(tu, path, source, preprocessed)  # after the divisions: see there
    replaced = [(a, b) for a, b, _ in edits if a < b]
    # (a literal the check's view converts to double is in the emulator's own double code)
    doubles = {source.original(literal.extent.start.offset) for conversion in found[k.UNEXPOSED_EXPR]
               if conversion.type.get_canonical().spelling in ("double", "const double")
               for literal in [next(conversion.get_children(), None)]
               if literal is not None and literal.kind == k.FLOATING_LITERAL}
    edits += [e for e in _float_literals(preprocessed)
              if e[0] not in doubles and not any(a <= e[0] < b for a, b in replaced)]
    translation = _regions.plan(tu, path, prepared, preprocessed, edits, kernels, enabled=regions)
    translation.edits += edits
    return translation


def _float_literals(preprocessed: str) -> List[Tuple[int, int, str]]:
    """``0.1`` -> ``0.1f``: an unsuffixed floating literal is a float in Metal, which has no
    double (``auto s = 1.0 / n`` is a float, ``x * 0.1`` a float product, and
    ``precise::atan2(h, 1.0 + h)`` of a half h calls the float overload). A literal that is
    the whole operand of a conversion (``T(0.7978845608028654)``, ``static_cast<T>(0.5)``)
    keeps its digits: whatever T is, the value is the literal's rounded to T, also in the
    emulator's double instantiations. (The emulator's own double code, where the literal
    converts to double, is left out by the caller.)"""
    masked = _rewrite._mask_strings_and_directives(preprocessed)
    scopes = _template_scopes(masked)
    edits = []
    for m in _DOUBLE_LITERAL.finditer(masked):
        before, after = masked[max(0, m.start() - 200):m.start()], masked[m.end():m.end() + 8]
        conversion = re.search(r"(?:\b(\w+)|\bstatic_cast\s*<[^<>;]*>)\s*\(\s*[-+]?\s*$", before)
        if conversion and re.match(r"\s*\)", after):
            name = conversion.group(1)
            if name is None or name in _CONVERSION_TYPES or any(
                    name in names and a < m.start() < b for names, a, b in scopes):
                continue
        edits.append((m.start(), m.end(), m.group() + "f"))
    return edits


_CONVERSION_TYPES = {"float", "half", "bfloat", "double", "int", "uint", "short", "ushort", "char",
                     "uchar", "long", "ulong"}


def _integer_or_dependent(type_) -> bool:
    kind = _type_kind(type_)
    if kind == "Dependent":
        return True
    return _scalar_name(type_) in _INTEGERS


_AS_PATTERN = re.compile(r"\b__(global|local|constant|private|generic)\b")
_AS_TAGS = {"global": "d", "local": "tg", "constant": "c", "private": "t", "generic": "t"}
_MSL_AS_PATTERN = re.compile(r"\b(device|threadgroup|constant|thread|__global|__local|__constant|__private|__generic)\b")


def _address_space_overloads(tu, path: str, prepared: _Prepared, preprocessed: str
                             ) -> List[Tuple[int, int, str]]:
    """Edits that keep overloads differing only in address space apart once the emulator's
    C++ has erased address spaces (see :func:`emulator_edits`)."""
    k = _cindex().CursorKind
    functions = (k.FUNCTION_DECL, k.CXX_METHOD, k.CONSTRUCTOR, k.CONVERSION_FUNCTION, k.FUNCTION_TEMPLATE)
    source = prepared.source
    decls, refs = [], []
    for top in tu.cursor.get_children():
        if top.location.file is None or top.location.file.name != path:
            continue
        for cursor in top.walk_preorder():
            if cursor.kind in functions and not cursor.spelling.startswith("__tsm"):
                decls.append(cursor)
            elif cursor.kind in (k.DECL_REF_EXPR, k.MEMBER_REF_EXPR, k.OVERLOADED_DECL_REF):
                refs.append(cursor)
    groups: Dict[Tuple[str, str, str], Dict[int, List[object]]] = {}
    for d in decls:
        parent = d.semantic_parent
        # (clang marks a constructor defaulted on its first declaration `noexcept`, the
        # others not: candle's `Taus() thread = default; Taus() threadgroup = default;`)
        key = (parent.get_usr() if parent is not None else "", d.spelling,
               " ".join(_AS_PATTERN.sub("", d.type.spelling).replace("noexcept", "").split()))
        groups.setdefault(key, {}).setdefault(d.canonical.location.offset, []).append(d)
    edits: List[Tuple[int, int, str]] = []
    renamed: Dict[int, str] = {}  # canonical declaration offset -> new name
    for (_, name, _), overloads in groups.items():
        if len(overloads) < 2:
            continue
        tags_of = {canonical: "_".join(_AS_TAGS[m.group(1)] for m in _AS_PATTERN.finditer(
            redeclarations[0].type.spelling)) for canonical, redeclarations in overloads.items()}
        if len(set(tags_of.values())) < 2:
            # not overloads on address space: a template and its explicit specialisations, or
            # templates told apart by their constraints (c10's functors, `enable_if_t<...> = true`)
            continue
        first = next(iter(overloads.values()))[0]
        parent = first.semantic_parent
        # A class template's constructors are spelled with its parameters (`cx<T>`).
        constructor = first.kind == k.CONSTRUCTOR or (
            parent is not None and parent.kind in (k.STRUCT_DECL, k.CLASS_DECL, k.CLASS_TEMPLATE)
            and name.split("<", 1)[0] == parent.spelling)
        if constructor or name.startswith("operator"):
            edits += _keep_one_definition(name, overloads, source, preprocessed)
            continue
        for canonical, redeclarations in overloads.items():
            tags = tags_of[canonical]
            new_name = f"{name}__tsm_as_{tags}"
            renamed[canonical] = new_name
            for d in redeclarations:
                at = source.original(d.location.offset)
                edits.append((at, at + len(name), new_name))
    if not renamed:
        return edits
    for ref in refs:
        target = ref.referenced
        if target is None:
            if ref.kind == k.OVERLOADED_DECL_REF and any(
                    n.rsplit("__tsm_as_", 1)[0] == ref.spelling for n in renamed.values()):
                raise _emulator_limit(ref, f"the call of {ref.spelling}, overloaded on address space, "
                                           f"depends on template parameters; the emulator resolves "
                                           f"such overloads only where the arguments' types are known")
            continue
        template = _cindex().conf.lib.clang_getSpecializedCursorTemplate(target)
        if template is not None and not template.kind.is_invalid():
            target = template
        new_name = renamed.get(target.canonical.location.offset)
        if new_name and ref.spelling == new_name.rsplit("__tsm_as_", 1)[0]:
            at = source.original(ref.location.offset)
            if preprocessed.startswith(ref.spelling, at):
                edits.append((at, at + len(ref.spelling), new_name))
    return edits


_MSL_SPACES = {"__global": "device", "__constant": "constant", "__local": "threadgroup"}
_FLOATING_SPELLINGS = {"__bf16": "bfloat", "_Float16": "half", "float": "float"}


def _main_file_cursors(tu, path: str, kinds) -> Dict[object, List[object]]:
    """The cursors of each of ``kinds`` in the declarations of the file clang knows as
    ``path``, found in one walk."""
    found: Dict[object, List[object]] = {kind: [] for kind in kinds}
    for top in tu.cursor.get_children():
        if top.location.file is not None and top.location.file.name == path:
            for c in top.walk_preorder():
                if c.kind in found:
                    found[c.kind].append(c)
    return found


def _wrap(expression, opener: str, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
    """Edits that enclose ``expression`` in ``opener`` ... ``)`` (a cast, a call), unless
    it is not the user's text or holds the check's own."""
    start = prepared.source.original(expression.extent.start.offset)
    end = prepared.source.original(expression.extent.end.offset, end=True)
    if start >= end or "__tsm" in preprocessed[start:end]:
        return []
    return [(start, start, opener), (end, end, ")")]


def _cast(expression, to: str, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
    """Edits that write clang's implicit conversion of ``expression`` to ``to`` as a cast."""
    return _wrap(expression, f"static_cast<{to}>(", prepared, preprocessed)


def _void_pointer_conversions(calls, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
    """An argument converted implicitly to a ``device``, ``constant`` or ``threadgroup``
    void pointer is converted by a cast the emulator's C++ sees. There every pointer
    converts to both ``ptr<void>`` and ``ptr<const void>`` by a constructor, so overloads on
    the address space of a void pointer (PyTorch's ``val_at_offs(constant void*, long)``
    and ``(device void*, long)``) would be ambiguous for a ``device float*``; the cast makes
    the argument the parameter's type exactly, as clang chose it."""
    k = _cindex().CursorKind
    edits: List[Tuple[int, int, str]] = []
    for call in calls:
        if call.referenced is None:
            continue
        for argument in call.get_arguments():
            to = re.fullmatch(r"((?:const )?)(__global|__constant|__local) void \*", argument.type.spelling)
            inner = next(argument.get_children(), None)
            if argument.kind == k.UNEXPOSED_EXPR and to is not None and inner is not None \
                    and "*" in inner.type.spelling and " void *" not in inner.type.spelling:
                edits += _cast(argument, f"{to.group(1)}{_MSL_SPACES[to.group(2)]} void*", prepared, preprocessed)
    return edits


def _threadgroup_array_arguments(calls, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
    """A threadgroup array passed whole to a function decays to a pointer, ``tsm_emu::decayed``
    in the emulator's C++, where the array is an object (tsm_emu/sanitize.h's tg_var):
    a template parameter ``Ptr`` deduces the pointer from ``f(tile, tile + n)`` as in Metal
    (PyTorch's Sort.metal ``merge_partition``), not the array object. An argument clang
    binds without the decay (to a reference to the array) is left alone. In a call that
    depends on a template parameter clang shows no decay; the array is decayed there all
    the same (none of MLX's, ggml's or PyTorch's kernels binds a threadgroup array to a
    reference parameter; if one did, the emulator's build would reject it, not miscompute)."""
    k = _cindex().CursorKind
    edits: List[Tuple[int, int, str]] = []
    for call in calls:
        for argument in call.get_arguments():
            decays = argument.kind == k.UNEXPOSED_EXPR and _type_kind(argument.type) == "Pointer"
            named = next(argument.get_children(), None) if decays else argument
            if named is None or named.kind != k.DECL_REF_EXPR or (call.referenced is not None and not decays):
                continue
            variable = named.referenced
            if variable is None or variable.kind != k.VAR_DECL:
                continue
            array = variable.type  # (the check declares threadgroup arrays as references to them)
            if _type_kind(array) == "LValueReference":
                array = array.get_pointee()
            if _address_space(array) != "__local" or _type_kind(array) not in ("ConstantArray",
                                                                               "DependentSizedArray"):
                continue
            start = prepared.source.original(named.extent.start.offset)
            end = prepared.source.original(named.extent.end.offset, end=True)
            # the whole argument, not an operand of one (`tile + n`: a call in a template)
            if preprocessed[start:end] == variable.spelling and \
                    preprocessed[:start].rstrip().endswith(("(", ",")) and \
                    preprocessed[end:].lstrip().startswith((")", ",")):
                edits += [(start, start, "::tsm_emu::decayed("), (end, end, ")")]
    return edits


def _thread_pointer_arguments(calls, unexposed, prepared: _Prepared, preprocessed: str
                              ) -> List[Tuple[int, int, str]]:
    """A thread pointer passed to a function template's parameter ``A* p`` (``thread A*``),
    whose pointee names a template parameter: the emulator's C++ keeps such a parameter a
    raw pointer, which a call deduces ``A`` from (see _rewrite._thread_pointers), while a
    ``thread T*`` variable is a bounds-carrying ``thread_ptr<T>``, from which nothing deduces.
    The argument becomes ``tsm_emu::raw_thread_pointer(p)``: the raw pointer, unchecked past
    the call as the parameter is. Calls of ``calls`` and the calls among ``unexposed`` that
    clang could not resolve (``f(p, 1.0f)`` deducing ``A`` as ``__private float`` from the one
    and ``float`` from the other, which the check forgives: both are Metal's thread) are
    edited; a call in a template, whose callee clang leaves unresolved, is not."""
    k = _cindex().CursorKind
    lib = _cindex().conf.lib
    edits: List[Tuple[int, int, str]] = []

    def pointer_parameters(template) -> Set[int]:
        parameters = [c for c in template.get_children() if c.kind == k.PARM_DECL]
        return {i for i, p in enumerate(parameters) if _type_kind(p.type) == "Pointer"
                and "type-parameter" in p.type.get_pointee().get_canonical().spelling}

    sites = []  # (the positions of template pointer parameters, the arguments)
    for call in calls:
        callee = call.referenced
        if callee is not None and callee.kind in (k.FUNCTION_DECL, k.CXX_METHOD):
            pattern = lib.clang_getSpecializedCursorTemplate(callee)
            if pattern is not None and pattern.kind == k.FUNCTION_TEMPLATE:
                sites.append((pointer_parameters(pattern), list(call.get_arguments())))
    for expression in unexposed:  # (a call clang recovered from: the callee's name, then the arguments)
        children = list(expression.get_children())
        name = next(children[0].get_children(), None) if children and children[0].kind == k.DECL_REF_EXPR else None
        if name is None or name.kind != k.OVERLOADED_DECL_REF:
            continue
        candidates = [lib.clang_getOverloadedDecl(name, i) for i in range(lib.clang_getNumOverloadedDecls(name))]
        positions = set().union(*(pointer_parameters(c) for c in candidates if c.kind == k.FUNCTION_TEMPLATE))
        sites.append((positions, children[1:]))
    for positions, arguments in sites:
        for i in sorted(positions):
            if i < len(arguments) and _type_kind(arguments[i].type) == "Pointer" and \
                    _address_space(arguments[i].type) in (None, "__private", "__generic"):
                edits += _wrap(arguments[i], "::tsm_emu::raw_thread_pointer(", prepared, preprocessed)
    return edits


def _threadgroup_reference_arguments(calls, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
    """A threadgroup scalar bound to a ``threadgroup T&`` parameter
    (``fin(total, ...)`` with ``threadgroup MD& total``: candle's softmax) is passed by
    address, which is no access: ``tsm_emu::reference_argument(total)``, which the
    rewriter makes the variable's checked pointer (a use of it elsewhere is a checked
    read). Without it the sanitizer saw every thread read the variable at the call, a race
    with the one thread that then writes it."""
    k = _cindex().CursorKind
    edits: List[Tuple[int, int, str]] = []
    for call in calls:
        callee = call.referenced
        if callee is None or callee.kind not in (k.FUNCTION_DECL, k.CXX_METHOD):
            continue
        for parameter, argument in zip(callee.get_arguments(), call.get_arguments()):
            if _type_kind(parameter.type) != "LValueReference" or _address_space(parameter.type) != "__local":
                continue
            named = _strip_to_reference(argument)
            variable = named.referenced if named is not None and named.kind == k.DECL_REF_EXPR else None
            if variable is None or variable.kind != k.VAR_DECL or _address_space(variable.type) != "__local":
                continue
            declared = variable.type  # (the check declares a threadgroup variable as a reference to it)
            if _type_kind(declared) == "LValueReference":
                declared = declared.get_pointee()
            if _type_kind(declared) not in ("ConstantArray", "DependentSizedArray", "Pointer"):
                edits += _wrap(named, "::tsm_emu::reference_argument(", prepared, preprocessed)
    return edits


def _bfloat_conditional_conversions(conditionals, prepared: _Prepared, preprocessed: str
                                    ) -> List[Tuple[int, int, str]]:
    """``c ? n : x`` with a bfloat and another arithmetic operand (PyTorch's GridSampler3D:
    a ``long`` and a ``bfloat``) has the type the usual arithmetic conversions give, as in
    C++ (an integer with a floating type converts to that type: ``bfloat`` here). The
    emulator's bfloat is a class, which converts to and from the other operand's type, so
    g++ finds both conversions and rejects the expression: the operand clang converted is
    converted by a cast the emulator's C++ sees.

    In a template (GridSampler3D's ``clip_coordinates<T>``: ``coord < 0 ? 0 : coord``;
    UnaryKernel's ``isnan(x) ? x : x < 0 ? M_PI_F : 0.0``) an arithmetic operand beside one
    of a template parameter's type ``T``, and that one, each become
    ``tsm_emu::conditional_operand<O>(...)`` of the other's type ``O``: converted to the
    type Metal's conversions give the pair when one is a bfloat (an integer to bfloat, a
    bfloat beside a float to float), themselves otherwise."""
    k = _cindex().CursorKind
    edits: List[Tuple[int, int, str]] = []
    for conditional in conditionals:
        operands = list(conditional.get_children())[1:]
        if len(operands) == 2 and _type_kind(conditional.type) == "Dependent":
            for operand, other in (operands, operands[::-1]):
                parameter = _template_parameter_type(other, k)
                scalar = _arithmetic_type(operand, k)
                if parameter and scalar:
                    edits += _wrap(operand, f"::tsm_emu::conditional_operand<{parameter}>(", prepared, preprocessed)
                    edits += _wrap(other, f"::tsm_emu::conditional_operand<{scalar}>(", prepared, preprocessed)
            continue
        result = _FLOATING_SPELLINGS.get(conditional.type.get_canonical().spelling)
        inner = [next(o.get_children(), None) if o.kind == k.UNEXPOSED_EXPR else o for o in operands]
        if result is None or len(operands) != 2 or any(i is None for i in inner) or not any(
                "__bf16" in i.type.get_canonical().spelling for i in inner):
            continue
        for operand, converted in zip(operands, inner):
            if operand.kind == k.UNEXPOSED_EXPR and _scalar_name(converted.type) != _scalar_name(operand.type):
                edits += _cast(operand, result, prepared, preprocessed)
    return edits


def _arithmetic_type(expression, k) -> Optional[str]:
    """The arithmetic type of ``expression``, also of a conditional whose condition alone
    depends on a template parameter (``x < 0 ? M_PI_F : 0.0``), or None."""
    while expression.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR):
        expression = next(expression.get_children(), None)
        if expression is None:
            return None
    if expression.kind == k.CONDITIONAL_OPERATOR and _type_kind(expression.type) == "Dependent":
        arms = {_arithmetic_type(a, k) for a in list(expression.get_children())[1:]}
        return arms.pop() if len(arms) == 1 else None
    scalar = _scalar_name(expression.type)
    return _FLOATING_SPELLINGS.get(scalar, scalar if scalar in _INTEGERS else None)


def _template_parameter_type(expression, k) -> Optional[str]:
    """The name of the template type parameter that is ``expression``'s type (through
    parentheses and the operands of a conditional), or None."""
    while expression.kind in (k.UNEXPOSED_EXPR, k.PAREN_EXPR):
        expression = next(expression.get_children(), None)
        if expression is None:
            return None
    if expression.kind == k.CONDITIONAL_OPERATOR:
        arms = list(expression.get_children())[1:]
        return next((n for n in (_template_parameter_type(a, k) for a in arms) if n), None)
    # (libclang shows no declaration for such a type: its canonical spelling says what it is)
    if not re.fullmatch(r"(?:(?:const|volatile|__\w+) )*type-parameter-\d+-\d+",
                        expression.type.get_canonical().spelling):
        return None
    name = re.fullmatch(r"(?:(?:const|volatile|__\w+) )*(\w+)", expression.type.spelling)
    return name.group(1) if name else None


def _address_space_specialisations(tu, path: str, prepared: _Prepared, preprocessed: str
                                   ) -> List[Tuple[int, int, str]]:
    """Specialisations of a class template for pointers that differ only in address spaces
    the emulator erases (MLX's ``pointer_element<device T*>`` and ``<threadgroup T*>``, both
    ``tsm_emu::ptr<T>`` there) keep one definition when their bodies agree."""
    k = _cindex().CursorKind
    specialisation = _cindex().conf.lib.clang_getSpecializedCursorTemplate
    groups: Dict[Tuple[str, str], Dict[int, List[object]]] = {}
    for cursor in tu.cursor.walk_preorder():
        if cursor.location.file is None or cursor.location.file.name != path or not cursor.is_definition():
            continue
        partial = cursor.kind == k.CLASS_TEMPLATE_PARTIAL_SPECIALIZATION
        if not partial and not (cursor.kind in (k.STRUCT_DECL, k.CLASS_DECL) and "<" in cursor.displayname
                                and not specialisation(cursor).kind.is_invalid()):
            continue
        # device, threadgroup and constant pointers are all checked pointers; a `constant`
        # one is const in clang's spelling as in the emulator's.
        arguments = re.sub(r"\b__(global|local|constant)\b", "__checked", cursor.displayname)
        parent = cursor.semantic_parent
        key = (parent.get_usr() if parent is not None else "", arguments)
        groups.setdefault(key, {}).setdefault(cursor.location.offset, []).append(cursor)
    edits: List[Tuple[int, int, str]] = []
    for specialisations in groups.values():
        if len(specialisations) > 1:
            name = next(iter(specialisations.values()))[0].displayname
            edits += _keep_one_definition(name, specialisations, prepared.source, preprocessed)
    return edits


_METHOD_KINDS = ("CXX_METHOD", "CONSTRUCTOR", "CONVERSION_FUNCTION", "DESTRUCTOR")


def _keep_one_definition(name: str, overloads: Dict[int, List[object]], source: _Text,
                         preprocessed: str) -> List[Tuple[int, int, str]]:
    """Overloads the emulator cannot name apart: identical bodies collapse to the first
    (defaulted ones too: candle's ``constexpr RMS<T>() = default;`` and ``... threadgroup =
    default;``, which libclang does not count as definitions in a class template)."""
    definitions = [d for redeclarations in overloads.values() for d in redeclarations
                   if d.is_definition() or (d.kind.name in _METHOD_KINDS and d.is_default_method())]
    spans = [(source.original(d.extent.start.offset), source.original(d.extent.end.offset, end=True))
             for d in definitions]
    bodies = {" ".join(_MSL_AS_PATTERN.sub("", preprocessed[a:b]).split()) for a, b in spans}
    if len(bodies) > 1:
        raise _emulator_limit(definitions[0], f"{name} is overloaded on address space with different "
                                              f"bodies; the emulator, which has one address space, "
                                              f"can run such overloads only when their bodies agree")
    return [(a, b, _rewrite.blank(preprocessed[a:b])) for a, b in spans[1:]]


def _emulator_limit(cursor, message: str) -> MetalCompileError:
    file, line, _ = presumed_location(cursor.location)
    return MetalCompileError.from_diagnostics("the emulator cannot compile this shader",
                                              [(file, line, message, "")])


# clang's CXBinaryOperatorKind and CXUnaryOperatorKind, as the AST walks compare them.
ASSIGNMENT_OPERATORS = frozenset(range(22, 33))  # = *= /= %= += -= <<= >>= &= ^= |=
LOGICAL_OPERATORS = frozenset((20, 21))          # && ||
COMMA_OPERATOR = 33
INC_DEC_OPERATORS = frozenset((1, 2, 3, 4))      # x++ x-- ++x --x
ADDRESS_OF, DEREFERENCE = 5, 6                   # &x *p
# The name of an operator that modifies its first operand, as a template leaves it unresolved.
MODIFYING_OPERATOR = re.compile(r"operator(?:[-+*/%^&|]|<<|>>)?=|operator(?:\+\+|--)")


def dependent_operator(call) -> Optional[Tuple[str, int]]:
    """An operator a template's dependent types leave unresolved: its name and operand
    count (``operator*`` of one operand is a dereference, of two a product)."""
    if call.referenced is not None or call.spelling:
        return None
    kids = list(call.get_children())
    for c in kids:
        names = [d.spelling for d in c.walk_preorder() if d.kind.name == "OVERLOADED_DECL_REF"]
        if c.kind.name in ("DECL_REF_EXPR", "UNEXPOSED_EXPR") and names and names[0].startswith("operator"):
            return names[0], len(kids) - 1
    return None
