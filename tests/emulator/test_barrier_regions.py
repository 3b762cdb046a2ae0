"""Barrier regions: kernels whose threads run as a loop between threadgroup barriers.

The translation (torch_sparse_metal/emulator/_regions.py) gives a kernel whose only
synchronisation is threadgroup_barrier statements in its own body a second definition that
runs a whole threadgroup without fibers. Its promise is that nothing observable changes:
the same results bit for bit, the same order of execution (so the same sanitizer reports),
the same faults with the same words. The oracle here is the fiber scheduler itself: every
kernel is compiled both ways (TSM_EMU_REGIONS=0 turns the regions off) and every launch
must agree, result and fault alike. The kernels cover the structures the translation
handles (nested loops, if/else, do/while, break and continue, early returns, variables of
every kind live across a barrier, parameters the kernel modifies) and randomly generated
ones; others check which kernels qualify and that the others still run as fibers.
"""
from __future__ import annotations

import random
import re
import tempfile
import warnings
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.emulator import KernelFault, _compiler, compile_shader, record

from _random_kernels import random_kernel
from _schedules import both_ways, bitwise_equal, grouped

from _hang_guard import call_with_timeout

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

# Each kernel: out[gid] gets a value that depends on threadgroup memory written by other
# threads between barriers, so a barrier in the wrong place or a variable lost across one
# changes the answer.
STRUCTURES = HEADER + r"""
struct Pair { float a; int b; };
constant constexpr uint WIDTH = 64;

kernel void nested_loops(device float* out [[buffer(0)]], constant uint& rounds [[buffer(1)]],
                         uint lid [[thread_position_in_threadgroup]],
                         uint gid [[thread_position_in_grid]], uint n [[threads_per_threadgroup]]) {
  threadgroup float t[WIDTH];
  float acc = float(lid);
  Pair p = {1.0f, int(lid)};
  float hist[3] = {0.0f, 0.0f, 0.0f};
  for (uint r = 0; r < rounds; ++r) {
    const uint shift = r + 1, other = (lid + shift) % n;
    for (uint q = 0; q < 2; q++) {
      t[lid] = acc + float(q);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      acc = 0.5f * acc + t[other] * p.a;
      hist[(r + q) % 3] += acc;
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    p.b += int(r);
  }
  out[gid] = acc + hist[0] - hist[1] + hist[2] + float(p.b);
}

kernel void if_else_loops(device float* out [[buffer(0)]], constant uint& mode [[buffer(1)]],
                          uint lid [[thread_position_in_threadgroup]],
                          uint gid [[thread_position_in_grid]], uint n [[threads_per_threadgroup]]) {
  threadgroup float t[WIDTH];
  float v = float(gid) * 0.25f;
  if (mode == 1) {
    t[lid] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v += t[n - 1 - lid];
  } else {
    uint i = 0;
    while (i < mode) {
      t[lid] = v + float(i);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      v = t[(lid + 1) % n];
      threadgroup_barrier(mem_flags::mem_threadgroup);
      ++i;
    }
  }
  uint k = 0;
  do {
    t[lid] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v += t[(lid + k) % n];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    k += 3;
  } while (k < 7);
  if (mode != 0) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = v;
}

kernel void break_continue(device float* out [[buffer(0)]], constant uint& limit [[buffer(1)]],
                           uint lid [[thread_position_in_threadgroup]],
                           uint gid [[thread_position_in_grid]], uint n [[threads_per_threadgroup]]) {
  threadgroup float t[WIDTH];
  float v = 1.0f;
  for (uint r = 0;; ++r) {
    if (r == limit) break;           // uniform: every thread leaves together
    if (r % 2 == 1) continue;        // uniform: every thread skips the same barriers
    t[lid] = v * float(r + 1);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint j = 0; j < 4; ++j) {   // no barrier inside: a thread's own loop
      if (j == lid % 4) continue;
      v += t[(lid + j) % n] * 0.125f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid % 3 == 0) {
    out[gid] = -v;
    return;                          // after the last barrier: allowed
  }
  out[gid] = v;
}

// Parameters the kernel modifies (each thread its own copy), a pointer into threadgroup
// memory, constants used as array bounds, a local type, integer division in a for's
// initialisation: all before a barrier a resumption jumps past.
kernel void declarations(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                         uint lid [[thread_position_in_threadgroup]],
                         uint gid [[thread_position_in_grid]], uint n [[threads_per_threadgroup]]) {
  typedef float2 f2;
  const int COUNT = 3;
  constexpr uint HALF = WIDTH / 2;
  static_assert(HALF == 32, "half of the width");
  threadgroup f2 t[WIDTH];
  float arr[COUNT] = {1.0f, 2.0f};
  in += gid % 2;
  lid ^= 1;                          // a built-in changed by its thread
  threadgroup f2* mine = &t[lid];
  const uint a = lid * 2, b = a + 1;
  for (uint s = n / 2, r = 0; s > 0; s /= 2, ++r) {
    *mine = f2(in[0] + float(a), float(b) + arr[r % COUNT]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    arr[r % COUNT] += t[(lid + s) % n].x - t[lid / 2].y;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = arr[0] + 10.0f * arr[1] + 100.0f * arr[2] + float(HALF);
}

template <typename T, int STEPS>
kernel void templated(device T* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                      uint gid [[thread_position_in_grid]], uint n [[threads_per_threadgroup]]) {
  threadgroup T t[WIDTH];
  T v = T(lid);
  for (int s = 0; s < STEPS; ++s) {
    t[lid] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    v = v + t[(lid + 1) % n] / T(2);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = v;
}
#define INSTANTIATE(name, T, STEPS)                                                          \
  template [[host_name(name)]] kernel void templated<T, STEPS>(                                \
      device T* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],              \
      uint gid [[thread_position_in_grid]], uint n [[threads_per_threadgroup]]);
INSTANTIATE("templated_float", float, 3)
INSTANTIATE("templated_int", int, 5)

// Divergence of every kind, each selected by `mode`.
kernel void divergent(device float* out [[buffer(0)]], constant uint& mode [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]]) {
  threadgroup float t[WIDTH];
  if (mode == 1 && lid >= 16) return;                      // returned before a barrier
  if (mode == 2 && lid < 5) {                              // different barriers
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    t[lid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < (mode == 3 ? lid % 2 + 1 : 1u); ++i) {  // per-thread trip count
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (uint i = 0; i < 3; ++i) {
    if (mode == 4 && lid == 7 && i == 0) continue;         // skips an iteration's barrier
    t[lid] = float(i);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = t[(lid + 1) % 32];
}

// Threadgroup scalars, one of them atomic (the rewriter wraps each use of a scalar).
kernel void tg_scalars(device uint* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint count;
  threadgroup float total;
  if (lid == 0) {
    atomic_store_explicit(&count, 0u, memory_order_relaxed);
    total = 1.5f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&count, lid, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = atomic_load_explicit(&count, memory_order_relaxed) + uint(total);
}

// A data race the sanitizer reports: the barrier after the reads is missing.
kernel void racy(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                 uint gid [[thread_position_in_grid]]) {
  threadgroup float t[WIDTH];
  float acc = 0.0f;
  for (uint r = 0; r < 2; ++r) {
    t[lid] = float(r + lid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[(lid + 1) % 32];
  }
  out[gid] = acc;
}
"""

