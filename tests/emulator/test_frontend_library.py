"""The front end's declarations of Metal's library and the emulator's implementation of it
describe the same library: a name the check accepts must exist in the emulator (or be a
listed gap), so that a shader passing the check compiles for the emulator."""
import re
import subprocess

import pytest

from torch_sparse_metal._paths import EMULATOR_INCLUDE_DIR
from torch_sparse_metal.emulator import _compiler, _frontend

# Metal names the check accepts and the emulator does not implement (a shader using one
# would pass the check and then fail to compile for the emulator): none.
EMULATOR_GAPS = frozenset()


def metal_names(version: str):
    """Every public name the front end declares in namespace metal (and metal::fast, ...),
    and in mpp (Metal 4's MetalPerformancePrimitives)."""
    cindex = _frontend._cindex()
    number = _frontend.language_version_number(version)
    tu = _frontend._index().parse("/names.msl", args=[
        *_frontend._CLANG_ARGS, "-isystem", str(_frontend.FRONTEND_INCLUDE_DIR), "-include",
        "tsm_msl_prelude.h", "-include", "metal_stdlib", f"-D__METAL_VERSION__={number}"],
        unsaved_files=[("/names.msl", "")])
    k = cindex.CursorKind
    kinds = {k.FUNCTION_DECL, k.FUNCTION_TEMPLATE, k.TYPEDEF_DECL, k.TYPE_ALIAS_DECL,
             k.TYPE_ALIAS_TEMPLATE_DECL, k.STRUCT_DECL, k.CLASS_TEMPLATE, k.VAR_DECL, k.ENUM_DECL}
    names = set()

    def visit(scope, prefix):
        for c in scope.get_children():
            if c.kind == k.NAMESPACE:
                visit(c, prefix + c.spelling + "::")
            elif c.kind in kinds and c.spelling and not c.spelling.startswith("__"):
                names.add(prefix + c.spelling)
                if c.kind == k.ENUM_DECL and not c.is_scoped_enum():
                    names.update(prefix + e.spelling for e in c.get_children())

    for c in tu.cursor.get_children():
        if c.kind == k.NAMESPACE and c.spelling in ("metal", "mpp"):
            visit(c, c.spelling + "::")
    return names


@pytest.mark.parametrize("version", ["3.0", "4.0"])
def test_the_emulator_implements_what_the_check_accepts(version):
    names = metal_names(version)
    assert len(names) > 300  # the whole library, not an empty parse
    source = "#include <metal_stdlib>\n" + "".join(f"using {n};\n" for n in sorted(names))
    proc = subprocess.run(
        [_compiler.compiler(), _compiler.CXX_STANDARD, "-fsyntax-only", "-x", "c++",
         f"-D__METAL_VERSION__={_frontend.language_version_number(version)}", "-D__METAL_EMULATOR__=1",
         "-I", str(EMULATOR_INCLUDE_DIR), "-"], input=source, capture_output=True, text=True)
    missing = {f"{scope}::{name}" for name, scope in
               re.findall(r"[‘'](\w+)[’'] has not been declared in [‘']([\w:]+)[’']", proc.stderr)}
    assert missing - EMULATOR_GAPS == set(), "declared for the check but missing in the emulator"
    assert EMULATOR_GAPS & names - missing == set(), "listed as a gap but implemented: update EMULATOR_GAPS"
