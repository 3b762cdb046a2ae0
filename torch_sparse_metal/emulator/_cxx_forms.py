"""Where C++ reads a form of Metal differently, the edits that give the emulator's C++
Metal's meaning: integer division, products of simdgroup matrices, unsuffixed floating
literals, and functions overloaded on address space with the calls and arguments that reach
them.

Layer: lower (the layers are in the package's docstring). Imports the parse layer and the
analyses (_matrix_products); _translation calls it before the kernels' schedules are planned.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Set, Tuple

from . import _matrix_products, _msl_text
from ._clang import (_address_space, _cindex, _scalar_name, _strip_to_reference,
                     _type_kind, element_type, presumed_location)
from ._clang_view import _DOUBLE_LITERAL, _Prepared, _Text, _template_scopes
from ..errors import MetalCompileError


_DIVISIONS = {4: "div", 5: "rem", 24: "div_assign", 25: "rem_assign"}  # clang's CXBinaryOperatorKind
_INTEGERS = {"bool", "char", "signed char", "unsigned char", "short", "unsigned short", "int", "unsigned int",
             "long", "unsigned long", "long long", "unsigned long long"}


def float_literals(preprocessed: str) -> List[Tuple[int, int, str]]:
    """``0.1`` -> ``0.1f``: an unsuffixed floating literal is a float in Metal, which has no
    double (``auto s = 1.0 / n`` is a float, ``x * 0.1`` a float product, and
    ``precise::atan2(h, 1.0 + h)`` of a half h calls the float overload). A literal that is
    the whole operand of a conversion (``T(0.7978845608028654)``, ``static_cast<T>(0.5)``)
    keeps its digits: whatever T is, the value is the literal's rounded to T, also in the
    emulator's double instantiations. (The emulator's own double code, where the literal
    converts to double, is left out by the caller.)"""
    masked = _msl_text._mask_strings_and_directives(preprocessed)
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


def address_space_overloads(tu, path: str, prepared: _Prepared, preprocessed: str
                             ) -> List[Tuple[int, int, str]]:
    """Edits that keep overloads differing only in address space apart once the emulator's
    C++ has erased address spaces (see _translation.emulator_edits)."""
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


def pointer_argument_conversions(calls, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
    """Pointer arguments that the emulator's C++ would convert ambiguously, where every raw
    pointer converts to every checked pointer by a constructor:

    * converted implicitly to a ``device``, ``constant`` or ``threadgroup`` void pointer:
      overloads on the address space of a void pointer (PyTorch's ``val_at_offs(constant
      void*, long)`` and ``(device void*, long)``) would be ambiguous for a ``device
      float*``; a cast makes the argument the parameter's type exactly, as clang chose it;
    * an array in device or constant memory (a member of a buffer's struct), decayed: between
      ``spvDescriptorArray(const device spvDescriptor<T>*)`` and ``(const device void*)``
      (SPIRV-Cross's descriptor arrays), where Metal's decay matches the first exactly. The
      argument becomes ``tsm_emu::checked_pointer(a)``, the checked pointer to its first
      element, which reaches ``ptr<const T>`` as a base class and ``ptr<const void>`` only by
      a constructor. Arrays of structs only: a string literal stays a raw ``const char*``."""
    k = _cindex().CursorKind
    edits: List[Tuple[int, int, str]] = []
    for call in calls:
        if call.referenced is None:
            continue
        for argument in call.get_arguments():
            if argument.kind != k.UNEXPOSED_EXPR:
                continue
            inner = next(argument.get_children(), None)
            to = re.fullmatch(r"((?:const )?)(__global|__constant|__local) void \*", argument.type.spelling)
            if to is not None:
                if inner is not None and "*" in inner.type.spelling and " void *" not in inner.type.spelling:
                    edits += _cast(argument, f"{to.group(1)}{_MSL_SPACES[to.group(2)]} void*", prepared, preprocessed)
                continue
            if _type_kind(argument.type) != "Pointer" or _address_space(argument.type) not in ("__global", "__constant"):
                continue
            while inner is not None and inner.kind == k.UNEXPOSED_EXPR and _type_kind(inner.type) == "Pointer":
                inner = next(inner.get_children(), None)  # through the implicit conversions (const)
            if inner is not None and _type_kind(inner.type) == "ConstantArray" and \
                    _type_kind(element_type(inner.type)) == "Record":  # (not a string literal)
                edits += _wrap(argument, "::tsm_emu::checked_pointer(", prepared, preprocessed)
    return edits


def _function_template_of(call):
    """The function template ``call`` calls a specialisation of, or None."""
    k = _cindex().CursorKind
    callee = call.referenced
    if callee is None or callee.kind not in (k.FUNCTION_DECL, k.CXX_METHOD):
        return None
    pattern = _cindex().conf.lib.clang_getSpecializedCursorTemplate(callee)
    return pattern if pattern is not None and pattern.kind == k.FUNCTION_TEMPLATE else None


_SWIZZLE = re.compile(r"[xyzw]{2,4}|[rgba]{2,4}")


def swizzle_arguments(calls, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
    """A swizzle of two or more components (``v.xy``) given to a function template: in MSL an
    rvalue of the vector type, which ``T`` deduces; in the emulator's C++ a proxy over the
    vector's storage, which ``T`` would deduce instead (``x + x`` of two proxies is a vector,
    not a proxy: SPIRV-Cross's ``spvSMod(v.xy, v.zw)`` did not build). The argument becomes
    ``tsm_emu::swizzle_value(v.xy)``, the vector."""
    k = _cindex().CursorKind
    edits: List[Tuple[int, int, str]] = []
    for call in calls:
        if _function_template_of(call) is None:
            continue
        for argument in call.get_arguments():
            node = argument
            while node is not None and node.kind == k.UNEXPOSED_EXPR:
                tokens = [t.spelling for t in node.get_tokens()]
                inner = next(node.get_children(), None)
                if len(tokens) >= 3 and tokens[-2] == "." and _SWIZZLE.fullmatch(tokens[-1]) and \
                        inner is not None and "ext_vector_type" in inner.type.get_canonical().spelling:
                    edits += _wrap(argument, "::tsm_emu::swizzle_value(", prepared, preprocessed)
                    break
                node = inner
    return edits


def threadgroup_array_arguments(calls, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
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


def template_pointer_arguments(calls, unexposed, prepared: _Prepared, preprocessed: str
                               ) -> List[Tuple[int, int, str]]:
    """A pointer passed to a function template's parameter ``A* p`` whose pointee names a
    template parameter, where the argument's type in the emulator's C++ is not the one the
    parameter deduces ``A`` from:

    * ``thread A*``: the emulator's C++ keeps such a parameter a raw pointer (see
      _rewrite._thread_pointers), while a ``thread T*`` variable is a bounds-carrying
      ``thread_ptr<T>``. The argument becomes ``tsm_emu::raw_thread_pointer(p)``: the raw
      pointer, unchecked past the call as the parameter is.
    * ``device A*`` (``constant``, ``threadgroup``): the parameter is a checked ``ptr<A>``,
      while the address of an element or member (``&buf.inner[i]``, naga's atomic helpers)
      is a raw pointer. The argument becomes ``tsm_emu::checked_pointer(p)``, which makes a
      raw pointer checked and passes a checked one through.

    Calls of ``calls`` and the calls among ``unexposed`` that
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
        pattern = _function_template_of(call)
        if pattern is not None:
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
            if i >= len(arguments) or _type_kind(arguments[i].type) != "Pointer":
                continue
            thread = _address_space(arguments[i].type) in (None, "__private", "__generic")
            edits += _wrap(arguments[i], "::tsm_emu::raw_thread_pointer(" if thread else "::tsm_emu::checked_pointer(",
                           prepared, preprocessed)
    return edits


def threadgroup_reference_arguments(calls, prepared: _Prepared, preprocessed: str) -> List[Tuple[int, int, str]]:
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


def bfloat_conditional_conversions(conditionals, prepared: _Prepared, preprocessed: str
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


def address_space_specialisations(tu, path: str, prepared: _Prepared, preprocessed: str
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
    return [(a, b, _msl_text.blank(preprocessed[a:b])) for a, b in spans[1:]]


def stored_pointers(tu, path: str) -> None:
    """Raise where a device or constant pointer (or reference) designates data that holds
    pointers: an argument buffer's struct, SPIRV-Cross's descriptor arrays. Metal stores a
    pointer in 8 bytes; the emulator's checked pointer is 32, so such data would not be laid
    out as the host wrote it, and the kernel would read addresses from the wrong bytes. (A
    ``device T* device*`` is laid out as Metal's: the pointers it holds stay raw.)"""
    k = _cindex().CursorKind
    kinds = {k.VAR_DECL, k.PARM_DECL, k.FIELD_DECL, k.CSTYLE_CAST_EXPR, k.CXX_STATIC_CAST_EXPR,
             k.CXX_REINTERPRET_CAST_EXPR, k.CXX_FUNCTIONAL_CAST_EXPR}
    memo: Dict[str, Optional[Tuple[str, str, str]]] = {}

    def msl(spelling: str) -> str:
        spelling = _MSL_AS_PATTERN.sub(lambda m: _MSL_SPACES.get(m.group(1), ""), spelling)
        return " ".join(spelling.replace(" *", "*").split()).replace(" *", "*").replace("* ", "*")

    def object_space(t) -> Optional[str]:
        """The address space of an object of type ``t``: of an array, its elements'; of a
        pointer, the qualifier after its ``*`` (``__global T *__generic`` is a thread pointer)."""
        t = element_type(t)
        if _type_kind(t) == "Pointer":
            m = re.search(r"\*\s*(?:(?:const|volatile)\s+)*(__\w+)?[\s\w]*$", t.spelling)
            return m.group(1) if m else None
        return _address_space(t)

    def held_pointer(t, depth: int = 0) -> Optional[Tuple[str, str]]:
        """(the member path, the pointer type) of a pointer ``t`` holds."""
        t = t.get_canonical()
        kind = _type_kind(t)
        if kind == "Pointer":
            return "", t.spelling
        if kind == "ConstantArray":
            return held_pointer(t.get_array_element_type(), depth + 1)
        if kind == "Record" and depth < 8:
            for field in t.get_fields():
                inner = held_pointer(field.type, depth + 1)
                if inner:
                    return (f"{field.spelling}.{inner[0]}" if inner[0] else field.spelling), inner[1]
        return None

    def stored(t, depth: int = 0) -> Optional[Tuple[str, str, str]]:
        """(the type, the member path, the pointer type) of a device or constant pointer in
        ``t`` (or ``t`` itself) to data that holds a pointer."""
        t = t.get_canonical()
        key = t.spelling
        if key in memo:
            return memo[key]
        memo[key] = None
        kind, found = _type_kind(t), None
        if kind in ("Pointer", "LValueReference") and object_space(t.get_pointee()) in ("__global", "__constant"):
            pointee = t.get_pointee().get_canonical()
            held = held_pointer(pointee) if _type_kind(pointee) in ("Record", "ConstantArray") else None
            found = (pointee.spelling, *held) if held else None
        elif kind == "ConstantArray":
            found = stored(t.get_array_element_type(), depth + 1)
        elif kind == "Record" and depth < 8:
            found = next(filter(None, (stored(f.type, depth + 1) for f in t.get_fields())), None)
        memo[key] = found
        return found

    for top in tu.cursor.get_children():
        if top.location.file is None or top.location.file.name != path:
            continue
        for cursor in top.walk_preorder():
            if cursor.kind == k.PARM_DECL and not cursor.spelling:
                continue  # (an implicit copy constructor's, in every address space clang declares)
            if cursor.kind in kinds and _type_kind(cursor.type) != "Invalid" and stored(cursor.type):
                holder, member, pointer = stored(cursor.type)
                held = f"{member}: {msl(pointer)}" if member else msl(pointer)
                raise _emulator_limit(cursor, (
                    f"{re.sub(r'^(?:(?:const|volatile|device|constant) )+', '', msl(holder))}, in device or "
                    f"constant memory, holds a pointer ({held}): "
                    "Metal stores a pointer in 8 bytes, the emulator's checked pointer takes 32, so the "
                    "emulator cannot lay out argument buffers or descriptor arrays of pointers as the GPU "
                    "does, and does not run them"))


def _emulator_limit(cursor, message: str) -> MetalCompileError:
    file, line, _ = presumed_location(cursor.location)
    return MetalCompileError.from_diagnostics("the emulator cannot compile this shader",
                                              [(file, line, message, "")])


def operator_calls(tu, path: str, source: _Text, preprocessed: str) -> List[Tuple[int, int, str]]:
    """Each integer (or type-dependent) ``/``, ``%``, ``/=`` and ``%=``, and each product of
    two simdgroup matrices, as a call (see _translation.emulator_edits): its operator
    becomes ``,``, the call opens before its left operand and closes after its right."""
    cindex = _cindex()
    edits = []
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
    return edits
