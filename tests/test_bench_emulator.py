"""The emulator benchmark (bench/emulator.py) on tiny sizes: answers checked, rows,
interleaving, ratios, the "not installed" path, the table, JSON and CSV."""
import csv
import dataclasses
import json
import os
import sys
import types

import numpy as np
import pytest

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import emulator as eb
from torch_sparse_metal.bench.pocl import find_pocl
from torch_sparse_metal.emulator import record

NOT_INSTALLED = "not installed (faked by the test)"


def tiny_twins():
    # 20: partial edge tiles; 400 floats: a partial last threadgroup; 40 x 30 at 20%: rows
    # of different lengths, some possibly empty.
    return eb.twin_cases([16, 20], sparse=(40, 30, 0.2, 3), reduce_count=400)


@pytest.fixture(scope="module")
def twin_run():
    with record() as launches:
        result = eb.run(tiny_twins(), repeats=2, sanitized_repeats=1, pocl=NOT_INSTALLED)
    return result, launches


def test_twins_run_right_plain_and_sanitized(twin_run):
    result, launches = twin_run
    rows = result["rows"]
    assert [(r["kernel"], r["size"]) for r in rows] == [
        ("tiled_matmul", "16^3"), ("tiled_matmul", "20^3"),
        ("csr_forward", "40x30 20% b3"), ("tree_reduce", "400 (256/group)")]
    for r in rows:
        assert r["ok"] and r["emulator"] == r["sanitized"] == "ok"
        assert r["emulator_ms"] > 0 and r["sanitized_ms"] > 0
        assert r["slowdown"] == r["sanitized_ms"] / r["emulator_ms"]
        assert r["pocl"] == NOT_INSTALLED and r["pocl_ms"] is None and r["ratio"] is None
    # Per row: plain warm-up, sanitized warm-up, then round 1 (plain, sanitized) and
    # round 2 (plain only). The plain build runs unsanitized although the suite sets
    # TSM_SANITIZE=1; only the sanitized build has counters.
    assert len(launches) == 5 * len(rows)
    for i, r in enumerate(rows):
        mine = launches[5 * i: 5 * i + 5]
        assert {l.kernel for l in mine} == {r["kernel"]}
        assert [l.counters is not None for l in mine] == [False, True, False, True, False]
    assert result["pocl"] == NOT_INSTALLED and result["pocl_available"] is False


def test_project_shaders_run_unsanitized_and_sanitized():
    cases = eb.project_cases(mm_sizes=[33], sparse=(40, 30, 0.2, 3), kmeans=(200, 5, 4))
    before = os.environ.get("TSM_SANITIZE")
    with record() as launches:
        result = eb.run(cases, repeats=1, sanitized_repeats=1, pocl=NOT_INSTALLED)
    assert os.environ.get("TSM_SANITIZE") == before
    rows = result["rows"]
    assert [r["kernel"] for r in rows] == [
        "tsm.mm[naive]", "tsm.mm[tiled]", "tsm.mm[register]", "tsm.mm[simdgroup]",
        "tsm.mm[shuffle]", "sparse_linear_forward", "sparse_linear_backward", "kmeans_iteration"]
    for r in rows:
        assert r["ok"], r
        assert r["pocl"] == eb.NO_TWIN and r["pocl_ms"] is None
        assert r["emulator_ms"] > 0 and r["sanitized_ms"] > 0
    # Both builds ran: unsanitized launches carry no counters, sanitized ones do.
    assert any(l.counters is None for l in launches)
    assert any(l.counters is not None for l in launches)
    assert {l.kernel for l in launches} >= {"sparse_linear_forward_batch_lanes_float",
                                            "sparse_linear_backward_batch_lanes_float"}


def test_a_wrong_answer_fails_the_row_and_gives_no_number():
    case = eb.tiled_matmul_case(16)
    right = case.check
    wrong = dataclasses.replace(case, check=lambda out: right([out[0] + 1]))
    row = eb.run_case(wrong, NOT_INSTALLED, repeats=1, sanitized_repeats=1)
    assert not row["ok"]
    assert row["emulator"].startswith("wrong answer: 256 of 256 elements off")
    assert row["emulator_ms"] is row["sanitized_ms"] is row["slowdown"] is None
    table = eb.format_table({"pocl": NOT_INSTALLED, "cpu_count": 2, "repeats": 1,
                             "sanitized_repeats": 1, "rows": [row]})
    assert "WRONG" in table and "FAILED rows:" in table


def test_an_implementation_that_raises_fails_the_row():
    case = eb.tiled_matmul_case(16)

    def broken(sanitize):
        raise RuntimeError("no such luck\nsecond line")
    row = eb.run_case(dataclasses.replace(case, emulator=broken), NOT_INSTALLED, 1, 0)
    assert not row["ok"]
    assert row["emulator"] == "error: RuntimeError: no such luck"
    assert row["sanitized"] == "not run"


