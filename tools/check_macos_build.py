#!/usr/bin/env python3
"""Check, without a Mac, that the project builds for macOS.

    python tools/check_macos_build.py --sdk /path/to/MacOSX13.3.sdk
    python tools/check_macos_build.py --sdk /path/to/MacOSX13.3.sdk --launcher-only \
        --torch-versions 2.4 2.5 2.6 2.7 2.8 2.9 2.10 2.11 2.12 2.13 2.14 2.15

Compiles with clang against the given macOS SDK (``-isysroot``):

* the emulator runtime (``csrc/emulator/src/*.cpp``) for ``arm64-apple-macos14``;
* the C++ the emulator generates for every shader under ``shaders/``, plain and
  sanitized, for ``arm64-apple-macos14`` (the flags the emulator compiles it with);
  ``--launcher-only`` leaves these out (they do not depend on torch);
* the Metal launcher (``csrc/metal/launcher.mm``) for ``arm64-apple-macos14`` and
  ``x86_64-apple-macos11`` with ``-fobjc-arc -Wall -Wextra -Werror`` against torch's own
  macOS headers, once per torch release checked: ``--torch-versions`` (``2.4``: the newest
  2.4.x in the cache, else downloaded; ``2.4.1``: that one) and ``--torch-wheel`` (a wheel
  file, repeatable), by default the installed torch's version. Wheels are torch's macOS
  arm64 ones, downloaded with ``pip download`` into ``~/.cache/torch_sparse_metal/wheels``.
  Each release is compiled with the ``-std`` its own BuildExtension adds (read from the
  wheel's ``torch/utils/cpp_extension.py``: c++17 up to 2.11, c++20 from 2.12) and its
  defines; torch's and Python's headers are system headers there, so only the launcher's
  own warnings count;

then checks, per release, that the extension would link: every undefined symbol of the
arm64 launcher object must be exported by a library the extension links (the SDK's ``.tbd``
stubs of the frameworks ``setup.py`` names and of libSystem, libc++ and libobjc; that
release's dylibs from its wheel; or Python, whose symbols an extension resolves at load
time) or be one of clang's runtime helpers. An SDK snapshot may lack a framework's
``.tbd`` (public snapshots of the 13.3 SDK lack Foundation's): that framework's symbols
then count as resolved when its headers declare them, and the report says how many were.

Python's headers are the running interpreter's (the C API is the same on macOS; its
``pyconfig.h`` is this platform's). Each unit is reported on its own line, then each torch
release on one (compiled or failed per target, and its link check); the last line counts
the units compiled and failed and names the releases whose link check passed or failed.
Exit status 0 when everything compiled and linked, 1 otherwise, 2 when a tool or input is
missing.

Needs clang (``--clang``; default: the first of clang++-19, clang++-16, clang++ on PATH)
and llvm-nm (``--nm``; default llvm-nm-19, llvm-nm-16, llvm-nm); on Debian:
``apt-get install clang-19 llvm-19``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

REPO = Path(__file__).resolve().parents[1]

CLANG_CANDIDATES = ("clang++-19", "clang++-16", "clang++")
NM_CANDIDATES = ("llvm-nm-19", "llvm-nm-16", "llvm-nm")
EMULATOR_TARGET = "arm64-apple-macos14"
LAUNCHER_TARGETS = ("arm64-apple-macos14", "x86_64-apple-macos11")
# torch ships no Intel-Mac wheel since 2.3: the link check has only arm64 dylibs to link to.
LINK_TARGET = "arm64-apple-macos14"
WHEEL_PLATFORM = "macosx_14_0_arm64"
# BuildExtension names the module after the extension's last dotted part (setup.py's
# torch_sparse_metal._metal_launcher).
EXTENSION_NAME_FLAG = "-DTORCH_EXTENSION_NAME=_metal_launcher"
LAUNCHER_WARNINGS = ("-fobjc-arc", "-Wall", "-Wextra", "-Werror")
# torch's CppExtension links these; setup.py adds the frameworks.
TORCH_LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")
# Linked by the clang driver on every macOS link (libobjc through Foundation's re-export).
SYSTEM_LIBRARIES = ("usr/lib/libSystem.tbd", "usr/lib/libc++.tbd", "usr/lib/libobjc.tbd")
# Symbols no library exports but every macOS link provides: clang's runtime helpers
# (libclang_rt.osx.a, linked statically by the driver; @available compiles to calls to
# them) and the image handle ld64 defines for the image it links.
TOOLCHAIN_SYMBOLS = (
    ("clang's runtime (libclang_rt.osx.a)",
     frozenset({"___isPlatformVersionAtLeast", "___isOSVersionAtLeast"})),
    ("the linker (___dso_handle of the image)", frozenset({"___dso_handle"})),
)


class MissingInput(Exception):
    """A tool or an input the check needs is not there (exit status 2)."""


# ---------------------------------------------------------------------------------------
# Tools and inputs


def find_tool(explicit: Optional[str], candidates: Sequence[str], what: str) -> str:
    """``explicit`` if it runs, else the first of ``candidates`` on PATH."""
    for name in ([explicit] if explicit else candidates):
        found = shutil.which(name)
        if found:
            return found
    tried = explicit or ", ".join(candidates)
    raise MissingInput(f"{what} not found (tried {tried}); on Debian: "
                       "apt-get install clang-19 llvm-19")


def check_sdk(sdk: Path) -> str:
    """The SDK's version (from SDKSettings.json), after checking it looks like a macOS SDK."""
    for needed in ("usr/include/stdlib.h", "System/Library/Frameworks/Metal.framework/Headers"):
        if not (sdk / needed).exists():
            raise MissingInput(f"{sdk} is not a macOS SDK: {needed} is missing")
    settings = sdk / "SDKSettings.json"
    if settings.is_file():
        return str(json.loads(settings.read_text()).get("Version", "unknown"))
    return "unknown"


