"""threadgroup_barrier, threadgroup memory and their limits on the emulator.

Semantics (../shared/notes/metal-semantics.md): every thread of a threadgroup must reach a
barrier before any continues; a barrier reached by only some threads is undefined (the
emulator reports it as KernelFault kind "barrier_divergence" and must never hang); threads
that returned count as arrived only with TSM_EMU_EXITED_THREADS_ARRIVE=1. Threadgroup
memory exists once per threadgroup (static `threadgroup T x[N];` in the body and dynamic
`[[threadgroup(n)]]` arguments whose byte length the host gives, a multiple of 16); static
plus dynamic must fit in 32 KB; a threadgroup holds at most 1024 threads.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, LaunchError, compile_shader

from _hang_guard import call_with_timeout

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

SOURCE = HEADER + r"""
// A tree reduction with one barrier per stage. `skip` names the stage whose barrier is left
// out (256: the barrier after the load; 0: none). skip is uniform, so no divergence.
kernel void tree_sum(device const float* in [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     constant uint& n [[buffer(2)]],
                     constant uint& skip [[buffer(3)]],
                     uint gid [[thread_position_in_grid]],
                     uint lid [[thread_position_in_threadgroup]],
                     uint tg [[threadgroup_position_in_grid]]) {
  threadgroup float buf[256];
  buf[lid] = gid < n ? in[gid] : 0.0f;
  if (skip != 256u) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint s = 128; s > 0; s >>= 1) {
    if (lid < s) {
      buf[lid] += buf[lid + s];
    }
    if (skip != s) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }
  if (lid == 0) {
    out[tg] = buf[0];
  }
}

