"""Compiling shaders for the emulator and launching their kernels: what is accepted, what is
cached, and what is rejected with which error.

* kernels: plain, templates instantiated under [[host_name]] (the `decltype(f<T>)` form and
  the restated-signature form), MLX-style instantiation macros, the project's
  `tsm_common.h` macros (quoted includes resolve in shaders/), half parameters;
* compile_shader caches by source: the second call compiles nothing;
* MetalCompileError carries the compiler's message, `.line` and `.source_line`;
* launches are checked before anything runs (LaunchError, a ValueError); record() sees
  every launch with its grid, group and backend; an empty grid runs nothing.
"""
from __future__ import annotations

import struct
import uuid

import numpy as np
import pytest
import torch

import torch_sparse_metal.emulator as tsm_metal
from torch_sparse_metal.emulator import (Launch, LaunchError, MetalCompileError, compile_shader,
                                      record)
from torch_sparse_metal.emulator import _compiler

SOURCE = r"""
#include <metal_stdlib>
#include "tsm_common.h"
using namespace metal;

template <typename T>
[[kernel]] void axpy(device T* y [[buffer(0)]],
                     device const T* x [[buffer(1)]],
                     constant T& a [[buffer(2)]],
                     uint i [[thread_position_in_grid]]) {
  y[i] = a * x[i] + y[i];
}
// decltype form
template [[host_name("axpy_float")]] [[kernel]] decltype(axpy<float>) axpy<float>;
// restated-signature form
template [[host_name("axpy_half")]] [[kernel]] void axpy<half>(
    device half* y [[buffer(0)]],
    device const half* x [[buffer(1)]],
    constant half& a [[buffer(2)]],
    uint i [[thread_position_in_grid]]);

template <typename T>
[[kernel]] void scale(device T* y [[buffer(0)]],
                      constant T& s [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
  y[i] = y[i] * s;
}
// MLX style: the host name is built by the preprocessor
#define instantiate_kernel(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#define instantiate_scale(tname, type) instantiate_kernel(#tname, scale, type)
instantiate_scale(scale_float32, float)
instantiate_scale(scale_int32, int)
// the project's own macros (shaders/tsm_common.h)
TSM_INSTANTIATE_KERNEL("scale_uint8", scale, uchar)
TSM_EMULATOR_ONLY(TSM_INSTANTIATE_KERNEL("scale_float64", scale, double))

kernel void half_math(device half* out [[buffer(0)]],
                      constant half& h [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
  out[i] = h * half(i) + 1.5h;
}

kernel void scalars(device float* out [[buffer(0)]],
                    constant half& h [[buffer(1)]],
                    constant int& i [[buffer(2)]],
                    constant uint& u [[buffer(3)]],
                    constant ushort& us [[buffer(4)]],
                    constant char& c [[buffer(5)]],
                    constant bool& b [[buffer(6)]],
                    constant float& f [[buffer(7)]],
                    uint gid [[thread_position_in_grid]]) {
  out[0] = float(h);
  out[1] = float(i);
  out[2] = float(u);
  out[3] = float(us);
  out[4] = float(c);
  out[5] = b ? 1.0f : 0.0f;
  out[6] = f;
}

struct Params {
  uint n;
  float scale;
};

kernel void struct_param(device float* out [[buffer(0)]],
                         constant Params& p [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
  out[i] = i < p.n ? p.scale * float(i) : -1.0f;
}

// Buffers without [[buffer(n)]] take the next index in order.
kernel void implicit_indices(device float* out,
                             device const float* x,
                             constant float& s,
                             uint i [[thread_position_in_grid]]) {
  out[i] = x[i] * s;
}

kernel void grid_2d(device uint* out [[buffer(0)]],
                    uint2 p [[thread_position_in_grid]],
                    uint2 n [[threads_per_grid]]) {
  out[p.y * n.x + p.x] = 1u + p.x + 100u * p.y;
}
"""

# MLX builds most host names by concatenating literals: "copy_s_" #tname.
CONCATENATED_HOST_NAME_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
template <typename T>
[[kernel]] void fill(device T* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  y[i] = T(7);
}
#define instantiate_kernel(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#define instantiate_fill(tname, type) instantiate_kernel("fill_" #tname, fill, type)
instantiate_fill(float32, float)
instantiate_fill(int32, int)
"""

BFLOAT_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;
kernel void bfloat_scalar(device float* out [[buffer(0)]],
                          constant bfloat& b [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  out[i] = float(b);
}
"""

