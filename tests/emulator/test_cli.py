"""The emulator's command line: check a .metal file against Metal's rules, run one of its
kernels on .npy buffers, plain or sanitized."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from torch_sparse_metal.emulator.__main__ import main

SOURCE = r"""
#include <metal_stdlib>
#include "scale.h"
using namespace metal;
kernel void axpy(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                 constant float& a [[buffer(2)]], constant uint& n [[buffer(4)]],
                 uint i [[thread_position_in_grid]]) {
  if (i < n) y[i] = scaled(a, x[i]) + y[i];
}
kernel void past_the_end(device float* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i + 1] = 1.0f;
}
"""
HEADER = "inline float scaled(float a, float x) { return a * x; }\n"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "k.metal").write_text(SOURCE)
    (tmp_path / "scale.h").write_text(HEADER)
    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.float32))
    np.save(tmp_path / "y.npy", np.ones(6, dtype=np.float32))
    return tmp_path


def test_check_lists_the_kernels(files, capsys):
    assert main(["check", str(files / "k.metal"), "--std", "3.1"]) == 0
    assert "passes Metal's rules at MSL 3.1; 2 kernel(s): axpy, past_the_end" in \
        capsys.readouterr().out


def test_check_rejects_what_apples_compiler_rejects(tmp_path, capsys):
    bad = tmp_path / "bad.metal"
    bad.write_text("#include <metal_stdlib>\nusing namespace metal;\n"
                   "kernel void k(float* x [[buffer(0)]]) { x[0] = 1; }\n")   # no address space
    assert main(["check", str(bad)]) == 1
    assert "bad.metal" in capsys.readouterr().err


def test_run_writes_the_kernels_results_back(files, capsys):
    argv = ["run", str(files / "k.metal"), "axpy", str(files / "x.npy"), str(files / "y.npy"),
            "float32:2", "none", "uint32:6", "--grid", "6", "--group", "4"]
    assert main(argv) == 0
    np.testing.assert_array_equal(np.load(files / "y.npy"), 2 * np.arange(6) + 1)
    assert "axpy: ran over grid (6,)" in capsys.readouterr().out


def test_run_into_another_directory_keeps_the_inputs(files):
    out = files / "out"
    argv = ["run", str(files / "k.metal"), "axpy", str(files / "x.npy"), str(files / "y.npy"),
            "float32:-1", "none", "uint32:6", "--grid", "6", "--out", str(out)]
    assert main(argv) == 0
    np.testing.assert_array_equal(np.load(files / "y.npy"), np.ones(6))
    np.testing.assert_array_equal(np.load(out / "y.npy"), 1 - np.arange(6))


def test_a_sanitized_run_names_the_fault(files, capsys):
    argv = ["run", str(files / "k.metal"), "past_the_end", str(files / "y.npy"), "--grid", "6",
            "--sanitize"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "out_of_bounds" in err and "`y` at element 6" in err


@pytest.mark.parametrize("argument, message", [
    ("float32:abc", "'abc' is not a float32"),
    ("complex:1", "TYPE one of"),
    ("missing.npy", "no such file"),
])
def test_bad_arguments_are_usage_errors(files, argument, message):
    done = subprocess.run([sys.executable, "-m", "torch_sparse_metal.emulator", "run",
                           str(files / "k.metal"), "axpy", argument, "--grid", "1"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr


def test_a_wrong_scalar_type_is_the_launch_error(files, capsys):
    argv = ["run", str(files / "k.metal"), "axpy", str(files / "x.npy"), str(files / "y.npy"),
            "int32:2", "none", "uint32:6", "--grid", "6"]
    assert main(argv) == 2
    assert "argument 2" in capsys.readouterr().err
