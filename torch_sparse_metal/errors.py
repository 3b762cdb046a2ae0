"""Exceptions of the Metal emulator.

Layer: base, below every other (the layers are in the package's docstring). Imports
nothing of the package.
"""
from __future__ import annotations

import re
from typing import Optional

FAULT_KINDS = ("out_of_bounds", "integer_division", "threadgroup_race", "device_race", "barrier_divergence",
               "uninitialized_read", "inactive_lane", "tensor_extents", "hang", "crash")


class MetalCompileError(RuntimeError):
    """A shader did not compile. ``line`` and ``source_line`` point into the kernel source."""

    def __init__(self, message: str, log: str = "", line: Optional[int] = None,
                 source_line: Optional[str] = None) -> None:
        super().__init__(message)
        self.log = log
        self.line = line
        self.source_line = source_line

    @classmethod
    def from_log(cls, what: str, log: str, source: Optional[str], origin: str) -> "MetalCompileError":
        """Build the error from a compiler log: the first error, its line, and that line's text."""
        errors = [ln for ln in log.splitlines() if re.search(r"\berror\b", ln)]
        first = errors[0] if errors else (log.strip().splitlines() or ["(no output)"])[-1]
        line = source_line = None
        if source is not None:
            m = re.search(re.escape(origin.split("/")[-1]) + r":(\d+)(?::\d+)?:\s*(?:fatal )?error", log) \
                or re.search(r"\.metal:(\d+)(?::\d+)?:\s*(?:fatal )?error", log)
            if m:
                line = int(m.group(1))
                lines = source.splitlines()
                if 0 < line <= len(lines):
                    source_line = lines[line - 1]
        message = f"{what} failed: {first.strip()}"
        if line is not None:
            message += f"\n  at {origin} line {line}: {source_line.strip() if source_line else ''}"
        message += "\n\nfull compiler output:\n" + log.strip()
        return cls(message, log, line, source_line)

    @classmethod
    def from_diagnostics(cls, what: str, diagnostics) -> "MetalCompileError":
        """Errors of the front-end check: ``(file, line, message, text)`` each, in source
        order, ``text`` the line as the preprocessor gave it (never read from the file a
        line marker names: a shader's #line could name any file); ``line`` and
        ``source_line`` are the first one's."""
        shown = [f"{file.split('/')[-1]}:{line}: error: {message}" + (f"\n    {text.strip()}" if text else "")
                 for file, line, message, text in diagnostics]
        file, line, message, text = diagnostics[0]
        log = "\n".join(shown)
        return cls(f"{what}: {message}\n  at {file.split('/')[-1]} line {line}: "
                   f"{text.strip() if text else ''}\n\n{log}", log, line, text)

    @classmethod
    def at_offset(cls, message: str, preprocessed: str, offset: int, origin: str) -> "MetalCompileError":
        """An error found by the emulator's own parser at ``offset`` of the preprocessed text."""
        line, file = 0, origin
        for ln in preprocessed[:offset].splitlines(keepends=True):
            m = re.match(r'#\s*(\d+)\s+"([^"]*)"', ln)
            if m:  # a line marker names the line that follows it
                line, file = int(m.group(1)) - 1, m.group(2)
            else:
                line += 1
        text = preprocessed.splitlines()[preprocessed[:offset].count("\n")] if preprocessed else ""
        return cls(f"{origin}: {message}\n  at {file.split('/')[-1]} line {line}: {text.strip()}",
                   "", line, text)


class KernelFault(RuntimeError):
    """A kernel did something Metal leaves undefined; ``kind`` names what."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class LaunchError(ValueError):
    """A dispatch was asked for with arguments Metal would reject."""


class UnknownKernelError(LaunchError, AttributeError):
    """A library has no kernel of that name; raised by both backends.

    A ``LaunchError`` (so a ``ValueError``) like every other bad launch, and an
    ``AttributeError`` because the emulator's libraries expose kernels as attributes
    (``hasattr(lib, name)`` and ``getattr(lib, name, default)`` keep working).
    """

    def __init__(self, kernel: str, origin: str, available) -> None:
        super().__init__(f"no kernel named {kernel!r} in {origin}; kernels: "
                         f"{', '.join(available) or '(none)'}")
        self.kernel = kernel
