"""Function constants: ``constant T name [[function_constant(n)]];`` given values at compile time.

Layer: drive (the layers are in the package's docstring). Imports the parse layer's text
reader (_msl_text) and _errors; the compiler specialises the preprocessed source with it
before the check and the translation.

Metal specialises a function with ``MTLFunctionConstantValues`` (a value per index, or per
name) when the pipeline is made. ``compile_shader(src, function_constants={...})`` does the
same for a whole library: before the check and the emulator's build, each declaration in the
preprocessed source becomes a ``constexpr`` constant of its declared type holding the given
value, ``is_function_constant_defined(name)`` becomes ``true`` or ``false``, and a parameter
attributed ``[[function_constant(b)]]`` exists only when ``b`` is true.

A constant given no value is undefined, as in Metal: a kernel whose code uses it (directly,
through a helper, or through a program-scope constant computed from it) cannot be launched,
and :func:`kernels_needing` names it for the error; using it only inside
``is_function_constant_defined`` is fine.
"""
from __future__ import annotations

import ast
import math
import numbers
import operator
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from . import _msl_text
from ..errors import MetalCompileError

Values = Mapping[Union[str, int], object]

# MSL scalar type -> (kind, bits): what a value given for it must be.
_SCALARS = {
    "bool": ("bool", 1),
    "char": ("int", 8), "int8_t": ("int", 8), "uchar": ("uint", 8), "uint8_t": ("uint", 8),
    "short": ("int", 16), "int16_t": ("int", 16), "ushort": ("uint", 16), "uint16_t": ("uint", 16),
    "int": ("int", 32), "int32_t": ("int", 32), "uint": ("uint", 32), "uint32_t": ("uint", 32),
    "unsigned": ("uint", 32), "unsigned int": ("uint", 32),
    "long": ("int", 64), "int64_t": ("int", 64), "ulong": ("uint", 64), "uint64_t": ("uint", 64),
    "half": ("float", 16), "float": ("float", 32), "bfloat": ("float", 16),
}

# `constant` among `static`, `constexpr` and `const` in any order (MLX's STEEL_CONST is
# `static constant constexpr const`).
_DECLARATION = re.compile(
    r"(?<![\w:])(?:(?:static|constexpr|const)\s+)*constant\s+(?:(?:static|constexpr)\s+)*"
    r"(?P<type>(?:const\s+)?(?:metal::)?(?:unsigned\s+)?\w+)\s+(?P<name>\w+)\s*"
    r"\[\[\s*function_constant\s*\((?P<index>[^()\[\]]*)\)\s*\]\]\s*;")
_DEFINED = re.compile(r"(?<![\w.:])(?:metal::)?is_function_constant_defined\s*\(\s*(\w+)\s*\)")
_PARAMETER_CONDITION = re.compile(r"(\[\[[^\[\]]*\bfunction_constant\s*\(\s*)(\w+)(\s*\)[^\[\]]*\]\])")


@dataclass(frozen=True)
class FunctionConstant:
    name: str
    type: str   # as declared, without `const`
    index: int
    value: Optional[object]  # None: given no value (undefined)

    def describe(self) -> str:
        return f"`{self.type} {self.name}` [[function_constant({self.index})]]"


def _c_integer(expression: str) -> int:
    """The value of an integer constant expression of literals (after preprocessing:
    ``1300 + 2``, ``00``, ``0x10 | 1``)."""
    def literal(m: "re.Match[str]") -> str:
        text = m.group(1).lower()
        if text.startswith("0x"):
            return str(int(text, 16))
        if len(text) > 1 and text.startswith("0"):
            return str(int(text, 8))
        return text
    python = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\b", literal, expression)
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.LShift: operator.lshift,
           ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitAnd: operator.and_,
           ast.BitXor: operator.xor, ast.USub: operator.neg, ast.UAdd: operator.pos}

    def value(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.operand))
        raise ValueError(expression)
    return value(ast.parse(python.replace("/", "//"), mode="eval").body)


def declarations(preprocessed: str) -> List[Tuple["re.Match[str]", str, int]]:
    """Every function constant declared in ``preprocessed``: (match, type, index)."""
    masked = _msl_text._mask_strings_and_directives(preprocessed)
    found = []
    for m in _DECLARATION.finditer(masked):
        type_ = re.sub(r"^(?:const\s+)?(?:metal::)?", "", m.group("type"))
        try:
            index = _c_integer(m.group("index"))
        except (ValueError, SyntaxError):
            raise MetalCompileError.at_offset(
                f"the index of function constant `{m.group('name')}` is not an integer constant: "
                f"{m.group('index').strip()}", preprocessed, m.start(), "") from None
        found.append((m, type_, index))
    return found


