"""A shader built both ways the emulator runs a threadgroup: barrier regions (its threads as
a loop between stops) and fibers (``TSM_EMU_REGIONS=0``), for tests that the two agree."""
from __future__ import annotations

from pathlib import Path

from torch_sparse_metal.metal import _compiler, compile_shader


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


def grouped(source: str, tmp_path: Path) -> set:
    """The kernels of ``source`` that run as barrier regions."""
    path = tmp_path / "shader.metal"
    path.write_text(source)
    return _compiler.generated_cxx(path).grouped