def installed_torch_version() -> str:
    import torch
    return torch.__version__.split("+")[0]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "torch_sparse_metal"


def _release_key(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def wheel_version(wheel: Path) -> str:
    """The torch version a wheel's file name gives (``torch-2.10.0-2-cp311-...``: 2.10.0)."""
    parts = wheel.name.split("-")
    if len(parts) < 3 or parts[0] != "torch" or not re.fullmatch(r"\d+(\.\d+)*", parts[1]):
        raise MissingInput(f"{wheel.name} is not named as a torch wheel (torch-X.Y.Z-...)")
    return parts[1]


def _matches_release(version: str, spec: str) -> bool:
    """``2.4`` admits every 2.4.x; ``2.4.1`` only itself."""
    return version == spec or version.startswith(spec + ".") and spec.count(".") == 1


def cached_wheel(spec: str, cache: Path) -> Optional[Path]:
    """The newest cached macOS arm64 wheel of torch ``spec`` (``2.4`` or ``2.4.1``)."""
    found = [w for w in cache.glob("torch-*-macosx_*_arm64.whl")
             if _matches_release(wheel_version(w), spec)]
    return max(found, key=lambda w: _release_key(wheel_version(w))) if found else None


def pip_requirement(spec: str) -> str:
    """What ``pip download`` is asked for: the newest patch of a minor release."""
    return f"torch=={spec}.*" if spec.count(".") == 1 else f"torch=={spec}"


def torch_wheel(spec: str, cache: Path) -> Path:
    """The macOS arm64 wheel of torch ``spec``: a cached one, or one fetched with
    ``pip download`` into ``cache``."""
    if not re.fullmatch(r"\d+\.\d+(\.\d+)?", spec):
        raise MissingInput(f"torch version {spec!r}: give X.Y (its newest patch) or X.Y.Z")
    cached = cached_wheel(spec, cache) if cache.is_dir() else None
    if cached is not None:
        return cached
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading torch {spec}'s macOS wheel into {cache} ...", flush=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                           "--only-binary=:all:", "--platform", WHEEL_PLATFORM,
                           pip_requirement(spec), "-d", str(cache)],
                          capture_output=True, text=True)
    cached = cached_wheel(spec, cache)
    if proc.returncode != 0 or cached is None:
        raise MissingInput(f"could not download torch {spec} for {WHEEL_PLATFORM} "
                           f"(pass --torch-wheel):\n{proc.stderr.strip()}")
    return cached


