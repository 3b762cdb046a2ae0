"""Lanes at once (``torch_sparse_metal/emulator/_lanes.py``, ``tsm_emu/lanes.h``): a uniform
kernel with SIMD-group functions runs a plain dispatch's threadgroup statement by statement,
the code between two stops a loop over the threads, its control flow once.

Every launch must give the bits of the regions' rounds (``TSM_EMU_LANES=0``) and of fibers
(``TSM_EMU_REGIONS=0``), and where it is computable NumPy's answer; a fault must name the
thread and access fibers name; a barrier after threads returned must fault (or not) as under
fibers; what the translation cannot run so must keep the rounds, saying why.
"""
from __future__ import annotations

import random
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.emulator import KernelFault, _compiler

from _hang_guard import call_with_timeout
from _random_kernels import random_simd_kernel
from _schedules import bitwise_equal, fault_of, same_bits_each_way, three_ways, translated

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"

KERNELS = HEADER + r"""
// Shuffles and a reduction in a loop whose trip count is a parameter; threads past n load
// zeros and keep shuffling (a partial last SIMD-group when the group is not a multiple of 32).
kernel void rotate(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                   constant uint& n [[buffer(2)]], constant uint& rounds [[buffer(3)]],
                   uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float v = gid < n ? x[gid] : 0.0f;
  float acc = 0.0f;
  for (uint r = 0; r < rounds; ++r) {
    v = simd_shuffle(v, ushort((lane + 1) % 32));
    acc = fma(v, float(r + 1), acc);
    acc += simd_sum(v) * 0.5f;
  }
  if (gid < n) {
    out[gid] = acc;
  }
}

// Threads past n return before the SIMD-group functions: inactive there, as fibers that
// returned.
kernel void early_return(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  if (gid >= n) {
    return;
  }
  const float v = x[gid];
  const float s = simd_sum(v);
  const float p = simd_prefix_exclusive_sum(v);
  out[gid] = s + 2.0f * p;
}

// Threadgroup memory between barriers beside SIMD-group functions; a uniform `break` out of
// the loop around them, and a variable every thread assigns alike (`scale`) but in code each
// thread runs on its own (the inner loop), so each thread has its own copy.
kernel void staged(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                   constant uint& limit [[buffer(2)]], uint gid [[thread_position_in_grid]],
                   uint lid [[thread_position_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                   uint sg [[simdgroup_index_in_threadgroup]], uint groups [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  float v = x[gid];
  float total = 0.0f;
  float scale = 1.0f;
  for (uint step = 0; step < 6; ++step) {
    const float s = simd_sum(v);
    if (lane == 0) {
      partial[sg] = s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const float t = lane < groups ? partial[lane] : 0.0f;
    total += simd_sum(t) * scale;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint j = 0; j < 2; ++j) {
      scale *= 0.75f;
    }
    v = v * 0.5f + float(step);
    if (step == limit) {
      break;
    }
  }
  out[gid] = total;
}
"""


def staged_reference(x: np.ndarray, group: int, limit: int) -> np.ndarray:
    """``staged`` in float64, for a grid of whole threadgroups of whole SIMD-groups."""
    x = x.astype(np.float64)
    out = np.zeros_like(x)
    for g0 in range(0, len(x), group):
        v = x[g0:g0 + group].copy()
        total = np.zeros(group)
        scale = np.ones(group)
        for step in range(6):
            sums = v.reshape(-1, 32).sum(axis=1)
            total += sums.sum() * scale
            scale = scale * 0.75 * 0.75
            v = v * 0.5 + step
            if step == limit:
                break
        out[g0:g0 + group] = total
    return out


@pytest.fixture(autouse=True)
def _strict_barriers(monkeypatch):
    monkeypatch.delenv("TSM_EMU_EXITED_THREADS_ARRIVE", raising=False)