def _checked_value(constant: FunctionConstant, value: object, given_as: str) -> object:
    """``value`` if it fits ``constant``'s declared type; a TypeError or ValueError otherwise."""
    what = f"function_constants[{given_as}] for {constant.describe()}"
    scalar = _SCALARS.get(constant.type)
    if scalar is None:
        raise TypeError(f"{what}: the emulator takes values for scalar function constants only "
                        f"(bool, integers, half, float, bfloat), not {constant.type}")
    kind, bits = scalar
    if kind == "bool":
        if not isinstance(value, (bool,)) and type(value).__name__ != "bool_":
            raise TypeError(f"{what}: expected a bool, got {value!r} ({type(value).__name__})")
        return bool(value)
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise TypeError(f"{what}: expected a number of type {constant.type}, got the bool {value!r}")
    if kind in ("int", "uint"):
        if not isinstance(value, numbers.Integral):
            raise TypeError(f"{what}: expected an integer ({constant.type}), got {value!r} "
                            f"({type(value).__name__})")
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if kind == "int" else (0, (1 << bits) - 1)
        if not lo <= int(value) <= hi:
            raise ValueError(f"{what}: {int(value)} does not fit {constant.type} ({lo} to {hi})")
        return int(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{what}: expected a number ({constant.type}), got {value!r} ({type(value).__name__})")
    return float(value)


def resolve(found: Sequence[Tuple["re.Match[str]", str, int]], values: Values) -> List[FunctionConstant]:
    """The declared constants with the values given for them by name or by index."""
    by_name = {m.group("name"): (type_, index) for m, type_, index in found}
    by_index: Dict[int, str] = {}
    for name, (_, index) in by_name.items():
        if index in by_index and by_index[index] != name:
            raise MetalCompileError(f"function constants `{by_index[index]}` and `{name}` have the "
                                    f"same index {index}")
        by_index[index] = name
    given: Dict[str, Tuple[object, str]] = {}
    for key, value in values.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"function_constants keys are names (str) or indices (int), got {key!r}")
        name = by_index.get(key) if isinstance(key, int) else key if key in by_name else None
        if name is None:
            declared = ", ".join(f"{n} ({i})" for n, (_, i) in sorted(by_name.items())) or "none"
            raise ValueError(f"function_constants[{key!r}]: the shader declares no function constant "
                             f"{'with index' if isinstance(key, int) else 'named'} {key!r} "
                             f"(declared: {declared})")
        if name in given:
            raise ValueError(f"function constant `{name}` is given twice (by name and by index "
                             f"{by_name[name][1]})")
        given[name] = (value, repr(key))
    out = []
    for name, (type_, index) in by_name.items():
        constant = FunctionConstant(name, type_, index, None)
        if name in given:
            value, key = given[name]
            constant = FunctionConstant(name, type_, index, _checked_value(constant, value, key))
        out.append(constant)
    return out


def _literal(constant: FunctionConstant) -> str:
    value = constant.value
    if value is None:
        return f"{constant.type}()"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        suffix = "ul" if _SCALARS[constant.type] == ("uint", 64) else "l" if _SCALARS[constant.type][1] == 64 else ""
        return f"static_cast<{constant.type}>({value}{suffix})"
    if math.isnan(value):
        text = '__builtin_nanf("")'
    elif math.isinf(value):
        text = "__builtin_inff()" if value > 0 else "-__builtin_inff()"
    else:
        text = float(value).hex()  # exact: C++17 and clang read hexadecimal floats
    return f"static_cast<{constant.type}>({text})"


def specialize(preprocessed: str, found: Sequence[Tuple["re.Match[str]", str, int]],
               constants: Sequence[FunctionConstant]) -> str:
    """``preprocessed`` with each declaration a constexpr constant of its value (the type's
    zero when it has none), and the tests of definedness replaced by their answers."""
    by_name = {c.name: c for c in constants}
    edits = []
    for m, _, _ in found:
        constant = by_name[m.group("name")]
        text = f"constant constexpr {constant.type} {constant.name} = {_literal(constant)};"
        newlines = preprocessed.count("\n", m.start(), m.end())
        edits.append((m.start(), m.end(), text + "\n" * newlines))
    masked = _msl_text._mask_strings_and_directives(preprocessed)
    for m in _DEFINED.finditer(masked):
        if m.group(1) in by_name:
            edits.append((m.start(), m.end(), "true" if by_name[m.group(1)].value is not None else "false"))
    values = {c.name: c.value for c in constants}
    values.update(_derived_conditions(masked, values))
    for m in _PARAMETER_CONDITION.finditer(masked):
        if m.group(2) in values:
            edits.append((m.start(2), m.end(2), "true" if values[m.group(2)] is True else "false"))
    return _msl_text._apply(preprocessed, edits)


