"""The emulator's compile cache: what the C++ compiler built, kept between processes.

Layer: drive (the layers are in the package's docstring). Imports nothing of the
translator; the compiler and the library use it.

* Entries are named by digests of what went into them (source text, toolchain), never by
  paths, so a cache directory that was moved or copied still hits.
* An entry is written to a staged file and renamed into place, then its SHA-256 is written
  beside it (``<name>.sha256``) the same way; an entry is used only when its bytes match
  that digest. A truncated, empty or garbage file (a full disk, a killed process, another
  tool) is rebuilt, never loaded: a truncated shared object crashes the process that maps
  it (SIGBUS). Files are replaced, never rewritten in place, so a library another process
  has loaded stays intact.
* The directory is ``$TSM_CACHE_DIR/emulator``, else ``$XDG_CACHE_HOME/torch_sparse_metal/emulator``
  (``~/.cache/...``). When it cannot be created or written, valid entries already in it are
  still used and new ones go to a private temporary directory for the life of the process
  (removed at exit), with one warning naming ``TSM_CACHE_DIR``.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Optional

ENV = "TSM_CACHE_DIR"
DIGEST_SUFFIX = ".sha256"

_lock = threading.Lock()
_private: Optional[Path] = None  # the fallback directory, once one was needed


def cache_dir() -> Path:
    """The configured cache directory (created if possible; it may not be writable)."""
    root = os.environ.get(ENV)
    base = Path(root) if root else \
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_sparse_metal"
    path = base / "emulator"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # read-only or not a directory: fetch() falls back
    return path


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verified(path: Path) -> bool:
    """Whether ``path`` is a complete entry: its bytes match the digest written beside it."""
    try:
        expected = path.with_name(path.name + DIGEST_SUFFIX).read_text().strip()
        return len(expected) == 64 and _digest(path) == expected
    except OSError:
        return False


def _stage(target: Path) -> Path:
    """A fresh file beside ``target`` to write and then rename onto it: no reader ever sees
    ``target`` half written. Unique per call, so concurrent builds never share one. Raises
    OSError when the directory cannot be written."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    return Path(name)


def _install(staged: Path, target: Path) -> None:
    """Rename ``staged`` onto ``target`` and write its digest beside it the same way."""
    digest = _digest(staged)
    os.replace(staged, target)
    sidecar = target.with_name(target.name + DIGEST_SUFFIX)
    staged_digest = _stage(sidecar)
    staged_digest.write_text(digest + "\n")
    os.replace(staged_digest, sidecar)


def _private_dir() -> Path:
    global _private
    with _lock:
        if _private is None:
            _private = Path(tempfile.mkdtemp(prefix="torch_sparse_metal-cache-"))
            atexit.register(shutil.rmtree, _private, ignore_errors=True)
            warnings.warn(f"torch_sparse_metal: the emulator's compile cache {cache_dir()} cannot "
                          f"be written; compiling into {_private} for this process only. Set "
                          f"{ENV} to a writable directory to keep compiled kernels between runs.",
                          RuntimeWarning, stacklevel=4)
        return _private


def fetch(name: str, build: Callable[[Path], None]) -> Path:
    """The path of the verified entry ``name``. When there is none (or only a damaged one),
    ``build(path)`` writes one at ``path`` (a staged file), which is then installed."""
    directories = [cache_dir()] + ([_private] if _private is not None else [])
    for directory in directories:
        if verified(directory / name):
            return directory / name
    try:
        target = cache_dir() / name
        staged = _stage(target)
    except OSError:
        target = _private_dir() / name
        staged = _stage(target)
    try:
        build(staged)
        _install(staged, target)
    finally:
        if staged.exists():
            staged.unlink()
    return target
