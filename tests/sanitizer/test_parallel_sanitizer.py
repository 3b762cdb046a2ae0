"""A sanitized dispatch on several workers (csrc/emulator/src/sanitizer.h): each worker runs
whole threadgroups with a sanitizer of its own, the buffers' shadows shared between them.

What must not change with the number of workers: a race between threadgroups is found
whichever of them runs first (and whether or not they run at the same time), a kernel without
a race is clean, and the counters are the same sums. TSM_EMU_WORKERS=8 oversubscribes the two
cores, so that workers are preempted while they hold a shadow page.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, compile_shader, record

from _hang_guard import call_with_timeout
from _sanitizer_support import HEADER

SOURCE = HEADER + r"""
// Every thread reads all of x (words every threadgroup reads: what the shadow's pages are
// shared for) and writes its own y; after a barrier that orders its threadgroup's accesses,
// thread 0 of threadgroup `writer` writes x[0] (none if writer is past the grid): a race
// with the other threadgroups' reads only.
kernel void readers_and_a_writer(device float* x [[buffer(0)]], device float* y [[buffer(1)]],
                                 constant uint& n [[buffer(2)]], constant uint& writer [[buffer(3)]],
                                 uint gid [[thread_position_in_grid]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint group [[threadgroup_position_in_grid]]) {
  float sum = 0.0f;
  for (uint i = 0; i < n; ++i) sum += x[i];
  y[gid] = sum;
  threadgroup_barrier(mem_flags::mem_device);
  if (group == writer && tid == 0) x[0] = 1.0f;
}

// Threadgroup 1 writes x[0]; threadgroup 0 reads it until it changes (or gives up), doing
// arithmetic between reads so that it waits long without repeating accesses as a spin-wait
// would (the sanitizer reports those as a hang): with the two on two workers, the reader's
// bytes change under it before it stops. out[0]: whether it saw the change.
kernel void reads_while_another_writes(device float* x [[buffer(0)]], device float* out [[buffer(1)]],
                                       uint group [[threadgroup_position_in_grid]]) {
  if (group == 1) {
    x[0] = 1.0f;
    return;
  }
  float busy = 0.0f;
  for (uint i = 0; i < (1u << 20) && x[0] == 0.0f; ++i)
    for (uint k = 0; k < 256; ++k) busy = fma(busy, 0.5f, 1.0f);
  out[0] = x[0];
  out[1] = busy;
}

// The benchmark's shape of work: each threadgroup stages tiles of both operands in
// threadgroup memory, with barriers, and every threadgroup of a row (column) reads the same
// words of a (b).
kernel void tiled_matmul(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                         device float* c [[buffer(2)]], constant uint& n [[buffer(3)]],
                         uint2 gid [[thread_position_in_grid]], uint2 lid [[thread_position_in_threadgroup]]) {
  threadgroup float as[8][8];
  threadgroup float bs[8][8];
  float sum = 0.0f;
  for (uint k0 = 0; k0 < n; k0 += 8) {
    as[lid.y][lid.x] = a[gid.y * n + k0 + lid.x];
    bs[lid.y][lid.x] = b[(k0 + lid.y) * n + gid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint k = 0; k < 8; ++k) sum = fma(as[lid.y][k], bs[k][lid.x], sum);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  c[gid.y * n + gid.x] = sum;
}
"""

GROUP = 64
GROUPS = 32
N = 16
WORKERS = ["1", "2", "8"]
THREAD = re.compile(r"thread \((\d+), 0, 0\) \(index (\d+) in threadgroup \((\d+), 0, 0\)\)")
CHANGED = re.compile(r"\) changed it \(its bytes differed when the thread next stopped: it wrote them "
                     r"through a reference, or read them while another threadgroup wrote them\)")


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, sanitize=True)


@pytest.fixture(params=WORKERS, ids=lambda w: f"workers={w}")
def workers(request, monkeypatch):
    monkeypatch.setenv("TSM_EMU_WORKERS", request.param)
    return int(request.param)


def readers_and_a_writer(lib, writer: int, groups: int = GROUPS):
    x = torch.arange(N, dtype=torch.float32)
    y = torch.zeros(GROUP * groups)
    call_with_timeout(lib.readers_and_a_writer, x, y, N, writer, threads=GROUP * groups, group_size=GROUP)
    return x, y


def test_threadgroups_that_only_read_shared_words_are_clean(lib, workers):
    x, y = readers_and_a_writer(lib, writer=GROUPS)  # no writer
    np.testing.assert_array_equal(y.numpy(), np.full(GROUP * GROUPS, N * (N - 1) / 2))


# Two threadgroups (on two workers, each has one); the first threadgroup to run, one in the
# middle, the last: before, among and after the other threadgroups' reads of x[0] (once two
# threadgroups have read a word, the others' reads are not recorded: a write must still race
# with the two that are).
@pytest.mark.parametrize("groups, writer", [(2, 0), (2, 1), (GROUPS, 0), (GROUPS, GROUPS // 2), (GROUPS, GROUPS - 1)])
def test_a_write_to_words_other_threadgroups_read_is_a_race_whichever_runs_first(lib, workers, groups, writer):
    for _ in range(3 if workers > 1 else 1):  # other interleavings
        with pytest.raises(KernelFault) as info:
            readers_and_a_writer(lib, writer, groups)
        message = str(info.value)
        assert info.value.kind == "device_race", message
        assert "[[buffer(0)]] `x` element 0" in message
        assert "threads of different threadgroups are never ordered" in message
        culprits = THREAD.findall(message)  # (grid position, index, threadgroup) of each
        assert len(culprits) == 2, message
        assert {int(g) for _, _, g in culprits} > {writer}, message
        if (str(writer * GROUP), "0", str(writer)) not in culprits:  # the writer: its thread 0
            # A reader that read x[0] as the writer wrote it, before the reader stopped, sees its
            # bytes changed: with another threadgroup running at the same time, it cannot tell
            # whether it wrote them itself, and says so.
            assert workers > 1 and CHANGED.search(message), message


def test_a_read_that_sees_another_threadgroups_write_says_the_bytes_changed(monkeypatch, lib):
    # Which of the two wrote cannot be told from the reader's side: the report names the reader
    # as having changed the bytes, with both explanations, never as their plain writer. The two
    # threadgroups run at the same time only as the OS schedules the two workers: a few tries.
    monkeypatch.setenv("TSM_EMU_WORKERS", "2")
    for _ in range(10):
        x, out = torch.zeros(2), torch.zeros(2)
        with pytest.raises(KernelFault) as info:
            call_with_timeout(lib.reads_while_another_writes, x, out, threads=2, group_size=1)
        if out[0] == 1.0:  # the reader saw the write before it stopped
            break
    else:
        pytest.fail("the reader never saw the other threadgroup's write in 10 dispatches")
    message = str(info.value)
    assert info.value.kind == "device_race", message
    assert CHANGED.search(message), message
    assert "thread (0, 0, 0) (index 0 in threadgroup (0, 0, 0)) changed it" in message, message
    assert "thread (1, 0, 0) (index 0 in threadgroup (1, 0, 0)) wrote it" in message, message


def test_counters_are_the_same_sums_on_any_number_of_workers(lib, monkeypatch):
    n = 64
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    counters = {}
    for w in WORKERS:
        monkeypatch.setenv("TSM_EMU_WORKERS", w)
        c = torch.zeros(n, n)
        with record() as launches:
            call_with_timeout(lib.tiled_matmul, a, b, c, n, threads=(n, n), group_size=(8, 8))
        np.testing.assert_allclose(c.numpy(), (a.double() @ b.double()).numpy(), rtol=1e-4, atol=1e-4)
        counters[w] = launches[0].counters
    assert counters["1"]["fmas"] == n ** 3
    assert counters["1"]["threadgroup_accesses"] == n * n * (2 + 2 * 8) * (n // 8)
    for w in WORKERS[1:]:
        assert counters[w] == counters["1"], w
