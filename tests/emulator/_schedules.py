"""A shader built each way the emulator runs a threadgroup: barrier regions (its threads as
a loop between stops), fibers (``TSM_EMU_REGIONS=0``) and, for a uniform kernel with
SIMD-group functions, lanes at once (the default of regions; ``TSM_EMU_LANES=0`` keeps the
rounds), for tests that they agree."""
from __future__ import annotations

from pathlib import Path

import torch

from torch_sparse_metal.emulator import KernelFault, _compiler, compile_shader

from _hang_guard import call_with_timeout


def both_ways(source: str, monkeypatch, sanitize: bool):
    """(regions, fibers): the library compiled with barrier regions and without."""
    monkeypatch.setenv("TSM_EMU_REGIONS", "1")
    regions = compile_shader(source, sanitize=sanitize)
    monkeypatch.setenv("TSM_EMU_REGIONS", "0")
    fibers = compile_shader(source, sanitize=sanitize)
    monkeypatch.delenv("TSM_EMU_REGIONS")
    # Two builds, not one library handed out twice (compile_shader keeps what it loaded).
    assert regions is not fibers and regions.path != fibers.path
    return regions, fibers


def three_ways(source: str, monkeypatch):
    """(lanes, rounds, fibers): plain libraries with lanes at once, with the regions'
    rounds instead (``TSM_EMU_LANES=0``), and with fibers."""
    monkeypatch.setenv("TSM_EMU_LANES", "0")
    rounds, fibers = both_ways(source, monkeypatch, sanitize=False)
    monkeypatch.delenv("TSM_EMU_LANES")
    lanes = compile_shader(source)
    assert len({lanes.path, rounds.path, fibers.path}) == 3
    return lanes, rounds, fibers


def translated(source: str, tmp_path: Path, sanitize: bool = False) -> _compiler.GeneratedCxx:
    """``source`` as the emulator translates it (written to ``tmp_path``)."""
    path = tmp_path / "shader.metal"
    path.write_text(source)
    return _compiler.generated_cxx(path, sanitize=sanitize)


def grouped(source: str, tmp_path: Path) -> set:
    """The kernels of ``source`` that run as barrier regions."""
    return translated(source, tmp_path).grouped


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit, NaNs (a shuffle's poison value) included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def same_bits_each_way(ways, launch):
    """What ``launch(lib)`` gives for each library of ``ways`` (a tensor, or a tuple of
    them: the outputs it wrote), asserted the same to the bit in every way; the first way's
    (lanes at once, of three_ways)."""
    results = [launch(lib) for lib in ways]
    as_tuples = [r if isinstance(r, tuple) else (r,) for r in results]
    for other in as_tuples[1:]:
        assert len(other) == len(as_tuples[0])
        for a, b in zip(as_tuples[0], other):
            assert bitwise_equal(a, b)
    return results[0]


def fault_of(lib, kernel: str, *args, **launch):
    """(kind, words) of the fault a launch of ``lib``'s ``kernel`` raises, or None."""
    try:
        call_with_timeout(getattr(lib, kernel), *args, **launch)
    except KernelFault as e:
        return e.kind, str(e)
    return None
