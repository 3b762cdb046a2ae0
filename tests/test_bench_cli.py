"""The benchmark CLI rejects bad options with argparse's usage message and exit status 2,
before any benchmark runs (never a traceback from inside one)."""
from __future__ import annotations

import re

import pytest

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.emulator import record


@pytest.mark.parametrize("argv, message", [
    (["sanitizer", "--sizes", "0"], "argument --sizes: '0': must be at least 1"),
    (["sanitizer", "--sizes", "16", "-3"], "argument --sizes: '-3': must be at least 1"),
    (["sanitizer", "--repeats", "0"], "argument --repeats: '0': must be at least 1"),
    (["train", "--steps", "0"], "argument --steps: '0': must be at least 1"),
    (["train", "--batch", "0"], "argument --batch: '0': must be at least 1"),
    (["train", "--widths", "6", "0", "3"], "argument --widths: '0': must be at least 1"),
    (["train", "--widths", "6"], r"--widths needs at least two widths \(input and output\)"),
    (["train", "--density", "0"], r"argument --density: '0': must lie in \(0, 1\]"),
    (["train", "--density", "1.5"], r"argument --density: '1.5': must lie in \(0, 1\]"),
    (["train", "--density", "nan"], r"argument --density: 'nan': must lie in \(0, 1\]"),
    (["train", "--density", "abc"], "argument --density: 'abc' is not a number"),
    (["kmeans", "--k", "0"], "argument --k: '0': must be at least 1"),
    (["kmeans", "--n", "0"], "argument --n: '0': must be at least 1"),
    (["kmeans", "--n", "x"], "argument --n: 'x' is not an int"),
    (["kmeans", "--d", "0"], "argument --d: '0': must be at least 1"),
    (["kmeans", "--iters", "0"], "argument --iters: '0': must be at least 1"),
    (["kmeans", "--n", "3", "--k", "5"], "--k 5 is more clusters than --n 3 points"),
    (["matmul", "--sizes", "0"], "argument --sizes: shape '0': every dimension must be at least 1"),
    (["matmul", "--sizes", "8x0x8"], "argument --sizes: shape '8x0x8': every dimension must be at least 1"),
    (["matmul", "--sizes", "2x3"], "argument --sizes: shape '2x3': expected S or MxNxK"),
    (["matmul", "--repeats", "0"], "argument --repeats: '0': must be at least 1"),
    (["matmul", "--warmup", "-1"], "argument --warmup: '-1': must be at least 0"),
    (["matmul", "--peak-tflops", "0"], "argument --peak-tflops: '0': must be a positive number"),
    (["matmul", "--peak-tflops", "inf"], "argument --peak-tflops: 'inf': must be a positive number"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with record() as launches, pytest.raises(SystemExit) as info:
        bench_cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m torch_sparse_metal.bench " + argv[0])
    assert re.search("error: " + message + "\n", err), err
    assert launches == []


def test_edge_values_are_accepted(capsys):
    assert bench_cli.main(["matmul", "--device", "emulator", "--sizes", "1", "1x2x3",
                           "--kernels", "naive", "--warmup", "0", "--json"]) == 0
    assert '"m": 1' in capsys.readouterr().out
