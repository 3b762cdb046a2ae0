"""What an access does, said to the sanitizer: rewrites of the sanitized build only.

Layer: emit. Imports only the parse layer (_msl_text); _rewrite calls it.

A checked access returns a plain reference (``tsm_emu/sanitize.h``), so the runtime sees
which element a thread touched but neither which field of it nor whether it stored. These
rewrites tell it:

* ``p[i].a.b``, ``p->a``, ``(*p).a`` and ``m.ref().a`` become
  ``::tsm_emu::member_of(<the element's address>, <one lambda per member>)``: the access is
  to the field's bytes, so two threads writing different fields of one struct element do
  not race (a vector still counts whole, as in Metal);
* the target of an assignment is wrapped in ``::tsm_emu::stored(...)`` (``=``) or
  ``::tsm_emu::updated(...)`` (``+=``, ``++``, ...): a store is a write even when it stores
  the value already in memory, and ``+=`` reads before it writes.

Like the rest of the rewriter this knows the shape of expressions, not the C++ grammar: an
assignment or member access it does not recognise stays as it was, and is then judged by
the bytes it changed, as before.
"""
from __future__ import annotations

import re
from typing import List, Optional, Tuple

from ._msl_text import _TYPE, _apply, _block_end, _mask_strings_and_directives

_OPENING = {")": "(", "]": "["}
_CLOSING = {"(": ")", "[": "]"}
# Words that end a statement's prefix rather than name an operand or a type.
_NOT_OPERANDS = {"return", "case", "else", "do", "throw", "sizeof", "decltype", "alignof",
                 "noexcept", "new", "delete", "co_return", "co_yield"}
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
_NEXT_MEMBER = re.compile(r"\s*\.\s*([A-Za-z_]\w*)")
_POSTFIX_MEMBER = re.compile(r"(?:\.|->|::)\s*[A-Za-z_]\w*")
_UNEVALUATED = re.compile(r"\b(?:sizeof|decltype|alignof|noexcept)\s*\(")
# p[i].a | m.ref().a | (*p).a | p->a
_MEMBER = re.compile(r"(\])\s*\.\s*(?=[A-Za-z_])"
                     r"|\b([A-Za-z_]\w*)\s*\.\s*ref\s*\(\s*\)\s*\.\s*(?=[A-Za-z_])"
                     r"|\(\s*\*\s*([A-Za-z_]\w*)\s*\)\s*\.\s*(?=[A-Za-z_])"
                     r"|->\s*(?=[A-Za-z_])")
_ASSIGNMENT = re.compile(r"<<=|>>=|[-+*/%&|^]=|(?<![=!<>+\-*/%&|^])=(?!=)")
_INCREMENT = re.compile(r"\+\+|--")
# float acc[4][4]; (a statement declaring a local array; threadgroup ones start otherwise)
_LOCAL_ARRAY = re.compile(r"(?:(?:thread|const|constexpr)\s+)*(" + _TYPE + r")\s+([A-Za-z_]\w*)\s*\[")


def _back(text: str, i: int) -> int:
    """The last offset <= ``i`` that is not whitespace (-1 if none)."""
    while i >= 0 and text[i].isspace():
        i -= 1
    return i


def _forward(text: str, i: int) -> int:
    """The first offset >= ``i`` that is not whitespace (len(text) if none)."""
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _opening(text: str, close: int) -> int:
    """The offset of the bracket opening the ``)`` or ``]`` at ``close`` (-1 if none)."""
    stack = []
    for i in range(close, -1, -1):
        c = text[i]
        if c in _OPENING:
            stack.append(_OPENING[c])
        elif c in _CLOSING:
            if not stack or stack.pop() != c:
                return -1
            if not stack:
                return i
    return -1


def _closing(text: str, open_: int) -> int:
    """The offset of the bracket closing the ``(`` or ``[`` at ``open_`` (-1 if none)."""
    stack = []
    for i in range(open_, len(text)):
        c = text[i]
        if c in _CLOSING:
            stack.append(_CLOSING[c])
        elif c in _OPENING:
            if not stack or stack.pop() != c:
                return -1
            if not stack:
                return i
    return -1