_DERIVED = re.compile(r"(?<![\w.])constant\s+(?:constexpr\s+)?bool\s+(\w+)\s*=\s*([^;{}]*);")


def _derived_conditions(masked: str, values: Mapping[str, object]) -> Dict[str, Optional[bool]]:
    """Program-scope ``constant bool b = a && !c;`` of function constants (candle's and MLX's
    ``gather_bias = do_gather && use_out_source``), which a parameter's
    ``[[function_constant(b)]]`` may name: b's value, or None where a constant it uses has
    none (the parameter is then absent, as for such a constant itself). An expression of
    anything but bool constants, ``&&``, ``||``, ``!`` and parentheses is left alone."""
    derived: Dict[str, Optional[bool]] = {}
    known = dict(values)  # the function constants, then each derived one as it is found

    def value(node) -> Optional[bool]:
        if isinstance(node, ast.BoolOp):
            parts = [value(v) for v in node.values]
            if None in parts:
                return None
            return all(parts) if isinstance(node.op, ast.And) else any(parts)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            inner = value(node.operand)
            return None if inner is None else not inner
        if isinstance(node, ast.Name) and node.id in ("true", "false"):
            return node.id == "true"
        if isinstance(node, ast.Name) and node.id in known and isinstance(known[node.id], (bool, type(None))):
            return known[node.id]
        raise ValueError(node)

    for m in _DERIVED.finditer(masked):
        python = re.sub(r"!(?!=)", " not ", m.group(2).replace("&&", " and ").replace("||", " or "))
        try:
            derived[m.group(1)] = known[m.group(1)] = value(ast.parse(python.strip(), mode="eval").body)
        except (SyntaxError, ValueError):
            continue
    return derived


def kernels_needing(preprocessed: str, constants: Sequence[FunctionConstant],
                    kernels: Sequence[_msl_text.Kernel]) -> Dict[str, Tuple[str, ...]]:
    """host name -> the constants without a value that the kernel needs, for the kernels
    that need any. ``preprocessed`` is the text before :func:`specialize`.

    A kernel needs a constant its code uses: in its body, in the functions it calls (by
    name, transitively) or through program-scope constants computed from it; unless the
    same code tests whether it is defined (``is_function_constant_defined``, directly or
    through a program-scope constant): its uses are then taken as guarded by that test.
    """
    undefined = {c.name for c in constants if c.value is None}
    if not undefined:
        return {}
    masked = _msl_text._mask_strings_and_directives(preprocessed)
    definitions = _msl_text._function_definitions(masked)

    def split(text: str) -> Tuple[set, set]:
        """(words used, constants tested for definedness) of ``text``."""
        tested = set(_DEFINED.findall(text)) & undefined
        return set(re.findall(r"\b\w+\b", _DEFINED.sub(" ", text))), tested

    roots = {name: {name} for name in undefined}  # name -> the undefined constants it stands for
    guards: Dict[str, set] = {}                   # name -> the constants it tests
    outside = list(masked)
    for d in definitions:
        outside[d.body_open:d.body_close + 1] = " " * (d.body_close + 1 - d.body_open)
    for m in re.finditer(r"\bconstant\b[^;{}]*?\b(\w+)\s*=\s*([^;]*);", "".join(outside)):
        words, tested = split(m.group(2))
        from_ = set().union(*(roots[w] for w in words if w in roots))
        if from_:
            roots[m.group(1)] = from_
        if tested:
            guards[m.group(1)] = tested
    names = {d.name for d in definitions}
    uses: Dict[str, set] = {}
    guarded: Dict[str, set] = {}
    calls: Dict[str, set] = {}
    for d in definitions:
        words, tested = split(masked[d.body_open:d.body_close])
        uses.setdefault(d.name, set()).update(*(roots[w] for w in words if w in roots))
        guarded.setdefault(d.name, set()).update(tested, *(guards[w] for w in words if w in guards))
        calls.setdefault(d.name, set()).update(words & names)
    out = {}
    for kernel in kernels:
        start = kernel.cxx.lstrip(":").split("<", 1)[0].rsplit("::", 1)[-1]
        seen, stack, needed, tested = set(), [start], set(), set()
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                needed |= uses.get(name, set())
                tested |= guarded.get(name, set())
                stack.extend(calls.get(name, ()))
        if needed - tested:
            out[kernel.host_name] = tuple(sorted(needed - tested))
    return out
