"""The GEMM rungs' device transactions, from the emulator's counters, against a count made
by hand: every load and store touches runs of 32 neighbours along a memory row (one
128-byte segment of float; 64 bytes of a 16-bit type, inside one segment), one run per
SIMD-group instruction (simdgroup, register) or four (shuffle, along K), and no element
is read twice by the unit that shares it (a threadgroup's 64 x 64 tile, a shuffle
SIMD-group's 32 x 32). With every leading dimension a multiple of 32 elements a run never
straddles segments, so the transactions are the runs with at least one element inside
the matrix."""
from __future__ import annotations

import math

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.emulator import coalescing_efficiency, instrumented, record

TILE = {"simdgroup": 64, "register": 64, "shuffle": 32}  # rows and columns of C sharing loads


def _operand(rows: int, cols: int, transposed: bool, ld: int, dtype, seed: int):
    """A ``rows x cols`` matrix whose memory rows are ``ld`` elements apart (a slice), as a
    transposed view of a ``cols x rows`` one if asked."""
    g = torch.Generator().manual_seed(seed)
    if transposed:
        return torch.randn(cols, ld, generator=g).to(dtype)[:, :rows].t()
    return torch.randn(rows, ld, generator=g).to(dtype)[:, :cols]


def _runs(mem_rows: int, mem_cols: int, copies: int) -> int:
    # A matrix cut into blocks whose widths are multiples of 32: each memory row splits
    # into ceil(cols / 32) runs, whatever the blocks; each block is copied once per tile
    # of the other output dimension.
    return copies * mem_rows * math.ceil(mem_cols / 32)


def expected_transactions(m: int, n: int, k: int, ta: bool, tb: bool, tile: int) -> int:
    tiles_m, tiles_n = math.ceil(m / tile), math.ceil(n / tile)
    a = _runs(k, m, tiles_n) if ta else _runs(m, k, tiles_n)    # A^T is K x M in memory
    b = _runs(n, k, tiles_m) if tb else _runs(k, n, tiles_m)    # B^T is N x K
    return a + b + _runs(m, n, 1)                               # C, written once


SHAPES = [(128, 128, 128), (70, 96, 40)]  # whole tiles; partial tiles in M, N and K

@pytest.mark.parametrize("rung", list(TILE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ta, tb", [(False, False), (False, True), (True, False), (True, True)])
def test_rungs_touch_each_segment_once_per_copy(rung, dtype, shape, ta, tb):
    m, n, k = shape
    a = _operand(m, k, ta, ld=160, dtype=dtype, seed=1)
    b = _operand(k, n, tb, ld=192, dtype=dtype, seed=2)
    with tsm.use_backend("emulator"), instrumented(), record() as launches:
        c = tsm.mm(a, b, kernel=rung)
    torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)
    counters = launches[0].counters
    assert counters["device_transactions"] == expected_transactions(m, n, k, ta, tb, TILE[rung])
    assert counters["bank_conflicts"] == 0
    # The shuffle rung's loads along K are 4 rows x 4 elements per lane: 128 bytes of each
    # row in float, 64 of a 16-bit type, and less in a partial last step.
    if rung != "shuffle" or (dtype == torch.float32 and shape == (128, 128, 128)):
        assert coalescing_efficiency(counters) == 1.0

