"""Metal Shading Language read as text: the parse layer's half that needs no clang.

Layer: parse, the translator's bottom (the layers are in the package's docstring).
Imports nothing of the translator. What every pass reads the preprocessed source with: strings and directives
masked, brackets matched, statements and function definitions found, and the kernels with
their parameters' bindings (:func:`find_kernels`).

It knows the shape of declarations, not the C++ grammar: what it cannot parse it reports
as a :class:`ParseError` at an offset, which the compiler turns into an error naming the
line, rather than guessing.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .._binding import (MAX_SAMPLERS, MAX_TEXTURES, P_ABSENT, P_BUFFER, P_BUILTIN, P_SAMPLER,  # noqa: F401
                        P_TEXTURE, P_THREADGROUP)
from .._paths import EMULATOR_INCLUDE_DIR

BUILTINS = (
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid",
    "threads_per_threadgroup", "dispatch_threads_per_threadgroup", "threadgroups_per_grid",
    "threads_per_grid", "thread_index_in_threadgroup", "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup", "threads_per_simdgroup", "thread_execution_width",
    "simdgroups_per_threadgroup", "dispatch_simdgroups_per_threadgroup",
    "thread_index_in_quadgroup", "quadgroup_index_in_threadgroup", "quadgroups_per_threadgroup",
    "dispatch_quadgroups_per_threadgroup",
    # The stage-in region's origin and size: a dispatch here has no stage-in region of its
    # own, so the whole grid (SPIRV-Cross's spvDispatchBase [[grid_origin]]).
    "grid_origin", "grid_size",
)


class ParseError(Exception):
    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.offset = offset


@dataclass
class Param:
    text: str
    kind: int
    index: int  # buffer / threadgroup index, or position in BUILTINS

    @property
    def builtin(self) -> Optional[str]:
        return BUILTINS[self.index] if self.kind == P_BUILTIN else None


@dataclass
class Kernel:
    host_name: str
    cxx: str  # expression naming the C++ function (e.g. ``f<float>``)
    params: List[Param] = field(default_factory=list)
    # An instantiation that names no template arguments (MLX's `template [[kernel]] void
    # f(const device float* in, ...);`), or of one of several templates of one name
    # (PyTorch's `fused_sgd`): its parameter list, which selects the function.
    signature: Optional[str] = None
    namespace: str = ""  # the namespaces an instantiation is in (`a::b`), where its arguments are named


_ATTRIBUTE = re.compile(r"\[\[(?:[^\[\]]|\[[^\[\]]*\])*?\]\]")
# `[[kernel]]`, also with other attributes in the same list
# (`[[kernel, max_total_threads_per_threadgroup(256)]]`, MLX's spelling), or `kernel`.
_KERNEL_MARK = re.compile(r"\[\[\s*kernel\s*(?:,(?:[^\[\]]|\[[^\[\]]*\])*)?\]\]|\bkernel\b")
# host_name("fill_" "float32"): adjacent literals concatenate, as MLX's "fill_" #tname makes.
_HOST_NAME = re.compile(r'host_name\s*\(\s*((?:"[^"]*"\s*)+)\)')
_SYNC_CALL = re.compile(r"\b(threadgroup_barrier|simdgroup_barrier|simdgroup_multiply\w*|simd_\w+|quad_\w+)\s*\(")


def blank(text: str) -> str:
    """Spaces for ``text``, keeping its newlines so line numbers stay right."""
    return re.sub(r"[^\n]", " ", text)


def _mask_strings_and_directives(src: str) -> str:
    """Same length as ``src``, with string literals and ``#`` lines blanked, for searching."""
    out = re.sub(r'"(?:\\.|[^"\\\n])*"', lambda m: '"' + " " * (len(m.group()) - 2) + '"', src)
    return re.sub(r"(?m)^[ \t]*#.*$", lambda m: " " * len(m.group()), out)


def _match_close(text: str, start: int, open_ch: str, close_ch: str) -> int:
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i
    raise ParseError(f"unbalanced {open_ch}{close_ch}", start)