# kernel -> list of (arguments builder, threads, group); every launch is compared.
LAUNCHES = {
    "nested_loops": [(lambda: [torch.zeros(128), 3], 128, 64), (lambda: [torch.zeros(100), 0], 100, 32)],
    "if_else_loops": [(lambda m=m: [torch.zeros(96), m], 96, 32) for m in (0, 1, 2, 3)],
    "break_continue": [(lambda lim=lim: [torch.zeros(64), lim], 64, 64) for lim in (0, 1, 4, 7)],
    "declarations": [(lambda: [torch.zeros(128), torch.arange(130, dtype=torch.float32)], 128, 64)],
    "templated_float": [(lambda: [torch.zeros(64)], 64, 32)],
    "templated_int": [(lambda: [torch.zeros(64, dtype=torch.int32)], 64, 32)],
    "divergent": [(lambda m=m: [torch.zeros(64), m], 64, 32) for m in (0, 1, 2, 3, 4)],
    "tg_scalars": [(lambda: [torch.zeros(64, dtype=torch.int32)], 64, 64)],
    "racy": [(lambda: [torch.zeros(64)], 64, 32)],
}


def outcome(lib, kernel: str, build, threads, group) -> Tuple[object, ...]:
    """What a launch does: its outputs, or its fault's kind and message."""
    args = build()
    try:
        call_with_timeout(lib[kernel], *args, threads=threads, group_size=group)
    except KernelFault as e:
        return ("fault", e.kind, str(e))
    return ("ran",) + tuple(a.clone() for a in args if isinstance(a, torch.Tensor))


def same(x: Tuple[object, ...], y: Tuple[object, ...]) -> bool:
    """Equal outputs, bit for bit; or the same fault. A divergence report names the same
    threads, but where they wait in fiber words (call and loop frames) or in its own."""
    if len(x) != len(y) or x[0] != y[0]:
        return False
    if x[0] == "fault" and x[1] == y[1] == "barrier_divergence":
        return re.findall(r"thread \([^)]*\)", x[2]) == re.findall(r"thread \([^)]*\)", y[2])
    return all(bitwise_equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(x[1:], y[1:]))


def agree_on_every_launch(source: str, launches, monkeypatch, sanitize: bool) -> List[Tuple[str, str]]:
    """Run every launch both ways; each must give the same outcome (and, sanitized, the
    same counters: bytes, bank conflicts, FMAs, barriers...). The faults, (kernel, kind)."""
    regions, fibers = both_ways(source, monkeypatch, sanitize)
    faults = []
    for kernel, runs in launches.items():
        for build, threads, group in runs:
            with record() as r_launches:
                r = outcome(regions, kernel, build, threads, group)
            with record() as f_launches:
                f = outcome(fibers, kernel, build, threads, group)
            assert same(r, f), f"{kernel}: regions {r[:3]} != fibers {f[:3]}"
            assert [x.counters for x in r_launches] == [x.counters for x in f_launches], kernel
            if r[0] == "fault":
                faults.append((kernel, r[1]))
    return faults


