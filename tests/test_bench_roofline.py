"""The roofline: a lower bound on GPU time from counters and public peak figures."""
from __future__ import annotations

import json

import pytest

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import chips, roofline, sparse

ZERO = {"fmas": 0, "device_transactions": 0}


def test_every_roofline_chip_has_sourced_figures():
    assert list(chips.ROOFLINE_CHIPS) == ["m1", "m1-max", "m2-max", "m3-max", "m4", "m4-max", "m5"]
    for key, chip in chips.ROOFLINE_CHIPS.items():
        tflops, estimated = chip.roofline_tflops()
        assert tflops > 0 and chip.bandwidth_gbs > 0, key
        assert "Apple newsroom" in chip.bandwidth_source or "Apple states no figure" in chip.bandwidth_source
        # An estimate only where the table holds no firm figure, and it says so.
        assert estimated == (chip.fp32_tflops is None), key
        if estimated:
            assert chip.fp32_estimate[1].startswith("third-party estimate"), key
    # The figures the issue quotes.
    m1_max, m4_max = chips.ROOFLINE_CHIPS["m1-max"], chips.ROOFLINE_CHIPS["m4-max"]
    assert (m1_max.roofline_tflops()[0], m1_max.bandwidth_gbs) == (10.6, 400.0)
    assert (m4_max.roofline_tflops()[0], m4_max.bandwidth_gbs) == (18.4, 546.0)


def test_matmul_peaks_keep_firm_figures_only():
    # matmul's "% of peak" must not divide by an estimate.
    assert chips.FP32_PEAKS["Apple M4 Max"][0] is None
    assert chips.FP32_PEAKS["Apple M1 Max"][0] == 10.6


def test_memory_bound_arithmetic():
    m1_max = chips.ROOFLINE_CHIPS["m1-max"]
    # 1e6 transactions of 128 B = 128 MB at 400 GB/s = 320 us; 1e6 FMAs = 2 MFLOP at
    # 10.6 TFLOP/s = 0.19 us.
    b = roofline.bound({"fmas": 10**6, "device_transactions": 10**6}, m1_max)
    assert b["transferred_bytes"] == 128 * 10**6 and b["flops"] == 2 * 10**6
    assert b["memory_us"] == pytest.approx(320.0)
    assert b["compute_us"] == pytest.approx(2e6 / 10.6e12 * 1e6)
    assert b["bound_us"] == b["memory_us"] and b["limited_by"] == "memory"


def test_compute_bound_arithmetic():
    m4_max = chips.ROOFLINE_CHIPS["m4-max"]
    b = roofline.bound({"fmas": 9.2 * 10**12, "device_transactions": 1}, m4_max)
    assert b["compute_us"] == pytest.approx(1e6)  # 18.4 TFLOP at 18.4 TFLOP/s: one second
    assert b["bound_us"] == b["compute_us"] and b["limited_by"] == "compute"
    assert b["peak_tflops_estimated"] is True


def test_segment_size_scales_the_bytes():
    chip = chips.ROOFLINE_CHIPS["m1"]
    assert roofline.bound({"fmas": 0, "device_transactions": 10}, chip, 64)["transferred_bytes"] == 640
    assert roofline.bound(ZERO, chip)["bound_us"] == 0.0


def test_unknown_chip_names_the_choices():
    with pytest.raises(ValueError, match="unknown chip 'm9': choose from m1, m1-max"):
        roofline.chip("m9")


@pytest.mark.parametrize("argv, message", [
    (["sparse", "--chip", "m9"], "argument --chip: unknown chip 'm9'"),
    (["sparse", "--chip"], "argument --chip: expected at least one argument"),
    (["matmul", "--chip", "M4-Max"], "argument --chip: unknown chip 'M4-Max'"),
    (["kmeans", "--chip", "m3"], "argument --chip: unknown chip 'm3'"),
    (["sparse", "--sizes", "0"], "argument --sizes: size '0': every dimension must be at least 1"),
    (["sparse", "--sizes", "4x5x6"], r"argument --sizes: size '4x5x6': expected S or IxO"),
    (["sparse", "--batch", "0"], "argument --batch: '0': must be at least 1"),
    (["sparse", "--density", "2"], "argument --density: '2': must lie in (0, 1]"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench_cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_sparse_rows_bound_each_kernel_on_each_chip(capsys):
    assert bench_cli.main(["sparse", "--sizes", "64x48", "--density", "0.2", "--batch", "8",
                           "--chip", "m1", "m4-max", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["phase"], r["dtype"]) for r in rows] == [
        ("forward", "float32"), ("backward", "float32"), ("forward", "float16"),
        ("backward", "float16")]
    assert [r["kernel"].rsplit("_", 1)[1] for r in rows] == ["float", "float", "half", "half"]
    for r in rows:
        c = r["counters"]
        # One FMA per edge and batch element; the backward's two (grad_input, grad_values).
        assert c["fmas"] == (1 if r["phase"] == "forward" else 2) * 8 * r["nnz"]
        assert 0 < r["coalescing_efficiency"] <= 1 and 0 < r["lane_efficiency"] <= 1
        assert [b["chip"] for b in r["bounds"]] == ["Apple M1", "Apple M4 Max"]
        m1, m4 = r["bounds"]
        assert m1["transferred_bytes"] == 128 * c["device_transactions"]
        assert m1["bound_us"] > m4["bound_us"] > 0  # more bandwidth and FLOP/s, lower bound


def test_table_says_it_is_a_bound_not_a_measurement():
    chosen = [chips.ROOFLINE_CHIPS["m1-max"], chips.ROOFLINE_CHIPS["m4-max"]]
    table = sparse.format_table(sparse.run([(32, 32)], 0.25, 4, chosen), chosen)
    assert "bound us M1 Max" in table and "bound us M4 Max" in table
    assert "a lower bound, not a measurement" in table
    assert "third-party estimate" in table  # the M4 Max's FP32 figure


def test_block_rows_set_each_sparsity_against_the_dense_layer(capsys):
    assert bench_cli.main(["block", "--size", "64", "--batch", "8", "--block", "16",
                           "--sparsities", "0.5", "0.75", "--chip", "m1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["form"], r["sparsity"], r["phase"]) for r in rows] == [
        ("dense", 0.0, "forward"), ("dense", 0.0, "backward"),
        ("block 16", 0.5, "forward"), ("block 16", 0.5, "backward"),
        ("block 16", 0.75, "forward"), ("block 16", 0.75, "backward")]
    for r in rows:
        # The block layer's FMAs are its blocks' (nnzb x 16 x 16 per batch row, twice in the
        # backward); the dense layer's, the products' own.
        nnzb = round((1 - r["sparsity"]) * 16)
        fmas = 64 * 64 * 8 if r["form"] == "dense" else nnzb * 16 * 16 * 8
        assert r["counters"]["fmas"] >= fmas * (1 if r["phase"] == "forward" else 2)
        assert r["against_dense"][0] == pytest.approx(
            r["bounds"][0]["bound_us"] / rows[0 if r["phase"] == "forward" else 1]["bounds"][0]["bound_us"])
    assert rows[2]["kernels"] == ["block_sparse_linear_forward_simdgroup_b16_float"]


def test_block_size_must_divide_the_layer(capsys):
    with pytest.raises(SystemExit):
        bench_cli.main(["block", "--size", "40", "--block", "16"])
    assert "40 is not a multiple of --block 16" in capsys.readouterr().err
