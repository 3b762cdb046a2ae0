"""``bench ops``: the per-call cost of each op registration style around a no-op kernel."""
import json

import pytest

from torch_sparse_metal.bench import __main__ as bench_cli
from torch_sparse_metal.bench import ops
from torch_sparse_metal.emulator import record


def test_rows_time_every_style_with_and_without_the_kernel():
    calls, repeats = 20, 2
    with record() as launches:
        rows = ops.run(calls=calls, repeats=repeats)
    key = ("launch", "arguments", "requires_grad", "style")
    assert [tuple(r[k] for k in key) for r in rows] == [
        (launch, arguments, grad, style) for launch in (True, False)
        for arguments in ops.ARGUMENTS for grad in (False, True) for style in ops.STYLES]
    for r in rows:
        assert r["us_per_call"] > 0
        direct = next(d for d in rows if d["style"] == "direct"
                      and all(d[k] == r[k] for k in key[:3]))
        assert r["overhead_us"] == pytest.approx(r["us_per_call"] - direct["us_per_call"])
    # Every style launched the kernel on every call (warm-up included), and only there.
    per_style = len(ops.ARGUMENTS) * 2 * (min(calls, 50) + repeats * calls)
    assert [l.kernel for l in launches] == ["noop"] * (len(ops.STYLES) * per_style)
    table = ops.format_table(rows, "emulator")
    assert "Library+Autograd kernel" in table and "EMULATOR" in table


def test_cli_json(capsys):
    assert bench_cli.main(["ops", "--calls", "5", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["style"] for r in rows} == set(ops.STYLES)


@pytest.mark.parametrize("argv, message", [
    (["ops", "--calls", "0"], "argument --calls: '0': must be at least 1"),
    (["ops", "--repeats", "0"], "argument --repeats: '0': must be at least 1"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        bench_cli.main(argv)
    assert info.value.code == 2
    assert "error: " + message in capsys.readouterr().err
