"""Compiling Metal Shading Language for the CPU: preprocess, rewrite, g++, cache.

1. The C preprocessor runs over the source with the emulated headers empty
   (``__TSM_EMU_PARSE__``), so what comes out is the user's code alone, macros expanded
   (MLX-style instantiation macros included) and ``#line`` markers kept.
2. :mod:`._rewrite` finds the kernels and translates to C++, appending the binding table.
3. The system C++ compiler builds a shared library from it and the runtime object; the
   library is cached (:mod:`._cache`) under a hash of everything that went into it, so a
   second run (or a second process) does not recompile.

The shader is C++ to the host compiler and the library it builds runs in this process with
the user's rights, as with ``torch.utils.cpp_extension``: only compile shaders you would
run. What the compiler may read is limited (:mod:`._includes`).
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .._paths import EMULATOR_DIR, EMULATOR_INCLUDE_DIR, SHADERS_DIR
from . import _cache, _includes, _rewrite
from ._errors import MetalCompileError

CXX_STANDARD = "-std=c++17"
# Kernels cast untyped buffers freely, as Metal allows; no fast-math, so float64 gradcheck
# through the kernels sees exact IEEE arithmetic.
BASE_CXX_FLAGS = ("-O2", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden",
                  "-Wno-attributes", "-Wno-ignored-attributes", "-Wno-unused-result")
# Diagnostics must not quote files the shader names in #line directives: the compiler
# would read and print them.
NO_SOURCE_QUOTES = ("-fno-diagnostics-show-caret",)
# Stack-clash protection probes every page of a large frame, so a fiber that overflows its
# stack hits the guard page below it instead of writing over a neighbouring fiber's stack.
# Used where the compiler accepts it.
OPTIONAL_CXX_FLAGS = ("-fstack-clash-protection",)
PREDEFINED = ("-D__METAL_EMULATOR__=1", "-D__METAL_VERSION__=310", "-D__METAL_MACOS__=1")


@dataclass
class CompiledLibrary:
    path: Path
    kernels: List[_rewrite.Kernel]
    uses_synchronisation: bool
    origin: str
    sanitize: bool


@functools.lru_cache(maxsize=None)
def compiler() -> str:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise MetalCompileError("the Metal emulator needs a C++17 compiler (g++ or clang++) on PATH; "
                            "none was found (set CXX to choose one)")


@functools.lru_cache(maxsize=None)
def cxx_flags() -> Tuple[str, ...]:
    """The compile flags: the base ones and the optional ones this compiler accepts."""
    accepted = []
    for flag in OPTIONAL_CXX_FLAGS:
        probe = subprocess.run([compiler(), "-x", "c++", "-Werror", flag, "-fsyntax-only", "-"],
                               input="int main() { return 0; }\n", capture_output=True, text=True)
        if probe.returncode == 0:
            accepted.append(flag)
    return BASE_CXX_FLAGS + tuple(accepted)


@functools.lru_cache(maxsize=None)
def _toolchain_fingerprint() -> str:
    """Hash of the compiler's identity and every emulator header and runtime source."""
    h = hashlib.sha256()
    version = subprocess.run([compiler(), "--version"], capture_output=True, text=True).stdout
    h.update(version.encode())
    for path in sorted(EMULATOR_DIR.rglob("*")):
        if path.is_file() and path.suffix in ("", ".h", ".cpp", ".inc"):
            h.update(str(path.relative_to(EMULATOR_DIR)).encode())
            h.update(path.read_bytes())
    h.update(" ".join(cxx_flags() + PREDEFINED + (CXX_STANDARD,)).encode())
    return h.hexdigest()


def _run(cmd: Sequence[str], what: str, source_text: Optional[str] = None,
         origin: str = "") -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise MetalCompileError.from_log(what, proc.stderr, source_text, origin)


