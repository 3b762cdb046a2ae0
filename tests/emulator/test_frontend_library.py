"""The front end's declarations of Metal's library and the emulator's implementation of it
describe the same library: a name the check accepts must exist in the emulator (or be a
listed gap), so that a shader passing the check compiles for the emulator."""
import re
import subprocess

import pytest

from torch_sparse_metal._paths import EMULATOR_INCLUDE_DIR
from torch_sparse_metal.metal import _compiler, _frontend

# Metal functions the check accepts and the emulator does not implement yet: a shader using
# one passes the check and then fails to compile for the emulator, naming it.
EMULATOR_GAPS = frozenset({
    "metal::array",
    "metal::float2x2",
    "metal::float2x3",
    "metal::float2x4",
    "metal::float3x2",
    "metal::float3x3",
    "metal::float3x4",
    "metal::float4x2",
    "metal::float4x3",
    "metal::float4x4",
    "metal::half2x2",
    "metal::half2x3",
    "metal::half2x4",
    "metal::half3x2",
    "metal::half3x3",
    "metal::half3x4",
    "metal::half4x2",
    "metal::half4x3",
    "metal::half4x4",
    "metal::int16_t",
    "metal::int32_t",
    "metal::int64_t",
    "metal::int8_t",
    "metal::intptr_t",
    "metal::matrix",
    "metal::pack_float_to_snorm2x16",
    "metal::pack_float_to_snorm4x8",
    "metal::pack_float_to_unorm2x16",
    "metal::pack_float_to_unorm4x8",
    "metal::pack_half_to_snorm2x16",
    "metal::pack_half_to_snorm4x8",
    "metal::pack_half_to_unorm2x16",
    "metal::pack_half_to_unorm4x8",
    "metal::quad_shuffle_and_fill_down",
    "metal::quad_shuffle_and_fill_up",
    "metal::uint16_t",
    "metal::uint32_t",
    "metal::uint64_t",
    "metal::uint8_t",
    "metal::uintptr_t",
    "metal::unpack_snorm2x16_to_float",
    "metal::unpack_snorm2x16_to_half",
    "metal::unpack_snorm4x8_to_float",
    "metal::unpack_snorm4x8_to_half",
    "metal::unpack_unorm2x16_to_float",
    "metal::unpack_unorm2x16_to_half",
    "metal::unpack_unorm4x8_to_float",
    "metal::unpack_unorm4x8_to_half",
})


def metal_names(version: str):
    """Every public name the front end declares in namespace metal (and metal::fast, ...)."""
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
        if c.kind == k.NAMESPACE and c.spelling == "metal":
            visit(c, "metal::")
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
