"""Barrier regions: kernels whose threads run as a loop between threadgroup barriers.

The translation (torch_sparse_metal/metal/_regions.py) gives a kernel whose only
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
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.metal import KernelFault, _compiler, compile_shader

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
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(x[1:], y[1:]))


def both_ways(source: str, monkeypatch, sanitize: bool):
    """(regions, fibers): the library compiled with barrier regions and without."""
    monkeypatch.setenv("TSM_EMU_REGIONS", "1")
    regions = compile_shader(source, sanitize=sanitize)
    monkeypatch.setenv("TSM_EMU_REGIONS", "0")
    fibers = compile_shader(source, sanitize=sanitize)
    monkeypatch.delenv("TSM_EMU_REGIONS")
    return regions, fibers


def grouped(source: str, tmp_path: Path) -> set:
    path = tmp_path / "shader.metal"
    path.write_text(source)
    return _compiler.generated_cxx(path).grouped


@pytest.fixture(autouse=True)
def _strict_barriers(monkeypatch):
    monkeypatch.delenv("TSM_EMU_EXITED_THREADS_ARRIVE", raising=False)


def test_every_structure_here_runs_as_regions(tmp_path):
    assert grouped(STRUCTURES, tmp_path) == {"nested_loops", "if_else_loops", "break_continue",
                                             "declarations", "templated", "divergent", "racy"}


@pytest.mark.parametrize("sanitize", [False, True], ids=["plain", "sanitized"])
def test_regions_and_fibers_agree_on_every_launch(monkeypatch, sanitize):
    regions, fibers = both_ways(STRUCTURES, monkeypatch, sanitize)
    faults = []
    for kernel, launches in LAUNCHES.items():
        for build, threads, group in launches:
            r = outcome(regions, kernel, build, threads, group)
            f = outcome(fibers, kernel, build, threads, group)
            assert same(r, f), f"{kernel}: regions {r[:3]} != fibers {f[:3]}"
            if r[0] == "fault":
                faults.append((kernel, r[1]))
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
kernel void with_simd(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  t[lid] = simd_sum(float(lid));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[(lid + 1) % 32];
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
    for kernel, extra in (("in_helper", []), ("in_switch", [1]), ("with_simd", []), ("no_barrier", [])):
        r = outcome(regions, kernel, lambda extra=extra: [torch.zeros(32), *extra], 32, 32)
        f = outcome(fibers, kernel, lambda extra=extra: [torch.zeros(32), *extra], 32, 32)
        assert r[0] == "ran" and same(r, f), kernel
    expected = (np.arange(32) + 1) % 32
    r = outcome(regions, "in_switch", lambda: [torch.zeros(32), 1], 32, 32)
    np.testing.assert_array_equal(r[1].numpy(), expected.astype(np.float32))


def test_the_project_shaders_with_barriers_run_as_regions():
    """The project's kernels whose only synchronisation is threadgroup barriers: a change
    that made one fall back to fibers (much slower) fails here."""
    expected = {
        "kmeans.metal": {"kmeans_accumulate_atomic", "kmeans_accumulate_cas_float", "kmeans_accumulate_blocks",
                         "kmeans_drift", "kmeans_assign_one", "kmeans_assign"},
        "matmul_tiled.metal": {"matmul_tiled"},
        "matmul_register.metal": {"matmul_register"},
    }
    for shader, kernels in expected.items():
        assert _compiler.generated_cxx(SHADERS_DIR / shader).grouped == kernels, shader


# ---- random structures ---------------------------------------------------------------------------
def random_kernel(name: str, rng: random.Random) -> str:
    """A kernel of nested uniform loops and ifs around barriers; threads exchange values
    through threadgroup memory between barriers, so any misplaced barrier or lost variable
    shows in the output."""
    counter = [0]

    def fresh() -> str:
        counter[0] += 1
        return f"v{counter[0]}"

    def block(depth: int, live: List[str]) -> List[str]:
        lines = []
        for _ in range(rng.randint(1, 3)):
            choice = rng.random()
            if choice < 0.35 or depth >= 3:
                var = fresh()
                src = rng.choice(live)
                lines.append(f"float {var} = {src} * 0.5f + float(lid % {rng.randint(2, 7)});")
                lines.append(f"t[lid] = {var};")
                lines.append("threadgroup_barrier(mem_flags::mem_threadgroup);")
                lines.append(f"{rng.choice(live)} += t[(lid + {rng.randint(1, 40)}) % n];")
                lines.append("threadgroup_barrier(mem_flags::mem_threadgroup);")
                live = live + [var]
            elif choice < 0.6:
                i = fresh()
                lines.append(f"for (uint {i} = 0; {i} < {rng.randint(0, 3)}u; ++{i}) {{")
                lines += block(depth + 1, live)
                if rng.random() < 0.3:
                    lines.append(f"if ({i} == 1u) continue;")
                    lines += block(depth + 1, live)
                lines.append("}")
            elif choice < 0.8:
                lines.append(f"if (mode % {rng.randint(2, 4)}u == 0u) {{")
                lines += block(depth + 1, live)
                lines.append("} else {")
                lines += block(depth + 1, live)
                lines.append("}")
            else:
                i = fresh()
                lines.append(f"uint {i} = 0;")
                lines.append("do {")
                lines += block(depth + 1, live)
                lines.append(f"}} while (++{i} < {rng.randint(1, 3)}u);")
        return lines

    body = block(0, ["acc"])
    return (f"kernel void {name}(device float* out [[buffer(0)]], constant uint& mode [[buffer(1)]],\n"
            f"    uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]],\n"
            f"    uint n [[threads_per_threadgroup]]) {{\n"
            f"  threadgroup float t[64];\n  float acc = float(gid);\n  " + "\n  ".join(body) +
            "\n  out[gid] = acc;\n}\n")


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2 ** 32 - 1))
def test_random_structures_agree_with_fibers(seed):
    rng = random.Random(seed)
    names = [f"random_{i}" for i in range(6)]
    source = HEADER + "\n".join(random_kernel(name, rng) for name in names)
    with tempfile.TemporaryDirectory() as tmp:
        assert grouped(source, Path(tmp)) == set(names)
    with pytest.MonkeyPatch.context() as monkeypatch:
        regions, fibers = both_ways(source, monkeypatch, sanitize=False)
    for name in names:
        for mode in (0, 1, 2, 3):
            build = lambda mode=mode: [torch.zeros(96), mode]  # noqa: E731
            r, f = outcome(regions, name, build, 96, 48), outcome(fibers, name, build, 96, 48)
            assert r[0] == "ran" and same(r, f), f"seed {seed}, {name}, mode {mode}"


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


def test_threadgroup_variables_keep_their_bounds_across_dispatches(monkeypatch):
    """Each dispatch runs on new worker threads, whose threadgroup variables may sit where
    another variable of an earlier dispatch was: the bounds of every access must be this
    dispatch's (a stale table once reported a thread past the end of `b_tile`)."""
    monkeypatch.delenv("TSM_EMU_WORKERS", raising=False)  # one worker, then two
    lib = compile_shader((SHADERS_DIR / "bench" / "barrier_heavy.metal").read_text())
    torch.manual_seed(0)
    for n in (128, 256, 512, 512, 512):
        a, b, c = torch.randn(n, n), torch.randn(n, n), torch.zeros(n, n)
        lib.tiled_matmul(a, b, c, n, threads=(n, n), group_size=(16, 16))
        torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-3)
