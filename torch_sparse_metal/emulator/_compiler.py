"""Compiling Metal Shading Language for the CPU: preprocess, check, rewrite, compile, cache.

Layer: drive (the layers are in the package's docstring). Imports every layer below it:
the check (_frontend), the translation (_translation) and the text rewrite (_rewrite).

1. The C preprocessor runs over the source with the emulated headers empty
   (``__TSM_EMU_PARSE__``), so what comes out is the user's code alone, macros expanded
   (MLX-style instantiation macros included) and ``#line`` markers kept. It runs twice:
   once as Apple's compiler would see the source (``__METAL_VERSION__`` of the language
   version, no ``__METAL_EMULATOR__``) and once as the emulator builds it. Only
   ``<metal_*>`` headers and the user's quoted includes are visible, as in Metal.
2. :mod:`._frontend` checks the first with clang against Metal's language rules;
   :mod:`._msl_text` finds the kernels in the second, and :mod:`._translation` reads from
   clang's AST of it what C++ would get wrong (integer division, overloads on address
   space) and how each kernel's threadgroup runs.
3. :mod:`._rewrite` translates it, so edited, to C++, appending the binding table.
4. The C++ compiler (``$TSM_EMU_CXX``, else the platform's usual one) builds a shared
   library from it and the runtime objects; the library is cached (:mod:`._cache`) under a
   hash of everything that went into it, so a second run (or a second process) neither
   checks nor recompiles.

The shader is C++ to the host compiler and the library it builds runs in this process with
the user's rights, as with ``torch.utils.cpp_extension``: only compile shaders you would
run. What the compiler may read is limited (:mod:`._includes`).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, TextIO, Tuple, Union

from .._paths import EMULATOR_DIR, EMULATOR_INCLUDE_DIR, SHADERS_DIR
from . import _cache, _clang, _frontend, _function_constants, _includes, _msl_text, _rewrite, _translation
from ..errors import MetalCompileError

CXX_STANDARD = "-std=c++17"
# Kernels cast untyped buffers freely, as Metal allows; no fast-math, so float64 gradcheck
# through the kernels sees exact IEEE arithmetic (-O3's vectoriser does not reassociate
# floating-point arithmetic without it: a threadgroup run as a loop is 1.5x faster than at
# -O2, for a few percent more compile time). The same arithmetic on every host: no
# contraction of a * b + c into an fma (the default of clang, and of g++ on AArch64), and
# MSL's `char` signed (it is unsigned on AArch64 Linux).
BASE_CXX_FLAGS = ("-O3", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden", "-ffp-contract=off",
                  "-fsigned-char", "-Wno-attributes", "-Wno-ignored-attributes", "-Wno-unused-result")
# Sanitized (instrumented) libraries: the counters tell a SIMD-group instruction by the
# place in the machine code its lanes' checks return to, so one access of the source must
# be one place, and one place one access of the source. -O2 and -O3 duplicate code along
# paths (loop unswitching, peeling, jump threading): lanes that took different copies of
# one access would pair with the wrong iterations (measured: 34 false bank conflicts in a
# matmul's edge tiles at -O3, none at -O1). And a helper left out of line serves all its
# calls from one place, where Metal inlines every call: lanes with nothing to copy in one
# call paired with the next call's accesses (the register GEMM's A^T and B copies, one
# helper, 770 transactions for 690 instructions as barrier regions, whose larger
# functions the inliner had declined). So every helper is inlined, by the first spelling
# the compiler accepts.
SANITIZED_OPTIMIZATION = "-O1"
INLINE_EVERYTHING_SPELLINGS = (
    ("-finline-small-functions", "-finline-functions", "--param=max-inline-insns-single=1000000",
     "--param=max-inline-insns-auto=1000000", "--param=large-function-growth=1000000",
     "--param=inline-unit-growth=1000000", "--param=large-stack-frame-growth=1000000"),  # g++
    ("-mllvm", "-inline-threshold=1000000"),  # clang
)
# Used where the compiler accepts them. Stack-clash protection probes every page of a large
# frame, so a fiber that overflows its stack hits the guard region below it instead of
# writing over a neighbouring fiber's stack. -fexcess-precision=16 rounds `half` arithmetic
# after every operation, as the GPU's half ALUs do (clang on x86-64 otherwise keeps floats).
OPTIONAL_CXX_FLAGS = ("-fstack-clash-protection", "-fexcess-precision=16")
# Diagnostics must not quote files the shader names in #line directives: the compiler
# would read and print them. g++ and clang spell it differently.
NO_SOURCE_QUOTES_SPELLINGS = ("-fno-diagnostics-show-caret", "-fno-caret-diagnostics")
# What Apple's compiler predefines for a macOS target; the emulator adds __METAL_EMULATOR__.
# -undef: none of the host compiler's own (__GNUC__, __x86_64__, ...) reaches user code.
METAL_PREDEFINED = ("-undef", "-D__METAL__=1", "-D__METAL_MACOS__=1")
EMULATOR_PREDEFINED = ("-D__METAL_EMULATOR__=1",)


@dataclass
class CompiledLibrary:
    path: Path
    kernels: List[_msl_text.Kernel]
    origin: str
    sanitize: bool
    language_version: str
    # host name -> function constants without a value that the kernel uses (no launch)
    needs_constants: Dict[str, Tuple[str, ...]]


COMPILER_VARIABLE = "TSM_EMU_CXX"  # not $CXX: that one drives the extension's build on macOS
# The emulator's `half` is the compiler's _Float16 (in C++: g++ 12 on x86-64, g++ 13 on
# AArch64, clang on AArch64 and, from clang 15, on x86-64).
FLOAT16_PROBE = "_Float16 h = 1;\nint main() { return int(h * h) - 1; }\n"


def default_compilers() -> Tuple[str, ...]:
    """The compilers tried in order when ``$TSM_EMU_CXX`` is not set."""
    return ("clang++",) if sys.platform == "darwin" else ("g++", "c++", "clang++")


def compiles(command: Sequence[str], source: str, flags: Sequence[str] = ()) -> bool:
    """Whether the compiler ``command`` (argv prefix) accepts C++17 ``source`` with ``flags``."""
    try:
        probe = subprocess.run([*command, "-x", "c++", CXX_STANDARD, *flags, "-fsyntax-only", "-"],
                               input=source, capture_output=True, text=True)
    except OSError:
        return False
    return probe.returncode == 0


@functools.lru_cache(maxsize=None)
def compiler() -> str:
    """The emulator's C++ compiler: ``$TSM_EMU_CXX``, else the first of
    :func:`default_compilers` on PATH that has ``_Float16``."""
    chosen = os.environ.get(COMPILER_VARIABLE, "").strip()
    if chosen:
        if not shutil.which(chosen):
            raise MetalCompileError(f"{COMPILER_VARIABLE}={chosen!r}: no such compiler on PATH")
        if not compiles([chosen], FLOAT16_PROBE):
            raise MetalCompileError(f"{COMPILER_VARIABLE}={chosen!r}: this compiler has no _Float16 in C++ "
                                    f"for this machine, which the emulator's `half` needs")
        return chosen
    present = [c for c in default_compilers() if shutil.which(c)]
    for candidate in present:
        if compiles([candidate], FLOAT16_PROBE):
            return candidate
    found = f"{', '.join(present)} found, but without _Float16 in C++" if present else "none found"
    raise MetalCompileError(
        f"the Metal emulator needs a C++17 compiler with _Float16 (g++ 12+ on x86-64 or 13+ on "
        f"AArch64; clang++, 15+ on x86-64) among {', '.join(default_compilers())} on PATH "
        f"({found}); set {COMPILER_VARIABLE} to choose one")


def _host_has_fma() -> bool:
    """Whether this x86-64 machine has FMA instructions (every AArch64 machine has them)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        if sys.platform == "darwin":
            features = subprocess.run(["sysctl", "-n", "machdep.cpu.features"], capture_output=True,
                                      text=True).stdout.split()
            return "FMA" in features
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " fma " in f" {line.split(':', 1)[-1]} " for line in f)
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def no_source_quotes(command: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    """The flag that keeps the compiler ``command`` (default :func:`compiler`) from quoting
    source lines in its diagnostics."""
    command = command or (compiler(),)
    for flag in NO_SOURCE_QUOTES_SPELLINGS:
        if compiles(command, "int main() { return 0; }\n", ["-Werror", flag]):
            return (flag,)
    raise MetalCompileError(f"{command[0]}: accepts none of {', '.join(NO_SOURCE_QUOTES_SPELLINGS)}, which "
                            f"keep a compiler from quoting files a shader's #line names")


@functools.lru_cache(maxsize=None)
def cxx_flags(command: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    """The compile flags for the compiler ``command`` (default :func:`compiler`): the base
    ones and the optional ones it accepts. For libraries this machine runs (the default
    compiler) on an x86-64 with FMA, -mfma: Metal's fma() is then one instruction, not a
    call to libm, with the same result (a fused multiply-add is exactly rounded either
    way; -ffp-contract=off still keeps the compiler from fusing a * b + c itself)."""
    native = not command
    command = command or (compiler(),)
    accepted = tuple(flag for flag in OPTIONAL_CXX_FLAGS
                     if compiles(command, "int main() { return 0; }\n", ["-Werror", flag]))
    isa = ("-mfma",) if native and _host_has_fma() else ()
    return BASE_CXX_FLAGS + accepted + isa


@functools.lru_cache(maxsize=None)
def sanitized_flags(command: Tuple[str, ...] = ()) -> Tuple[str, ...]:
    """What a sanitized library adds to :func:`compile_flags` for the compiler ``command``
    (default :func:`compiler`): -O1, and every helper inlined (see SANITIZED_OPTIMIZATION)."""
    command = command or (compiler(),)
    for spelling in INLINE_EVERYTHING_SPELLINGS:
        if compiles(command, "int main() { return 0; }\n", ["-Werror", *spelling]):
            return (SANITIZED_OPTIMIZATION, *spelling)
    raise MetalCompileError(f"{command[0]}: accepts none of the spellings that inline every function "
                            f"({'; '.join(' '.join(s) for s in INLINE_EVERYTHING_SPELLINGS)}), which the "
                            "sanitizer's instruction counters need")


def compile_flags(command: Sequence[str] = ()) -> Tuple[str, ...]:
    """Everything the kernel library and the runtime sources are compiled with by the
    compiler ``command`` (default :func:`compiler`)."""
    return (CXX_STANDARD, *cxx_flags(tuple(command)), "-I", str(EMULATOR_INCLUDE_DIR))


def runtime_sources() -> List[Path]:
    """The emulator runtime's translation units, linked into every kernel library."""
    return sorted((EMULATOR_DIR / "src").glob("*.cpp"))


def translation_sources() -> List[Path]:
    """The Python sources that decide a library's generated code: every module of this
    package (a list of some of them left out _uniformity and _bounds_probe, whose verdicts
    shape the translation, so an edit of theirs reused libraries built before it)."""
    return sorted(Path(__file__).parent.glob("*.py"))


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
    for path in translation_sources():
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(cxx_flags() + METAL_PREDEFINED + EMULATOR_PREDEFINED + (CXX_STANDARD,)).encode())
    return h.hexdigest()


def _run(cmd: Sequence[str], what: str, source_text: Optional[str] = None,
         origin: str = "") -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise MetalCompileError.from_log(what, proc.stderr, source_text, origin)


def _runtime_objects() -> List[Path]:
    """The emulator runtime (:func:`runtime_sources`), compiled once per toolchain."""
    objects = []
    for source in runtime_sources():
        def build(out: Path, source: Path = source) -> None:
            _run([compiler(), *compile_flags(), *no_source_quotes(), "-c", str(source), "-o", str(out)],
                 f"compiling the emulator runtime ({source.name})")
        objects.append(_cache.fetch(f"{source.stem}-{_toolchain_fingerprint()[:16]}.o", build))
    return objects


def _preprocess(path: Path, include_dirs: Sequence[Path], origin: str, language_version: str,
                emulator: bool) -> str:
    """The user's code alone, macros expanded, as Metal (``emulator=False``) or the emulator
    sees it. Includes resolve only in ``include_dirs`` (and the emulated headers, empty in
    this pass, for ``<metal_*>``), after :func:`._includes.check_includes` vetted them: no
    system header is reachable. Runs in the source's directory on its bare name, so line
    markers carry no path of it (nor of the cache): cache keys do not depend on where the
    source or the cache lives."""
    search = [Path(d).resolve() for d in (EMULATOR_INCLUDE_DIR, *include_dirs)]
    _includes.check_includes(path, search, EMULATOR_INCLUDE_DIR, origin)
    version = _clang.language_version_number(language_version)
    cmd = [compiler(), "-E", "-x", "c++", CXX_STANDARD, "-nostdinc", "-nostdinc++", *no_source_quotes(),
           "-D__TSM_EMU_PARSE__=1", *METAL_PREDEFINED, f"-D__METAL_VERSION__={version}",
           *(EMULATOR_PREDEFINED if emulator else ())]
    for d in search:
        cmd += ["-I", str(d)]
    proc = subprocess.run(cmd + [path.name], capture_output=True, text=True, cwd=path.parent,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise MetalCompileError.from_log("preprocessing", proc.stderr, path.read_text(), origin)
    _includes.check_preprocessed(proc.stdout, origin)
    return proc.stdout


@dataclass(frozen=True)
class _Views:
    """A shader preprocessed as the emulator builds it and as Apple's compiler sees it,
    specialised with its function constants' values."""
    emulator: str
    metal: str
    kernels: List[_msl_text.Kernel]
    needs_constants: Dict[str, Tuple[str, ...]]


FunctionConstantValues = Mapping[Union[str, int], object]


def _views(path: Path, include_dirs: Sequence[Path], origin: str, language_version: str,
           function_constants: FunctionConstantValues = {}) -> _Views:
    include_dirs = [path.parent, *include_dirs, SHADERS_DIR]
    views = {}
    for emulator in (False, True):  # the emulator's last: its constants are used below
        text = _preprocess(path, include_dirs, origin, language_version, emulator=emulator)
        found = _function_constants.declarations(text)
        constants = _function_constants.resolve(found, function_constants)
        views[emulator] = _function_constants.specialize(text, found, constants)
    emulator, metal = views[True], views[False]
    try:
        kernels = _msl_text.find_kernels(emulator)
    except _msl_text.ParseError as e:
        raise MetalCompileError.at_offset(str(e), emulator, e.offset, origin) from None
    needs = _function_constants.kernels_needing(text, constants, kernels)
    return _Views(emulator, metal, kernels, needs)


@dataclass(frozen=True)
class GeneratedCxx:
    """A shader translated to C++: the text given to the C++ compiler, with its flags."""
    text: str
    flags: Tuple[str, ...]  # also the runtime sources' (see compile_flags)
    kernels: List[_msl_text.Kernel]
    grouped: Set[str]  # kernel functions run as barrier regions (see _regions)
    lanes: Set[str] = frozenset()  # of those, the ones run lanes at once in plain dispatches (_lanes)


def _with_marked_includes(cxx: str) -> str:
    return _msl_text._apply(cxx, _msl_text.marked_include_edits(cxx))


def _translate(views: _Views, path: Path, origin: str, sanitize: bool, language_version: str,
               command: Sequence[str] = (), regions: Optional[bool] = None) -> GeneratedCxx:
    """Check ``views`` against Metal's rules, then translate the emulator's view to C++
    (with barrier regions unless ``regions`` is False; None: :func:`regions_enabled`)."""
    _frontend.check(views.metal, language_version=language_version, origin=origin, main_file=str(path))
    regions = regions_enabled() if regions is None else regions
    translation = _translation.emulator_edits(views.emulator, language_version=language_version,
                                           main_file=str(path), kernels=views.kernels, regions=regions)
    emulated = _msl_text._apply(views.emulator, translation.edits)
    text = (("#define __TSM_SANITIZE__ 1\n" if sanitize else "") +
            ("" if lanes_enabled() else "#define __TSM_EMU_NO_LANES__ 1\n") + "#include <metal_stdlib>\n" +
            _with_marked_includes(_rewrite.rewrite(emulated, sanitize=sanitize)) +
            _rewrite.binding_table(views.kernels, translation.grouped, translation.synchronising,
                                   straight=regions))
    flags = compile_flags(command) + (sanitized_flags(tuple(command)) if sanitize else ())
    return GeneratedCxx(text, flags, views.kernels, translation.grouped,
                        translation.lanes if lanes_enabled() and not sanitize else frozenset())


def regions_enabled() -> bool:
    """Whether kernels that only synchronise at threadgroup barriers run as barrier regions
    (the default) rather than fibers: ``TSM_EMU_REGIONS=0`` turns them off, to compare."""
    return os.environ.get("TSM_EMU_REGIONS", "1") != "0"


def lanes_enabled() -> bool:
    """Whether kernels with SIMD-group functions run their threadgroups lanes at once in
    plain dispatches (the default; _lanes) rather than as barrier regions' rounds:
    ``TSM_EMU_LANES=0`` turns it off, to compare."""
    return os.environ.get("TSM_EMU_LANES", "1") != "0"


def generated_cxx(path: Path, *, include_dirs: Sequence[Path] = (), origin: Optional[str] = None,
                  sanitize: bool = False, command: Sequence[str] = (),
                  language_version: str = _clang.DEFAULT_LANGUAGE_VERSION,
                  function_constants: FunctionConstantValues = {}) -> GeneratedCxx:
    """The C++ the emulator compiles for the MSL file at ``path`` (quoted includes resolve
    next to it and in ``include_dirs``), after the source passed the Metal check;
    ``sanitize`` gives the checked variant's. The flags are for the compiler ``command``
    (default :func:`compiler`; a cross compiler, say)."""
    origin = origin or path.name
    views = _views(path, include_dirs, origin, language_version, function_constants)
    return _translate(views, path, origin, sanitize, language_version, command)


def compile_file(path: Path, *, include_dirs: Sequence[Path] = (), origin: Optional[str] = None,
                 sanitize: bool = False,
                 language_version: str = _clang.DEFAULT_LANGUAGE_VERSION,
                 function_constants: FunctionConstantValues = {}) -> CompiledLibrary:
    """Compile the MSL file at ``path`` (quoted includes resolve next to it and in ``include_dirs``).

    ``sanitize`` builds the checked variant (docs/sanitizer.md);
    ``language_version`` ("3.0" ... "4.0") sets ``__METAL_VERSION__`` and the rules checked;
    ``function_constants`` gives ``[[function_constant(n)]]`` values by name or index.
    """
    origin = origin or path.name
    views = _views(path, include_dirs, origin, language_version, function_constants)
    # Keyed by what went in, so a cache hit needs neither the check nor the translation.
    key = hashlib.sha256("\0".join((_toolchain_fingerprint(), language_version,
                                    " ".join(sanitized_flags()) if sanitize else "plain",
                                    str(regions_enabled()), str(lanes_enabled()), views.metal,
                                    views.emulator)).encode()).hexdigest()[:24]

    def link(cxx: GeneratedCxx, out: Path) -> None:
        runtime = _runtime_objects()
        with tempfile.TemporaryDirectory(prefix="tsm-emu-") as tmp:
            src = Path(tmp) / "kernel.cpp"
            src.write_text(cxx.text)
            _run([compiler(), *cxx.flags, *no_source_quotes(), "-shared", str(src), *map(str, runtime),
                  "-o", str(out), "-lm", "-lpthread"], f"compiling {origin}", path.read_text(), origin)

    def build(out: Path) -> None:
        with compiling(origin, sanitize):
            built(out)

    def built(out: Path) -> None:
        cxx = _translate(views, path, origin, sanitize, language_version)
        try:
            link(cxx, out)
        except MetalCompileError:
            if not cxx.grouped:
                raise
            # The source passed the check, so the fault is the barrier-region translation's:
            # the kernels still run, as fibers, and the user hears of it.
            link(_translate(views, path, origin, sanitize, language_version, regions=False), out)
            warnings.warn(f"{origin}: the emulator could not run {', '.join(sorted(cxx.grouped))} as "
                          f"barrier regions (an emulator bug: please report it with the shader); they "
                          f"run as fibers, slower", RuntimeWarning, stacklevel=4)

    lib = _cache.fetch(f"{key}.so", build)
    return CompiledLibrary(lib, views.kernels, origin, sanitize, language_version, views.needs_constants)


@contextlib.contextmanager
def compiling(origin: str, sanitize: bool, stream: Optional[TextIO] = None) -> Iterator[None]:
    """Say on stderr that a library is being built (which one, and that it is cached after),
    then how long it took: the first use of a shader costs 5 to 60 s of C++ compilation, which
    would otherwise look like a hang. On a terminal the seconds tick meanwhile, on one line;
    elsewhere (a log, a notebook's captured output) it is a line before and one after."""
    stream = stream if stream is not None else sys.stderr
    what = f"{origin}{' (sanitized)' if sanitize else ''}"
    start = time.monotonic()
    head = (f"torch_sparse_metal: compiling {what} for the Metal emulator (first use; cached "
            f"after in {_cache.cache_dir()})")
    inline = bool(getattr(stream, "isatty", lambda: False)())
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            stream.write(f"\r{head}: {time.monotonic() - start:.0f} s\x1b[K")
            stream.flush()

    stream.write(head + ("" if inline else "\n"))
    stream.flush()
    ticker = threading.Thread(target=tick, daemon=True) if inline else None
    if ticker is not None:
        ticker.start()
    outcome = "failed"
    try:
        yield
        outcome = "compiled"
    finally:
        stop.set()
        if ticker is not None:
            ticker.join()
        done = f"torch_sparse_metal: {outcome} {what} in {time.monotonic() - start:.1f} s"
        stream.write((f"\r{done}\x1b[K\n") if inline else done + "\n")
        stream.flush()


def compile_source(source: str, *, include_dirs: Sequence[Path] = (), sanitize: bool = False,
                   language_version: str = _clang.DEFAULT_LANGUAGE_VERSION,
                   function_constants: FunctionConstantValues = {}) -> CompiledLibrary:
    """Compile MSL given as a string (as ``torch.mps.compile_shader`` takes it). It has no
    directory of its own: its includes resolve in ``include_dirs`` and ``shaders/``."""
    with tempfile.TemporaryDirectory(prefix="tsm-emu-source-") as tmp:
        path = Path(tmp) / "shader.metal"
        path.write_text(source)
        return compile_file(path, include_dirs=include_dirs, origin="<compile_shader>",
                            sanitize=sanitize, language_version=language_version,
                            function_constants=function_constants)