def _operand_start(masked: str, end: int) -> int:
    """Where the postfix expression ending just before ``end`` starts: names joined by
    ``.``, ``->`` and ``::``, with calls and subscripts (``end`` if there is none)."""
    start = end
    i = _back(masked, end - 1)
    while i >= 0:
        if masked[i] in _OPENING:  # a call's or subscript's brackets: what they apply to may precede
            j = _opening(masked, i)
            if j < 0:
                break
            keyword = re.search(r"\b(?:if|while|for|switch)\s*$", masked[:j])
            if keyword and start < end:
                break  # `if (c) (*r) = v` (candle): the condition, not a call the target applies
            start, i = j, _back(masked, j - 1)
            continue
        name = re.search(r"[A-Za-z_]\w*$", masked[:i + 1])
        if not name or name.group() in _NOT_OPERANDS:
            break
        start, i = name.start(), _back(masked, name.start() - 1)
        if masked[i - 1:i + 1] in ("->", "::"):
            if masked[i - 1:i + 1] == "::" and not re.match(r"[\w>]", masked[_back(masked, i - 2)]):
                start = i - 1  # ::tsm_emu::f(...): the global qualifier belongs to it
                break
            i = _back(masked, i - 2)
        elif i >= 0 and masked[i] == "." and not re.search(r"(?<![\w.])\d[\w.]*$", masked[:_back(masked, i - 1) + 1]):
            # a member of what precedes, unless that is a number (1.f); a name may end in a
            # digit (v2.x, and the barrier regions' renamed variables, c__tsm2.x)
            i = _back(masked, i - 1)
        else:
            break
    return start


def _operand_end(masked: str, start: int) -> int:
    """Where the postfix expression starting at ``start`` ends (``start`` if none)."""
    i = _forward(masked, start)
    if masked.startswith("::", i):
        i += 2
    name = _IDENTIFIER.match(masked, i)
    if name:
        i = name.end()
    elif i < len(masked) and masked[i] == "(":
        i = _closing(masked, i) + 1
        if i == 0:
            return start
    else:
        return start
    while True:
        j = _forward(masked, i)
        if j < len(masked) and masked[j] in "([":
            close = _closing(masked, j)
            if close < 0:
                return i
            i = close + 1
            continue
        member = _POSTFIX_MEMBER.match(masked, j)
        if not member:
            return i
        i = member.end()


def _unevaluated_spans(masked: str) -> List[Tuple[int, int]]:
    """The operands of sizeof, decltype, alignof and noexcept: no lambdas may go there."""
    spans = []
    for m in _UNEVALUATED.finditer(masked):
        close = _closing(masked, m.end() - 1)
        if close > 0:
            spans.append((m.start(), close))
    return spans


def _member_path(masked: str, src: str, pos: int) -> Tuple[List[str], int]:
    """The data members selected from ``pos`` on (the first name at ``pos``, then
    ``.name`` each), with the subscripts after each, as lambdas; and where they end. A
    member that is called is a method: the path stops before it."""
    steps, i, first = [], pos, True
    while True:
        m = (_IDENTIFIER if first else _NEXT_MEMBER).match(masked, i)
        if not m or m.group(m.lastindex or 0) == "template":
            break
        end = m.end()
        while True:  # subscripts of the member: a[k], m[r][c]
            j = _forward(masked, end)
            if not masked.startswith("[", j) or masked.startswith("[[", j):
                break
            close = _closing(masked, j)
            if close < 0:
                break
            end = close + 1
        if masked.startswith("(", _forward(masked, end)):
            break
        text = src[m.start():end].lstrip(". \t\n")
        capture = "[&]" if "[" in text else "[]"
        steps.append(f"{capture}(auto& tsm_m_) -> decltype(auto) {{ return (tsm_m_.{text}); }}")
        i, first = end, False
    return steps, i


def _member_rewrite(src: str, masked: str, m: "re.Match[str]") -> Optional[Tuple[str, int]]:
    """The source with the member access at ``m`` rewritten, and where the rewrite starts;
    None if it is not one to rewrite."""
    if m.group(1):  # p[i].a
        open_ = _opening(masked, m.start(1))
        start = _operand_start(masked, open_) if open_ > 0 else open_
        if open_ <= 0 or start == open_:
            return None
        address = (f"::tsm_emu::element_address({src[start:open_].strip()}, "
                   f"{src[open_ + 1:m.start(1)]})")
    elif m.group(2):  # m.ref().a: a threadgroup scalar
        start, address = m.start(2), f"{m.group(2)}.pointer()"
    elif m.group(3):  # (*p).a, unless the parentheses are a call's: f(*p).a
        before = _back(masked, m.start() - 1)
        if before >= 0 and (masked[before].isalnum() or masked[before] in "_)]"):
            return None
        start, address = m.start(), m.group(3)
    else:  # p->a, but not a trailing return type: auto f(...) -> T, [](...) -> T
        start = _operand_start(masked, m.start())
        operand = src[start:m.start()].strip()
        if (not operand or operand == "this" or operand.startswith("[")
                or _is_declaration(masked, start) or masked.startswith("decltype", m.end())):
            return None
        address = operand
    steps, end = _member_path(masked, src, m.end())
    if not steps:
        return None
    rewritten = f"::tsm_emu::member_of({address}, {', '.join(steps)})"
    rewritten += "\n" * (src.count("\n", start, end) - rewritten.count("\n"))  # keep the lines
    return src[:start] + rewritten + src[end:], start


