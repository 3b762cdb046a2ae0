"""Progress for long host loops: a bar redrawn in place on a terminal, a line per update
in logs and notebooks' captured output (where carriage returns would pile up)."""
from __future__ import annotations

import sys
from typing import Optional, TextIO


class ProgressBar:
    """``update(done, text)`` after each step of ``total``; ``close(text)`` at the end."""

    def __init__(self, total: int, prefix: str, *, stream: Optional[TextIO] = None,
                 width: int = 20) -> None:
        self.total = max(int(total), 1)
        self.prefix = prefix
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.inline = bool(getattr(self.stream, "isatty", lambda: False)())
        self._drawn = False

    def update(self, done: int, text: str) -> None:
        if self.inline:
            filled = min(self.width, self.width * done // self.total)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.prefix}[{bar}] {text}\x1b[K")
            self._drawn = True
        else:
            self.stream.write(f"{self.prefix}{text}\n")
        self.stream.flush()

    def close(self, text: Optional[str] = None) -> None:
        if self._drawn:
            self.stream.write("\n")
        if text:
            self.stream.write(f"{self.prefix}{text}\n")
        self.stream.flush()
