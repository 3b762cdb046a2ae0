"""``record()`` blocks nest and overlap, in one thread or several: each block collects every
launch made while it is open, and closing one never disturbs another (blocks are told
apart by identity, not by the launches they hold)."""
from __future__ import annotations

import threading

import pytest
import torch

from torch_sparse_metal.emulator import Launch, compile_shader, record

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void bump(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] += 1.0f;
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


def launch(lib, n: int) -> Launch:
    lib.bump(torch.zeros(n), threads=n, group_size=1)
    return Launch("bump", (n, 1, 1), (1, 1, 1), "emulator")


def test_inner_block_closed_while_both_are_empty(lib):
    with record() as outer:
        with record() as inner:
            pass
        a = launch(lib, 1)
    assert outer == [a] and inner == []


def test_inner_block_holding_the_same_launches_as_the_outer(lib):
    with record() as outer:
        with record() as inner:
            a = launch(lib, 2)
        b = launch(lib, 3)
    assert outer == [a, b] and inner == [a]


def test_three_levels_and_an_exception_in_the_middle(lib):
    with record() as outer:
        with pytest.raises(RuntimeError, match="boom"):
            with record() as middle:
                with record() as inner:
                    a = launch(lib, 1)
                raise RuntimeError("boom")
        b = launch(lib, 2)
    c = launch(lib, 3)  # after every block: nobody collects it
    assert outer == [a, b] and middle == [a] and inner == [a]
    assert c not in outer


def test_blocks_overlapping_across_threads_close_in_any_order(lib):
    """Thread B opens a block, then thread A, which launches and closes first while both
    blocks hold the same launch: B's block still collects what comes after, and A's holds
    exactly what happened while it was open."""
    b_open, a_closed = threading.Event(), threading.Event()
    seen = {}
    errors = []

    def thread_a():
        try:
            assert b_open.wait(30)
            with record() as launches:
                seen["x"] = launch(lib, 5)
            seen["a"] = launches
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
        finally:
            a_closed.set()

    def thread_b():
        try:
            with record() as launches:
                b_open.set()
                assert a_closed.wait(30)
                seen["y"] = launch(lib, 7)
            seen["b"] = launches
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (thread_a, thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert seen["a"] == [seen["x"]]
    assert seen["b"] == [seen["x"], seen["y"]]
    later = launch(lib, 9)
    assert later not in seen["a"] and later not in seen["b"]
