"""A shader reads only what it may: files under its own directory and the include
directories given (``shaders/`` among them), and the emulated ``<metal_*>`` headers. No
absolute path, no ``..`` out of them, no symbolic link out of them, no computed include,
no directive made by a macro, no inline assembly; and no compiler message ever quotes a
file the shader was not allowed to read. Each refusal is a MetalCompileError that names
the include and its line, raised before the preprocessor opens anything.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import MetalCompileError, compile_shader, load_shader_file

SECRET = "SECRET-7f3a-do-not-print"
HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"
KERNEL = ("kernel void f(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) "
          "{ o[i] = VALUE; }\n")


@pytest.fixture
def tree(tmp_path):
    """tmp/secret.h (outside), tmp/inc/ok.h and tmp/inc/sub/deeper.h (inside)."""
    (tmp_path / "secret.h").write_text(f"#define VALUE 1.0f\n{SECRET} '\n")
    inc = tmp_path / "inc"
    (inc / "sub").mkdir(parents=True)
    (inc / "ok.h").write_text("#define VALUE 3.0f\n")
    (inc / "sub" / "deeper.h").write_text('#include "../ok.h"\n')
    return tmp_path


def refused(source, match, **kwargs):
    with pytest.raises(MetalCompileError, match=match) as info:
        compile_shader(source, **kwargs)
    assert SECRET not in str(info.value) and SECRET not in info.value.log
    return info.value


def test_an_absolute_include_is_refused(tree):
    refused(HEAD + f'#include "{tree / "secret.h"}"\n' + KERNEL,
            r"shader\.metal line 3: include of '/.*secret\.h': only files under the shader's "
            r"directory and the include directories may be included, by relative name",
            include_dirs=[str(tree / "inc")])


@pytest.mark.parametrize("name", ["../secret.h", "sub/../../secret.h", "./../secret.h"])
def test_dot_dot_out_of_the_include_directories_is_refused(tree, name):
    refused(HEAD + f'#include "{name}"\n' + KERNEL,
            f"line 3: include of '{name}' leads outside the shader's directory and the "
            "include directories", include_dirs=[str(tree / "inc")])


def test_an_included_file_is_held_to_the_same_rule(tree):
    (tree / "inc" / "sneaky.h").write_text('// fine so far\n#include "../secret.h"\n')
    refused(HEAD + '#include "sneaky.h"\n' + KERNEL,
            r"sneaky\.h line 2: include of '\.\./secret\.h' leads outside",
            include_dirs=[str(tree / "inc")])


def test_a_symbolic_link_out_of_an_include_directory_is_refused(tree):
    os.symlink(tree / "secret.h", tree / "inc" / "link.h")
    refused(HEAD + '#include "link.h"\n' + KERNEL, "include of 'link.h' leads outside",
            include_dirs=[str(tree / "inc")])


@pytest.mark.parametrize("directive", ["include_next", "import", "embed"])
def test_every_kind_of_include_is_checked(tree, directive):
    refused(HEAD + f'#{directive} "{tree / "secret.h"}"\n' + KERNEL,
            f"line 3: {directive} of '/.*secret.h': only files")


def test_has_include_is_checked(tree):
    refused(HEAD + f'#if __has_include("{tree / "secret.h"}")\n#endif\n' + KERNEL,
            "line 3: __has_include of '/")


@pytest.mark.parametrize("source", [
    '#define F "/etc/hostname"\n#include F\n',
    '#define F(x) #x\n#include F(/etc/hostname)\n',
])
def test_a_computed_include_is_refused(source):
    refused(HEAD + source + KERNEL, "must name a \"file\" or <file> literally")


def test_a_directive_made_by_a_macro_is_refused(tree):
    refused(HEAD + f'#define H #\nH include "{tree / "secret.h"}"\n' + KERNEL,
            "a macro expands to the preprocessor directive #include")


def test_line_directives_cannot_make_the_compiler_quote_a_file(tree):
    """With #line naming a file, the compiler's error context used to print that file's line."""
    e = refused(HEAD + f'#line 2 "{tree / "secret.h"}"\n' + "kernel void f() { undefined_x; }\n",
                "undefined_x")
    assert "undefined_x" in e.log


def test_inline_assembly_is_refused(tree):
    refused(HEAD + f'asm(".incbin \\"{tree / "secret.h"}\\"");\n' + KERNEL.replace("VALUE", "1"),
            r"inline assembly \(asm\) is not Metal")


def test_system_headers_are_out_of_reach():
    refused(HEAD + "#include <stdio.h>\n" + KERNEL.replace("VALUE", "1"), "stdio.h")


def test_a_device_file_is_refused_without_reading_it():
    start = time.monotonic()
    refused(HEAD + '#include "/dev/zero"\n' + KERNEL.replace("VALUE", "1"), "'/dev/zero'")
    assert time.monotonic() - start < 30


def run(lib):
    out = torch.zeros(2)
    lib.f(out, threads=2)
    return out


@pytest.mark.parametrize("name", ["ok.h", "sub/deeper.h", "sub/../ok.h", "./ok.h"])
def test_includes_inside_the_directories_work(tree, name):
    lib = compile_shader(HEAD + f'#include "{name}"\n' + KERNEL, include_dirs=[str(tree / "inc")])
    np.testing.assert_array_equal(run(lib).numpy(), 3.0)


def test_angle_includes_search_the_include_directories(tree):
    lib = compile_shader(HEAD + "#include <ok.h>\n" + KERNEL, include_dirs=[str(tree / "inc")])
    np.testing.assert_array_equal(run(lib).numpy(), 3.0)


def test_comments_and_dead_branches_are_not_includes_but_dead_includes_must_still_be_allowed(tree):
    source = (HEAD + f'// #include "{tree / "secret.h"}"\n/* #include "../secret.h" */\n'
              '#if 0\n#include "ok.h"\n#endif\n#define VALUE 5.0f\n' + KERNEL)
    np.testing.assert_array_equal(run(compile_shader(source, include_dirs=[str(tree / "inc")])).numpy(), 5.0)
    refused(HEAD + f'#if 0\n#include "{tree / "secret.h"}"\n#endif\n' + KERNEL, "only files")


def test_the_package_headers_stay_available():
    lib = compile_shader(HEAD + '#include "tsm_common.h"\n#include "activations.h"\n'
                         + KERNEL.replace("VALUE", "tsm_activate(-2.0f, TSM_ACT_RELU) + 4.0f"))
    np.testing.assert_array_equal(run(lib).numpy(), 4.0)


@pytest.mark.parametrize("name", ["../README.md", "/etc/hostname", "bench/../../setup.py"])
def test_load_shader_file_reads_only_the_package_shaders(name):
    with pytest.raises(FileNotFoundError, match="^no shader"):
        load_shader_file(name)
