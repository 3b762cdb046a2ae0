#!/usr/bin/env python3
"""Compile a corpus of real-world Metal unedited through the emulator, and count what passes.

    python tools/real_world_metal.py --corpus /path/to/mlx/backend/metal/kernels \\
        --include /path/to/mlx --language-version 4.0

Every ``.metal`` file under ``--corpus`` goes through ``compile_shader``'s path: the front-end
check against Metal's rules (``--check-only`` stops there) and the emulator's C++ build, at the
given MSL version (the one the corpus's own build would pick). Quoted includes resolve next to
each file and in every ``--include`` root. Each file gets one line, ``ok`` or ``failed`` with the
first error; the last line counts them. Nothing of the corpus is copied anywhere: compiled
libraries go to the emulator's cache as usual (``$TSM_CACHE_DIR``).

``--tint`` reads Tint's end-to-end expectations (google/dawn ``test/tint/**/*.expected.msl``):
such a file holds one program per entry point, each under a ``//`` / ``// name`` / ``//``
header, and each was compiled by Apple's compiler when the expectations were regenerated on a
Mac. Files whose first line is ``SKIP`` (expected failures) are left out, and of the rest only
the programs with a ``kernel`` function are compiled, one line each (``file#entry``).
Programs that differ only in the six hexadecimal digits Tint's generated builtin tests put in
names (``textureLoad_39b361``) are compiled once and counted each.

Exit status 0 when every program compiled, 1 otherwise.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import re
import tempfile
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_sparse_metal.emulator import LANGUAGE_VERSIONS, MetalCompileError  # noqa: E402
from torch_sparse_metal.emulator import _compiler, _frontend  # noqa: E402


def first_error(error: MetalCompileError) -> str:
    """The first line of ``error`` that says what went wrong, on one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        if " error: " in line or "error:" in line:
            return line
    return lines[0] if lines else "(no message)"


TINT_HEADER = re.compile(r"^//\n// (\w+)\n//\n", re.MULTILINE)
KERNEL = re.compile(r"\bkernel\s+void\b")
TINT_NAME_SUFFIX = re.compile(r"_[0-9a-f]{6}\b")


def tint_programs(text: str) -> List[Tuple[str, str]]:
    """(entry point, program) for each compute program of one Tint expectation file."""
    if text.startswith("SKIP"):
        return []
    heads = list(TINT_HEADER.finditer(text))
    if not heads:
        pieces = [("", text)]
    else:
        pieces = [(h.group(1), text[h.end():(heads[i + 1].start() if i + 1 < len(heads) else len(text))])
                  for i, h in enumerate(heads)]
    # Tint's warnings, when it gave any, come before the program they are about.
    pieces = [(entry, program[m.start():] if (m := re.search(r"^#", program, re.M)) else program)
              for entry, program in pieces]
    return [(entry, program) for entry, program in pieces if KERNEL.search(program)]


def syntax_check(file: Path, includes: Sequence[Path], language_version: str) -> None:
    """The check, the translation and the C++ compiler's front end (no code generated), with
    the fallback a build takes: the kernels as fibers when their barrier regions fail."""
    views = _compiler._views(file, includes, file.name, language_version)
    source = file.read_text()
    for regions in (True, False):
        cxx = _compiler._translate(views, file, file.name, False, language_version, regions=regions)
        with tempfile.TemporaryDirectory(prefix="tsm-syntax-") as tmp:
            src = Path(tmp) / "kernel.cpp"
            src.write_text(cxx.text)
            try:
                _compiler._run([_compiler.compiler(), *cxx.flags, "-fsyntax-only", str(src)],
                               f"compiling {file.name}", source, file.name)
                return
            except MetalCompileError:
                if not regions or not cxx.grouped:
                    raise


def compile_one(path: str, include_dirs: Sequence[str], language_version: str,
                check_only: bool, source: Optional[str] = None,
                syntax_only: bool = False) -> Tuple[str, Optional[str], float]:
    """(path, None or the first error, seconds) for one file of the corpus, or for ``source``
    standing in for it (one program of a Tint expectation, compiled from a file of its own)."""
    start = time.monotonic()
    includes = [Path(d) for d in include_dirs]
    with tempfile.TemporaryDirectory(prefix="tsm-corpus-") as tmp:
        file = Path(path)
        if source is not None:
            includes.insert(0, file.parent)
            file = Path(tmp) / (file.name.split(".")[0] + ".metal")
            file.write_text(source)
        try:
            if check_only:
                views = _compiler._views(file, includes, file.name, language_version)
                _frontend.check(views.metal, language_version=language_version, origin=file.name,
                                main_file=str(file))
            elif syntax_only:
                syntax_check(file, includes, language_version)
            else:
                _compiler.compile_file(file, include_dirs=includes, language_version=language_version)
            error = None
        except MetalCompileError as e:
            error = first_error(e)
    return path, error, time.monotonic() - start


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, type=Path, help="directory searched for *.metal")
    parser.add_argument("--include", action="append", default=[], help="an include root (repeatable)")
    parser.add_argument("--language-version", default=_frontend.DEFAULT_LANGUAGE_VERSION,
                        choices=sorted(LANGUAGE_VERSIONS))
    parser.add_argument("--check-only", action="store_true", help="the front-end check only, no C++ build")
    parser.add_argument("--syntax-only", action="store_true",
                        help="the check and the translation, then the C++ compiler's front end only "
                             "(no code generated: several times faster than a build)")
    parser.add_argument("--tint", action="store_true",
                        help="the corpus is Tint's expectations: *.expected.msl, compute programs only")
    parser.add_argument("--exclude", action="append", default=[],
                        help="skip files whose path contains this text (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="files compiled at once")
    args = parser.parse_args(argv)

    pattern = "*.expected.msl" if args.tint else "*.metal"
    files = sorted(str(p) for p in args.corpus.rglob(pattern)
                   if not any(text in str(p) for text in args.exclude))
    if not files:
        print(f"no {pattern} file under {args.corpus}", file=sys.stderr)
        return 2
    # One unit per program: (name printed, path, source or None to read the file itself).
    units = []
    for f in files:
        name = str(Path(f).relative_to(args.corpus))
        if args.tint:
            programs = tint_programs(Path(f).read_text(errors="replace"))
            units += [(f"{name}#{entry}" if entry else name, f, program) for entry, program in programs]
        else:
            units.append((name, f, None))
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        compiled: Dict[str, concurrent.futures.Future] = {}
        futures = []
        for name, f, source in units:
            key = TINT_NAME_SUFFIX.sub("_X", source) if source is not None else f
            if key not in compiled:
                compiled[key] = pool.submit(compile_one, f, args.include, args.language_version,
                                            args.check_only, source, args.syntax_only)
            futures.append((name, compiled[key]))
        for name, future in futures:
            _, error, seconds = future.result()
            if error is None:
                print(f"ok      {name} ({seconds:.1f} s)", flush=True)
            else:
                failed += 1
                print(f"failed  {name}: {error}", flush=True)
    what = ("passed the check" if args.check_only else
            "passed the C++ front end" if args.syntax_only else "compiled")
    kind = "programs" if args.tint else "files"
    print(f"{len(units)} {kind}: {len(units) - failed} {what}, {failed} failed "
          f"(MSL {args.language_version})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