@pytest.fixture(autouse=True)
def _strict_barriers(monkeypatch):
    monkeypatch.delenv("TSM_EMU_EXITED_THREADS_ARRIVE", raising=False)


def test_every_structure_here_runs_as_regions(tmp_path):
    assert grouped(STRUCTURES, tmp_path) == {"nested_loops", "if_else_loops", "break_continue",
                                             "declarations", "templated", "divergent", "tg_scalars", "racy"}


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_regions_and_fibers_agree_on_every_launch(monkeypatch, sanitize):
    faults = agree_on_every_launch(STRUCTURES, LAUNCHES, monkeypatch, sanitize)
    # The comparison covered the faults it should: every kind of divergence, the race.
    assert sum(1 for k, kind in faults if k == "divergent" and kind == "barrier_divergence") == 4
    assert (("racy", "threadgroup_race") in faults) == sanitize


def test_divergence_reports_name_the_threads_and_barriers(monkeypatch):
    regions, _ = both_ways(STRUCTURES, monkeypatch, sanitize=False)
    messages = {m: outcome(regions, "divergent", lambda m=m: [torch.zeros(64), m], 64, 32)[2] for m in (1, 2, 3, 4)}
    assert "thread (16, 0, 0) (index 16 in threadgroup (0, 0, 0)) returned before the threadgroup_barrier" \
        in messages[1]
    assert "TSM_EMU_EXITED_THREADS_ARRIVE=1" in messages[1]
    assert "threads wait at different threadgroup_barrier calls" in messages[2]
    assert "different iteration" in messages[3] or "different threadgroup_barrier calls" in messages[3]
    assert "in a different iteration of the loop around it" in messages[4]


def test_exited_threads_arrive_the_same_way(monkeypatch):
    # The runtime reads the setting once per library loaded: a library of its own.
    monkeypatch.setenv("TSM_EMU_EXITED_THREADS_ARRIVE", "1")
    regions, fibers = both_ways(STRUCTURES + "constant int exited_threads_arrive = 1;\n", monkeypatch,
                                sanitize=False)
    r = outcome(regions, "divergent", lambda: [torch.zeros(64), 1], 64, 32)
    f = outcome(fibers, "divergent", lambda: [torch.zeros(64), 1], 64, 32)
    assert r[0] == "ran" and same(r, f), (r[:3], f[:3])


def test_results_are_the_kernels_not_just_the_same(monkeypatch):
    """Agreement with the fibers is not enough on its own: one kernel checked against NumPy."""
    regions, _ = both_ways(STRUCTURES, monkeypatch, sanitize=False)
    out = torch.zeros(64)
    regions.templated_float(out, threads=64, group_size=32)
    v = np.tile(np.arange(32, dtype=np.float32), 2)
    for _ in range(3):
        g = v.reshape(2, 32)
        v = (g + np.roll(g, -1, axis=1) / np.float32(2)).reshape(-1)
    np.testing.assert_array_equal(out.numpy(), v)


# ---- what qualifies ---------------------------------------------------------------------------
FALLBACKS = HEADER + r"""
void helper_barrier(threadgroup float* t, uint lid) {
  t[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
kernel void in_helper(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  helper_barrier(t, lid);
  out[lid] = t[(lid + 1) % 32];
}
kernel void in_switch(device float* out [[buffer(0)]], constant uint& m [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  t[lid] = float(lid);
  switch (m) {
    case 0: threadgroup_barrier(mem_flags::mem_threadgroup); break;
    default: threadgroup_barrier(mem_flags::mem_threadgroup); break;
  }
  out[lid] = t[(lid + 1) % 32];
}
float helper_sum(float v) { return simd_sum(v); }
kernel void simd_in_helper(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  out[lid] = helper_sum(float(lid));
}
kernel void simd_conditional(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  out[lid] = lid % 2 == 0 ? simd_sum(float(lid)) : 0.0f;
}
kernel void simd_argument_effect(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  uint k = lid;
  out[lid] = simd_shuffle(float(lid), k++) + float(k);
}
struct Ticket {  // a user's constructor with an effect: run twice, it would count twice
  uint v;
  Ticket(device atomic_uint* c) : v(atomic_fetch_add_explicit(c, 1u, memory_order_relaxed)) {}
};
kernel void simd_argument_constructor_effect(device float* out [[buffer(0)]], device atomic_uint* c [[buffer(1)]],
                                             uint lid [[thread_position_in_threadgroup]]) {
  out[lid] = simd_shuffle(float(lid), Ticket(c).v % 32);
}
struct Tally {  // a user's const method with an effect, through its pointer member
  device atomic_uint* c;
  uint next() const { return atomic_fetch_add_explicit(c, 1u, memory_order_relaxed); }
};
kernel void simd_argument_method_effect(device float* out [[buffer(0)]], device atomic_uint* c [[buffer(1)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  const Tally tally{c};
  out[lid] = simd_shuffle(float(lid), tally.next() % 32);
}
struct Box {  // a user's const method that sets a `mutable` member
  mutable uint v;
  uint bump() const { return v++; }
};
kernel void simd_argument_mutable_effect(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  const Box box{lid};
  out[lid] = simd_shuffle(float(lid), box.bump() % 32) + float(box.v);
}
kernel void simd_read_beside(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  t[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[31 - lid] * simd_sum(1.0f);
}
kernel void simd_two_in_one(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  out[lid] = simd_sum(simd_shuffle_xor(float(lid), 1u));
}
kernel void reference_across(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  device float& first = out[0] == 0.0f ? out[lid] : out[0];
  t[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  first = t[(lid + 1) % 32];
}
kernel void no_barrier(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  out[lid] = float(lid);
}
"""