def checked_members(src: str) -> str:
    """``p[i].a`` (and ``p->a``, ``(*p).a``, ``m.ref().a``) -> ``::tsm_emu::member_of(...)``,
    an access of the field's bytes only."""
    pos = 0
    while True:
        masked = _mask_strings_and_directives(src)
        spans = _unevaluated_spans(masked)
        m = _MEMBER.search(masked, pos)
        while m and any(a <= m.start() < b for a, b in spans):
            m = _MEMBER.search(masked, m.end())
        if not m:
            return src
        rewritten = _member_rewrite(src, masked, m)
        if rewritten is None:
            pos = m.end()
        else:  # members nested in its subscripts are found from its start on
            src, pos = rewritten


def _checked_operand(masked: str, start: int, end: int) -> bool:
    """Whether [start, end) may reach memory through a checked pointer: a subscript, a
    dereference, a member through a pointer, a call (``m.ref()``, ``member_of(...)``)."""
    return bool(re.search(r"[\[*(]|->", masked[start:end]))


def _is_declaration(masked: str, start: int) -> bool:
    """Whether the operand at ``start`` is the name being declared (``float a[2] = ...``):
    a type or declarator, or another declarator of a list, comes right before it."""
    i = _back(masked, start - 1)
    if i < 0:
        return False
    if masked[i] in ">*&,":
        return True
    name = re.search(r"[A-Za-z_]\w*$", masked[:i + 1])
    return bool(name) and name.group() not in _NOT_OPERANDS


def _unary_star_before(masked: str, start: int) -> int:
    """``start`` moved back over dereferences (``*p = v``), not over multiplications."""
    i = _back(masked, start - 1)
    while i >= 0 and masked[i] == "*":
        j = _back(masked, i - 1)
        if j >= 0 and (masked[j].isalnum() or masked[j] in "_)]"):
            break  # a multiplication or a declarator (float* p)
        start, i = i, j
    return start


def _local_arrays(masked: str) -> List[Tuple[str, int, int]]:
    """The arrays declared in function bodies (``float acc[4][4], b[4];``), each with the
    span of source where its name means it: registers, which no checked pointer reaches."""
    arrays = []
    for m in _LOCAL_ARRAY.finditer(masked):
        before = _back(masked, m.start() - 1)
        if before < 0 or masked[before] not in ";{}" or m.group(1) in _NOT_OPERANDS:
            continue
        end = masked.find(";", m.end())
        scope_end = _block_end(masked, m.start())
        for name in [m.group(2)] + re.findall(r",\s*([A-Za-z_]\w*)\s*\[", masked[m.end():end]):
            arrays.append((name, m.start(), scope_end))
    return arrays


def marked_stores(src: str) -> str:
    """The target of each assignment -> ``::tsm_emu::stored(target)`` (``=``) or
    ``::tsm_emu::updated(target)`` (compound assignments, ``++``, ``--``). Elements of local
    arrays are left alone: marking them would cost a call per store into registers."""
    masked = _mask_strings_and_directives(src)
    local_arrays = _local_arrays(masked)
    inserts = []  # (offset, text)

    def local(start: int) -> bool:
        name = _IDENTIFIER.match(masked, start)
        return bool(name) and any(n == name.group() and a <= start < b for n, a, b in local_arrays)

    def wrap(start: int, end: int, mark: str) -> None:
        end = _back(masked, end - 1) + 1
        if start < end and _checked_operand(masked, start, end) and not local(start):
            inserts.append((start, f"::tsm_emu::{mark}("))
            inserts.append((end, ")"))

    for m in _ASSIGNMENT.finditer(masked):
        start = _unary_star_before(masked, _operand_start(masked, m.start()))
        if start < m.start() and not _is_declaration(masked, start):
            wrap(start, m.start(), "stored" if m.group() == "=" else "updated")
    for m in _INCREMENT.finditer(masked):
        before = _back(masked, m.start() - 1)
        if before >= 0 and (masked[before].isalnum() or masked[before] in "_)]"):  # x[i]++
            wrap(_unary_star_before(masked, _operand_start(masked, m.start())), m.start(), "updated")
        else:  # ++x[i]
            wrap(_forward(masked, m.end()), _operand_end(masked, m.end()), "updated")
    return _apply(src, [(offset, offset, text) for offset, text in inserts])
