"""What a shader may read at compile time: files under its own directory and the include
directories given (the package's ``shaders/`` among them), and the emulated
``<metal_*>`` headers. Checked before the C++ preprocessor opens anything.

Layer: drive (the layers are in the package's docstring). Imports only _errors; the
compiler runs it before the preprocessor.

The preprocessor itself would open any path a directive names (an absolute path, ``..``
out of every directory, ``/dev/zero``) and its diagnostics would quote the file, so every
file a shader can reach is scanned first: each ``#include`` (``#include_next``,
``#import``, ``#embed``, ``__has_include``) must name a literal ``"file"`` or ``<file>``
(a computed include cannot be vetted) and every place the preprocessor would look for it
must lie inside an allowed directory (after resolving ``..`` and symbolic links). The scan
ignores ``#if`` (a directive in a branch never taken must pass too) and skips comments.

The preprocessor's output is checked as well: it must hold no directive but line markers
and ``#pragma`` (a macro can expand to ``# include "..."``, which the C++ compiler run on
the output would obey), and no inline assembly (Metal has none; ``.incbin`` reads files).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Sequence, Set

from ..errors import MetalCompileError

_DIRECTIVE = re.compile(r"^[ \t]*(?:#|%:)[ \t]*(include_next|include|import|embed)\b(.*)$", re.M)
_HAS_INCLUDE = re.compile(r"\b__has_(include_next|include|embed)\s*\(([^)]*)\)")
_OPERAND = re.compile(r'\s*(?:"([^"\n]*)"|<([^>\n]*)>)')
# C and C++ comments, and the string / character literals a comment marker may sit in.
_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'',
                                 re.S)
# Any directive but a line marker ("# 12 file") or a pragma; the lookahead (?![ \t]) keeps
# the blanks from backtracking into the match.
_OUTPUT_DIRECTIVE = re.compile(r"^[ \t]*(?:#|%:)[ \t]*(?![ \t]|\d|pragma\b)(\w*)", re.M)
_DEPENDENCY_PRAGMA = re.compile(r"^[ \t]*(?:#|%:)[ \t]*pragma[ \t]+GCC[ \t]+dependency\b", re.M)
_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b")


def _without_comments(text: str, literals: bool = False) -> str:
    """``text`` without its comments (and, with ``literals``, without the contents of its
    string and character literals: a line marker's file name, say)."""
    text = text.replace("\\\r\n", "").replace("\\\n", "")  # line splices first, as the preprocessor

    def blank(m: re.Match) -> str:
        s = m.group(0)
        if s.startswith("/"):
            return " " + "\n" * s.count("\n")  # keep line numbers
        return s[0] + s[-1] if literals else s

    return _COMMENT_OR_LITERAL.sub(blank, text)


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == root or root in real.parents for root in roots)


def check_includes(source: Path, search: Sequence[Path], trusted: Path, origin: str) -> None:
    """Vet every include reachable from ``source``.

    ``search``: the ``-I`` directories in the preprocessor's order (also the allowed
    roots, with ``source``'s own directory); files under ``trusted`` (the emulated headers)
    are allowed and not scanned. Raises :class:`MetalCompileError` naming the file and line.
    """
    roots = [Path(os.path.realpath(d)) for d in [source.parent, *search]]
    trusted = Path(os.path.realpath(trusted))
    seen: Set[Path] = set()
    # Paths as the preprocessor forms them (a quoted include is looked up beside the
    # including file as it was reached, symbolic links and all); compared by real path.
    pending: List[Path] = [source]
    while pending:
        path = pending.pop()
        real = Path(os.path.realpath(path))
        if real in seen or trusted in real.parents:
            continue
        seen.add(real)
        try:
            text = _without_comments(path.read_text(errors="replace"))
        except OSError as e:
            raise MetalCompileError(f"{origin}: cannot read {path.name}: {e.strerror}") from None
        uses = [(m.start(), m.group(1), m.group(2)) for m in _DIRECTIVE.finditer(text)]
        uses += [(m.start(), "__has_" + m.group(1), m.group(2)) for m in _HAS_INCLUDE.finditer(text)]
        for offset, kind, operand in sorted(uses):
            line = text.count("\n", 0, offset) + 1
            where = f"{origin}: {path.name} line {line}"
            m = _OPERAND.match(operand)
            if not m:
                raise MetalCompileError(f"{where}: {kind} must name a \"file\" or <file> literally; "
                                        "the emulator does not allow computed includes")
            name = m.group(1) if m.group(1) is not None else m.group(2)
            quoted = m.group(1) is not None
            if os.path.isabs(name) or not name:
                raise MetalCompileError(f"{where}: {kind} of {name!r}: only files under the "
                                        "shader's directory and the include directories may be "
                                        "included, by relative name")
            directories = ([path.parent] if quoted else []) + list(search)
            for directory in directories:
                candidate = directory / name
                if not candidate.exists():
                    continue
                if not _inside(candidate, roots + [trusted]):
                    raise MetalCompileError(f"{where}: {kind} of {name!r} leads outside the "
                                            "shader's directory and the include directories")
                if candidate.is_file():
                    pending.append(candidate)
        if _DEPENDENCY_PRAGMA.search(text):
            raise MetalCompileError(f"{origin}: {path.name}: #pragma GCC dependency is not allowed")


def check_preprocessed(text: str, origin: str) -> None:
    """The preprocessor's output holds user code only: no directive a macro produced (the
    compiler run on this text would obey it) and no inline assembly."""
    for m in _OUTPUT_DIRECTIVE.finditer(text):
        raise MetalCompileError(f"{origin}: a macro expands to the preprocessor directive "
                                f"#{m.group(1)}, which Metal would not run; write it directly")
    if _DEPENDENCY_PRAGMA.search(text):
        raise MetalCompileError(f"{origin}: #pragma GCC dependency is not allowed")
    m = _ASM.search(_without_comments(text, literals=True))  # not in a file name: `a.asm.metal`
    if m:
        raise MetalCompileError(f"{origin}: inline assembly ({m.group(0)}) is not Metal")
