"""The training benchmark and the flagship demo run (tiny sizes, sanitized kernels)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import train as train_bench


def test_train_benchmark_phases_and_dispatches():
    result = train_bench.run(widths=(12, 16, 8, 4), density=0.3, batch=8, steps=1,
                             backend="emulator")
    rows = {r["phase"]: r for r in result["rows"]}
    assert list(rows) == ["forward", "loss", "backward", "optimizer"]
    # L = 3 layers: 3 forward, 1 loss, 3 backward, 1 optimizer = 2L + 2.
    assert [rows[p]["dispatches"] for p in rows] == [3, 1, 3, 1]
    assert result["step_dispatches"] == 8
    assert all(r["ms"] > 0 for r in rows.values())
    # Device bytes come from the emulator's counters (one instrumented step): forward reads
    # the input and weights and writes the activations, so it moves at least those bytes.
    assert all(r["device_bytes"] > 0 for r in rows.values())
    assert rows["forward"]["device_bytes"] >= 4 * 8 * (16 + 8 + 4)
    text = train_bench.format_table(result)
    assert "EMULATOR on the CPU: not GPU time" in text


def test_train_benchmark_cli_json(capsys):
    assert bench_cli.main(["train", "--widths", "6", "5", "3", "--batch", "4", "--steps", "1",
                           "--backend", "emulator", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["backend"] == "emulator" and result["step_dispatches"] == 6


def load_demo():
    path = Path(__file__).resolve().parents[1] / "examples" / "train_sparse_mlp.py"
    spec = importlib.util.spec_from_file_location("train_sparse_mlp", path)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_demo_runs_and_plots(tmp_path, capsys):
    demo = load_demo()
    png = tmp_path / "curves.png"
    acc = demo.main(["--epochs", "2", "--hidden", "32", "16", "--density", "0.2",
                     "--batch-size", "128", "--regrow-every", "5", "--plot", str(png),
                     "--quiet"])
    out = capsys.readouterr().out
    assert 0.0 <= acc <= 1.0
    assert png.is_file() and png.stat().st_size > 10_000
    assert f"plot: {png.resolve()}" in out
    assert "edges replaced per layer: [" in out


def test_the_block_sparse_demo_reaches_the_csr_demos_accuracy(tmp_path, capsys, monkeypatch):
    """The demo as the README runs it (30 epochs, 10% density), with the hidden layer in 8x8
    blocks (--block 8): within a point of the all-CSR model's test accuracy. The plain build
    (the suite's other tests run these kernels sanitized): two trainings of 660 steps."""
    monkeypatch.setenv("TSM_SANITIZE", "0")
    demo = load_demo()
    csr = demo.main(["--quiet", "--plot", str(tmp_path / "csr.png")])
    block = demo.main(["--quiet", "--block", "8", "--plot", str(tmp_path / "block.png")])
    out = capsys.readouterr().out
    assert "BlockSparseLinear(in_features=256, out_features=128, block=8" in out
    assert block >= csr - 0.01, (block, csr)