def not_lanes(cxx: _compiler.GeneratedCxx) -> dict:
    """Why each kernel that runs as regions does not run lanes at once (the translation says)."""
    reasons = {}
    for m in re.finditer(r"inline void (\w+)__tsm_group\(.*?__tsm_not_lanes = \"((?:[^\"\\]|\\.)*)\"", cxx.text):
        reasons[m.group(1)] = m.group(2)
    return reasons


def test_these_kernels_run_lanes_at_once(tmp_path):
    cxx = translated(KERNELS, tmp_path)
    assert cxx.lanes == {"rotate", "early_return", "staged"}
    # Sanitized builds keep the rounds (the sanitizer follows one thread at a time).
    assert translated(KERNELS, tmp_path, sanitize=True).lanes == set()


@pytest.mark.parametrize("n, threads, group", [(256, 256, 64), (100, 100, 50), (70, 96, 96), (33, 64, 64)])
@pytest.mark.parametrize("rounds", [0, 1, 5])
def test_shuffles_and_sums_agree_with_rounds_and_fibers(monkeypatch, n, threads, group, rounds):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)).float()

    def launch(lib):
        out = torch.full((n,), float("nan"))
        lib.rotate(x, out, n, rounds, threads=threads, group_size=group)
        return out
    out = same_bits_each_way(three_ways(KERNELS, monkeypatch), launch)
    if threads % 32 == 0 and rounds:
        # NumPy, where every SIMD-group is whole (a partial one's missing lanes read poison)
        v = np.zeros(threads)
        v[:n] = x.double().numpy()
        acc = np.zeros(threads)
        for r in range(rounds):
            v = np.roll(v.reshape(-1, 32), -1, axis=1).reshape(-1)
            acc = v * (r + 1) + acc
            acc += np.repeat(v.reshape(-1, 32).sum(axis=1), 32) * 0.5
        np.testing.assert_allclose(out.numpy(), acc[:n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n, threads, group", [(256, 256, 64), (40, 64, 64), (1, 32, 32), (95, 128, 64)])
def test_threads_that_returned_are_inactive(monkeypatch, n, threads, group):
    x = torch.arange(threads, dtype=torch.float32) * 0.25 + 1.0

    def launch(lib):
        out = torch.full((threads,), float("nan"))
        lib.early_return(x, out, n, threads=threads, group_size=group)
        return out
    out = same_bits_each_way(three_ways(KERNELS, monkeypatch), launch)
    v = x.double().numpy()
    want = np.full(threads, np.nan)
    for first in range(0, n, 32):
        live = v[first:min(first + 32, n)]  # the active lanes of this SIMD-group
        want[first:first + len(live)] = live.sum() + 2.0 * (np.cumsum(live) - live)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-6)


@pytest.mark.parametrize("group", [32, 64, 256])
@pytest.mark.parametrize("limit", [0, 3, 100])
def test_barriers_a_uniform_break_and_a_thread_own_variable(monkeypatch, group, limit):
    x = torch.rand(512, generator=torch.Generator().manual_seed(group)) * 4.0

    def launch(lib):
        out = torch.full((512,), float("nan"))
        lib.staged(x, out, limit, threads=512, group_size=group)
        return out
    out = same_bits_each_way(three_ways(KERNELS, monkeypatch), launch)
    np.testing.assert_allclose(out.numpy(), staged_reference(x.numpy(), group, limit), rtol=1e-5)


FAULTS = HEADER + r"""
// Between two SIMD-group functions thread `first` reads past the end of x, and later in the
// code thread `second` does: `second` < `first` runs to its fault before `first` starts, so
// fibers report `second`'s read. A loop over the threads per statement would reach `first`'s
// read first; lanes at once must report `second`'s.
kernel void two_faults(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                       constant uint& first [[buffer(2)]], constant uint& second [[buffer(3)]],
                       constant uint& never [[buffer(4)]], uint lid [[thread_position_in_threadgroup]]) {
  float v = simd_sum(float(lid));
  const float a = lid == first ? x[1000 + lid] : 1.0f;
  if (never != 0) {
    v += simd_sum(a);  // (not run: only a place the threads' loop ends)
  }
  const float b = lid == second ? x[2000 + lid] : 2.0f;
  out[lid] = simd_sum(a + b) + v;
}

// Threads from 40 on return before a barrier the others wait at.
kernel void return_before_barrier(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid >= 40) {
    return;
  }
  const float s = simd_sum(1.0f);
  threadgroup_barrier(mem_flags::mem_none);
  out[lid] = s;
}
"""


@pytest.mark.parametrize("first, second", [(9, 3), (3, 9), (40, 33), (5, 5)])
def test_a_fault_names_the_thread_and_access_fibers_name(monkeypatch, tmp_path, first, second):
    assert translated(FAULTS, tmp_path).lanes == {"two_faults", "return_before_barrier"}
    ways = three_ways(FAULTS, monkeypatch)
    x = torch.zeros(64)
    faults = [fault_of(lib, "two_faults", x, torch.zeros(64), first, second, 0, threads=64, group_size=64)
              for lib in ways]
    assert faults[0] is not None and faults[0][0] == "out_of_bounds"
    assert faults[0] == faults[1] == faults[2]
    reported = min(first, second)
    assert f"index {reported} in threadgroup" in faults[0][1], faults[0][1]


def test_a_barrier_after_threads_returned_is_what_fibers_make_of_it(monkeypatch):
    ways = three_ways(FAULTS, monkeypatch)
    faults = [fault_of(lib, "return_before_barrier", torch.zeros(64), threads=64, group_size=64)
              for lib in ways]
    assert faults[0] is not None and faults[0][0] == "barrier_divergence"
    assert "returned before the threadgroup_barrier" in faults[0][1]
    assert faults[0] == faults[1] == faults[2]
    # (Read once per loaded library: a source of its own.)
    monkeypatch.setenv("TSM_EMU_EXITED_THREADS_ARRIVE", "1")
    lenient = FAULTS.replace("return_before_barrier", "lenient_return_before_barrier")
    outs = []
    for lib in three_ways(lenient, monkeypatch):
        out = torch.full((64,), float("nan"))
        call_with_timeout(lib.lenient_return_before_barrier, out, threads=64, group_size=64)
        outs.append(out)
    want = torch.tensor([32.0] * 32 + [8.0] * 8 + [float("nan")] * 24)
    for out in outs:
        torch.testing.assert_close(out, want, equal_nan=True)


PARTED = HEADER + r"""
// SIMD-group 0 sums what every SIMD-group left in threadgroup memory (MLX's reductions): a
// SIMD-group function only some SIMD-groups reach.
kernel void two_level_sum(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                          uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint groups [[simdgroups_per_threadgroup]], uint tg [[threadgroup_position_in_grid]]) {
  threadgroup float partial[32];
  const float s = simd_sum(x[gid]);
  if (lane == 0) {
    partial[sg] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float t = lane < groups ? partial[lane] : 0.0f;
    t = simd_sum(t);
    if (lane == 0) {
      out[tg] = t;
    }
  }
}

// Each thread loops its own number of times around SIMD-group functions: the lanes that left
// are inactive at the ones after; a lane's `continue` skips an iteration's, its `break`
// leaves the loop; a thread returns from inside it.
kernel void own_trips(device const uint* trips [[buffer(0)]], device float* out [[buffer(1)]],
                      uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float acc = 0.0f;
  uint done = 0;
  for (uint k = 0; k < trips[gid]; ++k) {
    if (k == 2 && lane % 3 == 0) {
      continue;
    }
    if (k == 5 && lane % 5 == 1) {
      break;
    }
    acc += simd_sum(float(k + lane));
    const float left = simd_shuffle_down(acc, ushort(1));
    acc += left == left ? left * 0.5f : 1000.0f;  // (an inactive lane reads NaN)
    done += 1;
    if (acc > 60000.0f) {
      out[gid] = -acc;
      return;
    }
  }
  out[gid] = acc + float(done) * 0.125f;
}

// Branches with a SIMD-group function each, inside a loop each thread leaves on its own; a
// do-while and a while whose conditions each thread evaluates.
kernel void branches(device const uint* trips [[buffer(0)]], device const float* x [[buffer(1)]],
                     device float* out [[buffer(2)]], uint gid [[thread_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  float acc = 0.0f;
  uint k = 0;
  while (k < trips[gid]) {
    float a;
    if ((lane + k) % 2 == 0) {
      a = simd_sum(float(lane));
    } else {
      a = simd_max(float(k * 3 + lane));
    }
    acc += a;
    k += 1;
  }
  float v = x[gid];
  uint steps = 0;
  do {
    v = v * 0.5f + simd_broadcast(v, ushort(0)) * 0.25f;
    steps += 1;
  } while (v > 1.0f && steps < 20);
  out[gid] = acc + v + float(steps);
}
"""


@pytest.mark.parametrize("threads, group", [(256, 256), (256, 64), (96, 96), (70, 70), (40, 40)])
def test_threads_parting_around_simd_group_functions_agree_with_rounds_and_fibers(monkeypatch, tmp_path,
                                                                                    threads, group):
    assert translated(PARTED, tmp_path).lanes == {"two_level_sum", "own_trips", "branches"}
    rng = np.random.default_rng(threads + group)
    x = torch.from_numpy(rng.standard_normal(threads).astype(np.float32) * 8.0)
    trips = torch.from_numpy(rng.integers(0, 9, threads).astype(np.int32))
    groups = -(-threads // group)

    def launch(lib):
        sums = torch.full((groups,), float("nan"))
        lib.two_level_sum(x, sums, threads=threads, group_size=group)
        own = torch.full((threads,), float("nan"))
        lib.own_trips(trips, own, threads=threads, group_size=group)
        parted = torch.full((threads,), float("nan"))
        lib.branches(trips, x, parted, threads=threads, group_size=group)
        return sums, own, parted
    sums, _, _ = same_bits_each_way(three_ways(PARTED, monkeypatch), launch)
    if group % 32 == 0:  # (a partial SIMD-group's missing lanes are poison in simd_sum's reference)
        want = x.double().numpy().reshape(groups, group).sum(axis=1)
        np.testing.assert_allclose(sums.numpy(), want, rtol=1e-5, atol=1e-4)


EDGES = HEADER + r"""
// A message: the threads' loops would log them in another order.
kernel void with_message(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  const float s = simd_sum(float(gid));
  if (gid == 0) {
    os_log_default.log("sum %f", s);
  }
  out[gid] = s;
}

// A barrier only some SIMD-groups reach.
kernel void barrier_apart(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  float v = float(lid);
  if (sg == 0) {
    v = simd_sum(v);
    threadgroup_barrier(mem_flags::mem_none);
  }
  out[lid] = v;
}

// A loop counter that every thread sets alike, but in code each thread runs on its own: each
// thread has its copy, and the loop's condition reads it in each thread.
kernel void counter_set_per_thread(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  float v = 1.0f;
  for (uint i = 0; i < 4; ++i) {
    v = simd_sum(v) * 0.25f;
    for (uint j = 0; j < 2; ++j) {
      i += 0;
    }
  }
  out[gid] = v;
}

// A variable declared in the code between two stops, read after a statement that runs once.
kernel void local_after_scalar(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  uint k = 0;
  for (uint i = 0; i < 2; ++i) {
    const float s = simd_sum(float(gid));
    k += 1;
    out[gid] = s + float(k);
  }
}

// A loop around a SIMD-group function that declares, beside its counter, a variable every
// thread sets alike in code each thread runs on its own.
kernel void loop_declares_own(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  float v = float(gid);
  for (uint i = 0, c = 0; i < 3; ++i) {
    v = simd_sum(v) * 0.125f;
    for (uint j = 0; j < 2; ++j) {
      c += 1;
    }
    out[gid] = v + float(c);
  }
}

// The same for the condition of an `if` around a SIMD-group function.
kernel void condition_reads_own(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  uint u = 1;
  float v = float(gid);
  for (uint i = 0; i < 2; ++i) {
    for (uint j = 0; j < 2; ++j) {
      u += 1;
    }
    if (u > 2) {
      v = simd_sum(v) * 0.5f;
    }
  }
  out[gid] = v;
}

// Barriers only: the rounds serve.
kernel void barriers_only(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[63 - lid];
}
"""


def test_what_cannot_run_lanes_at_once_keeps_the_rounds_and_says_why_and_edges_that_can(monkeypatch, tmp_path):
    cxx = translated(EDGES, tmp_path)
    # A variable every thread sets alike in code each thread runs on its own is each
    # thread's own, and a condition reading it is evaluated by each thread, as where their
    # ways may part.
    assert cxx.lanes == {"counter_set_per_thread", "loop_declares_own", "condition_reads_own"}
    assert cxx.grouped >= {"with_message", "barrier_apart", "local_after_scalar", "barriers_only"}
    assert not_lanes(cxx) == {
        "with_message": "a message, whose order the threads' loops would change",
        "barrier_apart": "a barrier where threads may go different ways",
        "local_after_scalar": "s is read beyond the statements around it",
        "barriers_only": "no SIMD-group function",
    }
    # ... and the others run, giving the fibers' bits.
    lanes, rounds, fibers = three_ways(EDGES, monkeypatch)
    for kernel in ("counter_set_per_thread", "local_after_scalar", "loop_declares_own", "condition_reads_own",
                   "barrier_apart"):
        def launch(lib):
            out = torch.full((64,), float("nan"))
            # (threadgroups of one SIMD-group where a barrier is reached only by SIMD-group 0)
            getattr(lib, kernel)(out, threads=64, group_size=32 if kernel == "barrier_apart" else 64)
            return out
        same_bits_each_way((lanes, fibers), launch)


def test_the_projects_kernels_with_simd_group_functions(tmp_path):
    """Which of the project's kernels run lanes at once, and why the others do not."""
    lanes, reasons = set(), {}
    for path in sorted(SHADERS_DIR.glob("*.metal")):
        cxx = _compiler.generated_cxx(path)
        lanes |= cxx.lanes
        reasons.update({k: v for k, v in not_lanes(cxx).items() if v != "no SIMD-group function"})
    assert lanes == {"matmul_shuffle", "matmul_simdgroup", "cross_entropy_forward", "adamw_step",
                     "sparse_linear_forward_batch_lanes", "sparse_linear_backward_batch_lanes",
                     "block_sparse_linear_forward_shuffle", "block_sparse_linear_backward_shuffle"}
    # Their barriers sit in loops over a block row's blocks, whose bounds and exits come from
    # the index arrays in device memory: uniform in fact (every lane reads the same word, and
    # a threadgroup is one task), not provably so to the analysis. They run as regions.
    assert reasons == dict.fromkeys(["block_sparse_linear_forward_simdgroup",
                                     "block_sparse_linear_backward_simdgroup"],
                                    "a barrier where threads may go different ways")


def test_simd_group_functions_go_inline_into_the_loops_over_threads():
    """Out of line, each lane's simd_broadcast cost ~90 instructions, half of tsm.mm[shuffle]'s
    lanes at once; g++ left it out of line in that kernel's large group function."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs nm (binutils)")
    lib = _compiler.compile_file(SHADERS_DIR / "matmul_shuffle.metal")
    symbols = subprocess.run([nm, "-C", "--defined-only", str(lib.path)], capture_output=True, text=True,
                             check=True).stdout.splitlines()
    assert any("matmul_shuffle__tsm_group" in s for s in symbols)  # (nm reads the library's own functions)
    out_of_line = [s for s in symbols if re.search(r"metal::(simd|quad)_\w+<|lane_exchange|tsm_emu::Site\)", s)]
    assert out_of_line == []


ATOMICS = HEADER + r"""
// Each thread takes a ticket and adds to a sum, before and after SIMD-group functions, in a
// branch only some SIMD-groups take: atomics of different threads are unordered, so the
// tickets may go to other threads than under fibers, but each once, and the sums hold every
// term.
kernel void tickets(device atomic_uint* next [[buffer(0)]], device atomic_uint* total [[buffer(1)]],
                    device atomic_float* sum [[buffer(2)]], device uint* ticket [[buffer(3)]],
                    device float* out [[buffer(4)]], uint gid [[thread_position_in_grid]],
                    uint sg [[simdgroup_index_in_threadgroup]]) {
  ticket[gid] = atomic_fetch_add_explicit(next, 1u, memory_order_relaxed);
  float v = simd_sum(float(gid % 7));
  if (sg % 2 == 0) {
    atomic_fetch_add_explicit(total, gid, memory_order_relaxed);
    v += simd_max(float(gid));
  }
  atomic_fetch_add_explicit(sum, float(gid) * 0.5f, memory_order_relaxed);
  out[gid] = v;
}
"""


@pytest.mark.parametrize("threads, group", [(256, 64), (100, 50)])
def test_atomics_take_a_legal_order(monkeypatch, tmp_path, threads, group):
    assert translated(ATOMICS, tmp_path).lanes == {"tickets"}
    def launch(lib):
        next_, total = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        sum_, ticket, out = torch.zeros(1), torch.full((threads,), -1, dtype=torch.int32), torch.zeros(threads)
        lib.tickets(next_, total, sum_, ticket, out, threads=threads, group_size=group)
        assert sorted(ticket.tolist()) == list(range(threads)) and next_.item() == threads
        gid = np.arange(threads)
        assert total.item() == int(gid[(gid % group) // 32 % 2 == 0].sum())
        np.testing.assert_allclose(sum_.item(), gid.sum() * 0.5, rtol=1e-6)
        return out
    same_bits_each_way(three_ways(ATOMICS, monkeypatch), launch)


# ---- random kernels --------------------------------------------------------------------------------
def outcome(lib, kernel: str, threads: int, group: int, mode: int):
    out = torch.full((threads,), float("nan"))
    try:
        call_with_timeout(lib[kernel], out, mode, threads=threads, group_size=group)
    except KernelFault as e:
        return ("fault", e.kind, str(e))
    return ("ran", out)


# (No shrinking: each example builds three libraries; the failing seed is in the message.)
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(st.integers(0, 2 ** 32 - 1))
def test_random_kernels_with_parting_lanes_agree_with_fibers(tmp_path_factory, seed):
    rng = random.Random(seed)
    names = [f"random_{i}" for i in range(6)]
    source = HEADER + "\n".join(random_simd_kernel(name, rng) for name in names)
    assert translated(source, tmp_path_factory.mktemp("random")).lanes == set(names), f"seed {seed}"
    with pytest.MonkeyPatch.context() as monkeypatch:
        ways = three_ways(source, monkeypatch)
    for name in names:
        for mode in (0, 1):
            for threads, group in ((96, 96), (80, 40)):
                lanes, rounds, fibers = (outcome(lib, name, threads, group, mode) for lib in ways)
                assert lanes[0] == rounds[0] == fibers[0] == "ran", (seed, name, lanes[:3], fibers[:3])
                assert bitwise_equal(lanes[1], fibers[1]) and bitwise_equal(rounds[1], fibers[1]), \
                    f"seed {seed}, {name}, mode {mode}, {threads}/{group}"
