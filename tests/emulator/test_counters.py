"""The counters instrumented (sanitized) dispatches report through record()."""
import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import compile_shader, record

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Transpose a 32x32 block through threadgroup memory. Reading a column of an unpadded
// [32][32] tile puts all 32 lanes of a SIMD-group on one bank; padding a row by one float
// spreads them over all 32 banks. (Metal declares threadgroup variables in kernels only.)
template <uint PAD>
void transpose_block(device const float* in, device float* out, uint2 lid, threadgroup float* tile) {
  tile[lid.y * (32 + PAD) + lid.x] = in[lid.y * 32 + lid.x];  // a row per SIMD-group: no conflict
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid.y * 32 + lid.x] = tile[lid.x * (32 + PAD) + lid.y];  // a column per SIMD-group
}
kernel void transpose_unpadded(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                               uint2 lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[32 * 32];
  transpose_block<0>(in, out, lid, tile);
}
kernel void transpose_padded(device const float* in [[buffer(0)]], device float* out [[buffer(1)]],
                             uint2 lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[32 * 33];
  transpose_block<1>(in, out, lid, tile);
}

kernel void count_things(device const float* x [[buffer(0)]], device atomic_uint* n [[buffer(1)]],
                         device float* y [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(n, 1u, memory_order_relaxed);
  y[gid] = fma(x[gid], 2.0f, 1.0f);
  threadgroup_barrier(mem_flags::mem_device);
  threadgroup_barrier(mem_flags::mem_device);
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, sanitize=True)


@pytest.mark.parametrize("kernel, conflicts", [
    # 32 SIMD-groups (one per row of the block), one column read each: 32 words on one bank.
    ("transpose_unpadded", 32 * 31),
    ("transpose_padded", 0),
])
def test_bank_conflicts(lib, kernel, conflicts):
    x = torch.arange(32 * 32, dtype=torch.float32)
    y = torch.full((32 * 32,), -1.0)  # a write of the value already there would not count
    with record() as launches:
        getattr(lib, kernel)(x, y, threads=(32, 32), group_size=(32, 32))
    np.testing.assert_array_equal(y.view(32, 32).numpy(), x.view(32, 32).numpy().T)
    c = launches[0].counters
    assert c["bank_conflicts"] == conflicts
    assert c["threadgroup_accesses"] == 2 * 32 * 32
    assert c["barriers"] == 1
    assert c["device_bytes_read"] == c["device_bytes_written"] == 32 * 32 * 4


def test_atomics_fmas_barriers_and_bytes(lib):
    n_threads, group = 96, 32
    x, n, y = torch.randn(n_threads), torch.zeros(1, dtype=torch.int32), torch.full((n_threads,), -7.0)
    with record() as launches:
        lib.count_things(x, n, y, threads=n_threads, group_size=group)
    c = launches[0].counters
    assert n.item() == n_threads
    assert c["atomics"] == n_threads
    assert c["fmas"] == n_threads
    assert c["barriers"] == 2 * (n_threads // group)
    assert c["device_bytes_read"] == 4 * n_threads
    assert c["device_bytes_written"] == 4 * n_threads


def test_plain_libraries_report_no_counters():
    lib = compile_shader(SOURCE)
    with record() as launches:
        lib.count_things(torch.randn(32), torch.zeros(1, dtype=torch.int32), torch.zeros(32),
                         threads=32, group_size=32)
    assert launches[0].counters is None


def test_dispatches_begun_outside_record_are_not_counted(lib, monkeypatch):
    """Pairing accesses into instructions is skipped when nothing records: a record() block
    opened (in another thread) while such a dispatch runs gets no counters for it, rather
    than counters missing the per-instruction ones."""
    from torch_sparse_metal.emulator import _library

    x = torch.arange(32 * 32, dtype=torch.float32)
    monkeypatch.setattr(_library, "recording", lambda: False)  # the block opens just after the check
    with record() as launches:
        lib.transpose_unpadded(x, torch.empty(32 * 32), threads=(32, 32), group_size=(32, 32))
    assert launches[0].counters is None
    monkeypatch.undo()
    with record() as launches:
        lib.transpose_unpadded(x, torch.empty(32 * 32), threads=(32, 32), group_size=(32, 32))
    assert launches[0].counters["bank_conflicts"] == 32 * 31


def test_instrumented_gives_package_kernels_counters(monkeypatch):
    import torch_sparse_metal as tsm
    from torch_sparse_metal.emulator import instrumented

    monkeypatch.delenv("TSM_SANITIZE", raising=False)
    layer = tsm.nn.SparseLinear(20, 10, density=0.5)
    x = torch.randn(4, 20)
    with tsm.use_backend("emulator"):
        with record() as plain:
            layer(x)
        with instrumented(), record() as counted:
            layer(x)
    assert plain[0].counters is None
    c = counted[0].counters
    assert c["fmas"] == 4 * layer.nnz  # one fma per edge per batch element
    assert c["device_bytes_written"] > 0
