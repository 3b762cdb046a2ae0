"""The README is a front page whose examples run as written.

* Every ```python block of README.md runs, in a fresh namespace, in this process (on the
  emulator, sanitized as the whole suite is); a failure names the block's line, and the
  traceback points into README.md. A block preceded by ``<!-- not run: reason -->`` is
  skipped, with the reason.
* Every command of its ```bash blocks names something that exists: files, test paths,
  modules; the command-line options of the project's own scripts and modules parse (the
  parser runs, nothing else does).
* Every relative link of README.md and docs/*.md leads to a file, and every anchor to a
  heading of it; every page of docs/ is in the index; the README stays short.
"""
from __future__ import annotations

import argparse
import importlib.util
import re
import runpy
import shlex
import sys
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional

import pytest

import torch_sparse_metal as tsm

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 400

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")


class Block(NamedTuple):
    language: str
    line: int            # 1-based line of the block's first line of code
    code: str
    not_run: Optional[str]


def code_blocks(path: Path) -> List[Block]:
    """The fenced blocks of a Markdown file, with the reason of a ``not run`` marker on the
    last non-blank line before the fence."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _NOT_RUN.match(before)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path.name}:{i + 1}: a code block that is never closed"
        blocks.append(Block(m.group(1).lower(), i + 2, "\n".join(lines[i + 1:end]) + "\n",
                            marker.group(1) if marker else None))
        i = end + 1
    return blocks


README_BLOCKS = code_blocks(README)
PYTHON_BLOCKS = [b for b in README_BLOCKS if b.language in ("python", "py")]
BASH_BLOCKS = [b for b in README_BLOCKS if b.language in ("bash", "sh", "shell", "console")]


def _id(block: Block) -> str:
    return f"README.md:{block.line}"


def test_the_readme_has_an_example_of_each_capability():
    assert len(PYTHON_BLOCKS) >= 5
    text = "".join(b.code for b in PYTHON_BLOCKS)
    for name in ("SparseLinear", "spmm", "tsm.mm", "KMeans", "compile_shader", "sanitize=True",
                 "optim.AdamW"):
        assert name in text, f"no README example uses {name}"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_id)
def test_python_block_runs_as_written(block: Block):
    if block.not_run is not None:
        pytest.skip(f"README.md:{block.line}: marked not run: {block.not_run}")
    # Padded so that the traceback's line numbers are README.md's.
    code = compile("\n" * (block.line - 1) + block.code, str(README), "exec")
    backend = tsm.get_backend()
    try:
        exec(code, {"__name__": "__readme__"})
    except Exception as e:
        raise AssertionError(f"the README's python block at line {block.line} failed: "
                             f"{type(e).__name__}: {e}") from e
    finally:
        tsm.use_backend(backend)


# -- commands ----------------------------------------------------------------------------

def commands(block: Block) -> List[List[str]]:
    """The block's commands as argument lists: continuation lines joined, comments dropped,
    ``a && b`` split."""
    text = block.code.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            if words[:cut]:
                out.append(words[:cut])
            words = words[cut + 1:]
    return out


class _Parsed(Exception):
    """Raised in place of running a script once its command line parsed."""


def _parse_only(monkeypatch, capsys, run: Callable[[], object], argv: List[str]) -> None:
    """Run a script or module until its argparse parser has parsed ``argv``, then stop."""
    parse_args = argparse.ArgumentParser.parse_args

    def parsed(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parsed)
    monkeypatch.setattr(sys, "argv", list(argv))
    try:
        run()
    except _Parsed:
        return
    except SystemExit as e:
        pytest.fail(f"{' '.join(argv)}: its options do not parse (exit {e.code}):\n"
                    f"{capsys.readouterr().err}")
    pytest.fail(f"{' '.join(argv)}: ran to its end without parsing a command line")


def _uses_argparse(path: Path) -> bool:
    return "parse_args" in path.read_text()


def check_command(words: List[str], monkeypatch, capsys) -> None:
    where = " ".join(words)
    if words[:2] == ["pip", "install"]:
        if "-r" in words:
            assert (ROOT / words[words.index("-r") + 1]).is_file(), where
        return
    assert words[0] == "python", \
        f"{where}: the test knows how to check python and pip commands only"
    if words[1:3] == ["-m", "pytest"]:
        for arg in words[3:]:
            if not arg.startswith("-") and ("/" in arg or arg.endswith(".py")):
                assert (ROOT / arg.split("::")[0]).exists(), f"{where}: no {arg}"
        return
    if words[1] == "-m":
        module = words[2]
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"{where}: no module {module}"
        if spec.submodule_search_locations:               # a package: its __main__ runs
            spec = importlib.util.find_spec(module + ".__main__")
            assert spec is not None, f"{where}: {module} has no __main__"
        if _uses_argparse(Path(spec.origin)):
            _parse_only(monkeypatch, capsys,
                        lambda: runpy.run_module(module, run_name="__main__", alter_sys=True),
                        [module, *words[3:]])
        return
    script = ROOT / words[1]
    assert script.is_file(), f"{where}: no {words[1]}"
    if _uses_argparse(script):
        _parse_only(monkeypatch, capsys, lambda: runpy.run_path(str(script), run_name="__main__"),
                    [str(script), *words[2:]])


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=_id)
def test_bash_block_names_what_exists(block: Block, monkeypatch, capsys):
    if block.not_run is not None:
        pytest.skip(f"README.md:{block.line}: marked not run: {block.not_run}")
    found = commands(block)
    assert found, f"README.md:{block.line}: a bash block without a command"
    for words in found:
        try:
            check_command(words, monkeypatch, capsys)
        except AssertionError as e:
            raise AssertionError(f"README.md:{block.line}: {e}") from None


# -- links and size ----------------------------------------------------------------------

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose(path: Path) -> List[str]:
    """The file's lines outside fenced code blocks, with inline code removed."""
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return out


def anchors(path: Path) -> set:
    """GitHub's heading anchors of a Markdown file."""
    seen: dict = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else _HEADING.match(line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


MARKDOWN = [README, *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(path: Path):
    broken = []
    for number, line in enumerate(_prose(path), 1):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue                                  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name}:{number}: {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.name}:{number}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_every_doc_is_in_the_index():
    index = (DOCS / "README.md").read_text()
    missing = [p.name for p in DOCS.glob("*.md")
               if p.name != "README.md" and f"({p.name}" not in index]
    assert not missing, f"docs/README.md does not link {missing}"


def test_the_readme_is_a_front_page():
    lines = len(README.read_text().splitlines())
    assert lines < MAX_README_LINES, (f"README.md has {lines} lines: keep it a front page "
                                      f"(under {MAX_README_LINES}) and move detail to docs/")
