"""The first use of a shader says it is compiling, which library and that it is cached after,
and how long it took; a cached one says nothing."""
from __future__ import annotations

import io
import time
import uuid

import pytest

from torch_sparse_metal.emulator import compile_shader
from torch_sparse_metal.emulator._compiler import compiling

SOURCE = """
#include <metal_stdlib>
using namespace metal;
kernel void one(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) { x[i] = 1; }
"""


def test_a_first_compile_says_so_and_a_cached_one_does_not(capfd):
    source = SOURCE + f"// {uuid.uuid4()}: a source no cache has seen\n"
    compile_shader(source)
    err = capfd.readouterr().err
    assert "torch_sparse_metal: compiling <compile_shader> for the Metal emulator (first use; " \
           "cached after in " in err
    assert "torch_sparse_metal: compiled <compile_shader> in " in err
    compile_shader(source, sanitize=False)   # the same library: cached, silent
    assert "compiling" not in capfd.readouterr().err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_seconds_tick_on_one_line():
    out = Terminal()
    with compiling("slow.metal", True, stream=out):
        time.sleep(2.3)
    text = out.getvalue()
    assert text.startswith("torch_sparse_metal: compiling slow.metal (sanitized) for the Metal "
                           "emulator")
    assert ": 1 s" in text and ": 2 s" in text and text.count("\n") == 1
    assert "\rtorch_sparse_metal: compiled slow.metal (sanitized) in 2." in text


def test_a_failed_compile_says_it_failed():
    out = io.StringIO()
    with pytest.raises(RuntimeError), compiling("bad.metal", False, stream=out):
        raise RuntimeError("g++ said no")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("torch_sparse_metal: compiling bad.metal for the Metal emulator")
    assert lines[1].startswith("torch_sparse_metal: failed bad.metal in ")