def test_what_defeats_the_transformation_runs_as_fibers(tmp_path, monkeypatch):
    assert grouped(FALLBACKS, tmp_path) == set()
    regions, fibers = both_ways(FALLBACKS, monkeypatch, sanitize=False)
    for kernel, extra in (("in_helper", []), ("in_switch", [1]), ("no_barrier", []), ("simd_in_helper", []),
                          ("simd_conditional", []), ("simd_argument_effect", []), ("simd_argument_mutable_effect", []),
                          ("simd_read_beside", []),
                          ("simd_two_in_one", [])):
        r = outcome(regions, kernel, lambda extra=extra: [torch.zeros(32), *extra], 32, 32)
        f = outcome(fibers, kernel, lambda extra=extra: [torch.zeros(32), *extra], 32, 32)
        assert r[0] == "ran" and same(r, f), kernel
    expected = (np.arange(32) + 1) % 32
    r = outcome(regions, "in_switch", lambda: [torch.zeros(32), 1], 32, 32)
    np.testing.assert_array_equal(r[1].numpy(), expected.astype(np.float32))
    # Each thread's constructor ran once: the counter is the thread count.
    ticket = lambda: [torch.zeros(32), torch.zeros(1, dtype=torch.int32)]  # noqa: E731
    for kernel in ("simd_argument_constructor_effect", "simd_argument_method_effect"):
        r = outcome(regions, kernel, ticket, 32, 32)
        f = outcome(fibers, kernel, ticket, 32, 32)
        assert r[0] == "ran" and same(r, f) and r[2].item() == 32, kernel


def test_the_project_shaders_with_barriers_run_as_regions():
    """Every project kernel that synchronises (barriers, SIMD-group functions) runs as
    regions: a change that made one fall back to fibers (much slower) fails here."""
    expected = {
        "kmeans.metal": {"kmeans_sq_norms", "kmeans_accumulate_atomic", "kmeans_accumulate_cas_float",
                         "kmeans_accumulate_blocks", "kmeans_drift", "kmeans_assign_one", "kmeans_assign"},
        "matmul_tiled.metal": {"matmul_tiled"},
        "matmul_register.metal": {"matmul_register"},
        "matmul_simdgroup.metal": {"matmul_simdgroup"},
        "matmul_shuffle.metal": {"matmul_shuffle"},
        "adamw.metal": {"adamw_step"},
        "cross_entropy.metal": {"cross_entropy_forward"},
        "sparse_linear.metal": {"sparse_linear_forward_batch_lanes",
                                "sparse_linear_backward_batch_lanes"},
        "block_sparse_linear.metal": {f"block_sparse_linear_{d}_{f}"
                                      for d in ("forward", "backward")
                                      for f in ("simdgroup", "shuffle")},
    }
    for shader, kernels in expected.items():
        assert _compiler.generated_cxx(SHADERS_DIR / shader).grouped == kernels, shader


# ---- random structures ---------------------------------------------------------------------------
def random_structures_agree(generator, seed: int, kernels: int, threads: int, group: int) -> None:
    rng = random.Random(seed)
    names = [f"{generator.__name__}_{i}" for i in range(kernels)]
    source = HEADER + "\n".join(generator(name, rng) for name in names)
    with tempfile.TemporaryDirectory() as tmp:
        assert grouped(source, Path(tmp)) == set(names)
    with pytest.MonkeyPatch.context() as monkeypatch:
        regions, fibers = both_ways(source, monkeypatch, sanitize=False)
    for name in names:
        for mode in (0, 1, 2, 3):
            build = lambda mode=mode: [torch.zeros(threads), mode]  # noqa: E731
            r, f = outcome(regions, name, build, threads, group), outcome(fibers, name, build, threads, group)
            assert r[0] == "ran" and same(r, f), f"seed {seed}, {name}, mode {mode}"


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2 ** 32 - 1))
def test_random_structures_agree_with_fibers(seed):
    random_structures_agree(random_kernel, seed, kernels=6, threads=96, group=48)


