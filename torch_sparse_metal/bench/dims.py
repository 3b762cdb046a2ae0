"""Sizes on the benchmarks' command lines: ``AxB...`` or one number for all dimensions."""
from __future__ import annotations

from typing import Tuple


def parse_dims(text: str, what: str, form: str) -> Tuple[int, ...]:
    """The dimensions ``text`` gives, as many as ``form`` has (``"IxO"``: 2, ``"MxNxK"``: 3),
    a single ``S`` standing for all of them; ValueError naming ``what`` and ``form`` for
    anything else, or for a dimension below 1."""
    count = len(form.split("x"))
    try:
        dims = [int(x) for x in text.lower().split("x")]
    except ValueError:
        dims = []
    if len(dims) == 1:
        dims = dims * count
    if len(dims) != count:
        raise ValueError(f"{what} {text!r}: expected S or {form}")
    if min(dims) < 1:
        raise ValueError(f"{what} {text!r}: every dimension must be at least 1")
    return tuple(dims)
