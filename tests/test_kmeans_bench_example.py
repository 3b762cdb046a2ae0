"""The k-means benchmark and example run (tiny sizes) and report what they claim."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import kmeans as kmeans_bench

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kmeans_digits.py"


def test_kmeans_benchmark_rows_and_counters():
    pytest.importorskip("sklearn")
    result = kmeans_bench.run(n=300, d=4, k=3, iters=2, counter_points=60)
    impls = [r["impl"] for r in result["rows"]]
    assert impls == ["sklearn", "reference-cpu", "emulator"]
    for r in result["rows"]:
        assert r["ms_per_iter"] > 0 and r["points_per_s"] > 0
    inertias = [r["inertia"] for r in result["rows"]]
    assert max(inertias) <= 1.0001 * min(inertias)  # same init, same answer
    assert "kmeans_accumulate_atomic_float" in result["dispatches_one_iteration_fit"]
    counters = result["counters_one_iteration"]
    assert counters["kmeans_accumulate_atomic_float"]["dispatches"] == 1
    assert "ms/iter" in kmeans_bench.format_report(result)


def test_kmeans_cli_json(capsys):
    pytest.importorskip("sklearn")
    assert bench_cli.main(["kmeans", "--n", "200", "--d", "3", "--k", "2", "--iters", "1",
                           "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["n"], result["d"], result["k"]) == (200, 3, 2)
    assert [r["impl"] for r in result["rows"]] == ["sklearn", "reference-cpu", "emulator"]
    assert all(r["iterations"] == 1 for r in result["rows"])
    inertias = [r["inertia"] for r in result["rows"]]
    assert max(inertias) <= 1.0001 * min(inertias)  # same init, same answer
    # The per-kernel counters cover exactly the dispatches listed for that iteration.
    dispatched = result["dispatches_one_iteration_fit"]
    assert {name: c["dispatches"] for name, c in result["counters_one_iteration"].items()} == {
        name: dispatched.count(name) for name in dispatched}


def test_example_saves_centroid_png(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("kmeans_digits", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    png = tmp_path / "centroids.png"
    assert example.main(["--backend", "reference", "--n-init", "1", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "iteration 1/300, inertia" in out and "centroids saved to" in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
