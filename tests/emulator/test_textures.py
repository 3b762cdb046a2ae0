"""Textures and samplers in compute kernels, against NumPy: image kernels of our own (a 3x3
box blur, a transpose) in several pixel formats, sampling with every address mode and both
filters, the pixel formats' conversions, the texture types' reads and size queries, cube
faces, depth comparison and gather; out-of-bounds coordinates fault, plain and sanitized;
binding mistakes and what Apple's compiler rejects are named."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import KernelFault, LaunchError, MetalCompileError, Sampler, compile_shader

SANITIZE = [pytest.param(False, id="plain"), pytest.param(True, id="sanitized")]

IMAGE_KERNELS = """
#include <metal_stdlib>
using namespace metal;
kernel void blur(texture2d<float, access::read> src [[texture(0)]],
                 texture2d<float, access::write> dst [[texture(1)]],
                 uint2 gid [[thread_position_in_grid]]) {
  if (gid.x >= dst.get_width() || gid.y >= dst.get_height()) return;
  const int2 last = int2(src.get_width(), src.get_height()) - 1;
  float4 sum = 0.0f;
  for (int dy = -1; dy <= 1; ++dy)
    for (int dx = -1; dx <= 1; ++dx)
      sum += src.read(uint2(clamp(int2(gid) + int2(dx, dy), int2(0), last)));
  dst.write(sum / 9.0f, gid);
}
kernel void transpose_uint(texture2d<uint, access::read> src [[texture(0)]],
                           texture2d<uint, access::write> dst [[texture(1)]],
                           uint2 gid [[thread_position_in_grid]]) {
  dst.write(src.read(gid), gid.yx);
}
kernel void transpose_int(texture2d<int, access::read_write> src [[texture(0)]],
                          texture2d<int, access::read_write> dst [[texture(1)]],
                          uint2 gid [[thread_position_in_grid]]) {
  dst.write(src.read(gid), uint2(gid.y, gid.x));
}
"""


@pytest.fixture(scope="module", params=SANITIZE)
def images(request):
    return compile_shader(IMAGE_KERNELS, sanitize=request.param)


def box_blur(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    padded = np.pad(image.astype(np.float64), ((1, 1), (1, 1), (0, 0)), mode="edge")
    return sum(padded[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] for dy in (-1, 0, 1) for dx in (-1, 0, 1)) / 9


def test_blur_float32_rgba(images):
    image = torch.rand(9, 13, 4, generator=torch.Generator().manual_seed(0))
    out = torch.full_like(image, float("nan"))
    images.blur(textures=[image, out], threads=(13, 9), group_size=(8, 4))
    np.testing.assert_allclose(out.numpy(), box_blur(image.numpy()), rtol=1e-6, atol=1e-6)


def test_blur_rgba8_unorm(images):
    # uint8 bound to a float texture is rgba8Unorm: read as c / 255, written rounded to nearest.
    image = torch.randint(0, 256, (7, 6, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = torch.zeros_like(image)
    images.blur(textures=[image, out], threads=(6, 7), group_size=(4, 4))
    expected = np.rint(box_blur(image.numpy() / 255.0) * 255)
    assert np.abs(out.numpy().astype(np.float64) - expected).max() <= 1  # float32 sums round differently at .5
    assert (out.numpy() == expected).mean() > 0.95


def test_blur_r16float(images):
    image = torch.rand(5, 8, 1, generator=torch.Generator().manual_seed(2)).half()
    out = torch.zeros_like(image)
    images.blur(textures=[image, out], threads=(8, 5), group_size=(8, 1))
    np.testing.assert_allclose(out.float().numpy(), box_blur(image.float().numpy()), rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("kernel, dtype, channels", [("transpose_uint", torch.int32, 1),
                                                     ("transpose_uint", torch.uint8, 2),
                                                     ("transpose_int", torch.int16, 4)])
def test_transpose(images, kernel, dtype, channels):
    info = torch.iinfo(dtype)
    image = torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (6, 11, channels), dtype=dtype,
                          generator=torch.Generator().manual_seed(3))
    out = torch.zeros(11, 6, channels, dtype=dtype)
    getattr(images, kernel)(textures=[image, out], threads=(11, 6), group_size=(4, 4))
    assert torch.equal(out, image.transpose(0, 1))


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_a_coordinate_outside_the_texture_faults(sanitize):
    lib = compile_shader(IMAGE_KERNELS, sanitize=sanitize)
    image = torch.zeros(3, 5, 1, dtype=torch.int32)
    with pytest.raises(KernelFault, match=r"write at \(0, 4\) outside texture `dst` \(3x4 texels") as e:
        lib.transpose_uint(textures=[image, torch.zeros(4, 3, 1, dtype=torch.int32)], threads=(5, 3))
    assert e.value.kind == "out_of_bounds"
    with pytest.raises(KernelFault, match=r"read at \(0, 3\) outside texture `src` \(5x3 texels"):
        lib.transpose_uint(textures=[image, torch.zeros(5, 5, 1, dtype=torch.int32)], threads=(5, 4))


# ---- sampling ------------------------------------------------------------------------------

SAMPLE = """
#include <metal_stdlib>
using namespace metal;
kernel void sample2d(texture2d<float> t [[texture(0)]], sampler s [[sampler(0)]],
                     device const float2* uv [[buffer(0)]], device float4* out [[buffer(1)]],
                     uint i [[thread_position_in_grid]]) {
  out[i] = t.sample(s, uv[i]);
}
kernel void linear_repeat(texture2d<float> t [[texture(0)]], device const float2* uv [[buffer(0)]],
                          device float4* out [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  constexpr sampler s(filter::linear, address::repeat);
  out[i] = t.sample(s, uv[i], level(0.0f));
}
kernel void nearest_border_white(texture2d<float> t [[texture(0)]], device const float2* uv [[buffer(0)]],
                                 device float4* out [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  constexpr sampler s(coord::normalized, address::clamp_to_border, border_color::opaque_white, filter::nearest);
  out[i] = t.sample(s, uv[i]);
}
kernel void offset_pixel(texture2d<float> t [[texture(0)]], device const float2* uv [[buffer(0)]],
                         device float4* out [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  constexpr sampler s(coord::pixel, address::clamp_to_edge, filter::nearest);
  out[i] = t.sample(s, uv[i], int2(1, -1));
}
"""


def addressed(i: np.ndarray, n: int, mode: str):
    """(index, inside) of integer texel coordinates ``i`` under an address mode."""
    if mode == "repeat":
        return np.mod(i, n), np.ones(i.shape, bool)
    if mode == "mirrored_repeat":
        m = np.mod(i, 2 * n)
        return np.where(m < n, m, 2 * n - 1 - m), np.ones(i.shape, bool)
    inside = (i >= 0) & (i < n)
    clipped = np.clip(i, 0, n - 1)
    return clipped, (np.ones(i.shape, bool) if mode == "clamp_to_edge" else inside)


def reference_sample(image: np.ndarray, uv: np.ndarray, filter: str, mode: str, border, pixel=False,
                     offset=(0, 0)) -> np.ndarray:
    """Metal's 2D sample of an (H, W, 4) image: texel centres at i + 0.5."""
    h, w = image.shape[:2]
    x = uv[:, 0] * (1 if pixel else w)
    y = uv[:, 1] * (1 if pixel else h)

    def texel(ix, iy):
        cx, inx = addressed(ix, w, mode)
        cy, iny = addressed(iy, h, mode)
        return np.where((inx & iny)[:, None], image[cy, cx], border)

    if filter == "nearest":
        return texel(np.floor(x).astype(int) + offset[0], np.floor(y).astype(int) + offset[1])
    x0, y0 = np.floor(x - 0.5), np.floor(y - 0.5)
    fx, fy = (x - 0.5 - x0)[:, None], (y - 0.5 - y0)[:, None]
    x0, y0 = x0.astype(int), y0.astype(int)
    return ((1 - fx) * (1 - fy) * texel(x0, y0) + fx * (1 - fy) * texel(x0 + 1, y0) +
            (1 - fx) * fy * texel(x0, y0 + 1) + fx * fy * texel(x0 + 1, y0 + 1))


@pytest.fixture(scope="module")
def sampling():
    return compile_shader(SAMPLE)


@pytest.fixture(scope="module")
def coordinates():
    g = torch.Generator().manual_seed(4)
    uv = torch.rand(512, 2, generator=g) * 2.6 - 0.8  # inside and well outside [0, 1]
    image = torch.rand(5, 7, 4, generator=g)
    return image, uv


@pytest.mark.parametrize("filter", ["nearest", "linear"])
@pytest.mark.parametrize("mode", ["clamp_to_edge", "repeat", "mirrored_repeat", "clamp_to_zero", "clamp_to_border"])
def test_sample_matches_numpy(sampling, coordinates, filter, mode):
    image, uv = coordinates
    out = torch.zeros(len(uv), 4)
    sampling.sample2d(uv, out, textures=[image], samplers=[Sampler(filter=filter, address=mode)], threads=len(uv))
    border = np.zeros(4)  # clamp_to_zero on rgba, and the default border, are transparent black
    expected = reference_sample(image.numpy().astype(np.float64), uv.numpy().astype(np.float64), filter, mode, border)
    np.testing.assert_allclose(out.numpy(), expected, atol=2e-5)


def test_constexpr_samplers_match_numpy(sampling, coordinates):
    image, uv = coordinates
    out = torch.zeros(len(uv), 4)
    sampling.linear_repeat(uv, out, textures=[image], threads=len(uv))
    np.testing.assert_allclose(out.numpy(), reference_sample(image.numpy(), uv.numpy(), "linear", "repeat", 0),
                               atol=2e-5)
    sampling.nearest_border_white(uv, out, textures=[image], threads=len(uv))
    np.testing.assert_allclose(out.numpy(), reference_sample(image.numpy(), uv.numpy(), "nearest",
                                                             "clamp_to_border", np.ones(4)), atol=0)
    pixels = uv * torch.tensor([7.0, 5.0])
    sampling.offset_pixel(pixels, out, textures=[image], threads=len(uv))
    np.testing.assert_allclose(out.numpy(), reference_sample(image.numpy(), pixels.numpy(), "nearest",
                                                             "clamp_to_edge", 0, pixel=True, offset=(1, -1)),
                               atol=0)


def test_a_single_channel_texture_reads_as_r001(sampling):
    image = torch.rand(2, 3, 1)
    uv = torch.tensor([[0.5, 0.5], [2.0, 2.0]])
    out = torch.zeros(2, 4)
    sampling.sample2d(uv, out, textures=[image], samplers=[Sampler(address="clamp_to_zero")], threads=2)
    assert out[0].tolist() == [image[1, 1, 0].item(), 0.0, 0.0, 1.0]
    assert out[1].tolist() == [0.0, 0.0, 0.0, 1.0]  # clamp_to_zero is opaque black without alpha


# ---- pixel formats -------------------------------------------------------------------------

FORMATS = """
#include <metal_stdlib>
using namespace metal;
kernel void store(device const float4* colors [[buffer(0)]], texture1d<float, access::write> t [[texture(0)]],
                  uint i [[thread_position_in_grid]]) {
  t.write(colors[i], i);
}
kernel void store_uint(device const uint4* colors [[buffer(0)]], texture1d<uint, access::write> t [[texture(0)]],
                       uint i [[thread_position_in_grid]]) {
  t.write(colors[i], i);
}
kernel void load(texture1d<float, access::read> t [[texture(0)]], device float4* out [[buffer(0)]],
                 uint i [[thread_position_in_grid]]) {
  out[i] = t.read(i);
}
"""


@pytest.fixture(scope="module")
def formats():
    return compile_shader(FORMATS)


def test_writes_convert_as_metal_does(formats):
    values = torch.tensor([[0.5, 1.5, -0.2, 0.25], [0.002, 0.998, 1 / 3, 0.0]])
    unorm = torch.zeros(2, 4, dtype=torch.uint8)
    formats.store(values, textures=[unorm], threads=2)
    # clamp to [0, 1], scale by 255, round to nearest even: 127.5 -> 128, 63.75 -> 64
    assert unorm.tolist() == [[128, 255, 0, 64], [1, 254, 85, 0]]
    snorm = torch.zeros(2, 4, dtype=torch.int8)
    formats.store(-values * 2, textures=[snorm], threads=2)
    assert snorm.tolist() == [[-127, -127, 51, -64], [-1, -127, -85, 0]]  # -0.508 rounds to -1
    half = torch.zeros(2, 4, dtype=torch.float16)
    formats.store(values, textures=[half], threads=2)
    assert torch.equal(half, values.half())
    small = torch.zeros(2, 2, dtype=torch.uint8)  # rg8Uint saturates
    formats.store_uint(torch.tensor([[300, 7, 0, 0], [255, 256, 1, 1]], dtype=torch.int32), textures=[small], threads=2)
    assert small.tolist() == [[255, 7], [255, 255]]


def test_reads_convert_as_metal_does(formats):
    out = torch.zeros(3, 4)
    formats.load(out, textures=[torch.tensor([[255, 0], [51, 128], [1, 2]], dtype=torch.uint8)], threads=3)
    np.testing.assert_allclose(out.numpy(), [[1, 0, 0, 1], [0.2, 128 / 255, 0, 1], [1 / 255, 2 / 255, 0, 1]],
                               rtol=1e-6)
    formats.load(out, textures=[torch.tensor([[-128], [127], [-64]], dtype=torch.int8)], threads=3)
    np.testing.assert_allclose(out[:, 0].numpy(), [-1.0, 1.0, -64 / 127], rtol=1e-6)  # -128 reads as -1


# ---- the texture types -----------------------------------------------------------------------

TYPES = """
#include <metal_stdlib>
using namespace metal;
kernel void sizes(texture2d_array<float, access::read> a [[texture(0)]], texture3d<half, access::read> b [[texture(1)]],
                  texturecube<float, access::read> c [[texture(2)]], texture2d_ms<int, access::read> d [[texture(3)]],
                  depth2d<float, access::read> e [[texture(4)]], texturecube_array<uint, access::read> f [[texture(5)]],
                  texture1d_array<float, access::read> g [[texture(6)]], device uint* out [[buffer(0)]]) {
  uint v[] = {a.get_width(), a.get_height(), a.get_array_size(), b.get_width(), b.get_height(), b.get_depth(),
              c.get_width(), d.get_num_samples(), e.get_height(), f.get_array_size(), g.get_array_size(),
              a.get_num_mip_levels(), a.get_width(1), uint(a.is_null_texture())};
  for (uint i = 0; i < 14; ++i) out[i] = v[i];
}
kernel void reads(texture2d_array<float, access::read> a [[texture(0)]], texture3d<half, access::read> b [[texture(1)]],
                  texturecube<float, access::read> c [[texture(2)]], texture2d_ms<int, access::read> d [[texture(3)]],
                  depth2d<float, access::read> e [[texture(4)]], texturecube_array<uint, access::read> f [[texture(5)]],
                  texture1d_array<float, access::read> g [[texture(6)]], device float* out [[buffer(0)]]) {
  out[0] = a.read(uint2(2, 1), 1).y;
  out[1] = b.read(uint3(1, 0, 2)).x;
  out[2] = c.read(uint2(0, 1), 4).x;
  out[3] = float(d.read(uint2(1, 1), 2).w);
  out[4] = e.read(uint2(1, 0));
  out[5] = float(f.read(uint2(1, 1), 3, 1).x);
  out[6] = g.read(2u, 1u).x;
}
kernel void faces(texturecube<float> c [[texture(0)]], sampler s [[sampler(0)]], device float* out [[buffer(0)]]) {
  const float3 d[6] = {float3(1, 0.1, 0.2), float3(-1, 0.2, 0.1), float3(0.1, 1, -0.2),
                       float3(0.2, -1, 0.1), float3(-0.1, 0.2, 1), float3(0.1, 0.1, -1)};
  for (int i = 0; i < 6; ++i) out[i] = c.sample(s, d[i]).x;
}
kernel void compare_and_gather(depth2d<float> z [[texture(0)]], texture2d<float> t [[texture(1)]],
                               device float* out [[buffer(0)]]) {
  constexpr sampler less(compare_func::less, filter::nearest);
  constexpr sampler nearest(filter::nearest);
  out[0] = z.sample_compare(less, float2(0.25, 0.25), 0.5f);   // texel (0, 0)
  out[1] = z.sample_compare(less, float2(0.75, 0.25), 0.5f);   // texel (1, 0)
  float4 g = t.gather(nearest, float2(0.5, 0.5), int2(0), component::y);
  for (int i = 0; i < 4; ++i) out[2 + i] = g[i];
}
"""


@pytest.fixture(scope="module")
def types():
    g = torch.Generator().manual_seed(5)
    textures = [torch.rand(2, 3, 4, 4, generator=g),                              # 2d_array (L, H, W, C)
                torch.rand(3, 2, 2, 1, generator=g).half(),                       # 3d (D, H, W, C)
                torch.rand(6, 2, 2, 1, generator=g),                              # cube (6, H, W, C)
                torch.randint(-9, 9, (2, 2, 4, 4), dtype=torch.int32, generator=g),  # 2d_ms (H, W, S, C)
                torch.rand(2, 3, generator=g),                                    # depth2d (H, W)
                torch.randint(0, 99, (2, 6, 2, 2, 1), dtype=torch.int32, generator=g),  # cube_array (L, 6, H, W, C)
                torch.rand(2, 3, 2, generator=g)]                                 # 1d_array (L, W, C)
    return compile_shader(TYPES), textures


def test_size_queries(types):
    lib, textures = types
    out = torch.zeros(14, dtype=torch.int32)
    lib.sizes(out, textures=textures, threads=1)
    assert out.tolist() == [4, 3, 2, 2, 2, 3, 2, 4, 2, 2, 2, 1, 2, 0]


def test_reads_of_each_type(types):
    lib, t = types
    out = torch.zeros(7)
    lib.reads(out, textures=t, threads=1)
    expected = [t[0][1, 1, 2, 1], t[1][2, 0, 1, 0].float(), t[2][4, 1, 0, 0], t[3][1, 1, 2, 3].float(),
                t[4][0, 1], t[5][1, 3, 1, 1, 0].float(), t[6][1, 2, 0]]
    np.testing.assert_allclose(out.numpy(), [float(e) for e in expected], rtol=1e-6)


def test_a_cube_direction_picks_its_face():
    lib = compile_shader(TYPES)
    cube = torch.arange(6.0).view(6, 1, 1, 1).expand(6, 2, 2, 1).contiguous()  # face i holds i
    out = torch.zeros(6)
    lib.faces(out, textures=[cube], samplers=[Sampler()], threads=1)
    assert out.tolist() == [0, 1, 2, 3, 4, 5]  # +x, -x, +y, -y, +z, -z


def test_depth_comparison_and_gather():
    lib = compile_shader(TYPES)
    depth = torch.tensor([[0.75, 0.25], [0.9, 0.1]])
    image = torch.arange(16.0).view(2, 2, 4)  # texel (x, y) has green 4 * (2y + x) + 1
    out = torch.zeros(6)
    lib.compare_and_gather(out, textures=[depth, image], threads=1)
    # compare_func::less passes when the reference is less than the texel: 0.5 < 0.75, not < 0.25
    # gather's order: (x0, y1), (x1, y1), (x1, y0), (x0, y0)
    assert out.tolist() == [1.0, 0.0, 9.0, 13.0, 5.0, 1.0]


def test_reads_outside_layers_samples_and_faces_fault(types):
    lib, t = types
    bad = dict(enumerate(t))
    bad[0] = t[0][:1].contiguous()  # one layer: a.read(..., 1) reads layer 1
    with pytest.raises(KernelFault, match=r"read at \(2, 1\), layer 1 outside texture `a`"):
        lib.reads(torch.zeros(7), textures=list(bad.values()), threads=1)
    bad = dict(enumerate(t))
    bad[3] = t[3][:, :, :2].contiguous()  # two samples: d.read(..., 2) reads sample 2
    with pytest.raises(KernelFault, match=r"sample 2 outside texture `d`"):
        lib.reads(torch.zeros(7), textures=list(bad.values()), threads=1)


def test_a_null_texture_is_null_and_faults_when_read(types):
    lib, t = types
    out = torch.zeros(14, dtype=torch.int32)
    lib.sizes(out, textures=[None] + t[1:], threads=1)
    assert out[13] == 1 and out[0] == 0
    with pytest.raises(KernelFault, match="read of a null texture"):
        lib.reads(torch.zeros(7), textures=[None] + t[1:], threads=1)


# ---- binding mistakes, and what Metal rejects -------------------------------------------------------

@pytest.mark.parametrize("textures, message", [
    ([torch.zeros(4, 4)], r"a texture2d<float, access::read> binds a tensor of shape \(H, W, C\) with C 1, 2 or "
                          r"4 channels \(6 faces for a cube\), got shape \(4, 4\)"),
    ([torch.zeros(4, 4, 3)], r"got shape \(4, 4, 3\)"),
    ([torch.zeros(4, 4, 1, dtype=torch.float64)], r"binds a tensor of float32, float16, uint8, int8, int16.*got "
                                                  r"torch.float64"),
    ([torch.zeros(4, 8, 1)[:, ::2]], r"must be contiguous"),
    ([], r"textures= must give one entry per \[\[texture\(n\)\]\] index up to the last the kernel declares \(2"),
    ([torch.zeros(4, 4, 1), torch.zeros(4, 4, 1), torch.zeros(4, 4, 1)], r"got 3"),
    ([[1.0]], r"bind a tensor of shape \(H, W, C\)"),
])
def test_binding_mistakes_are_named(images, textures, message):
    if len(textures) == 1:
        textures = textures + [torch.zeros(4, 4, 1)]
    with pytest.raises(LaunchError, match=message):
        images.blur(textures=textures, threads=(4, 4))


def test_an_int_texture_takes_integer_tensors_only(images):
    with pytest.raises(LaunchError, match=r"texture2d<int, access::read_write> binds a tensor of int32, int16, "
                                          r"int8; got torch.float32"):
        images.transpose_int(textures=[torch.zeros(2, 2, 1), torch.zeros(2, 2, 1)], threads=(2, 2))


def test_samplers_are_checked(sampling):
    with pytest.raises(ValueError, match=r"Sampler: address must be one of repeat, .*; got 'wrap'"):
        Sampler(address="wrap")
    with pytest.raises(LaunchError, match=r"samplers\[0\] .* must be a torch_sparse_metal.emulator.Sampler"):
        sampling.sample2d(torch.zeros(1, 2), torch.zeros(1, 4), textures=[torch.zeros(2, 2, 4)],
                          samplers=["linear"], threads=1)


@pytest.mark.parametrize("body, message", [
    ("texture2d<float, access::read> t [[texture(0)]]) { t.write(float4(0), uint2(0)); }",
     r"no matching member function for call to 'write'"),
    ("texture2d<float, access::write> t [[texture(0)]]) { float4 v = t.read(uint2(0)); }",
     r"no matching member function for call to 'read'"),
    ("texture2d<float, access::read> t [[texture(0)]], sampler s) { float4 v = t.sample(s, float2(0)); }",
     r"no matching member function for call to 'sample'"),
    ("texture2d<bool> t [[texture(0)]]) { }", r"element type is float, half, int, uint, short or ushort"),
    ("depth2d<int> t [[texture(0)]]) { }", r"depth texture's element type is float or half"),
    ("texture2d<float> t [[texture(0)]], sampler s) { float4 v = t.sample(s, float2(0), 3.0f); }",
     r"no matching member function for call to 'sample'"),
])
def test_what_apples_compiler_rejects_is_rejected(body, message):
    with pytest.raises(MetalCompileError, match=message):
        compile_shader("#include <metal_stdlib>\nusing namespace metal;\nkernel void k(" + body)


ATOMICS = """
#include <metal_stdlib>
using namespace metal;
kernel void histogram(device const uint* values [[buffer(0)]], texture2d<uint, access::read_write> bins [[texture(0)]],
                      texture2d_array<int, access::read_write> low [[texture(1)]], uint i [[thread_position_in_grid]]) {
  uint v = values[i];
  bins.atomic_fetch_add(uint2(v % 4, v / 4), 1u);
  low.atomic_fetch_min(uint2(0, 0), 1, -int(v));
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_texture_atomics_count_across_threads(sanitize):
    lib = compile_shader(ATOMICS, sanitize=sanitize, language_version="3.1")
    values = torch.randint(0, 16, (20000,), dtype=torch.int32, generator=torch.Generator().manual_seed(6))  # two workers
    bins = torch.zeros(4, 4, 1, dtype=torch.int32)
    low = torch.zeros(2, 1, 1, 1, dtype=torch.int32)
    lib.histogram(values, textures=[bins, low], threads=len(values), group_size=64)
    assert bins.flatten().tolist() == torch.bincount(values, minlength=16).tolist()
    assert low[1, 0, 0, 0].item() == -values.max().item() and low[0].item() == 0


def test_texture_atomics_are_metal_3_1():
    with pytest.raises(MetalCompileError, match="no matching member function for call to 'atomic_fetch_add'"):
        compile_shader(ATOMICS, language_version="3.0")


EXCHANGES = """
#include <metal_stdlib>
using namespace metal;
kernel void k(texture2d<uint, access::read_write> total [[texture(0)]],
              texture1d_array<int, access::read_write> rows [[texture(1)]],
              texture_buffer<uint, access::read_write, memory_coherence_device> flags [[texture(2)]],
              device uint* seen [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  uint4 expected = uint4(0u);
  do {  // SPIRV-Cross's compare-exchange loop: each thread adds i + 1 to one texel
    expected.x = total.atomic_load(uint2(1, 0)).x;
  } while (!total.atomic_compare_exchange_weak(uint2(1, 0), &expected, expected.x + i + 1));
  seen[i] = expected.x;
  rows.atomic_fetch_max(1, i % 3, int(i));
  if (i == 5) flags.atomic_store(2, 77u);
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_texture_compare_exchange_load_and_store(sanitize):
    lib = compile_shader(EXCHANGES, sanitize=sanitize, language_version="3.2")
    n = 3000
    total, rows = torch.zeros(1, 2, 1, dtype=torch.int32), torch.full((3, 2, 1), -1, dtype=torch.int32)
    flags, seen = torch.zeros(4, 1, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    lib.k(seen, textures={0: total, 1: rows, 2: flags}, threads=n, group_size=64)
    assert total[0, 1, 0].item() == n * (n + 1) // 2
    # every exchange saw a distinct running total: the old values are the partial sums in some order
    assert len(set(seen.tolist())) == n and seen.min().item() == 0
    assert rows[:, 1, 0].tolist() == [n - 3, n - 2, n - 1] and rows[:, 0, 0].tolist() == [-1] * 3
    assert flags.flatten().tolist() == [0, 0, 77, 0]


@pytest.mark.parametrize("source, version, message", [
    ("texturecube<uint, access::read_write> t [[texture(0)]]) { t.atomic_fetch_add(uint2(0), 0, 1u); }", "3.2",
     "no matching member function for call to 'atomic_fetch_add'"),  # cubes' atomics are MSL 4.0's
    ("texture2d<float, access::write, memory_coherence_device> t [[texture(0)]]) { }", "3.1",
     "use of undeclared identifier 'memory_coherence_device'"),
    ("texture2d<float, access::write, 1> t [[texture(0)]]) { }", "3.2", "value of type 'int'|no viable conversion"),
])
def test_texture_forms_of_later_versions_and_other_types_are_rejected(source, version, message):
    with pytest.raises(MetalCompileError, match=message):
        compile_shader("#include <metal_stdlib>\nusing namespace metal;\nkernel void k(" + source,
                       language_version=version)


def test_textures_by_index_mapping_name_bad_keys():
    lib = compile_shader(EXCHANGES, language_version="3.2")
    with pytest.raises(LaunchError, match=r"textures= has key 7; the kernel declares indices 0, 1, 2"):
        lib.k(torch.zeros(1, dtype=torch.int32), textures={7: torch.zeros(1, 1, 1)}, threads=1)


ARGUMENT_BUFFER_TEXTURE = """
#include <metal_stdlib>
using namespace metal;
struct Set { texture2d<uint, access::read_write> image; };
void bump(texture2d<uint, access::read_write> image) { image.atomic_fetch_add(uint2(0), 1u); }
kernel void k(constant Set& set [[buffer(0)]]) { bump(set.image); }  // copied from constant memory
"""


def test_a_texture_in_an_argument_buffer_compiles_and_is_null_here():
    # the check takes it as Apple's compiler does; Python cannot fill an argument buffer with
    # textures, so the texture read from one is null, and using it faults
    lib = compile_shader(ARGUMENT_BUFFER_TEXTURE, language_version="3.1")
    with pytest.raises(KernelFault, match="null|no texture|unbound"):
        lib.k(torch.zeros(2, dtype=torch.int32), threads=1)


CUBE_ATOMICS = """
#include <metal_stdlib>
using namespace metal;
kernel void k(texturecube<uint, access::read_write> cube [[texture(0)]],
              texturecube_array<int, access::read_write> cubes [[texture(1)]], uint3 i [[thread_position_in_grid]]) {
  cube.atomic_fetch_add(i.xy, i.z, 10u);  // SPIRV-Cross's image-cube-atomic (MSL 4.0)
  cubes.atomic_fetch_or(i.xy, i.z % 6, i.z / 6, 1 << i.x);
}
"""


@pytest.mark.parametrize("sanitize", SANITIZE)
def test_cube_atomics_of_metal_4(sanitize):
    lib = compile_shader(CUBE_ATOMICS, sanitize=sanitize, language_version="4.0")
    cube = torch.zeros(6, 2, 2, 1, dtype=torch.int32)
    cubes = torch.zeros(2, 6, 2, 2, 1, dtype=torch.int32)
    lib.k(textures=[cube, cubes], threads=(2, 2, 6), group_size=(2, 2, 1))
    assert (cube == 10).all()
    assert cubes[0, :, :, :, 0].tolist() == [[[1, 2], [1, 2]]] * 6 and (cubes[1] == 0).all()