def extension_flags(cpp_extension: str, source: str = "torch/utils/cpp_extension.py"
                    ) -> Tuple[str, ...]:
    """What a release's BuildExtension adds to an extension's C++ compile, from the text of
    its ``torch/utils/cpp_extension.py``: the ``-std`` it appends when the extension gives
    none (setup.py gives none), the define that marks an extension build, and the module's
    name. (Its pybind11 ABI defines only name the module's internals and are left out.)"""
    std = re.search(r"cpp_flag_prefix\s*\+\s*['\"](c\+\+\w+)['\"]", cpp_extension)
    if std is None:
        raise MissingInput(f"{source} names no -std= for BuildExtension's C++ compiles "
                           "(append_std..._if_no_std_present); this check does not know "
                           "what this release compiles extensions with")
    flags = [f"-std={std.group(1)}"]
    if re.search(r"_add_compile_flag\(\s*extension\s*,\s*['\"]-DTORCH_API_INCLUDE_EXTENSION_H",
                 cpp_extension):
        flags.append("-DTORCH_API_INCLUDE_EXTENSION_H")
    return (*flags, EXTENSION_NAME_FLAG)


@dataclass
class TorchRelease:
    """One torch release the launcher is checked against."""
    version: str
    wheel: Path
    root: Path                  # holds torch/include and torch/lib of the wheel
    flags: Tuple[str, ...]      # extension_flags() of the release

    @property
    def std(self) -> str:
        return next(f for f in self.flags if f.startswith("-std="))


def torch_release(wheel: Path, cache: Path) -> TorchRelease:
    with zipfile.ZipFile(wheel) as zf:
        try:
            text = zf.read("torch/utils/cpp_extension.py").decode()
        except KeyError:
            raise MissingInput(f"{wheel.name} has no torch/utils/cpp_extension.py") from None
    return TorchRelease(wheel_version(wheel), wheel, extract_torch(wheel, cache),
                        extension_flags(text, f"{wheel.name}: torch/utils/cpp_extension.py"))


def extract_torch(wheel: Path, cache: Path) -> Path:
    """``torch/include`` and ``torch/lib/*.dylib`` of ``wheel``, extracted once under
    ``cache``; returns the directory holding ``torch/``."""
    dest = cache / (wheel.stem + "-headers-and-dylibs")
    done = dest / ".complete"
    if not done.exists():
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("torch/include/") or (
                        name.startswith("torch/lib/") and name.endswith(".dylib")):
                    zf.extract(name, dest)
        done.touch()
    return dest


def python_library() -> Path:
    """The running interpreter's shared library (or the executable, if it is static)."""
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and name and (Path(libdir) / name).is_file() and ".so" in name:
        return Path(libdir) / name
    return Path(sys.executable)


def linked_frameworks(setup_py: Path) -> Tuple[str, ...]:
    """The frameworks setup.py links the extension with (``"-framework", "X"``)."""
    found = tuple(re.findall(r'"-framework",\s*"(\w+)"', setup_py.read_text()))
    if not found:
        raise MissingInput(f"no '-framework' link arguments found in {setup_py}")
    return found


# ---------------------------------------------------------------------------------------
# .tbd stubs (text-based dylib stubs: YAML in versions 3 and 4, JSON in version 5)


@dataclass
class TbdLibrary:
    """One library of a .tbd file: its symbols and re-exported libraries for one target."""
    install_name: str
    symbols: Set[str] = field(default_factory=set)
    reexports: List[str] = field(default_factory=list)


def _objc_symbols(kind: str, names: Iterable[str]) -> Set[str]:
    prefixes = {"objc-classes": ("_OBJC_CLASS_$_", "_OBJC_METACLASS_$_"),
                "objc-eh-types": ("_OBJC_EHTYPE_$_",), "objc-ivars": ("_OBJC_IVAR_$_",)}[kind]
    return {p + n for n in names for p in prefixes}


_TBD_SYMBOL_KEYS = ("symbols", "weak-symbols", "thread-local-symbols", "objc-classes",
                    "objc-eh-types", "objc-ivars")


def _yaml_logical_lines(text: str) -> List[Tuple[int, str]]:
    """``(indent, content)`` per line, a ``[...]`` list spanning lines joined into one."""
    out: List[Tuple[int, str]] = []
    pending: Optional[List] = None
    for raw in text.splitlines():
        if pending is not None:
            pending[1] += " " + raw.strip()
        else:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            pending = [len(raw) - len(raw.lstrip(" ")), raw.strip()]
        if pending[1].count("[") <= pending[1].count("]"):
            out.append((pending[0], pending[1]))
            pending = None
    return out


def _yaml_value(value: str):
    value = value.strip()
    if value.startswith("["):
        return [v.strip().strip("'\"") for v in value.strip("[] ").split(",") if v.strip()]
    return value.strip("'\"")


