"""Launching the fault tests' kernels: each takes an output of one float per thread and one
int (which case to run, or by how much to step out of bounds)."""
from __future__ import annotations

from typing import List

import pytest
import torch

from torch_sparse_metal.emulator import KernelFault


def line_of(lines: List[str], needle: str) -> int:
    """The 1-based line of the shader's source that holds ``needle``."""
    return next(n for n, text in enumerate(lines, start=1) if needle in text)


def run(lib, kernel: str, value: int, threads: int = 4, group: int = 4) -> torch.Tensor:
    out = torch.full((threads,), -1.0)
    lib[kernel](out, torch.tensor([value], dtype=torch.int32), threads=threads, group_size=group)
    return out


def fault(lib, kernel: str, value: int, threads: int = 4, group: int = 4, nothing_stored: bool = False) -> str:
    """The message of the out_of_bounds fault the launch must raise (``nothing_stored``: in
    the first thread, before its store)."""
    out = torch.full((threads,), -1.0)
    with pytest.raises(KernelFault) as info:
        lib[kernel](out, torch.tensor([value], dtype=torch.int32), threads=threads, group_size=group)
    assert info.value.kind == "out_of_bounds"
    if nothing_stored:
        assert out.tolist() == [-1.0] * threads
    return str(info.value)
