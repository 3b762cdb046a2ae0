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

Layer: analyse (the layers are in the package's docstring): a validation pass over clang's
AST that changes nothing. Imports only the parse layer (_clang, _clang_view); the compiler
(_compiler) runs it before the translation.

Known to be permissive: what clang accepts in C++ for OpenCL and Metal may not (reported
as found, from real kernels); the emulator's own C++ compile then rejects what it does
not implement.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from ._clang import (_AS_WORDS, _QUALIFIERS, _address_space, _cindex, _is_exempt_copy, _only_read, _scalar_name,
                     _strip_to_reference, _type_kind, _user_declarations, language_version_number, presumed_location)
from ._clang_view import _parse
from ..errors import MetalCompileError
# (tools/real_world_metal.py and the tests reach the language versions and clang's set-up
# through this module, where they were before the parse layer had modules of its own)
from ._clang import _CLANG_ARGS, DEFAULT_LANGUAGE_VERSION, FRONTEND_INCLUDE_DIR, _index  # noqa: F401


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
    # A scalar of a greater rank than a vector's elements, converted to the element type:
    # the rank rule is OpenCL's alone in clang (ggml's `slope*pmask4[i]`, a float and a half4;
    # SPIRV-Cross's `remainder == 0` of a short2).
    re.compile(r"scalar operand type has greater rank than the type of the vector element\. "),
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


_AMBIGUOUS_MEMBER = re.compile(r"(?:use of overloaded operator '([^']*)'|call to member function '(\w+)') is ambiguous")


def _ambiguous_on_a_temporary(diagnostic, path: str, lines: List[str]) -> bool:
    """A member function overloaded on the object's address space, called on a temporary
    (Tint's ``make_array()[0u]`` of its ``tint_array``): clang's C++ for OpenCL gives the
    temporary no address space, so the ``device`` and ``threadgroup`` overloads tie, where
    Metal's temporary is in ``thread`` and takes that overload. Forgiven when every candidate
    clang names is declared (in ``lines``, the text clang read) with a ``device`` or
    ``threadgroup`` object and a ``thread`` one of the same name is declared too."""
    m = _AMBIGUOUS_MEMBER.match(diagnostic.spelling)
    if not m:
        return False
    name = re.escape(f"operator{m.group(1)}" if m.group(1) else m.group(2))
    qualified = r"\b{}\s*\([^;{{}}]*\)\s*(?:const\s+)?({})\b"
    candidates = [n for n in diagnostic.children if n.spelling.startswith("candidate function")]
    if not candidates:
        return False
    for note in candidates:
        line = note.location.line
        if note.location.file is None or note.location.file.name != path or not 0 < line <= len(lines) or \
                not re.search(qualified.format(name, "device|threadgroup"), lines[line - 1]):
            return False
    return any(re.search(qualified.format(name, "thread"), text) for text in lines)


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
    ``vec<bool, N>`` into a vector of int (_clang_view._typedef_vectors) cannot reach one made
    through an alias template's parameter (MLX's nax attention instantiates its tiles with
    ``bool`` masks, ``dtype_frag_t<bool>`` being ``metal::vec<bool, 8>``) without making that
    parameter undeducible for every type. Such instantiations are not type-checked here: the
    kernel's explicit instantiations with ``bool`` (and the calls _clang_view._prepare adds for
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
                 or _ambiguous_on_a_temporary(d, path, lines) for d in errors]
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