def _matches(target: str, item: Dict[str, object]) -> bool:
    arch = target.split("-")[0]
    if "targets" in item:
        return f"{arch}-macos" in item["targets"]
    return arch in item.get("archs", ())  # tbd v3


def parse_tbd_yaml(text: str, target: str) -> List[TbdLibrary]:
    """The libraries of a version 3 or 4 ``.tbd`` (one YAML document each), as ``target``
    (``arm64-apple-macos14``) sees them."""
    libraries = []
    for document in re.split(r"^---[^\n]*$", text, flags=re.M):
        if not document.strip():
            continue
        library = TbdLibrary("")
        section = ""
        items: List[Tuple[str, Dict[str, object]]] = []  # list items, by top-level section
        for indent, content in _yaml_logical_lines(document):
            if indent == 0 and not content.startswith("- "):
                section, _, value = content.partition(":")
                if section == "install-name":
                    library.install_name = _yaml_value(value)
                continue
            if content.startswith("- "):
                items.append((section, {}))
                content = content[2:]
            if items:
                key, _, value = content.partition(":")
                items[-1][1][key.strip()] = _yaml_value(value)
        for section, item in items:
            if not _matches(target, item):
                continue
            if section == "reexported-libraries":
                library.reexports.extend(item.get("libraries", []))
            elif section in ("exports", "reexports"):
                for key in _TBD_SYMBOL_KEYS:
                    names = item.get(key, [])
                    library.symbols |= (_objc_symbols(key, names) if key.startswith("objc-")
                                        else set(names))
        libraries.append(library)
    return libraries


def parse_tbd_json(text: str, target: str) -> List[TbdLibrary]:
    """The libraries of a version 5 ``.tbd`` (JSON), as ``target`` sees them."""
    data = json.loads(text)
    arch = target.split("-")[0]
    libraries = []
    for lib in [data["main_library"], *data.get("libraries", [])]:
        default = [t["target"] for t in lib.get("target_info", [])]

        def applies(entry) -> bool:
            return f"{arch}-macos" in entry.get("targets", default)

        library = TbdLibrary(lib["install_names"][0]["name"])
        for entry in lib.get("reexported_libraries", []):
            if applies(entry):
                library.reexports.extend(entry["names"])
        for entry in lib.get("exported_symbols", []) + lib.get("reexported_symbols", []):
            if not applies(entry):
                continue
            for part in ("data", "text"):
                symbols = entry.get(part, {})
                for kind in ("global", "weak", "thread_local"):
                    library.symbols.update(symbols.get(kind, []))
                for kind, yaml_kind in (("objc_class", "objc-classes"),
                                        ("objc_eh_type", "objc-eh-types"),
                                        ("objc_ivar", "objc-ivars")):
                    library.symbols |= _objc_symbols(yaml_kind, symbols.get(kind, []))
        libraries.append(library)
    return libraries


def parse_tbd(text: str, target: str) -> List[TbdLibrary]:
    return parse_tbd_json(text, target) if text.lstrip().startswith("{") \
        else parse_tbd_yaml(text, target)


class SdkStubs:
    """Symbols the SDK's .tbd stubs export, following re-exported libraries."""

    def __init__(self, sdk: Path, target: str) -> None:
        self.sdk, self.target = sdk, target
        self._by_install_name: Dict[str, TbdLibrary] = {}
        self.missing: List[str] = []  # stubs the SDK lacks

    def _load(self, path: Path) -> Optional[TbdLibrary]:
        if not path.is_file():
            return None
        libraries = parse_tbd(path.read_text(), self.target)
        for library in libraries:
            self._by_install_name.setdefault(library.install_name, library)
        return libraries[0] if libraries else None

    def _stub_path(self, install_name: str) -> Path:
        relative = install_name.lstrip("/")
        if relative.endswith(".dylib"):
            relative = relative[:-len(".dylib")]
        return self.sdk / (relative + ".tbd")

    def exports(self, stub: Path) -> Optional[Set[str]]:
        """Every symbol the library at ``stub`` (a path in the SDK) exports, its
        re-exports included; None when the SDK lacks that stub."""
        top = self._load(stub)
        if top is None:
            self.missing.append(str(stub.relative_to(self.sdk)))
            return None
        symbols: Set[str] = set()
        seen: Set[str] = set()
        pending = [top]
        while pending:
            library = pending.pop()
            if library.install_name in seen:
                continue
            seen.add(library.install_name)
            symbols |= library.symbols
            for name in library.reexports:
                child = self._by_install_name.get(name) or self._load(self._stub_path(name))
                if child is None:
                    self.missing.append(name)
                else:
                    pending.append(child)
        return symbols