UNCOPYABLE = HEADER + r"""
struct Counter {
  Counter() = default;
  Counter(const thread Counter&) = delete;  // kept in place: never copied
  int value = 0;
};
kernel void uncopyable(device int* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup int t[32];
  Counter c;
  c.value = int(lid);
  t[lid] = c.value;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[(lid + 1) % 32] + c.value;
}
"""


def test_a_kernel_the_translation_cannot_compile_runs_as_fibers_with_a_warning(monkeypatch):
    """A variable across a barrier is copied into its slot; one that cannot be copied
    defeats the translation only when C++ compiles it. The library still builds (as
    fibers), and the user is told."""
    monkeypatch.setenv("TSM_EMU_REGIONS", "1")
    # The warning comes with the build: a source of its own, never in the compile cache.
    nonce = f"constant uint nonce = {random.getrandbits(31)};\n"
    with pytest.warns(RuntimeWarning, match=r"could not run uncopyable as barrier regions"):
        lib = compile_shader(UNCOPYABLE + nonce)
    out = torch.zeros(32, dtype=torch.int32)
    lib.uncopyable(out, threads=32, group_size=32)
    lid = np.arange(32)
    np.testing.assert_array_equal(out.numpy(), (lid + 1) % 32 + lid)


MATRIX_ARRAY = HEADER + r"""
kernel void matrix_array(device float* out [[buffer(0)]], uint lid [[thread_index_in_threadgroup]]) {
  threadgroup float t[32];
  simdgroup_float8x8 m[2];
  m[0] = make_filled_simdgroup_matrix<float, 8, 8>(2.0f);
  m[1] = m[0];
  t[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[(lid + 1) % 32];
  simdgroup_store(m[1], out + 32, 8);
}
"""


def test_an_array_of_simdgroup_matrices_lives_across_a_barrier_as_regions(monkeypatch):
    """simdgroup_matrix (through Metal's vectors, whose assignment is user-provided) may not
    count as trivially copyable where the kernel is instantiated, but its copy constructor,
    all a slot uses, is trivial: an array of them across a barrier (the simdgroup GEMM's
    accumulators) must not send the kernel back to fibers."""
    monkeypatch.setenv("TSM_EMU_REGIONS", "1")
    nonce = f"constant uint nonce = {random.getrandbits(31)};\n"  # a fresh build: its warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        lib = compile_shader(MATRIX_ARRAY + nonce)
    out = torch.zeros(32 + 64)
    lib.matrix_array(out, threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy()[:32], ((np.arange(32) + 1) % 32).astype(np.float32))
    np.testing.assert_array_equal(out.numpy()[32:], np.full(64, 2.0, np.float32))


def test_threadgroup_variables_keep_their_bounds_across_dispatches(monkeypatch):
    """Each dispatch runs on new worker threads, whose threadgroup variables may sit where
    another variable of an earlier dispatch was: the bounds of every access must be this
    dispatch's (a stale table once reported a thread past the end of `b_tile`)."""
    monkeypatch.delenv("TSM_EMU_WORKERS", raising=False)  # one worker, then two
    lib = compile_shader((SHADERS_DIR / "bench" / "barrier_heavy.metal").read_text())
    torch.manual_seed(0)
    for n in (64, 256, 512, 512, 512):
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.zeros(n, n)
        lib.tiled_matmul(a, b, c, n, threads=(n, n), group_size=(16, 16))
        torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-3)


