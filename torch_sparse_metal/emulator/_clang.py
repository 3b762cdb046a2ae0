"""clang's AST of Metal Shading Language: libclang loaded, the language versions, and the
helpers every pass reads the AST with.

Layer: parse, the translator's bottom (the layers are in the package's docstring).
Imports nothing of the translator.

The check (_frontend) and the emulator's translation both parse the source with clang (the
``libclang`` wheel), in C++ for OpenCL mode, where address spaces are part of the type
system as in Metal (_clang_view makes the source one clang parses).
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import re
from typing import Dict, List, Optional, Sequence, Tuple

from .._paths import EMULATOR_DIR


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


def _scalar_name(type_) -> str:
    """The canonical spelling of a type without qualifiers (for the bfloat rules)."""
    words = [w for w in type_.get_canonical().spelling.split() if w not in _QUALIFIERS]
    return " ".join(words)


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


def _dependent_name(ref) -> str:
    """The name a reference through a dependent type spells (MLX's `gemv_kernel::run(...)`,
    `Reduce<T>::run`, `tile.template load<T>(...)` in a template), which clang gives only in
    its tokens."""
    name, depth = "", 0
    for token in ref.get_tokens():  # the last identifier outside template arguments
        depth += {"<": 1, ">": -1, ">>": -2}.get(token.spelling, 0)
        if depth == 0 and token.kind.name == "IDENTIFIER":
            name = token.spelling
    return name


_ARRAY_KINDS = ("ConstantArray", "DependentSizedArray")
