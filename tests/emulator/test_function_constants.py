"""Function constants: ``[[function_constant(n)]]`` given values by compile_shader, as
MTLFunctionConstantValues gives them (by name or index, typed as declared)."""
import pytest
import torch

from torch_sparse_metal.emulator import LaunchError, compile_shader

SOURCE = """
#include <metal_stdlib>
using namespace metal;
constant int scale [[function_constant(0)]];
constant bool use_bias [[function_constant(1)]];
constant float offset [[function_constant(2)]];
constant half half_offset [[function_constant(3 + 1)]];
constant bool has_offset = is_function_constant_defined(offset);
kernel void affine(device float* out [[buffer(0)]],
                   device const float* bias [[buffer(1), function_constant(use_bias)]],
                   uint i [[thread_position_in_grid]]) {
  float v = float(i) * scale;
  if (use_bias) v += bias[i];
  if (has_offset) v += offset;
  out[i] = v;
}
kernel void defined(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = (is_function_constant_defined(offset) ? 1.0f : 0.0f) +
           (is_function_constant_defined(half_offset) ? 2.0f : 0.0f);
}
kernel void uses_half(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = float(half_offset);
}
"""


def test_values_by_name_and_index_specialise_the_kernel():
    lib = compile_shader(SOURCE, function_constants={"scale": 3, 1: True, "offset": 0.5})
    out, bias = torch.zeros(8), torch.arange(8.0) * 10
    lib.affine(out, bias, threads=8)
    assert torch.equal(out, torch.arange(8.0) * 3 + bias + 0.5)


def test_a_parameter_with_a_false_function_constant_takes_no_argument():
    lib = compile_shader(SOURCE, function_constants={"scale": 2, "use_bias": False}, sanitize=True)
    out = torch.zeros(8)
    lib.affine(out, threads=8)  # one argument: `bias` does not exist
    assert torch.equal(out, torch.arange(8.0) * 2)  # offset undefined: has_offset is false
    with pytest.raises(LaunchError, match="argument"):
        lib.affine(out, torch.zeros(8), threads=8)


def test_is_function_constant_defined():
    out = torch.zeros(4)
    compile_shader(SOURCE, function_constants={4: 1.5}).defined(out, threads=4)
    assert out.tolist() == [2.0] * 4
    compile_shader(SOURCE, function_constants={"offset": 1.0}).defined(out, threads=4)
    assert out.tolist() == [1.0] * 4
    compile_shader(SOURCE).defined(out, threads=4)
    assert out.tolist() == [0.0] * 4


def test_half_constant_holds_the_given_value():
    out = torch.zeros(2)
    compile_shader(SOURCE, function_constants={"half_offset": 0.1}).uses_half(out, threads=2)
    assert out.tolist() == [float(torch.tensor(0.1, dtype=torch.float16))] * 2


def test_a_kernel_using_a_constant_without_value_cannot_launch():
    lib = compile_shader(SOURCE, function_constants={"use_bias": False})
    with pytest.raises(LaunchError, match=r"affine: .*function constant\(s\) scale, given no value"):
        lib.affine(torch.zeros(4), threads=4)
    lib.defined(torch.zeros(4), threads=4)  # only tests definedness: launches


@pytest.mark.parametrize("values, error, message", [
    ({"scale": 1.5}, TypeError, r"`int scale` \[\[function_constant\(0\)\]\]: expected an integer"),
    ({"use_bias": 1}, TypeError, "expected a bool"),
    ({"scale": True}, TypeError, "got the bool"),
    ({"offset": "x"}, TypeError, "expected a number"),
    ({"scale": 2 ** 31}, ValueError, "does not fit int"),
    ({"nope": 1}, ValueError, "declares no function constant named 'nope'"),
    ({7: 1}, ValueError, "no function constant with index 7"),
    ({"scale": 1, 0: 2}, ValueError, "given twice"),
])
def test_bad_values_are_named(values, error, message):
    with pytest.raises(error, match=message):
        compile_shader(SOURCE, function_constants=values)


def test_values_are_part_of_the_cache_key():
    a = compile_shader(SOURCE, function_constants={"scale": 1, "use_bias": False})
    b = compile_shader(SOURCE, function_constants={"scale": 5, "use_bias": False})
    assert a.path != b.path
    out = torch.zeros(2)
    b.affine(out, threads=2)
    assert out.tolist() == [0.0, 5.0]
