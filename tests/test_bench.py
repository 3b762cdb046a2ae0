"""The benchmarks run (tiny sizes) and their kernels pass the sanitizer with right answers."""
import json

import math

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import sanitizer
from torch_sparse_metal.emulator import record


def test_sanitizer_benchmark_rows():
    with record() as launches:
        rows = sanitizer.run([16, 20], repeats=1)  # 20: the matmul's edge tiles are partial
    assert [(r["kernel"], r["size"]) for r in rows] == [
        ("tiled_matmul", "16x16x16"), ("tiled_matmul", "20x20x20"),
        ("tree_reduce", "256"), ("tree_reduce", "400")]
    for r in rows:
        assert r["plain_s"] > 0 and r["sanitized_s"] > 0 and r["counted_s"] > 0
        assert r["slowdown"] == r["sanitized_s"] / r["plain_s"]
        assert r["counted_slowdown"] == r["counted_s"] / r["plain_s"]
    # The reported barrier waits are what the sanitized dispatches counted: the emulator
    # counts one per threadgroup barrier, each one waited at by every thread of the group.
    # Per row: a check and a timing plain, sanitized, and sanitized inside record().
    assert len(launches) == 6 * len(rows)
    for i, r in enumerate(rows):
        plain, sanitized = launches[6 * i: 6 * i + 2], launches[6 * i + 2: 6 * i + 6]
        assert all(l.kernel == r["kernel"] for l in plain + sanitized)
        assert all(l.counters is None for l in plain)
        for l in sanitized:
            assert l.counters["barriers"] * math.prod(l.group_size) == r["barrier_waits"]
    assert [r["barrier_waits"] for r in rows] == [
        2 * 1 * 16 * 16,        # 16x16: one 16x16 group, two barriers per k-tile, one k-tile
        2 * 2 * 32 * 32,        # 20x20: four groups (edge tiles padded), two k-tiles
        9 * 1 * 256,            # 256 values: one group, log2(256) + 1 barrier stages
        9 * 2 * 256]            # 400 values: two groups
    assert "slowdown" in sanitizer.format_table(rows)


def test_cli_json(capsys):
    assert bench_cli.main(["sanitizer", "--sizes", "16", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["kernel"] for r in rows} == {"tiled_matmul", "tree_reduce"}