# Line numbers below are 1-based lines of these sources.
BROKEN_SOURCE = """#include <metal_stdlib>
using namespace metal;

kernel void broken(device float* out [[buffer(0)]],
                   uint i [[thread_position_in_grid]]) {
    out[i] = undefined_thing * 2.0f;
}
"""
BROKEN_LINE = 6

UNSUPPORTED_ATTRIBUTE_SOURCE = """#include <metal_stdlib>
using namespace metal;

kernel void vertex_like(device float* out [[buffer(0)]],
                        float4 p [[stage_in]]) {
    out[0] = p.x;
}
"""

MISSING_INCLUDE_SOURCE = """#include <metal_stdlib>
#include "no_such_header_for_the_test.h"
using namespace metal;
kernel void f(device float* out [[buffer(0)]]) { out[0] = 1.0f; }
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


# ---- kernels ---------------------------------------------------------------------------
def test_kernel_names_are_the_host_names(lib):
    assert set(lib.kernel_names) == {
        "axpy_float", "axpy_half", "scale_float32", "scale_int32", "scale_uint8",
        "scale_float64", "half_math", "scalars", "grid_2d", "implicit_indices",
        "struct_param"}
    assert "axpy" not in lib.kernel_names and "scale" not in lib.kernel_names


def test_template_decltype_instantiation(lib):
    x = torch.arange(10, dtype=torch.float32)
    y = torch.ones(10)
    lib.axpy_float(y, x, 2.5, threads=10)
    np.testing.assert_array_equal(y.numpy(), 2.5 * np.arange(10) + 1)


def test_template_restated_signature_instantiation_with_half(lib):
    x = torch.linspace(-2, 2, 33, dtype=torch.float16)
    y = torch.full((33,), 0.25, dtype=torch.float16)
    lib.axpy_half(y, x, 0.5, threads=33, group_size=8)
    want = (0.5 * x.double() + 0.25)
    # half arithmetic: one rounding per operation at most, so within 2 half-ulps
    torch.testing.assert_close(y.double(), want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name,dtype,s", [("scale_float32", torch.float32, 1.5),
                                          ("scale_int32", torch.int32, -3),
                                          ("scale_uint8", torch.uint8, 3),
                                          ("scale_float64", torch.float64, 1.0 / 3.0)])
def test_macro_instantiations(lib, name, dtype, s):
    y = torch.arange(1, 21).to(dtype)
    want = (torch.arange(1, 21).double() * s)
    getattr(lib, name)(y, s, threads=20, group_size=7)
    if dtype == torch.uint8:
        want = want.remainder(256)
    torch.testing.assert_close(y.double(), want.to(dtype).double(), rtol=1e-12, atol=0)


def test_half_parameter_and_half_literal(lib):
    out = torch.zeros(8, dtype=torch.float16)
    lib.half_math(out, 0.25, threads=8)
    np.testing.assert_array_equal(out.numpy(), (np.float16(0.25) * np.arange(8) + 1.5)
                                  .astype(np.float16))


def test_scalar_arguments_are_converted_to_the_declared_types(lib):
    out = torch.zeros(7)
    lib.scalars(out, 0.333, -5, 2**32 - 1, 65535, -128, True, 1.5, threads=1)
    np.testing.assert_array_equal(
        out.numpy(),
        np.array([np.float16(0.333), -5, 2**32 - 1, 65535, -128, 1, 1.5], dtype=np.float32))


def test_numpy_scalars_of_the_declared_width_are_accepted(lib):
    out = torch.zeros(7)
    lib.scalars(out, np.float16(2.5), np.int32(-7), np.uint32(9), np.uint16(10), np.int8(-3),
                np.bool_(False), np.float32(0.5), threads=1)
    np.testing.assert_array_equal(out.numpy(), [2.5, -7, 9, 10, -3, 0, 0.5])


def test_two_dimensional_grid(lib):
    out = torch.zeros(7 * 5, dtype=torch.int32)
    lib.grid_2d(out, threads=(7, 5), group_size=(4, 2))
    y, x = np.mgrid[0:5, 0:7]
    np.testing.assert_array_equal(out.numpy(), (1 + x + 100 * y).ravel())


def test_buffers_without_attributes_bind_in_order(lib):
    out = torch.zeros(5)
    lib.implicit_indices(out, torch.arange(5.0), 3.0, threads=5)
    np.testing.assert_array_equal(out.numpy(), 3.0 * np.arange(5))


def test_struct_parameter_from_bytes(lib):
    out = torch.zeros(6)
    lib.struct_param(out, struct.pack("<If", 4, 2.5), threads=6)
    np.testing.assert_array_equal(out.numpy(), [0, 2.5, 5, 7.5, -1, -1])
    with pytest.raises(LaunchError, match="8 bytes"):
        lib.struct_param(out, torch.zeros(1), threads=6)  # 4 bytes for an 8-byte struct


def test_library_indexing_by_name(lib):
    assert lib["axpy_float"] is lib.axpy_float


def test_host_name_built_from_concatenated_literals():
    lib = compile_shader(CONCATENATED_HOST_NAME_SOURCE)
    assert set(lib.kernel_names) == {"fill_float32", "fill_int32"}
    y = torch.zeros(3, dtype=torch.int32)
    lib.fill_int32(y, threads=3)
    np.testing.assert_array_equal(y.numpy(), 7)


def test_bfloat_parameter_from_a_python_float():
    lib = compile_shader(BFLOAT_SOURCE)
    out = torch.zeros(2)
    lib.bfloat_scalar(out, 1.5, threads=2)
    np.testing.assert_array_equal(out.numpy(), [1.5, 1.5])
    lib.bfloat_scalar(out, 1.0 + 2.0**-9, threads=2)  # rounds to bfloat's 8-bit significand
    np.testing.assert_array_equal(out.numpy(), [1.0, 1.0])


# ---- caching ---------------------------------------------------------------------------
def test_same_source_returns_the_cached_library(lib, monkeypatch):
    def no_compiler(*args, **kwargs):
        raise AssertionError("the compiler was invoked for a cached source")

    monkeypatch.setattr(_compiler, "_run", no_compiler)
    monkeypatch.setattr(_compiler, "_preprocess", no_compiler)
    assert compile_shader(SOURCE) is lib


def test_disk_cache_skips_the_compiler(lib, monkeypatch, tmp_path):
    """A new in-process key (an extra, unused include directory) still finds the shared
    object on disk: the C++ compiler is not run."""
    calls = []

    def no_compiler(cmd, *args, **kwargs):
        calls.append(cmd)
        raise AssertionError("the C++ compiler was invoked although the library is cached")

    monkeypatch.setattr(_compiler, "_run", no_compiler)
    again = compile_shader(SOURCE, include_dirs=[str(tmp_path)])
    assert again is not lib and not calls
    y = torch.ones(4)
    again.scale_float32(y, 3.0, threads=4)
    np.testing.assert_array_equal(y.numpy(), 3.0)


def test_a_new_source_does_invoke_the_compiler(monkeypatch):
    # The control for the two tests above: patching _run does intercept compilation.
    def no_compiler(*args, **kwargs):
        raise RuntimeError("compiler intercepted")

    monkeypatch.setattr(_compiler, "_run", no_compiler)
    src = ("#include <metal_stdlib>\n"
           "kernel void k_%s(device float* o [[buffer(0)]]) { o[0] = 1; }\n" % uuid.uuid4().hex)
    with pytest.raises(RuntimeError, match="compiler intercepted"):
        compile_shader(src)


def test_source_must_be_a_string():
    with pytest.raises(TypeError, match="^compile_shader expects the shader source as a str, "
                                        "got bytes$"):
        compile_shader(b"kernel void f() {}")


# ---- compile errors --------------------------------------------------------------------
def test_compile_error_carries_message_line_and_source_line():
    with pytest.raises(MetalCompileError) as info:
        compile_shader(BROKEN_SOURCE)
    e = info.value
    assert "undefined_thing" in str(e)
    assert e.line == BROKEN_LINE
    assert e.source_line is not None and "undefined_thing" in e.source_line
    assert "undefined_thing" in e.log


def test_unsupported_attribute_is_a_compile_error_naming_it():
    with pytest.raises(MetalCompileError) as info:
        compile_shader(UNSUPPORTED_ATTRIBUTE_SOURCE)
    e = info.value
    assert "stage_in" in str(e)
    assert e.line in (4, 5)  # the kernel's declaration
    assert e.source_line is not None and ("vertex_like" in e.source_line
                                          or "stage_in" in e.source_line)


def test_missing_include_is_a_compile_error():
    with pytest.raises(MetalCompileError) as info:
        compile_shader(MISSING_INCLUDE_SOURCE)
    assert "no_such_header_for_the_test.h" in str(info.value)
    assert info.value.line == 2


# ---- launch errors ---------------------------------------------------------------------
def test_unknown_kernel_names_the_kernels(lib):
    with pytest.raises(AttributeError) as info:
        lib.no_such_kernel
    message = str(info.value)
    assert "no_such_kernel" in message and "axpy_float" in message and "scale_int32" in message


@pytest.mark.parametrize("nargs", [2, 4, 0])
def test_wrong_argument_count(lib, nargs):
    args = [torch.zeros(4), torch.zeros(4), 1.0, torch.zeros(4)][:nargs]
    with pytest.raises(LaunchError, match="expected 3 arguments"):
        lib.axpy_float(*args, threads=4)


def test_non_contiguous_tensor(lib):
    y = torch.zeros(4, 4).t()
    with pytest.raises(LaunchError, match="contiguous"):
        lib.axpy_float(y, torch.zeros(16), 1.0, threads=16)


def test_tensor_on_another_device(lib):
    y = torch.empty(4, device="meta")
    with pytest.raises(LaunchError, match="meta"):
        lib.axpy_float(y, torch.zeros(4), 1.0, threads=4)


@pytest.mark.parametrize("group", [1025, (64, 17), (8, 8, 17), 0])
def test_threadgroup_too_large_or_empty(lib, group):
    with pytest.raises(LaunchError, match="1024"):
        lib.axpy_float(torch.zeros(4), torch.zeros(4), 1.0, threads=4, group_size=group)


def test_threads_is_required(lib):
    with pytest.raises(LaunchError, match="threads"):
        lib.axpy_float(torch.zeros(4), torch.zeros(4), 1.0)


def test_python_float_for_an_integer_parameter(lib):
    with pytest.raises(LaunchError, match="float"):
        lib.scale_int32(torch.zeros(4, dtype=torch.int32), 1.5, threads=4)


@pytest.mark.parametrize("position,value", [
    (3, -1), (3, 2**32), (2, 2**31), (2, -2**31 - 1), (4, 65536), (5, 128), (5, -129)])
def test_python_int_out_of_range_for_the_declared_type(lib, position, value):
    args = [torch.zeros(7), 0.5, 1, 1, 1, 1, True, 1.0]
    args[position] = value
    with pytest.raises(LaunchError, match="does not fit"):
        lib.scalars(*args, threads=1)


@pytest.mark.parametrize("position,value", [
    (2, np.int64(1)),        # int is 4 bytes
    (2, np.int16(1)),
    (3, np.int32(1)),        # signed for unsigned
    (7, np.float64(1.0)),    # float is 4 bytes
    (1, np.float32(1.0)),    # half is 2 bytes
    (7, np.int32(1)),        # an integer for a float
])
def test_numpy_scalar_of_the_wrong_type_or_width(lib, position, value):
    args = [torch.zeros(7), 0.5, 1, 1, 1, 1, True, 1.0]
    args[position] = value
    with pytest.raises(LaunchError, match="NumPy"):
        lib.scalars(*args, threads=1)


@pytest.mark.parametrize("position,value,declared", [
    (7, 1e39, "float"), (7, -3.5e38, "float"), (7, 10**39, "float"), (1, 70000.0, "half"),
    (1, -65520, "half")])
def test_python_number_past_the_declared_float_range(lib, position, value, declared):
    args = [torch.zeros(7), 0.5, 1, 1, 1, 1, True, 1.0]
    args[position] = value
    with pytest.raises(LaunchError, match=f"does not fit the declared {declared}"):
        lib.scalars(*args, threads=1)


def test_python_number_past_double_and_bfloat_range():
    lib = compile_shader(BFLOAT_SOURCE)
    with pytest.raises(LaunchError, match="does not fit the declared bfloat"):
        lib.bfloat_scalar(torch.zeros(1), 3.4e38, threads=1)  # rounds past bfloat's maximum
    with pytest.raises(LaunchError, match="does not fit the declared double"):
        compile_shader(SOURCE).scale_float64(torch.zeros(1, dtype=torch.float64), 10**400,
                                             threads=1)


def test_floats_at_the_edge_of_the_range_and_infinities_bind(lib):
    out = torch.zeros(7)
    for value, expected in ((3.4028234e38, np.float32(3.4028234e38)), (-1e-50, -0.0),
                            (float("inf"), np.inf), (float("-inf"), -np.inf)):
        lib.scalars(out, 65504.0, 1, 1, 1, 1, True, value, threads=1)
        assert out[6].item() == expected and out[0].item() == 65504.0
    lib.scalars(out, 0.5, 1, 1, 1, 1, True, float("nan"), threads=1)
    assert np.isnan(out[6].item())


@pytest.mark.parametrize("threads", [2**32 + 2, 2**32, (1, 2**32), (4, 4, 2**40)])
def test_grid_dimension_past_32_bits_is_rejected(lib, threads):
    y = torch.zeros(4)
    with pytest.raises(LaunchError, match=r"at most 2\*\*32 - 1 = 4294967295"):
        lib.axpy_float(y, torch.ones(4), 1.0, threads=threads)
    with pytest.raises(LaunchError, match=r"at most 2\*\*32 - 1"):
        lib.axpy_float(y, torch.ones(4), 1.0, threads=4, group_size=threads)
    assert not y.any()


def test_numpy_integers_give_the_grid_and_group(lib):
    y = torch.zeros(12)
    with record() as launches:
        lib.axpy_float(y, torch.ones(12), 1.0, threads=np.int64(12), group_size=np.uint32(4))
        lib.grid_2d(torch.zeros(35, dtype=torch.int32), threads=(np.int32(7), np.int16(5)),
                    group_size=np.array([4, 2]))
    assert [(launch.threads, launch.group_size) for launch in launches] == [
        ((12, 1, 1), (4, 1, 1)), ((7, 5, 1), (4, 2, 1))]
    np.testing.assert_array_equal(y.numpy(), 1.0)


@pytest.mark.parametrize("threads", [4.0, True, "4", (4, None), [2.5]])
def test_grid_of_non_integers_is_a_type_error(lib, threads):
    with pytest.raises(TypeError, match="threads must be an int or a tuple of 1-3 ints"):
        lib.axpy_float(torch.zeros(4), torch.ones(4), 1.0, threads=threads)


def test_reference_parameter_given_too_few_bytes(lib):
    with pytest.raises(LaunchError, match="4 bytes"):
        lib.axpy_float(torch.zeros(4), torch.zeros(4), torch.zeros(1, dtype=torch.int8),
                       threads=4)


def test_unsupported_argument_type(lib):
    with pytest.raises(LaunchError, match="cannot bind"):
        lib.axpy_float(torch.zeros(4), torch.zeros(4), "1.0", threads=4)


def test_launch_errors_are_value_errors():
    assert issubclass(LaunchError, ValueError)


# ---- record() and empty grids ----------------------------------------------------------
def test_record_captures_name_grid_group_and_backend(lib):
    y, x = torch.zeros(12), torch.zeros(12)
    lib.axpy_float(y, x, 1.0, threads=12)  # outside any record block
    with record() as outer:
        lib.axpy_float(y, x, 1.0, threads=12, group_size=4)
        with record() as inner:
            lib.grid_2d(torch.zeros(35, dtype=torch.int32), threads=(7, 5), group_size=(4, 2))
        with pytest.raises(LaunchError, match=r"^axpy_float: group_size \(2000, 1, 1\) has 2000 "
                                              "threads; a Metal threadgroup holds 1 to 1024"):
            lib.axpy_float(y, x, 1.0, threads=12, group_size=2000)  # rejected: not launched
        lib.scale_float32(y, 2.0, threads=12)
    lib.scale_float32(y, 2.0, threads=12)  # after the block
    assert outer == [
        Launch("axpy_float", (12, 1, 1), (4, 1, 1), "emulator"),
        Launch("grid_2d", (7, 5, 1), (4, 2, 1), "emulator"),
        Launch("scale_float32", (12, 1, 1), (12, 1, 1), "emulator"),
    ]
    assert inner == [Launch("grid_2d", (7, 5, 1), (4, 2, 1), "emulator")]
    assert outer[0].kernel == "axpy_float" and outer[0].threads == (12, 1, 1)
    assert outer[0].group_size == (4, 1, 1) and outer[0].backend == "emulator"


@pytest.mark.parametrize("threads", [0, (0,), (0, 4), (4, 0, 2)])
def test_empty_grid_runs_nothing(lib, threads):
    y = torch.full((8,), 5.0)
    lib.axpy_float(y, torch.ones(8), 1.0, threads=threads, group_size=4)
    np.testing.assert_array_equal(y.numpy(), 5.0)


def test_public_api():
    for name in ("compile_shader", "record", "Launch", "KernelFault", "LaunchError",
                 "MetalCompileError"):
        assert name in tsm_metal.__all__
