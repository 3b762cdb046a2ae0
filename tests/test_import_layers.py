"""The package's imports go one way (issue 45).

No module of torch_sparse_metal imports itself through others (but the circles WAIVED
names), counting imports inside functions: they only hide a circle from Python at import
time, not from a reader. And the emulator's translator keeps its layers: a module of
torch_sparse_metal/emulator/ imports only modules of its own layer or of layers before it.
The layers, bottom first, are the bullets of the metal package's docstring; each module's
docstring names its own (``Layer: parse``). One that names none is of the top layer; every
module the compiler reaches names its own.

Read from the source with ``ast``, so nothing is imported.
"""
import ast
import re
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[1] / "torch_sparse_metal"
METAL = "torch_sparse_metal.emulator"
# Circles the test lets stand, each with what keeps it, until its module's owner breaks it;
# one that is gone fails the test too, so that its waiver goes with it.
WAIVED: Dict[frozenset, str] = {}


@lru_cache(maxsize=None)
def modules() -> Dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


@lru_cache(maxsize=None)
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(), str(modules()[name]))


@lru_cache(maxsize=None)
def imports(name: str) -> Tuple[Tuple[str, int], ...]:
    """(module of the package, line) for each import in ``name``, at any depth."""
    known = modules()
    package = name if modules()[name].name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            if node.level:
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from . import _x` imports the module _x; `from ._x import f` imports _x
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target in known and target != name:
                found.append((target, node.lineno))
    return tuple(dict.fromkeys(found))  # once per line, however many names it imports


def circles() -> List[List[str]]:
    """The package's import circles: strongly connected sets of more than one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, _ in imports(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                out.append(sorted(members))

    for v in modules():
        if v not in index:
            visit(v)
    return out


def layers() -> List[str]:
    """The translator's layers, bottom first, from the bullets of the metal package's docstring."""
    doc = ast.get_docstring(tree(METAL))
    return re.findall(r"^\* (\w+): ", doc, re.M)


def layer_of(name: str) -> str:
    """The layer ``name``'s docstring names; the top one where it names none."""
    found = re.search(r"^Layer: (\w+)", ast.get_docstring(tree(name)) or "", re.M)
    return found.group(1) if found else layers()[-1]


def metal_modules() -> List[str]:
    return [m for m in modules() if m == METAL or m.startswith(METAL + ".")]


def test_no_import_circle():
    found = [members for members in circles() if frozenset(members) not in WAIVED]
    described = []
    for members in found:
        edges = [f"{modules()[m].relative_to(PACKAGE.parent)}:{line} imports {t}" for m in members
                 for t, line in imports(m) if t in members]
        described.append(f"{len(members)} modules: " + "; ".join(edges))
    assert not found, "import circles in the package:\n" + "\n".join(described)
    gone = [sorted(w) for w in WAIVED if list(sorted(w)) not in circles()]
    assert not gone, f"no longer circles, so no longer waived: {gone}"


def test_the_layers_are_named():
    names = layers()
    assert names[:2] == ["base", "parse"] and len(set(names)) == len(names) >= 5, names
    for m in metal_modules():
        found = re.findall(r"^Layer: (\w+)", ast.get_docstring(tree(m)) or "", re.M)
        assert set(found) <= set(names), f"{m}: layer {found} is not one of {names}"
    # every module the compiler reaches says where it stands: none is on top by omission
    reached, frontier = set(), [f"{METAL}._compiler"]
    while frontier:
        m = frontier.pop()
        for t, _ in imports(m):
            if t.startswith(METAL + ".") and t not in reached:
                reached.add(t)
                frontier.append(t)
    unnamed = sorted(m for m in reached | {f"{METAL}._compiler"}
                     if not re.search(r"^Layer: ", ast.get_docstring(tree(m)) or "", re.M))
    assert not unnamed, f"modules of the translator whose docstring names no layer: {unnamed}"


def test_no_module_imports_a_layer_above_its_own():
    rank = {name: i for i, name in enumerate(layers())}
    upward = []
    for m in metal_modules():
        for t, line in imports(m):
            if (t == METAL or t.startswith(METAL + ".")) and rank[layer_of(t)] > rank[layer_of(m)]:
                upward.append(f"{modules()[m].name}:{line} ({layer_of(m)}) imports {t} ({layer_of(t)})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)
