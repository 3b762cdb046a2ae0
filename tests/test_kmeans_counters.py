"""The k-means kernels' memory behaviour from the emulator's counters: the row norms
(kmeans_sq_norms) and the distance scan (kmeans_assign) coalesced, the accumulation one device atomic per (cluster present in a
block, feature) with the lanes of each atomic instruction on distinct addresses."""
from __future__ import annotations

import pytest
import torch

import torch_sparse_metal as tsm
from torch_sparse_metal.emulator import coalescing_efficiency, instrumented, record
from torch_sparse_metal.ops import kmeans as K


def _counted(fn, *args, **kwargs):
    with tsm.use_backend("emulator"), instrumented(), record() as launches:
        result = fn(*args, **kwargs)
    return result, launches


def _assign_transactions(n: int, k: int, store: bool) -> int:
    """Transactions of kmeans_assign when every instruction is one whole segment: a
    SIMD-group's rows are one contiguous run of rows * k floats from a 128-byte boundary,
    32 to an instruction (read, and written back when storing), plus one segment each for
    its labels and minimums (and its x_sq when finishing D')."""
    total = 0
    for p0 in range(0, n, 32):
        rows = min(32, n - p0)
        total += -(-rows * k // 32) * (2 if store else 1) + (3 if store else 2)
    return total


@pytest.mark.parametrize("k", [1, 5, 16, 32, 40, 50, 64, 96, 128])
def test_assign_is_coalesced_when_rows_fit_a_block_or_k_is_a_multiple_of_32(k):
    n = 1000  # not a whole number of threadgroups
    dist = torch.rand(n, k, generator=torch.Generator().manual_seed(k))
    (labels, min_dist), launches = _counted(K.assign_from_distances, dist)
    c = launches[0].counters
    assert launches[0].kernel == "kmeans_assign_float"
    assert c["device_transactions"] == _assign_transactions(n, k, store=False)
    assert coalescing_efficiency(c) == 1.0
    torch.testing.assert_close(labels.long(), dist.argmin(1))
    torch.testing.assert_close(min_dist, dist.min(1).values)


def test_assign_storing_distances_of_width_40_is_coalesced():
    # k = 40: rows 160 bytes apart. In blocks of 32 columns a row's first block straddled
    # two segments and its second touched one for 32 bytes: 47%. A 64-column block holds
    # the whole row, so the SIMD-group's 32 rows are one contiguous run.
    n, k = 500, 40
    x, c = torch.randn(n, 8), torch.randn(k, 8)
    d, launches = _counted(K.distances, x, c)  # the GEMM, then kmeans_assign storing D
    assign = [l for l in launches if l.kernel.startswith("kmeans_assign")][0].counters
    assert assign["device_transactions"] == _assign_transactions(n, k, store=True)
    assert coalescing_efficiency(assign) == 1.0
    torch.testing.assert_close(d, torch.cdist(x, c) ** 2, rtol=1e-4, atol=1e-4)


def test_assign_of_wider_rows_not_a_multiple_of_32_stays_above_half():
    # k = 100: 64-column blocks, each 256-byte row piece straddling a third segment.
    n, k = 500, 100
    dist = torch.rand(n, k, generator=torch.Generator().manual_seed(k))
    (labels, _), launches = _counted(K.assign_from_distances, dist)
    assert coalescing_efficiency(launches[0].counters) > 0.5
    torch.testing.assert_close(labels.long(), dist.argmin(1))


@pytest.mark.parametrize("d", [1, 5, 32, 40, 64, 128])
def test_sq_norms_are_coalesced_when_rows_fit_a_block_or_d_is_a_multiple_of_32(d):
    n = 1000
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(d))
    norms, launches = _counted(K.sq_norms, x)
    c = launches[0].counters
    # a SIMD-group's rows, 32 floats to an instruction, then one segment of norms
    rows = [min(32, n - p0) for p0 in range(0, n, 32)]
    assert c["device_transactions"] == sum(-(-r * d // 32) + 1 for r in rows)
    assert coalescing_efficiency(c) == 1.0
    torch.testing.assert_close(norms, (x * x).sum(1), rtol=1e-5, atol=1e-5)


def test_accumulate_one_atomic_per_cluster_present_and_feature_on_distinct_addresses():
    n, k, d = 3000, 7, 24
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    labels = torch.randint(0, k, (n,), generator=g, dtype=torch.int32)
    labels[:500] = 3  # a block where one cluster is alone
    (sums, counts), launches = _counted(K.accumulate, x, labels, k, mode="atomic")
    torch.testing.assert_close(counts.long(), torch.bincount(labels.long(), minlength=k))
    expected = torch.zeros(k, d).index_add_(0, labels.long(), x)
    torch.testing.assert_close(sums, expected, rtol=1e-4, atol=1e-4)
    shape = K.accumulate_shape(n, k, d, 4)
    present = sum(len(torch.unique(labels[b * shape.block:(b + 1) * shape.block]))
                  for b in range(shape.blocks))
    c = [l for l in launches if "accumulate" in l.kernel][0].counters
    assert c["atomics"] == present * d + present  # the sums, then the counts (tile 0)
    assert c["atomic_conflicts"] == 0
