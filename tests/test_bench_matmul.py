"""The matmul benchmark: emulator rows (tiny shapes), the CLI, the MPS-side writers on
synthetic rows, and the MPSMatrixMultiplication baseline's stream contract in launcher.mm."""
import csv
import json
import re
from pathlib import Path

import pytest

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import matmul as bench

LAUNCHER = Path(__file__).resolve().parents[1] / "csrc" / "metal" / "launcher.mm"


def test_emulator_rows_are_correct_and_carry_counters():
    rows = bench.run_emulator([("t", 33, 20, 17)], kernels=("naive", "simdgroup"))
    assert [r["rung"] for r in rows] == ["naive", "simdgroup"]
    for r in rows:
        assert r["ok"] and r["kernel"].startswith(f"matmul_{r['rung']}_nn_")
        assert r["device_bytes_written"] == 33 * 20 * 4
        assert r["flops"] == 2 * 33 * 20 * 17
        moved = r["device_bytes_read"] + r["device_bytes_written"]
        assert r["flops_per_device_byte"] == pytest.approx(r["flops"] / moved)
    naive, simd = rows
    assert naive["flops_per_device_byte"] < simd["flops_per_device_byte"]
    assert simd["bank_conflicts"] == 0
    assert "FLOP/B" in bench.format_emulator_table(rows)


