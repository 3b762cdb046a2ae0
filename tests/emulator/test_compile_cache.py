"""The compile cache trusts no file it finds: an entry is used only when its bytes match
the digest written beside it, so a truncated, empty or garbage entry (shared object or
runtime object) is rebuilt instead of crashing or failing every later process; a cache
that cannot be written falls back to a private directory; a moved cache still hits.

Each test gets its own cache directory, seeded with the runtime objects of the suite's
cache so that nothing but the test's own shader is compiled.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

import pytest

from torch_sparse_metal.emulator import _cache, _compiler

REPO = Path(__file__).resolve().parents[2]


def unique_source() -> str:
    return ("#include <metal_stdlib>\nusing namespace metal;\n"
            f"kernel void k_{uuid.uuid4().hex}(device float* o [[buffer(0)]],\n"
            "                uint i [[thread_position_in_grid]]) { o[i] = 2.0f * float(i); }\n")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory holding only (verified copies of) the runtime objects."""
    objects = _compiler._runtime_objects()  # built (or verified) in the suite's cache
    directory = tmp_path / "cache"
    (directory / "emulator").mkdir(parents=True)
    for obj in objects:
        for path in (obj, obj.with_name(obj.name + _cache.DIGEST_SUFFIX)):
            shutil.copy(path, directory / "emulator" / path.name)
    monkeypatch.setenv(_cache.ENV, str(directory))
    monkeypatch.setattr(_cache, "_private", None)
    return directory / "emulator"


def compiler_calls(monkeypatch):
    """Record every compiler run (and let it run)."""
    calls = []
    real = _compiler._run

    def counting(cmd, *args, **kwargs):
        calls.append(cmd)
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(_compiler, "_run", counting)
    return calls


def run_in_subprocess(code: str, cache_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), **{_cache.ENV: str(cache_dir.parent)})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "no digest", "other digest"])
def test_a_damaged_library_is_rebuilt(cache, monkeypatch, damage):
    source = unique_source()
    first = _compiler.compile_source(source)
    good = first.path.read_bytes()
    digest_file = first.path.with_name(first.path.name + _cache.DIGEST_SUFFIX)
    if damage == "truncated":
        first.path.write_bytes(good[: len(good) // 3])
    elif damage == "empty":
        first.path.write_bytes(b"")
    elif damage == "garbage":
        first.path.write_bytes(os.urandom(len(good)))
    elif damage == "no digest":
        digest_file.unlink()
    else:
        digest_file.write_text("0" * 64 + "\n")
    calls = compiler_calls(monkeypatch)
    again = _compiler.compile_source(source)
    assert again.path == first.path and len(calls) == 1  # rebuilt, in place
    assert _cache.verified(again.path)
    assert again.path.stat().st_size == len(good)


def test_a_truncated_library_does_not_take_a_new_process_down(cache):
    """The issue's case: a later process loading a truncated entry died of SIGBUS."""
    code = ("import torch\nfrom torch_sparse_metal.emulator import compile_shader\n"
            f"lib = compile_shader({unique_source()!r})\n"
            "out = torch.zeros(4)\n"
            "getattr(lib, lib.kernel_names[0])(out, threads=4)\n"
            "print(out.tolist())\n")
    first = run_in_subprocess(code, cache)
    assert first.returncode == 0, first.stderr
    (library,) = cache.glob("*.so")
    library.write_bytes(library.read_bytes()[:4096])
    second = run_in_subprocess(code, cache)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "[0.0, 2.0, 4.0, 6.0]"
    assert _cache.verified(library)


def test_a_damaged_runtime_object_is_rebuilt(cache, monkeypatch):
    (runtime,) = cache.glob("runtime-*.o")
    runtime.write_bytes(b"\x7fELF" + b"\0" * 100)
    calls = compiler_calls(monkeypatch)
    _compiler.compile_source(unique_source())
    assert any("runtime.cpp" in " ".join(map(str, cmd)) for cmd in calls)
    assert _cache.verified(runtime)


def test_a_moved_cache_still_hits(cache, monkeypatch, tmp_path):
    source = unique_source()
    _compiler.compile_source(source)
    moved = tmp_path / "elsewhere"
    shutil.move(str(cache.parent), str(moved))
    monkeypatch.setenv(_cache.ENV, str(moved))
    calls = compiler_calls(monkeypatch)
    again = _compiler.compile_source(source)
    assert calls == [] and again.path.parent == moved / "emulator"


def test_an_unwritable_cache_falls_back_to_a_private_directory(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(_cache.ENV, str(blocker / "cache"))  # cannot be created
    monkeypatch.setattr(_cache, "_private", None)
    source = unique_source()
    with pytest.warns(RuntimeWarning, match=r"cannot be written; compiling into .* for this "
                                            r"process only\. Set TSM_CACHE_DIR"):
        compiled = _compiler.compile_source(source)
    private = _cache._private
    assert private is not None and compiled.path.parent == private
    calls = compiler_calls(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process
        assert _compiler.compile_source(source).path == compiled.path
    assert calls == []  # the private entry is reused


def test_a_read_only_cache_still_serves_its_valid_entries(cache, monkeypatch):
    source = unique_source()
    kept = _compiler.compile_source(source).path
    real_stage = _cache._stage

    def read_only(target):
        if target.parent == cache:
            raise PermissionError(13, "Read-only file system", str(target))
        return real_stage(target)

    monkeypatch.setattr(_cache, "_stage", read_only)
    calls = compiler_calls(monkeypatch)
    assert _compiler.compile_source(source).path == kept and calls == []
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        fresh = _compiler.compile_source(unique_source())
    assert fresh.path.parent == _cache._private and len(calls) == 1


def test_entries_are_replaced_never_rewritten_in_place(cache):
    """A rebuild gives the entry a new inode: a process that mapped the old file keeps a
    complete copy (rewriting it in place is what turns a truncation into SIGBUS)."""
    source = unique_source()
    path = _compiler.compile_source(source).path
    before = path.stat().st_ino
    path.write_bytes(b"")
    _compiler.compile_source(source)
    assert path.stat().st_ino != before


@pytest.mark.parametrize("module", ["_uniformity.py", "_bounds_probe.py", "_regions.py", "_compiler.py"])
def test_an_edit_of_any_translation_module_misses_the_cache(monkeypatch, module):
    """A library's key covers every module that shapes its generated code: an edit of one
    (here its bytes with a comment appended) gives another fingerprint, so libraries built
    before it are not reused. _uniformity and _bounds_probe were once left out."""
    before = _compiler._toolchain_fingerprint.__wrapped__()
    read_bytes = Path.read_bytes

    def edited(self: Path) -> bytes:
        data = read_bytes(self)
        return data + b"\n# edited\n" if self.name == module and self.parent.name == "emulator" else data

    monkeypatch.setattr(Path, "read_bytes", edited)
    assert _compiler._toolchain_fingerprint.__wrapped__() != before