# ---- SIMD-group functions ------------------------------------------------------------------------
# A statement that calls a SIMD-group function runs twice: once to hand over the lane's
# value, then, when the SIMD-group's lanes met, for the result. Every kernel here is
# compared with fibers as above, sanitized and not, faults and sanitizer counters included.
SIMD = HEADER + r"""
kernel void reduce_rows(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                        constant uint& cols [[buffer(2)]],
                        uint lid [[thread_position_in_threadgroup]], uint tg [[threadgroup_position_in_grid]],
                        uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float partial[8];
  float acc = 0.0f;
  for (uint c = lid; c < cols; c += 64) {
    acc += x[tg * cols + c];
  }
  acc = simd_sum(acc);
  if (lane == 0) partial[sg] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float v = lane < 2 ? partial[lane] : 0.0f;
    v = simd_sum(v);
    if (lane == 0) out[tg] = v;
  }
}

kernel void shuffles(device float* out [[buffer(0)]], constant uint& rounds [[buffer(1)]],
                     uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float v = float(gid);
  for (uint r = 0; r < rounds; ++r) {
    for (uint off = 16; off > 0; off /= 2)
      v += simd_shuffle_down(v, off);
    v = simd_broadcast(v, (lane + r) % 32) * 0.5f;
    if (simd_any(v > 100.0f)) v -= 1.0f;
  }
  float s = simd_prefix_exclusive_sum(v);
  out[gid] = s + simd_shuffle_xor(v, 1u);
}

// Lanes in different branches meet at different functions; they meet again after.
kernel void branches(device int* out [[buffer(0)]], constant uint& mode [[buffer(1)]],
                     uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  int v = int(gid) + 1;
  if (lane % (mode + 2) == 0) {
    v = simd_sum(v);
  } else if (lane % 3 == 1) {
    v = simd_max(v);
    v += int(uint(ulong(simd_ballot(v > 5))));
    v ^= simd_broadcast_first(v);
  } else {
    do {
      v = quad_sum(v);
      v += simd_prefix_inclusive_sum(v);
    } while (v % 3 == 0);
  }
  v += simd_prefix_inclusive_sum(v);
  out[gid] = v;
}

// Lanes run different numbers of iterations: the same call in two iterations is two places.
kernel void iterations(device float* out [[buffer(0)]], constant uint& mode [[buffer(1)]],
                       uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float acc = float(lane);
  for (uint i = 0; i < lane % 4 + mode; ++i) {
    if (i == 1) continue;
    acc += simd_sum(acc) * 0.001f;
    uint j = 0;
    while (j < i) {
      acc = simd_shuffle_rotate_down(acc, 3u) + float(j);
      ++j;
    }
  }
  out[gid] = acc + float(simd_is_first());
}

kernel void quads(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                  uint lane [[thread_index_in_simdgroup]]) {
  const float v = float(gid) * 0.5f;
  float a = quad_shuffle_down(v, 1u);
  a += quad_broadcast(v, 2u);
  a += quad_prefix_exclusive_sum(v);
  float b = simd_shuffle_and_fill_down(v, -v, 3u, 8u);
  b += simd_broadcast_first(v);
  float c = float(quad_all(v > 2.0f));
  c += float(simd_min(int(lane) - 7));
  out[gid] = a * 3.0f + b + c;
}

// A simdgroup_barrier orders threadgroup memory between the lanes of a SIMD-group; lanes
// that returned before it are divergence (strict mode).
kernel void simd_barrier(device float* out [[buffer(0)]], constant uint& mode [[buffer(1)]],
                         uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]],
                         uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float t[128];
  if (mode > 0 && lane == mode) return;
  t[lid] = float(gid) * 2.0f;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = t[lid ^ 1u];
}

// A shuffle from a lane of the other branch: inactive (a poison value; a fault sanitized).
kernel void inactive(device int* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  int v = int(gid);
  if (lane < 16) {
    v = simd_shuffle(v, lane + 16);
  }
  out[gid] = v;
}

// Operands read from memory: the sanitizer sees each read once, though the statement runs twice.
kernel void loads(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                  uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]]) {
  threadgroup float t[64];
  t[lid] = x[gid] * 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = simd_sum(x[gid]);
  s += simd_shuffle_xor(t[(lid * 5) % 64], 1u);
  out[gid] = s;
}

// A user's const method that only reads, and sets only its own locals: its call may run
// twice, as an operand evaluated again after the stop.
struct Window {
  device const float* x;
  float sum(uint from, uint n) const {
    float s = 0.0f;
    for (uint i = 0; i < n; ++i) s += x[from + i];
    return s;
  }
};
kernel void method_operand(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
  const Window w{x};
  out[gid] = simd_sum(w.sum(gid, 2));
}

kernel void matrices(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                     device float* c [[buffer(2)]], uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 ma, mb, mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (uint k = 0; k < 16; k += 8) {
    simdgroup_load(ma, a + sg * 128 + k, 16);
    simdgroup_load(mb, b + k * 8, 8);
    simdgroup_multiply_accumulate(mc, ma, mb, mc);
  }
  simdgroup_store(mc, c + sg * 64, 8);
}

// `a * b` of simdgroup matrices is a SIMD-group function too; two on one line are two stops.
kernel void products(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                     device float* c [[buffer(2)]], uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 ma, mb, mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(mb, b, 8);
  for (uint k = 0; k < 2; ++k) {
    simdgroup_load(ma, a + sg * 128 + k * 8, 16);
    simdgroup_float8x8 p = ma * mb; simdgroup_float8x8 q = p * mb;
    for (uint i = 0; i < 2; ++i) mc.thread_elements()[i] += q.thread_elements()[i];
  }
  simdgroup_store(mc, c + sg * 64, 8);
}
"""

SIMD_LAUNCHES = {
    "reduce_rows": [(lambda: [torch.arange(4 * 200, dtype=torch.float32).sin(), torch.zeros(4), 200], 256, 64)],
    "shuffles": [(lambda r=r: [torch.zeros(96), r], 96, 96) for r in (0, 3)],
    "branches": [(lambda m=m: [torch.zeros(80, dtype=torch.int32), m], 80, 80) for m in (0, 1, 2)],
    "iterations": [(lambda m=m: [torch.zeros(64), m], 64, 64) for m in (0, 2)],
    "quads": [(lambda: [torch.zeros(64)], 64, 32)],
    "simd_barrier": [(lambda m=m: [torch.zeros(128), m], 128, 128) for m in (0, 5)],
    "inactive": [(lambda: [torch.zeros(32, dtype=torch.int32)], 32, 32)],
    "loads": [(lambda: [torch.arange(64, dtype=torch.float32), torch.zeros(64)], 64, 64)],
    "method_operand": [(lambda: [torch.arange(66, dtype=torch.float32), torch.zeros(64)], 64, 64)],
    "matrices": [(lambda: [torch.arange(2 * 128, dtype=torch.float32).cos(),
                           torch.arange(128, dtype=torch.float32).sin(), torch.zeros(128)], 64, 64)],
    "products": [(lambda: [torch.arange(2 * 128, dtype=torch.float32).cos(),
                           torch.arange(64, dtype=torch.float32).sin(), torch.zeros(128)], 64, 64)],
}


