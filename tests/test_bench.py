"""The benchmarks run (tiny sizes) and their kernels pass the sanitizer with right answers."""
import json

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import sanitizer


def test_sanitizer_benchmark_rows():
    rows = sanitizer.run([16, 20], repeats=1)  # 20: the matmul's edge tiles are partial
    assert [(r["kernel"], r["size"]) for r in rows] == [
        ("tiled_matmul", "16x16x16"), ("tiled_matmul", "20x20x20"),
        ("tree_reduce", "256"), ("tree_reduce", "400")]
    for r in rows:
        assert r["plain_s"] > 0 and r["sanitized_s"] > 0
        assert r["slowdown"] == r["sanitized_s"] / r["plain_s"]
    assert "slowdown" in sanitizer.format_table(rows)


def test_cli_json(capsys):
    assert bench_cli.main(["sanitizer", "--sizes", "16", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["kernel"] for r in rows} == {"tiled_matmul", "tree_reduce"}