def test_cli_json(capsys):
    assert bench_cli.main(["matmul", "--device", "emulator", "--sizes", "9x7x5",
                           "--kernels", "tiled", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["m"], row["n"], row["k"], row["rung"], row["ok"]) == (9, 7, 5, "tiled", True)


def test_shape_parsing():
    assert [bench.parse_shape(s) for s in ("64", "2x3x4")] == [("64x64x64", 64, 64, 64),
                                                               ("2x3x4", 2, 3, 4)]
    for spec in ("2x3", "ax2x3", "", "2x3x4x5"):
        with pytest.raises(ValueError, match=f"^shape '{spec}': expected S or MxNxK$"):
            bench.parse_shape(spec)
    for spec in ("0", "4x0x4", "-2x3x4"):
        with pytest.raises(ValueError, match=f"^shape '{spec}': every dimension must be at least 1$"):
            bench.parse_shape(spec)


def test_mps_writers_on_synthetic_rows(tmp_path):
    # The MPS timing loop needs a Mac; its CSV and plot writers do not.
    rows = [{"shape": "square_256", "m": 256, "n": 256, "k": 256, "dtype": "torch.float32",
             "kernel": k, "ms": 1.0, "tflops": 0.5, "pct_peak": None, "ok": True}
            for k in ("torch.mm", "simdgroup")]
    bench.write_csv(rows, str(tmp_path / "m.csv"))
    with open(tmp_path / "m.csv") as f:
        assert [r["kernel"] for r in csv.DictReader(f)] == ["torch.mm", "simdgroup"]
    pytest.importorskip("matplotlib")
    bench.write_plot(rows, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert "TFLOP/s" in bench.format_mps_table(rows)


def test_default_shapes_cover_the_issue():
    assert bench.SQUARE_SIZES[0] == 256 and bench.SQUARE_SIZES[-1] == 4096
    labels = {s[0] for s in bench.TRANSFORMER_SHAPES}
    assert {"qk_t", "mlp_up", "mlp_down"} <= labels and any("skinny" in l for l in labels)


def test_mps_baseline_follows_the_stream_contract():
    from test_metal_launcher import _block_end, _code_only  # same checks as the launcher's

    code = _code_only(LAUNCHER.read_text())
    start = code.index("void py_mps_matmul(")
    body = code[start:_block_end(code, code.index("{", start))]
    # Encoded in the stream's queue, after torch closes its coalesced encoder, on torch's
    # command buffer; never submitted here (test_metal_launcher checks no commit at all).
    queue = re.search(r"dispatch_sync\s*\(\s*stream\s*->\s*queue\s*\(\s*\)\s*,\s*\^", body)
    assert queue
    block = body[queue.end():]
    close = block.index("endKernelCoalescing()")
    encode = block.index("encodeToCommandBuffer:")
    assert close < encode
    assert re.search(r"encodeToCommandBuffer:\s*stream\s*->\s*commandBuffer\s*\(\s*\)", block)
    assert "initWithBuffer:" in block and "offset:" in block
    # Operands bound at their storage offsets.
    helper = code[code.index("StoredMatrix stored_matrix("):]
    assert re.search(r"storage_offset\s*\(\s*\)\s*\)\s*\*", helper[:2000])
    assert 'm.def("mps_matmul", &py_mps_matmul' in LAUNCHER.read_text()


# ---- the MPS path's logic, on CPU with a fake synchronisation and clock ------------------

def test_time_per_call_is_n_calls_between_two_synchronisations():
    events = []
    ticks = iter([10.0, 10.6])

    def clock():
        events.append("clock")
        return next(ticks)

    seconds = bench.time_per_call(lambda: events.append("call"), warmup=2, calls=3,
                                  sync=lambda: events.append("sync"), clock=clock)
    assert events == ["call", "call", "sync", "clock", "call", "call", "call", "sync", "clock"]
    assert seconds == pytest.approx(0.2)


def test_mps_rows_keep_going_when_an_implementation_fails():
    def failing_baseline(a, b, c):
        raise RuntimeError("MPSMatrixMultiplication init failed\nmore detail")

    syncs = []
    ticks = iter(float(t) for t in range(100))
    rows = bench.run_mps([("t", 9, 7, 5)], kernels=("naive", "simdgroup", "tiled"), warmup=1,
                         repeats=4, device="cpu", backend="emulator",
                         caps={"name": "Apple M1", "supports_apple7": False},
                         baseline=failing_baseline, sync=lambda: syncs.append(1),
                         clock=lambda: next(ticks))
    assert [r["kernel"] for r in rows] == ["torch.mm", "naive", "tiled", "MPSMatrixMultiplication"]
    *timed, failed = rows
    for r in timed:  # each timed: 4 calls in 1 tick of the fake clock
        assert r["ok"] and r["error"] is None and r["ms"] == pytest.approx(1e3 / 4)
        assert r["pct_peak"] == pytest.approx(100 * r["tflops"] / 2.6)  # Apple M1: 2.6
    assert failed["error"] == "RuntimeError: MPSMatrixMultiplication init failed"
    assert failed["ms"] is None and failed["ok"] is False
    assert len(syncs) == 3 * 3  # per timed row: after the check, the warm-up, the timed calls
    table = bench.format_mps_table(rows)
    assert "failed: RuntimeError: MPSMatrixMultiplication init failed" in table
    assert table.splitlines()[-1].startswith("ms: per call, over back-to-back calls")


def test_peak_table_covers_m1_to_m5_with_a_source_for_every_figure():
    names = set(bench.FP32_PEAKS)
    for generation in ("M1", "M2", "M3", "M4", "M5"):
        assert f"Apple {generation}" in names
    assert {"Apple M1 Pro", "Apple M1 Max", "Apple M1 Ultra", "Apple M2 Pro", "Apple M2 Max",
            "Apple M2 Ultra", "Apple M3 Max", "Apple M4 Max"} <= names
    for name, (peak, source) in bench.FP32_PEAKS.items():
        if peak is None:
            assert source.startswith("no public figure"), name
        else:
            assert peak > 0 and ("apple" in source.lower() or "github.com" in source), name
    # Within a generation the bigger chip has the higher peak.
    peaks = {n: p for n, (p, _) in bench.FP32_PEAKS.items()}
    assert peaks["Apple M1"] < peaks["Apple M1 Pro"] < peaks["Apple M1 Max"] < peaks["Apple M1 Ultra"]
    assert peaks["Apple M2"] < peaks["Apple M2 Pro"] < peaks["Apple M2 Max"] < peaks["Apple M2 Ultra"]