def test_simd_group_kernels_run_as_regions(tmp_path):
    assert grouped(SIMD, tmp_path) == set(SIMD_LAUNCHES)


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_simd_group_functions_agree_with_fibers(monkeypatch, sanitize):
    faults = agree_on_every_launch(SIMD, SIMD_LAUNCHES, monkeypatch, sanitize)
    # Sanitized, a shuffle from an inactive lane is a fault (`inactive`; `iterations`, whose
    # lanes run different numbers of iterations, in both its launches).
    inactive = [("inactive", "inactive_lane")] + [("iterations", "inactive_lane")] * 2
    expected = [("simd_barrier", "barrier_divergence")] + (inactive if sanitize else [])
    assert sorted(faults) == sorted(expected)


def test_simd_group_results_are_right(monkeypatch):
    """Against NumPy, not only against fibers."""
    regions, _ = both_ways(SIMD, monkeypatch, sanitize=False)
    x = torch.arange(4 * 200, dtype=torch.float32).sin()
    out = torch.zeros(4)
    regions.reduce_rows(x, out, 200, threads=256, group_size=64)
    torch.testing.assert_close(out, x.view(4, 200).sum(1))
    a, b, c = torch.arange(2 * 128, dtype=torch.float32).cos(), torch.arange(128, dtype=torch.float32).sin(), \
        torch.zeros(128)
    regions.matrices(a, b, c, threads=64, group_size=64)
    expected = np.stack([a.view(2, 8, 16)[i].numpy() @ b.view(16, 8).numpy() for i in range(2)])
    np.testing.assert_allclose(c.view(2, 8, 8).numpy(), expected, rtol=1e-5, atol=1e-5)
    b, c = b[:64], torch.zeros(128)
    regions.products(a, b, c, threads=64, group_size=64)
    m = b.view(8, 8).double().numpy()
    expected = np.stack([sum(a.view(2, 8, 16)[i, :, k:k + 8].double().numpy() @ m @ m for k in (0, 8))
                         for i in range(2)])
    np.testing.assert_allclose(c.view(2, 8, 8).numpy(), expected, rtol=1e-5, atol=1e-5)
    out = torch.zeros(64)
    regions.quads(out, threads=64, group_size=32)
    v = np.arange(64, dtype=np.float32) * 0.5
    lane = np.arange(64) % 32
    quad = v.reshape(-1, 4)
    down = np.where(lane % 4 < 3, np.roll(v, -1), v)
    broadcast = np.repeat(quad[:, 2], 4)
    prefix = np.concatenate([np.concatenate([[0], np.cumsum(q)[:-1]]) for q in quad])
    window = (lane // 8) * 8 + (lane % 8 + 3) % 8
    base = (np.arange(64) // 32) * 32
    fill = np.where(lane % 8 + 3 < 8, v[base + window], -v[base + window])
    first = v[base]
    expected = (down + broadcast + prefix) * 3 + fill + first + (v > 2).reshape(-1, 4).all(1).repeat(4) + (-7)
    np.testing.assert_allclose(out.numpy(), expected.astype(np.float32), rtol=1e-6)


def test_a_fault_at_a_simdgroup_barrier_leaves_nothing_for_the_next_dispatch(monkeypatch):
    """Fibers are reused from dispatch to dispatch: one that faulted while its lanes waited
    at a simdgroup_barrier once made the next kernel's shuffle look like that barrier."""
    for regions in ("0", "1"):
        monkeypatch.setenv("TSM_EMU_REGIONS", regions)
        lib = compile_shader(SIMD)
        with pytest.raises(KernelFault, match="simdgroup_barrier"):
            call_with_timeout(lib.simd_barrier, torch.zeros(128), 5, threads=128, group_size=128)
        out = torch.zeros(32, dtype=torch.int32)
        call_with_timeout(lib.inactive, out, threads=32, group_size=32)
        assert out[16:].tolist() == list(range(16, 32)), regions


# ---- what a stop stores: only what a thread may read after it --------------------------------
# Each kernel keeps a variable whose every use is before a stop in the source, but inside a
# loop around it: the next iteration reads it, so the stop must store it (a rule that looked
# only at uses after the stop would lose every update but the first).
LIVE_IN_LOOPS = HEADER + r"""
kernel void live_in_for(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  float v = float(lid);
  for (uint i = 0; i < 4; ++i) {
    t[lid] = v;
    v += 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i * 32 + lid] = t[31 - lid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
kernel void live_in_while(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  float v = float(lid);
  uint i = 0;
  while (i < 4) {
    t[lid] = v;
    v *= 2.0f;
    out[i * 32 + lid] = float(i);
    i++;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
kernel void live_in_do(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  uint i = 0;
  float v = float(lid);
  do {
    const float before = v;
    v = before + t[lid] * 0.0f + 3.0f;
    out[i * 32 + lid] = before;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    t[lid] = 0.0f;
  } while (++i < 4);
}
kernel void header_only(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  uint n = 0;
  for (uint k = 0; k < 128; k += 32) {
    t[lid] = float(k + lid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[n * 32 + lid] = t[(lid + 1) % 32];
    n++;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
"""


def test_variables_read_in_a_later_iteration_survive_the_stop(monkeypatch):
    regions, fibers = both_ways(LIVE_IN_LOOPS, monkeypatch, sanitize=False)
    lid = np.arange(32, dtype=np.float32)
    expected = {
        "live_in_for": np.concatenate([31 - lid + i for i in range(4)]),
        "live_in_while": np.repeat(np.arange(4, dtype=np.float32), 32),
        "live_in_do": np.concatenate([lid + 3 * i for i in range(4)]),
        "header_only": np.concatenate([k + (lid + 1) % 32 for k in range(0, 128, 32)]),
    }
    for kernel, want in expected.items():
        for lib in (regions, fibers):
            out = torch.full((128,), float("nan"))
            lib[kernel](out, threads=32, group_size=32)
            np.testing.assert_array_equal(out.numpy(), want, err_msg=kernel)


def test_a_stop_stores_only_what_may_be_read_after_it(tmp_path):
    """tiled_matmul's ak and bk are declared in the K loop's body and read only before its
    first barrier: neither barrier stores them; acc and the loop's k0 and counter, both."""
    cxx = _compiler.generated_cxx(SHADERS_DIR / "bench" / "barrier_heavy.metal").text
    group = cxx[cxx.index("tiled_matmul__tsm_group"):cxx.index("tree_reduce__tsm_group")]
    saves = dict(re.findall(r"auto (__tsm_save\d+) = \[&\]\(\) \{([^}]*)\}", group))
    assert set(saves) == {"__tsm_save1", "__tsm_save2"}
    for stored in saves.values():
        names = re.findall(r"store_local\(__tsm_r\d+, (\w+)\)", stored)
        assert sorted(names) == ["__tsm_it0", "acc__tsm0", "k0__tsm1"], names
    # Its threadgroup arrays' views are made once per group, not through thread_local at each
    # thread, and each thread copies them.
    assert "const auto __tsm_h0 = ::tsm_emu::view_of(a_tile);" in group
    assert "const auto __tsm_h1 = ::tsm_emu::view_of(b_tile);" in group
    assert "auto a_tile = __tsm_h0;" in group and "auto b_tile = __tsm_h1;" in group


def test_rounds_are_compiled_for_each_stop_of_the_kernel():
    """A group function's rounds that start from one stop call its body with that stop as a
    constant (regions.h's run_regions<Stops>): the count must be the kernel's last stop, or
    the stops past it would run through the general loop, correct but slower."""
    sources = sorted(SHADERS_DIR.glob("*.metal")) + [SHADERS_DIR / "bench" / "barrier_heavy.metal"]
    counted = 0
    for path in sources:
        cxx = _compiler.generated_cxx(path).text
        for group in re.split(r"inline void \w+__tsm_group", cxx)[1:]:
            count = re.search(r"run_regions<(\d+), (?:true|false),", group)
            assert count, path.name
            stops = {int(k) for k in re.findall(r"\bcase (\d+):;", group)}
            assert stops == set(range(1, int(count.group(1)) + 1)), (path.name, count.group(0), stops)
            counted += 1
    assert counted >= 15


def test_liveness_kernels_run_as_regions(tmp_path):
    assert grouped(LIVE_IN_LOOPS, tmp_path) == {"live_in_for", "live_in_while", "live_in_do", "header_only"}


# A threadgroup array in a thread's segment is a copy of its checked pointer (tg_view): what
# a kernel may do with the array itself still works -- a range-for, sizeof, passing it on.
ARRAY_USES = HEADER + r"""
float sum_of(threadgroup const float* t, uint n) {
  float s = 0.0f;
  for (uint i = 0; i < n; ++i) s += t[i];
  return s;
}
kernel void array_uses(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  threadgroup float grid[2][16];
  t[lid] = float(lid);
  grid[lid / 16][lid % 16] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = 0.0f;
  for (threadgroup float& v : t) s += v;
  out[lid] = s + float(sizeof(t) + sizeof(grid)) + sum_of(t, 32) + sum_of(grid[1], 16);
}
"""


def test_threadgroup_arrays_keep_their_uses_in_regions(tmp_path, monkeypatch):
    assert grouped(ARRAY_USES, tmp_path) == {"array_uses"}
    out = torch.zeros(32)
    compile_shader(ARRAY_USES).array_uses(out, threads=32, group_size=32)
    np.testing.assert_array_equal(out.numpy(), np.full(32, 496.0 + 128 + 128 + 496 + 16, np.float32))