def _runtime_objects() -> List[Path]:
    """The emulator runtime (csrc/emulator/src/*.cpp), compiled once per toolchain."""
    objects = []
    for source in sorted((EMULATOR_DIR / "src").glob("*.cpp")):
        def build(out: Path, source: Path = source) -> None:
            _run([compiler(), CXX_STANDARD, *cxx_flags(), "-I", str(EMULATOR_INCLUDE_DIR), "-c",
                  str(source), "-o", str(out)], f"compiling the emulator runtime ({source.name})")
        objects.append(_cache.fetch(f"{source.stem}-{_toolchain_fingerprint()[:16]}.o", build))
    return objects


def _preprocess(path: Path, include_dirs: Sequence[Path], origin: str) -> str:
    """The user's code alone, macros expanded; includes resolve only in ``include_dirs``
    (the emulated headers, empty in this pass, for ``<metal_stdlib>``), after
    :func:`._includes.check_includes` vetted them. Runs in the source's directory on its
    bare name, so line markers carry no path of it (nor of the cache): cache keys do not
    depend on where the source or the cache lives."""
    search = [Path(d).resolve() for d in (EMULATOR_INCLUDE_DIR, *include_dirs)]
    _includes.check_includes(path, search, EMULATOR_INCLUDE_DIR, origin)
    cmd = [compiler(), "-E", "-x", "c++", CXX_STANDARD, "-nostdinc", "-nostdinc++",
           *NO_SOURCE_QUOTES, "-D__TSM_EMU_PARSE__=1", *PREDEFINED]
    for d in search:
        cmd += ["-I", str(d)]
    proc = subprocess.run(cmd + [path.name], capture_output=True, text=True, cwd=path.parent,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise MetalCompileError.from_log("preprocessing", proc.stderr, path.read_text(), origin)
    _includes.check_preprocessed(proc.stdout, origin)
    return proc.stdout


def compile_file(path: Path, *, include_dirs: Sequence[Path] = (), origin: Optional[str] = None,
                 sanitize: bool = False) -> CompiledLibrary:
    """Compile the MSL file at ``path`` (quoted includes resolve next to it and in ``include_dirs``).

    ``sanitize`` builds the checked variant (see the sanitizer in the README).
    """
    origin = origin or path.name
    include_dirs = [path.parent, *include_dirs, SHADERS_DIR]
    preprocessed = _preprocess(path, include_dirs, origin)
    source_text = path.read_text()
    try:
        kernels = _rewrite.find_kernels(preprocessed)
    except _rewrite.ParseError as e:
        raise MetalCompileError.at_offset(str(e), preprocessed, e.offset, origin) from None
    cxx = (("#define __TSM_SANITIZE__ 1\n" if sanitize else "") + "#include <metal_stdlib>\n" +
           _rewrite.rewrite(preprocessed, sanitize=sanitize) + _rewrite.binding_table(kernels))
    key = hashlib.sha256((_toolchain_fingerprint() + cxx).encode()).hexdigest()[:24]

    def build(out: Path) -> None:
        runtime = _runtime_objects()
        with tempfile.TemporaryDirectory(prefix="tsm-emu-") as tmp:
            src = Path(tmp) / "kernel.cpp"
            src.write_text(cxx)
            _run([compiler(), CXX_STANDARD, *cxx_flags(), *NO_SOURCE_QUOTES, "-shared",
                  "-I", str(EMULATOR_INCLUDE_DIR), str(src), *map(str, runtime), "-o", str(out),
                  "-lm", "-lpthread"], f"compiling {origin}", source_text, origin)

    lib = _cache.fetch(f"{key}.so", build)
    return CompiledLibrary(lib, kernels, _rewrite.uses_synchronisation(preprocessed), origin, sanitize)


def compile_source(source: str, *, include_dirs: Sequence[Path] = (), sanitize: bool = False
                   ) -> CompiledLibrary:
    """Compile MSL given as a string (as ``torch.mps.compile_shader`` takes it). It has no
    directory of its own: its includes resolve in ``include_dirs`` and ``shaders/``."""
    with tempfile.TemporaryDirectory(prefix="tsm-emu-source-") as tmp:
        path = Path(tmp) / "shader.metal"
        path.write_text(source)
        return compile_file(path, include_dirs=include_dirs, origin="<compile_shader>",
                            sanitize=sanitize)
