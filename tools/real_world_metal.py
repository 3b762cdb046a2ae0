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

Exit status 0 when every file compiled, 1 otherwise.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

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


def compile_one(path: str, include_dirs: Sequence[str], language_version: str,
                check_only: bool) -> Tuple[str, Optional[str], float]:
    """(path, None or the first error, seconds) for one file of the corpus."""
    start = time.monotonic()
    includes = [Path(d) for d in include_dirs]
    try:
        if check_only:
            views = _compiler._views(Path(path), includes, Path(path).name, language_version)
            _frontend.check(views.metal, language_version=language_version, origin=Path(path).name,
                            main_file=path)
        else:
            _compiler.compile_file(Path(path), include_dirs=includes, language_version=language_version)
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
    parser.add_argument("--exclude", action="append", default=[],
                        help="skip files whose path contains this text (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="files compiled at once")
    args = parser.parse_args(argv)

    files = sorted(str(p) for p in args.corpus.rglob("*.metal")
                   if not any(text in str(p) for text in args.exclude))
    if not files:
        print(f"no .metal file under {args.corpus}", file=sys.stderr)
        return 2
    failed = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(compile_one, f, args.include, args.language_version, args.check_only)
                   for f in files]
        for future in futures:
            path, error, seconds = future.result()
            name = str(Path(path).relative_to(args.corpus))
            if error is None:
                print(f"ok      {name} ({seconds:.1f} s)", flush=True)
            else:
                failed += 1
                print(f"failed  {name}: {error}", flush=True)
    what = "passed the check" if args.check_only else "compiled"
    print(f"{len(files)} files: {len(files) - failed} {what}, {failed} failed "
          f"(MSL {args.language_version})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