def declared_in_headers(symbol: str, header_text: str) -> bool:
    """Whether framework headers declare ``symbol``: an ``@interface`` for a class symbol,
    an exported function or variable otherwise."""
    for prefix in ("_OBJC_CLASS_$_", "_OBJC_METACLASS_$_"):
        if symbol.startswith(prefix):
            return re.search(rf"@interface\s+{re.escape(symbol[len(prefix):])}\b",
                             header_text) is not None
    name = re.escape(symbol[1:])
    return re.search(rf"^[^\n;]*\b(?:FOUNDATION_EXPORT|FOUNDATION_EXTERN|extern)\b[^\n;]*\b{name}\b",
                     header_text, re.M) is not None


# ---------------------------------------------------------------------------------------
# Symbols


def nm_symbols(nm: str, path: Path, *flags: str) -> Set[str]:
    proc = subprocess.run([nm, *flags, str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise MissingInput(f"{nm} could not read {path}: {proc.stderr.strip()}")
    return {line.split()[-1] for line in proc.stdout.splitlines() if line.strip()}


@dataclass
class LinkReport:
    resolved: Dict[str, int]   # provider -> symbols it resolved
    unresolved: List[str]
    notes: List[str]

    @property
    def ok(self) -> bool:
        return not self.unresolved


def resolve_symbols(undefined: Iterable[str], providers: Sequence[Tuple[str, Set[str]]],
                    fallback: Sequence[Tuple[str, str]] = ()) -> LinkReport:
    """Attribute each undefined symbol to the first provider exporting it; ``fallback``:
    ``(name, header text)`` of frameworks without a stub, whose headers must declare it."""
    resolved: Dict[str, int] = {}
    unresolved = []
    for symbol in sorted(set(undefined)):
        for name, exported in providers:
            if symbol in exported:
                resolved[name] = resolved.get(name, 0) + 1
                break
        else:
            for name, headers in fallback:
                if declared_in_headers(symbol, headers):
                    key = f"{name} (declared in its headers; no .tbd in this SDK)"
                    resolved[key] = resolved.get(key, 0) + 1
                    break
            else:
                unresolved.append(symbol)
    return LinkReport(resolved, unresolved, [])


def link_check(obj: Path, nm: str, sdk: Path, torch_root: Path, frameworks: Sequence[str],
               target: str = LINK_TARGET) -> LinkReport:
    """Whether every undefined symbol of ``obj`` resolves at link or load time."""
    stubs = SdkStubs(sdk, target)
    providers: List[Tuple[str, Set[str]]] = []
    fallback: List[Tuple[str, str]] = []
    for framework in frameworks:
        root = sdk / "System/Library/Frameworks" / f"{framework}.framework"
        exported = stubs.exports(root / f"{framework}.tbd")
        if exported is not None:
            providers.append((f"{framework}.framework", exported))
        else:
            headers = "\n".join(h.read_text(errors="replace")
                                for h in sorted((root / "Headers").glob("*.h")))
            fallback.append((f"{framework}.framework", headers))
    for stub in SYSTEM_LIBRARIES:
        exported = stubs.exports(sdk / stub)
        if exported is not None:
            providers.append((Path(stub).stem, exported))
    for lib in TORCH_LIBRARIES:
        dylib = torch_root / "torch" / "lib" / f"lib{lib}.dylib"
        if not dylib.is_file():
            raise MissingInput(f"torch's wheel has no {dylib.name}")
        providers.append((f"torch/lib/{dylib.name}", nm_symbols(nm, dylib, "-g", "--defined-only")))
    python = python_library()
    providers.append((f"Python ({python.name}, resolved at load time)",
                      {"_" + s for s in nm_symbols(nm, python, "-D", "--defined-only")}))
    providers.extend((name, set(symbols)) for name, symbols in TOOLCHAIN_SYMBOLS)
    report = resolve_symbols(nm_symbols(nm, obj, "-u"), providers, fallback)
    report.notes.extend(f"missing in the SDK: {m}" for m in dict.fromkeys(stubs.missing))
    return report


# ---------------------------------------------------------------------------------------
# Compile units


@dataclass
class Unit:
    name: str
    command: List[str]
    output: Path
    error: str = ""      # set when the unit could not even be prepared
    ok: bool = False
    seconds: float = 0.0
    log: str = ""


def run_unit(unit: Unit) -> Unit:
    if unit.error:
        unit.log = unit.error
        return unit
    start = time.perf_counter()
    proc = subprocess.run(unit.command, capture_output=True, text=True)
    unit.seconds = time.perf_counter() - start
    unit.ok = proc.returncode == 0
    unit.log = proc.stderr
    return unit


def first_problems(log: str, limit: int = 6) -> str:
    lines = [ln for ln in log.splitlines() if re.search(r"\b(error|warning)\b", ln)]
    return "\n".join("      " + ln for ln in (lines or log.strip().splitlines())[:limit])


def emulator_units(clang: str, sdk: Path, work: Path) -> List[Unit]:
    """The runtime's sources and every shader's generated C++, plain and sanitized."""
    sys.path.insert(0, str(REPO))
    from torch_sparse_metal.emulator import _compiler
    from torch_sparse_metal.errors import MetalCompileError

    # The emulator's own flags, probed for this compiler and target (as on a Mac).
    command = [clang, "-target", EMULATOR_TARGET, "-isysroot", str(sdk)]
    base = [*command, *_compiler.compile_flags(command), "-c"]
    units = []
    for source in _compiler.runtime_sources():
        out = work / f"{source.stem}.o"
        units.append(Unit(f"{source.name} [{EMULATOR_TARGET}]",
                          base + [str(source), "-o", str(out)], out))
    shaders = _compiler.SHADERS_DIR
    for shader in sorted(shaders.rglob("*.metal")):
        relative = shader.relative_to(shaders).as_posix()
        for sanitize in (False, True):
            variant = "sanitized" if sanitize else "plain"
            stem = relative.replace("/", "_") + f".{variant}"
            cpp, out = work / f"{stem}.cpp", work / f"{stem}.o"
            unit = Unit(f"{relative} ({variant}) [{EMULATOR_TARGET}]",
                        base + [str(cpp), "-o", str(out)], out)
            try:
                cpp.write_text(_compiler.generated_cxx(shader, sanitize=sanitize, command=command).text)
            except MetalCompileError as exc:
                unit.error = f"the emulator could not translate it: {exc}"
            units.append(unit)
    return units


def launcher_unit_name(release: TorchRelease, target: str) -> str:
    return f"launcher.mm [torch {release.version}, {target}]"


def launcher_units(clang: str, sdk: Path, release: TorchRelease, work: Path) -> List[Unit]:
    include = release.root / "torch" / "include"
    python_include = sysconfig.get_paths()["include"]
    units = []
    for target in LAUNCHER_TARGETS:
        out = work / f"launcher.torch-{release.version}.{target}.o"
        units.append(Unit(
            launcher_unit_name(release, target),
            [clang, "-target", target, "-isysroot", str(sdk), "-x", "objective-c++",
             *release.flags, *LAUNCHER_WARNINGS,
             "-isystem", str(include), "-isystem", str(include / "torch/csrc/api/include"),
             "-isystem", python_include, "-c", str(REPO / "csrc/metal/launcher.mm"),
             "-o", str(out)], out))
    return units


# ---------------------------------------------------------------------------------------
# Main


def link_result(link: Optional[LinkReport]) -> str:
    if link is None:
        return "link check not run (the arm64 launcher did not compile)"
    if link.ok:
        return f"link check passed ({sum(link.resolved.values())} symbols)"
    return f"link check failed ({len(link.unresolved)} unresolved symbols)"


def release_line(release: TorchRelease, units: Sequence[Unit],
                 link: Optional[LinkReport]) -> str:
    """One torch release's result: the launcher per target, then its link check."""
    mine = {u.name: u for u in units}
    targets = [(t, mine[launcher_unit_name(release, t)]) for t in LAUNCHER_TARGETS]
    compiled = [t for t, u in targets if u.ok]
    failed = [t for t, u in targets if not u.ok]
    parts = []
    if compiled:
        parts.append(f"compiled for {', '.join(compiled)}")
    if failed:
        parts.append(f"FAILED for {', '.join(failed)}")
    return (f"torch {release.version} ({release.std}): launcher " + ", ".join(parts) + "; "
            + link_result(link))


def summary_line(units: Sequence[Unit],
                 links: Sequence[Tuple[str, Optional[LinkReport]]]) -> str:
    """``links``: (torch version, its link check or None when its arm64 launcher failed)."""
    failed = [u.name for u in units if not u.ok]
    line = f"check_macos_build: {len(units) - len(failed)} units compiled, {len(failed)} failed"
    if failed:
        line += f" ({', '.join(failed)})"
    if len(links) == 1:
        return f"{line}; {link_result(links[0][1])}"
    passed = [v for v, link in links if link is not None and link.ok]
    broken = [v for v, link in links if link is not None and not link.ok]
    not_run = [v for v, link in links if link is None]
    for what, versions in (("passed", passed), ("failed", broken), ("not run", not_run)):
        if versions:
            line += f"; link check {what} for torch {', '.join(versions)}"
    return line


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sdk", required=True, type=Path, help="a macOS SDK directory")
    parser.add_argument("--clang", help=f"clang++ to use (default: first of {', '.join(CLANG_CANDIDATES)})")
    parser.add_argument("--nm", help=f"llvm-nm to use (default: first of {', '.join(NM_CANDIDATES)})")
    parser.add_argument("--torch-versions", nargs="+", metavar="VERSION", default=[],
                        help="torch releases to check the launcher against: X.Y (its newest "
                             "patch) or X.Y.Z (default: the installed torch's version)")
    parser.add_argument("--torch-wheel", type=Path, action="append", default=[],
                        help=f"a torch {WHEEL_PLATFORM} wheel to check the launcher against "
                             "(repeatable)")
    parser.add_argument("--launcher-only", action="store_true",
                        help="compile only the launcher (the emulator's units do not depend "
                             "on torch)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="compiles run in parallel (default: the core count)")
    args = parser.parse_args(argv)
    try:
        clang = find_tool(args.clang, CLANG_CANDIDATES, "clang++")
        nm = find_tool(args.nm, NM_CANDIDATES, "llvm-nm")
        sdk = args.sdk.resolve()
        sdk_version = check_sdk(sdk)
        cache = cache_root() / "wheels"
        wheels = []
        for wheel in args.torch_wheel:
            if not wheel.is_file():
                raise MissingInput(f"--torch-wheel {wheel}: no such file")
            wheels.append(wheel)
        specs = args.torch_versions or ([] if wheels else [installed_torch_version()])
        wheels.extend(torch_wheel(spec, cache) for spec in specs)
        releases = [torch_release(wheel, cache) for wheel in dict.fromkeys(wheels)]
        frameworks = linked_frameworks(REPO / "setup.py")
    except MissingInput as exc:
        print(f"check_macos_build: {exc}", file=sys.stderr)
        return 2
    print(f"SDK {sdk} (macOS {sdk_version}); {Path(clang).name}; torch headers from "
          + ", ".join(r.wheel.name for r in releases), flush=True)

    with tempfile.TemporaryDirectory(prefix="tsm-macos-check-") as tmp:
        work = Path(tmp)
        units = [u for r in releases for u in launcher_units(clang, sdk, r, work)]
        if not args.launcher_only:
            units += emulator_units(clang, sdk, work)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for unit in pool.map(run_unit, units):
                status = "ok  " if unit.ok else "FAIL"
                print(f"{status}  {unit.name}  ({unit.seconds:.1f} s)", flush=True)
                if not unit.ok:
                    print(first_problems(unit.log), flush=True)
        links: List[Tuple[str, Optional[LinkReport]]] = []
        for release in releases:
            arm64 = next(u for u in units if u.name == launcher_unit_name(release, LINK_TARGET))
            link = None
            if arm64.ok:
                try:
                    link = link_check(arm64.output, nm, sdk, release.root, frameworks)
                except MissingInput as exc:
                    print(f"check_macos_build: {exc}", file=sys.stderr)
                    return 2
                print(f"{'ok  ' if link.ok else 'FAIL'}  link check of _metal_launcher "
                      f"[torch {release.version}, {LINK_TARGET}]: "
                      + "; ".join(f"{n}: {c}" for n, c in link.resolved.items()))
                for note in link.notes:
                    print(f"      {note}")
                for symbol in link.unresolved:
                    print(f"      unresolved: {symbol}")
            links.append((release.version, link))
    for release, (_, link) in zip(releases, links):
        print(release_line(release, units, link))
    print(summary_line(units, links))
    return 0 if all(u.ok for u in units) and all(l is not None and l.ok for _, l in links) else 1


if __name__ == "__main__":
    sys.exit(main())