// Threadgroup memory declared in the body: several rounds of write / barrier / read a
// neighbour's slot / barrier. Another group's data would show up as a wrong group id.
kernel void tg_static_rounds(device uint* out [[buffer(0)]],
                             uint gid [[thread_position_in_grid]],
                             uint lid [[thread_position_in_threadgroup]],
                             uint tg [[threadgroup_position_in_grid]],
                             uint ts [[threads_per_threadgroup]]) {
  threadgroup uint t[128];
  uint acc = 0;
  for (uint r = 0; r < 4; ++r) {
    t[lid] = tg * 100000u + r * 1000u + lid;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[(lid + 1 + r) % ts];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = acc;
}

// The same through a dynamic [[threadgroup(0)]] block.
kernel void tg_dynamic_rounds(device uint* out [[buffer(0)]],
                              threadgroup uint* t [[threadgroup(0)]],
                              uint gid [[thread_position_in_grid]],
                              uint lid [[thread_position_in_threadgroup]],
                              uint tg [[threadgroup_position_in_grid]],
                              uint ts [[threads_per_threadgroup]]) {
  uint acc = 0;
  for (uint r = 0; r < 4; ++r) {
    t[lid] = tg * 100000u + r * 1000u + lid;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[(lid + 1 + r) % ts];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = acc;
}

// One static array and two dynamic blocks at once: three distinct memories.
kernel void tg_three_blocks(device uint* out [[buffer(0)]],
                            threadgroup uint* a [[threadgroup(0)]],
                            threadgroup uint* b [[threadgroup(1)]],
                            uint gid [[thread_position_in_grid]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint tg [[threadgroup_position_in_grid]],
                            uint ts [[threads_per_threadgroup]]) {
  threadgroup uint s[64];
  s[lid] = 1u + lid;
  a[lid] = 1000u + lid + 10000u * tg;
  b[lid] = 2000u + lid;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint j = ts - 1 - lid;
  out[3 * gid + 0] = s[j];
  out[3 * gid + 1] = a[j];
  out[3 * gid + 2] = b[j];
}

// A threadgroup atomic counter: each group counts its own threads.
kernel void tg_counter(device uint* out [[buffer(0)]],
                       uint lid [[thread_position_in_threadgroup]],
                       uint tg [[threadgroup_position_in_grid]]) {
  threadgroup atomic_uint cnt;
  if (lid == 0) {
    atomic_store_explicit(&cnt, 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&cnt, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup | mem_flags::mem_device);
  if (lid == 0) {
    out[tg] = atomic_load_explicit(&cnt, memory_order_relaxed);
  }
}

// Exchange inside one SIMD-group through threadgroup memory; simdgroup_barrier orders it.
kernel void simd_barrier_exchange(device uint* out [[buffer(0)]],
                                  constant uint& use_barrier [[buffer(1)]],
                                  constant uint& salt [[buffer(2)]],
                                  uint lid [[thread_position_in_threadgroup]]) {
  threadgroup uint t[64];
  t[lid] = lid * 3u + salt;
  if (use_barrier != 0u) {
    simdgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = t[lid ^ 1u];
}

// ---- limits ------------------------------------------------------------------------------
kernel void static_32k(device float* out [[buffer(0)]],
                       uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[8192];  // exactly 32 KB
  t[lid] = float(lid);
  t[8191 - lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[lid];
}

kernel void static_too_big(device float* out [[buffer(0)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[8193];  // 32 KB + 4 bytes
  t[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[0];
}

// 16 KB + 16 KB + 4 bytes, declared in one statement.
kernel void static_two_declarators_too_big(device float* out [[buffer(0)]],
                                           uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float a[4096], b[4097];
  a[lid] = 1.0f;
  b[lid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = a[lid] + b[lid];
}

kernel void static_16k_plus_dynamic(device float* out [[buffer(0)]],
                                    threadgroup float* d [[threadgroup(0)]],
                                    uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float s[4096];  // 16 KB
  s[lid] = 1.0f;
  d[lid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = s[lid] + d[lid];
}

kernel void dynamic_only(device float* out [[buffer(0)]],
                         threadgroup float* d [[threadgroup(0)]],
                         uint lid [[thread_position_in_threadgroup]]) {
  d[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = d[lid] + 1.0f;
}

kernel void big_group(device uint* out [[buffer(0)]],
                      uint lid [[thread_index_in_threadgroup]],
                      uint3 ts [[threads_per_threadgroup]],
                      uint3 tgp [[threadgroup_position_in_grid]],
                      uint3 ng [[threadgroups_per_grid]]) {
  threadgroup uint t[1024];
  const uint n = ts.x * ts.y * ts.z;
  const uint tg = tgp.x + ng.x * (tgp.y + ng.y * tgp.z);
  t[lid] = lid;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tg * n + lid] = t[n - 1 - lid];
}
"""

# Kernels whose barriers are reached by only some threads.
DIVERGENT = HEADER + r"""
kernel void early_return(device float* out [[buffer(0)]],
                         uint lid [[thread_position_in_threadgroup]]) {
  if (lid >= 16) {
    return;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = 1.0f;
}

// The barrier is in a branch taken by half the threads; the others reach the next one.
kernel void barrier_in_branch(device float* out [[buffer(0)]],
                              uint lid [[thread_position_in_threadgroup]]) {
  if (lid < 16) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// if / else with one barrier in each branch: two different barriers.
kernel void barrier_if_else(device float* out [[buffer(0)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  if (lid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[lid] = 3.0f;
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[lid] = 4.0f;
  }
}

// A barrier in a loop whose trip count depends on the thread.
kernel void barrier_in_loop(device float* out [[buffer(0)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  for (uint i = 0; i < 1 + (lid & 1u); ++i) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = 5.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Uniform control flow: must not be reported.
kernel void uniform_barriers(device float* out [[buffer(0)]],
                             constant uint& rounds [[buffer(1)]],
                             uint gid [[thread_position_in_grid]]) {
  for (uint i = 0; i < rounds; ++i) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = 6.0f;
}
"""

# TSM_EMU_EXITED_THREADS_ARRIVE is read once per loaded library (a function-local static in
# runtime.cpp, first evaluated at the first barrier). The permissive tests therefore use a
# library of their own: the same kernels plus this one, so the source (and .so) differ.
EXITED_ARRIVE_VARIANT = DIVERGENT + r"""
kernel void exited_threads_arrive_variant(device float* out [[buffer(0)]]) { out[0] = 0.0f; }
"""



@pytest.fixture(autouse=True)
def _strict_barriers(monkeypatch):
    monkeypatch.delenv("TSM_EMU_EXITED_THREADS_ARRIVE", raising=False)


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


@pytest.fixture(scope="module")
def divergent():
    return compile_shader(DIVERGENT)


@pytest.fixture
def permissive(monkeypatch):
    monkeypatch.setenv("TSM_EMU_EXITED_THREADS_ARRIVE", "1")
    return compile_shader(EXITED_ARRIVE_VARIANT)




# ---- barriers order threadgroup memory ---------------------------------------------------
def _tree_inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 10, size=n).astype(np.float32)  # small integers: exact sums
    groups = -(-n // 256)
    padded = np.zeros(groups * 256, dtype=np.float32)
    padded[:n] = x
    return torch.from_numpy(x), padded.reshape(groups, 256).sum(axis=1), groups


@pytest.mark.parametrize("n", [256, 1000, 4096])
def test_tree_reduction_with_every_barrier_is_right(lib, n):
    x, want, groups = _tree_inputs(n)
    out = torch.full((groups,), -1.0)
    lib.tree_sum(x, out, n, 0, threads=groups * 256, group_size=256)
    np.testing.assert_array_equal(out.numpy(), want)  # exact: integer sums below 2**24


@pytest.mark.parametrize("skip", [256, 128, 64, 32, 16, 2])
def test_tree_reduction_missing_one_barrier_is_wrong(lib, skip):
    n = 2048
    x, want, groups = _tree_inputs(n, seed=skip)
    out = torch.full((groups,), -1.0)
    lib.tree_sum(x, out, n, skip, threads=groups * 256, group_size=256)
    assert not np.array_equal(out.numpy(), want), \
        f"removing the barrier after stage {skip} went unnoticed: the emulator does not " \
        "make the missing ordering observable"


def test_removing_the_last_barrier_is_harmless_here(lib):
    # After the last stage only thread 0 reads, and it reads its own write.
    n = 1024
    x, want, groups = _tree_inputs(n, seed=1)
    out = torch.full((groups,), -1.0)
    lib.tree_sum(x, out, n, 1, threads=groups * 256, group_size=256)
    np.testing.assert_array_equal(out.numpy(), want)


def test_simdgroup_barrier_orders_threadgroup_memory_in_a_simdgroup(lib):
    out = torch.zeros(64, dtype=torch.int32)
    lid = np.arange(64)
    for salt in (7, 11):
        lib.simd_barrier_exchange(out, 1, salt, threads=64, group_size=64)
        np.testing.assert_array_equal(out.numpy(), (lid ^ 1) * 3 + salt)
    # Without the barrier even lanes read their neighbour's slot before it is written
    # (the salt differs from the previous launch, so stale memory cannot pass for it).
    out.zero_()
    lib.simd_barrier_exchange(out, 0, 13, threads=64, group_size=64)
    assert not np.array_equal(out.numpy(), (lid ^ 1) * 3 + 13)


# ---- threadgroup memory: shared within a group, private to it --------------------------
def _expected_rounds(n, group):
    gid = np.arange(n)
    tg, lid = gid // group, gid % group
    ts = np.minimum(group, n - tg * group)
    acc = np.zeros(n, dtype=np.int64)
    for r in range(4):
        acc += tg * 100000 + r * 1000 + (lid + 1 + r) % ts
    return acc


@pytest.mark.parametrize("workers", [None, "8"])
@pytest.mark.parametrize("n,group", [(128 * 64, 128), (1000, 96)])
def test_static_threadgroup_memory_is_per_group_and_shared_within(lib, monkeypatch,
                                                                 workers, n, group):
    if workers:
        monkeypatch.setenv("TSM_EMU_WORKERS", workers)
    out = torch.zeros(n, dtype=torch.int32)
    lib.tg_static_rounds(out, threads=n, group_size=group)
    np.testing.assert_array_equal(out.numpy(), _expected_rounds(n, group))


@pytest.mark.parametrize("workers", [None, "8"])
@pytest.mark.parametrize("n,group", [(128 * 64, 128), (1000, 96)])
def test_dynamic_threadgroup_memory_is_per_group_and_shared_within(lib, monkeypatch,
                                                                  workers, n, group):
    if workers:
        monkeypatch.setenv("TSM_EMU_WORKERS", workers)
    out = torch.zeros(n, dtype=torch.int32)
    lib.tg_dynamic_rounds(out, threads=n, group_size=group, threadgroup_memory=[group * 4])
    np.testing.assert_array_equal(out.numpy(), _expected_rounds(n, group))


def test_static_and_dynamic_blocks_are_distinct(lib):
    n, group = 200, 64
    out = torch.zeros(3 * n, dtype=torch.int32)
    lib.tg_three_blocks(out, threads=n, group_size=group, threadgroup_memory=[256, 256])
    gid = np.arange(n)
    tg, lid = gid // group, gid % group
    ts = np.minimum(group, n - tg * group)
    j = ts - 1 - lid
    want = np.stack([1 + j, 1000 + j + 10000 * tg, 2000 + j], axis=1).reshape(-1)
    np.testing.assert_array_equal(out.numpy(), want)


def test_threadgroup_atomic_counts_each_groups_threads(lib):
    n, group = 1000, 96
    out = torch.zeros(-(-n // group), dtype=torch.int32)
    lib.tg_counter(out, threads=n, group_size=group)
    want = [group] * (n // group) + [n % group]
    np.testing.assert_array_equal(out.numpy(), want)


# ---- barrier divergence: reported, never a hang ------------------------------------------
def _expect_divergence(kernel, group=32):
    out = torch.zeros(group)
    with pytest.raises(KernelFault) as info:
        call_with_timeout(kernel, out, threads=group, group_size=group)
    assert info.value.kind == "barrier_divergence", str(info.value)
    return str(info.value)


def test_threads_returning_before_a_barrier_is_divergence(divergent):
    message = _expect_divergence(divergent.early_return)
    assert "returned" in message and "TSM_EMU_EXITED_THREADS_ARRIVE" in message


def test_barrier_in_a_branch_is_divergence(divergent):
    _expect_divergence(divergent.barrier_in_branch)


def test_barriers_in_if_and_else_are_divergence(divergent):
    _expect_divergence(divergent.barrier_if_else)


def test_barrier_in_a_loop_with_thread_dependent_trip_count_is_divergence(divergent):
    _expect_divergence(divergent.barrier_in_loop)


def test_divergence_in_a_later_threadgroup_is_found(divergent):
    # Many groups: the fault surfaces from whichever worker meets it; the launch ends.
    out = torch.zeros(64 * 32)
    with pytest.raises(KernelFault) as info:
        call_with_timeout(divergent.early_return, out, threads=64 * 32, group_size=32)
    assert info.value.kind == "barrier_divergence"


def test_uniform_barriers_are_not_reported(divergent):
    out = torch.zeros(64)
    call_with_timeout(divergent.uniform_barriers, out, 3, threads=64, group_size=32)
    np.testing.assert_array_equal(out.numpy(), 6.0)


def test_library_still_works_after_a_fault(divergent):
    _expect_divergence(divergent.early_return)
    out = torch.zeros(32)
    call_with_timeout(divergent.uniform_barriers, out, 2, threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), 6.0)


def test_exited_threads_arrive_when_asked(permissive):
    out = torch.zeros(32)
    call_with_timeout(permissive.early_return, out, threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), [1.0] * 16 + [0.0] * 16)


def test_exited_threads_arrive_still_reports_different_barriers(permissive):
    _expect_divergence(permissive.barrier_if_else)
    _expect_divergence(permissive.barrier_in_branch)


# ---- limits ------------------------------------------------------------------------------
def test_static_threadgroup_memory_of_exactly_32k_is_allowed(lib):
    out = torch.zeros(64)
    lib.static_32k(out, threads=64, group_size=64)
    np.testing.assert_array_equal(out.numpy(), np.arange(64, dtype=np.float32))


def test_static_threadgroup_memory_over_32k_is_a_launch_error(lib):
    with pytest.raises(LaunchError, match="32 KB"):
        call_with_timeout(lib.static_too_big, torch.zeros(32), threads=32, group_size=32)


def test_static_threadgroup_memory_over_32k_in_one_statement_is_a_launch_error(lib):
    with pytest.raises(LaunchError, match="32 KB"):
        call_with_timeout(lib.static_two_declarators_too_big, torch.zeros(32), threads=32,
                          group_size=32)


def test_static_plus_dynamic_threadgroup_memory_limit(lib):
    out = torch.zeros(32)
    lib.static_16k_plus_dynamic(out, threads=32, group_size=32, threadgroup_memory=[16384])
    np.testing.assert_array_equal(out.numpy(), 3.0)
    with pytest.raises(LaunchError, match="32 KB"):
        call_with_timeout(lib.static_16k_plus_dynamic, out, threads=32, group_size=32,
                          threadgroup_memory=[16384 + 16])


def test_dynamic_threadgroup_memory_limit(lib):
    out = torch.zeros(32)
    lib.dynamic_only(out, threads=32, group_size=32, threadgroup_memory=[32768])
    np.testing.assert_array_equal(out.numpy(), np.arange(1, 33, dtype=np.float32))
    with pytest.raises(LaunchError, match="32768"):
        lib.dynamic_only(out, threads=32, group_size=32, threadgroup_memory=[32768 + 16])
    with pytest.raises(LaunchError, match="32768"):
        lib.tg_three_blocks(torch.zeros(96, dtype=torch.int32), threads=32, group_size=32,
                            threadgroup_memory=[16384, 16384 + 16])


@pytest.mark.parametrize("nbytes", [100, 8, 32768 - 8])
def test_dynamic_threadgroup_memory_must_be_a_multiple_of_16(lib, nbytes):
    with pytest.raises(LaunchError, match="multiple of 16"):
        lib.dynamic_only(torch.zeros(2), threads=2, group_size=2, threadgroup_memory=[nbytes])


def test_dynamic_threadgroup_memory_length_is_required(lib):
    with pytest.raises(LaunchError, match="threadgroup_memory"):
        lib.dynamic_only(torch.zeros(2), threads=2, group_size=2)
    with pytest.raises(LaunchError, match="threadgroup_memory"):
        lib.tg_three_blocks(torch.zeros(6, dtype=torch.int32), threads=2, group_size=2,
                            threadgroup_memory=[256])


def test_1024_threads_per_group_is_allowed(lib):
    out = torch.zeros(2048, dtype=torch.int32)
    lib.big_group(out, threads=(32, 32, 2), group_size=(32, 32, 1))
    np.testing.assert_array_equal(out.numpy(), np.tile(np.arange(1023, -1, -1), 2))
    out.zero_()
    lib.big_group(out, threads=2048, group_size=1024)
    np.testing.assert_array_equal(out.numpy(), np.tile(np.arange(1023, -1, -1), 2))


@pytest.mark.parametrize("group", [1025, (32, 33), (32, 32, 2), (2048, 1, 1), 0])
def test_more_than_1024_threads_per_group_is_a_launch_error(lib, group):
    with pytest.raises(LaunchError, match="1024"):
        lib.big_group(torch.zeros(4096, dtype=torch.int32), threads=4096, group_size=group)