def test_mismatch():
    want = np.array([1.0, 2.0, 3.0])
    assert eb.mismatch(np.float32([1, 2, 3]), want, 1e-6) is None
    with_nan = eb.mismatch(np.float32([1, np.nan, 3]), want, 1)
    assert "1 of 3 elements off, e.g. at (1,): nan" in with_nan
    assert "at (2,)" in eb.mismatch(np.float32([1, 2, 3.5]), want, 0.1)
    assert "shape" in eb.mismatch(np.zeros(2), want, 1)


class _FakeClock:
    """A clock that moves only when a fake implementation runs."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_implementations_are_interleaved_and_ratios_computed():
    clock, calls = _FakeClock(), []

    def impl(name, durations):
        times = iter(durations)

        def run():
            calls.append(name)
            clock.now += next(times)
        return eb.Impl(run, lambda: [np.zeros(1)])

    emulator = {False: [0.0, 0.005, 0.003, 0.004], True: [0.0, 0.5]}
    case = eb.Case("k", "s",
                   lambda sanitize: impl("san" if sanitize else "emu", emulator[sanitize]),
                   lambda out: None, pocl=lambda device: impl("pocl", [0.0, 0.002, 0.001, 0.003]))
    row = eb.run_case(case, object(), repeats=3, sanitized_repeats=1, clock=clock)
    assert calls == ["emu", "pocl", "san",          # warm-ups (checked)
                     "emu", "pocl", "san",          # round 1
                     "emu", "pocl", "emu", "pocl"]  # rounds 2, 3
    assert row["emulator_ms"] == pytest.approx(3.0) and row["pocl_ms"] == pytest.approx(1.0)
    assert row["ratio"] == pytest.approx(3.0)
    assert row["sanitized_ms"] == pytest.approx(500.0) and row["slowdown"] == pytest.approx(500 / 3)
    assert row["ok"] and row["pocl"] == "ok"


def test_not_installed_without_pyopencl(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyopencl", None)  # import pyopencl raises ImportError
    reason = find_pocl(eb.TWIN_PROGRAMS)
    assert reason.startswith("not installed")
    row = eb.run_case(eb.tiled_matmul_case(16), reason, repeats=1, sanitized_repeats=0)
    assert row["ok"] and row["pocl"] == reason and row["ratio"] is None
    table = eb.format_table({"pocl": reason, "cpu_count": 2, "repeats": 1,
                             "sanitized_repeats": 0, "rows": [row]})
    assert f"PoCL: {reason}" in table
    assert table.splitlines()[3].split()[3:5] == ["not", "installed"]


def test_not_installed_without_a_pocl_cpu_device(monkeypatch):
    fake = types.SimpleNamespace(get_platforms=lambda: [], Error=Exception)
    monkeypatch.setitem(sys.modules, "pyopencl", fake)
    assert find_pocl(eb.TWIN_PROGRAMS) == "not installed (pyopencl finds no PoCL CPU device)"


def test_cli_json_csv_and_exit_code(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(eb, "twin_cases", lambda sizes: [eb.tiled_matmul_case(n) for n in sizes])
    monkeypatch.setattr(eb, "find_pocl", lambda programs: NOT_INSTALLED)
    path = tmp_path / "rows.csv"
    assert bench_cli.main(["emulator", "--twins-only", "--matmul-sizes", "16", "--repeats", "1",
                           "--sanitized-repeats", "0", "--json", "--csv", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pocl"] == NOT_INSTALLED and len(out["rows"]) == 1
    assert out["rows"][0]["kernel"] == "tiled_matmul" and out["rows"][0]["sanitized"] == "not run"
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == eb.CSV_FIELDS and rows[0]["size"] == "16^3"

    wrong = dataclasses.replace(eb.tiled_matmul_case(16), check=lambda out: "made wrong")
    monkeypatch.setattr(eb, "twin_cases", lambda sizes: [wrong])
    assert bench_cli.main(["emulator", "--twins-only", "--repeats", "1",
                           "--sanitized-repeats", "0"]) == 1
    assert "FAILED rows:" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--repeats", "0"], ["--sanitized-repeats", "-1"],
                                 ["--matmul-sizes", "x"]])
def test_cli_rejects_bad_values(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_cli.main(["emulator", *bad])
    assert exit_.value.code == 2
    assert "emulator: error: argument" in capsys.readouterr().err


def test_pocl_twins_agree_with_numpy():
    pocl = find_pocl(eb.TWIN_PROGRAMS)
    if isinstance(pocl, str):
        pytest.skip(f"PoCL {pocl}")
    result = eb.run(tiny_twins(), repeats=2, sanitized_repeats=0, pocl=pocl)
    assert result["pocl_available"] and result["pocl"].startswith("PoCL")
    for r in result["rows"]:
        assert r["ok"] and r["pocl"] == "ok", r
        assert r["ratio"] == r["emulator_ms"] / r["pocl_ms"]