def _match_open(text: str, close: int) -> int:
    """The offset of the "(" matching the ")" at ``close`` (-1 if there is none)."""
    depth = 0
    for i in range(close, -1, -1):
        if text[i] == ")":
            depth += 1
        elif text[i] == "(":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _split_top_level(text: str) -> List[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def declarator(declaration: str) -> str:
    """``declaration`` without its initialiser: up to the first ``=`` outside brackets that
    is an assignment (MLX's gemv sizes an array ``[n == 0 ? 1 : n]``)."""
    depth = 0
    for i, c in enumerate(declaration):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(c, 0)
        if c == "=" and depth == 0 and declaration[i - 1:i] not in ("=", "!", "<", ">") \
                and declaration[i + 1:i + 2] != "=":
            return declaration[:i]
    return declaration


def _param_attributes(piece: str) -> List[Tuple[str, str]]:
    """(name, argument) of every entry of a parameter's attribute lists:
    ``[[buffer(5), function_constant(has_mask)]]`` -> [("buffer", "5"), ("function_constant", "has_mask")]."""
    entries = []
    for attribute in _ATTRIBUTE.findall(piece):
        for entry in _split_top_level(attribute[2:-2]):
            m = re.fullmatch(r"\s*(\w+)\s*(?:\((.*)\))?\s*", entry, re.S)
            if m:
                entries.append((m.group(1), (m.group(2) or "").strip()))
    return entries


# The highest index of each of a kernel's argument tables: Apple's compiler rejects
# [[buffer(31)]] with "'buffer' attribute parameter is out of bounds: must be between 0 and
# 30" (31 buffer and threadgroup slots; Metal's feature set tables list 31 buffers, 128
# textures and 16 samplers per stage on macOS).
MAX_BINDING_INDEX = 30
MAX_INDEX = {"buffer": MAX_BINDING_INDEX, "threadgroup": MAX_BINDING_INDEX,
             "texture": MAX_TEXTURES - 1, "sampler": MAX_SAMPLERS - 1}
# A parameter of a texture or sampler type, which takes a slot of those tables.
TEXTURE_TYPE = re.compile(r"\b(?:texture(?:1d|1d_array|2d|2d_array|3d|cube|cube_array|2d_ms|2d_ms_array|_buffer)"
                          r"|depth(?:2d|2d_array|cube|cube_array|2d_ms|2d_ms_array))\s*<")
SAMPLER_TYPE = re.compile(r"^(?:const\s+)?(?:metal::)?sampler\b")


def _check_binding(kernel: str, table: str, index: int, piece: str,
                   explicit: Dict[Tuple[str, int], str], offset: int) -> None:
    """A ``[[buffer(n)]]``, ``[[threadgroup(n)]]``, ``[[texture(n)]]`` or ``[[sampler(n)]]``
    within its table and not already taken by another parameter's attribute, as Apple's
    compiler requires."""
    if index > MAX_INDEX[table]:
        raise ParseError(f"kernel {kernel}: '{table}' attribute parameter is out of bounds: must "
                         f"be between 0 and {MAX_INDEX[table]} (parameter `{piece}`)", offset)
    if (table, index) in explicit:
        raise ParseError(f"kernel {kernel}: cannot reserve '{table}' resource location at index "
                         f"{index}: parameters `{explicit[table, index]}` and `{piece}` both ask "
                         "for it", offset)
    explicit[table, index] = piece


def _parse_params(text: str, offset: int, kernel: str) -> List[Param]:
    params: List[Param] = []
    explicit: Dict[Tuple[str, int], str] = {}  # (table, index) -> the parameter bound there
    next_buffer = next_tg = next_texture = next_sampler = 0
    for raw in _split_top_level(text):
        piece = " ".join(raw.split())
        if not piece or piece == "void":
            continue
        attrs = _param_attributes(piece)
        # [[function_constant(b)]] on a parameter: it exists only when b is true. The
        # function-constant pass has already put b's value there (true or false).
        if ("function_constant", "false") in attrs:
            params.append(Param(piece, P_ABSENT, 0))
            continue
        # [[user(name)]] names a stage's input or output; on a kernel's buffer Apple's compiler
        # ignores it (SPIRV-Cross writes it there).
        attrs = [a for a in attrs if a != ("function_constant", "true") and a[0] != "user"]
        attr = attrs[0] if attrs else None
        if attr is None:
            if TEXTURE_TYPE.search(piece):
                params.append(Param(piece, P_TEXTURE, next_texture))
                next_texture += 1
            elif SAMPLER_TYPE.search(piece):
                params.append(Param(piece, P_SAMPLER, next_sampler))
                next_sampler += 1
            elif re.search(r"\bthreadgroup\b", piece):
                params.append(Param(piece, P_THREADGROUP, next_tg))
                next_tg += 1
            else:
                params.append(Param(piece, P_BUFFER, next_buffer))
                next_buffer += 1
            continue
        name, idx = attr
        if name in MAX_INDEX and idx.isdigit():
            _check_binding(kernel, name, int(idx), piece, explicit, offset)
        if len(attrs) > 1 or (name in MAX_INDEX and not idx.isdigit()) or \
                (name in BUILTINS and idx):
            raise ParseError(f"kernel {kernel}: parameter attributes {' '.join(_ATTRIBUTE.findall(piece))} "
                             f"are not supported by the emulator (parameter `{piece}`)", offset)
        if name == "buffer":
            params.append(Param(piece, P_BUFFER, int(idx)))
            next_buffer = int(idx) + 1
        elif name == "threadgroup":
            params.append(Param(piece, P_THREADGROUP, int(idx)))
            next_tg = int(idx) + 1
        elif name == "texture":
            params.append(Param(piece, P_TEXTURE, int(idx)))
            next_texture = int(idx) + 1
        elif name == "sampler":
            params.append(Param(piece, P_SAMPLER, int(idx)))
            next_sampler = int(idx) + 1
        elif name in BUILTINS:
            params.append(Param(piece, P_BUILTIN, BUILTINS.index(name)))
        else:
            raise ParseError(f"kernel {kernel}: parameter attribute [[{name}]] is not supported "
                             f"by the emulator (parameter `{piece}`)", offset)
    return params


def _head_start(masked: str, pos: int) -> int:
    """Start of the declaration that contains ``pos`` (after the previous ; { or })."""
    i = pos
    while i > 0 and masked[i - 1] not in ";{}":
        i -= 1
    return i


def _overload_instantiated(overloads: List[List[Param]], params: Optional[List[Param]], host_name: str,
                           offset: int) -> List[Param]:
    """The parameters of the template kernel, among ``overloads`` of one name, that an
    instantiation's parameter list ``params`` names (PyTorch's two ``fused_sgd`` templates,
    with and without momentum): the one with as many parameters, bound alike."""
    def binding(o: List[Param]):
        return [(p.kind, p.index) for p in o]

    if params is None:
        fitting = overloads
    else:
        fitting = [o for o in overloads if len(o) == len(params)]
        if len(fitting) > 1:
            fitting = [o for o in fitting if all(a.kind == b.kind for a, b in zip(o, params))]
    # Templates bound alike need no choosing (MLX's two `block_masked_gemm`, instantiated
    # through decltype).
    if fitting and all(binding(o) == binding(fitting[0]) for o in fitting):
        return fitting[0]
    if len(fitting) != 1:
        raise ParseError(f"instantiation {host_name!r}: cannot tell which of {len(overloads)} template "
                         f"kernels of that name its parameter list names", offset)
    return fitting[0]


def find_kernels(src: str) -> List[Kernel]:
    masked = _mask_strings_and_directives(src)
    # The same length, attributes blanked too: what follows a kernel mark, read once.
    unattributed = _ATTRIBUTE.sub(lambda m: blank(m.group()), masked)
    templates: Dict[str, List[List[Param]]] = {}  # name -> params of each template kernel so named
    instantiations: List[Tuple[str, str, str, int, Optional[List[Param]], Optional[str], bool]] = []
    kernels: List[Kernel] = []
    defined: Dict[str, int] = {}  # plain kernel -> its index in kernels
    prototype_names: Dict[str, str] = {}  # plain kernel -> the host name a prototype gives it
    for mark in _KERNEL_MARK.finditer(masked):
        head_start = _head_start(masked, mark.start())
        head = src[head_start:mark.start()]
        host = _HOST_NAME.search(head) or _HOST_NAME.match(src[mark.end():mark.end() + 4096].lstrip())
        host_name = "".join(re.findall(r'"([^"]*)"', host.group(1))) if host else None
        head_masked = masked[head_start:mark.start()]
        tail = unattributed[mark.end():]
        # `template [[host_name("n")]] kernel decltype(f<T>) f<T>;` (MLX), or with a typedef
        # of the function type: `typedef decltype(f<T>) f_t; ... kernel f_t f<T>;` (ggml).
        # (template arguments may hold a cast: candle's `decltype(gemv<T, ..., (bool)nc>)`)
        m_decltype = re.match(r"\s*(?:decltype\s*\(\s*((?:[^()]|\([^()]*\))*?)\s*\)|(?!void\b)[\w:]+)\s*"
                              r"([\w:]+\s*<[^;]*?>)\s*;", tail)
        # A qualified name may have spaces around `::` (PyTorch's instantiation macros).
        # `void kernel f(` is as valid as `kernel void f(` (PyTorch's SpecialOps.metal); template
        # arguments may hold a call (`<T, simdgroups(BM) / 2>`, PyTorch's GroupedMM.metal).
        void_first = re.search(r"\bvoid\s*$", head_masked) is not None
        m_func = re.match(r"\s*" + ("" if void_first else r"void\s+") +
                          r"((?:::\s*)?\w+(?:\s*::\s*\w+)*)\s*(<(?:[^();<>]|\([^()]*\)|<(?:[^();<>]|<[^<>();]*>)*>)*>)?\s*\(",
                          tail)
        is_instantiation = re.match(r"\s*template\b(?!\s*<)", head_masked) is not None
        is_template = re.match(r"\s*template\s*<", head_masked) is not None
        if m_decltype and is_instantiation:
            name = re.sub(r"\s+", "", m_decltype.group(2))
            base = name.split("<", 1)[0]
            instantiations.append((host_name or name, base, name, mark.start(), None, None, True))
            continue
        if not m_func:
            raise ParseError("cannot parse the kernel declaration after `kernel`", mark.start())
        name = re.sub(r"\s+", "", m_func.group(1))
        targs = re.sub(r"\s+", "", m_func.group(2) or "")
        open_paren = mark.end() + m_func.end() - 1
        close_paren = _match_close(masked, open_paren, "(", ")")
        params = _parse_params(src[open_paren + 1:close_paren], open_paren, name)
        if is_template:
            templates.setdefault(name, []).append(params)
        elif is_instantiation or targs:
            instantiations.append((host_name or name + targs, name, name + targs, mark.start(), params,
                                   src[open_paren + 1:close_paren], bool(targs)))
        elif re.match(r"\s*;", unattributed[close_paren + 1:]):
            # A prototype of a kernel defined elsewhere in the file, which may name it
            # (PyTorch's Indexing.metal: `[[host_name("f")]] kernel void f(device bool*, ...);`).
            if host_name:
                prototype_names[name] = host_name
        else:
            defined[name] = len(kernels)
            kernels.append(Kernel(host_name or name, name, params))
    for name, host_name in prototype_names.items():
        if name in defined:
            kernels[defined[name]].host_name = host_name
    namespaces = namespace_blocks(masked) if instantiations else []
    for host_name, base, cxx, offset, params, signature, targs in instantiations:
        if base not in templates and "::" in base:  # `ns::f<T>` of `f` defined in namespace ns
            base = base.rsplit("::", 1)[-1]
        overloads = templates.get(base, [])
        if overloads:
            # The parameters' bindings are the template's: an instantiation that repeats
            # the parameter list need not repeat its attributes (PyTorch's Repeat.metal).
            params = _overload_instantiated(overloads, params, host_name, offset)
        elif params is None:
            raise ParseError(f"instantiation {host_name!r} of {base!r}: no template kernel "
                             f"named {base!r} is defined before it", offset)
        if targs and len(overloads) < 2:
            signature = None  # its template arguments alone name the function
        kernels.append(Kernel(host_name, cxx, params, signature,
                              "::".join(n for n, a, b in namespaces if n and a < offset < b)))
    seen = set()
    for k in kernels:
        if k.host_name in seen:
            raise ParseError(f"two kernels are named {k.host_name!r}", 0)
        seen.add(k.host_name)
    return kernels


_TYPE = (r"(?:unsigned\s+\w+|(?:::\s*)?[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*(?:\s*<[^<>;{}()]*(?:<[^<>;{}()]*>[^<>;{}()]*)*>)?)")


def _block_end(masked: str, pos: int) -> int:
    """Offset of the ``}`` closing the block that contains ``pos``."""
    depth = 0
    for i in range(pos, len(masked)):
        c = masked[i]
        if c == "{":
            depth += 1
        elif c == "}":
            if depth == 0:
                return i
            depth -= 1
    return len(masked)


def _apply(src: str, edits: List[Tuple[int, int, str]]) -> str:
    """Replace [start, end) spans of ``src`` (non-overlapping) with new text."""
    for start, end, text in sorted(edits, reverse=True):
        src = src[:start] + text + src[end:]
    return src


@functools.lru_cache(maxsize=None)
def collective_names() -> Tuple[str, ...]:
    """The barrier and SIMD-group functions of the emulated headers: those taking a Site."""
    names = set()
    for header in ("sync.h", "simd.h", "simdgroup_matrix.h"):
        text = (EMULATOR_INCLUDE_DIR / "tsm_emu" / header).read_text()
        names.update(re.findall(r"\b(\w+)\s*\([^{;()]*::tsm_emu::Site site_", text))
        names.update(re.findall(r"^TSM_(?:SIMD_REDUCTION|SHUFFLE)\((\w+),", text, re.M))
        names.update("__metal_" + n for n in re.findall(r"\bTSM_SIMD_BUILTIN\w*\((\w+)\)", text))
    names -= {"name", "__metal_name"}  # the placeholders inside the macro definitions
    return tuple(sorted(names))


def _source_lines(src: str) -> Tuple[List[int], List[int]]:
    """Offsets where each text line starts, and the source line each one is (line markers)."""
    starts, lines, line = [], [], 0
    offset = 0
    for text_line in src.splitlines(keepends=True):
        starts.append(offset)
        m = re.match(r'#\s*(\d+)\s+"', text_line)
        if m:  # a line marker names the line that follows it
            line = int(m.group(1)) - 1
            lines.append(line)
        else:
            line += 1
            lines.append(line)
        offset += len(text_line)
    return starts, lines


_NOT_FUNCTIONS = {"if", "for", "while", "switch", "catch", "return", "sizeof", "decltype",
                  "alignof", "static_assert"}


@dataclass
class _Definition:
    name: str
    open_paren: int
    close_paren: int
    body_open: int
    body_close: int
    is_kernel: bool


def _function_definitions(masked: str) -> List[_Definition]:
    """Function definitions outside other function bodies: a ``{`` right after ``)``."""
    defs, i = [], 0
    while i < len(masked):
        if masked[i] != "{":
            i += 1
            continue
        # A member function's qualifiers stand between its `)` and `{` (steel's `void mma(...) thread {`).
        qualifiers = re.search(r"\)((?:\s*\b(?:const|volatile|thread|device|constant|threadgroup|noexcept)\b"
                               r"|\s*&{1,2})*)\s*$", masked[max(0, i - 200):i])
        if not qualifiers:
            i += 1
            continue
        j = i - len(qualifiers.group())  # the `)`
        k = _match_open(masked, j)
        name = re.search(r"(\w+)\s*(?:<[^<>;{}()]*>)?\s*$", masked[max(0, k - 200):k])
        if k < 0 or not name or name.group(1) in _NOT_FUNCTIONS:
            i += 1
            continue
        head = masked[_head_start(masked, k):k]
        body_close = _match_close(masked, i, "{", "}")
        defs.append(_Definition(name.group(1), k, j, i, body_close, _KERNEL_MARK.search(head) is not None))
        i = body_close + 1
    return defs


_STAGE_MARK = re.compile(r"\[\[\s*(?:vertex|fragment)\s*\]\]|\b(?:vertex|fragment)\b")


def stage_function_edits(src: str) -> List[Tuple[int, int, str]]:
    """Edits that blank the vertex and fragment functions of ``src`` (line for line): a file
    may hold them beside its kernels (naga's, SPIRV-Cross's); the check reads them, and the
    emulator, which dispatches compute kernels only, has no use for them."""
    masked = _mask_strings_and_directives(src)
    edits = []
    for d in _function_definitions(masked):
        start = _head_start(masked, d.open_paren)
        if _STAGE_MARK.search(masked[start:d.open_paren]):
            edits.append((start, d.body_close + 1, blank(src[start:d.body_close + 1])))
    return edits


def namespace_blocks(masked: str) -> List[Tuple[str, int, int]]:
    """(name, ``{``, ``}``) of every namespace block of ``masked``, outer ones first (an
    unnamed one's name is empty; ``namespace a::b {`` is one block named ``a::b``)."""
    blocks = []
    for m in re.finditer(r"\bnamespace\s*((?:\w+\s*::\s*)*\w+)?\s*\{", masked):
        try:
            blocks.append(("".join((m.group(1) or "").split()), m.end() - 1, _match_close(masked, m.end() - 1, "{", "}")))
        except ParseError:
            continue
    return blocks


def _call_pattern(names) -> "re.Pattern[str]":
    return re.compile(r"(?<![\w.>])(?:metal::)?(" + "|".join(sorted(names)) +
                      r")\s*(?:<[^<>;{}()]*>)?\s*\(")


def semicolon_end(text: str, start: int) -> Optional[int]:
    """The offset just past the first ``;`` from ``start`` outside brackets (a declaration's
    braced initialisers, a call's arguments), or None."""
    depth = 0
    for j in range(start, len(text)):
        c = text[j]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == ";" and depth == 0:
            return j + 1
    return None


# Metal's `coherent` without a scope (`coherent device T* p`, as SPIRV-Cross writes it; MSL 3.2
# spells it coherent(device)): device memory is coherent in the emulator, and the check has
# no use for it either.
_BARE_COHERENT = re.compile(r"\bcoherent\b(?!\s*\()")


def bare_coherent_edits(text: str) -> List[Tuple[int, int, str]]:
    """Edits that blank every `coherent` qualifier written without a scope."""
    masked = _mask_strings_and_directives(text)
    return [(m.start(), m.end(), " " * len(m.group())) for m in _BARE_COHERENT.finditer(masked)]


# Where the parse pass met an emulated header that declares names (<simd/simd.h>): the
# header leaves this mark instead of its declarations, which the user's code alone (what
# the pass keeps) does not hold.
_MARKED_INCLUDE = re.compile(r"^[ \t]*#[ \t]*pragma[ \t]+tsm_msl_include[ \t]+(<[\w/.]+>)[ \t]*$", re.M)


def marked_include_edits(text: str) -> List[Tuple[int, int, str]]:
    """Edits that put each header the parse pass marked back where it was included."""
    return [(m.start(), m.end(), f"#include {m.group(1)}") for m in _MARKED_INCLUDE.finditer(text)]


def function_name(cxx: str) -> str:
    """The function a kernel's C++ expression names (``ns::k<float>`` -> ``k``)."""
    return cxx.split("<", 1)[0].split("::")[-1].strip()
