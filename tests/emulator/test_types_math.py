"""Types and math of the emulated <metal_stdlib> (csrc/emulator/include/tsm_emu/types.h, math.h).

Kernels apply Metal functions element-wise to CPU tensors; results are compared with NumPy
(float functions, as_type), torch (half/bfloat rounding) and plain Python ints (integer
functions). Each shader source below is compiled once (one g++ run, cached on disk), so the
functions are grouped into a few generated shaders rather than one shader per case.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from torch_sparse_metal.emulator import MetalCompileError, compile_shader

PRELUDE = "#include <metal_stdlib>\nusing namespace metal;\n"


def kernel(name: str, params, body: str) -> str:
    """One kernel: params are the [[buffer(i)]] declarations in order; `i` is the thread id."""
    sig = ", ".join(f"{p} [[buffer({n})]]" for n, p in enumerate(params))
    return f"kernel void {name}({sig}, uint i [[thread_position_in_grid]]) {{ {body} }}\n"


def run(lib, name: str, *args, threads: int) -> None:
    getattr(lib, name)(*args, threads=threads, group_size=min(threads, 64))


def f32(values) -> torch.Tensor:
    return torch.tensor(np.asarray(values, dtype=np.float32))


# ---------------------------------------------------------------------------------------
# Floating-point functions against NumPy (float64 reference, float32 result)
# ---------------------------------------------------------------------------------------
N = 96  # multiple of 4: the same data also runs through the float4 path

DOMAINS = {
    "any": np.linspace(-9.7, 9.7, N),
    "small": np.linspace(-4.3, 4.3, N),
    "pos": np.geomspace(0.013, 87.0, N),
    "unit": np.linspace(-0.985, 0.985, N),
    "ge1": np.linspace(1.0, 40.0, N),
    "halves": np.arange(N) / 4.0 - 12.0,  # many .25/.5/.75 and exact halfway cases
}


def _round_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _fract(x):
    return np.minimum(x - np.floor(x), np.float64(np.float32(1) - np.float32(2.0**-24)))


# name -> (reference, domain, rtol, atol)
UNARY = {
    "sqrt": (np.sqrt, "pos", 1e-7, 0),
    "rsqrt": (lambda x: 1 / np.sqrt(x), "pos", 1e-7, 0),
    "cbrt": (np.cbrt, "any", 2e-7, 0),
    "exp": (np.exp, "small", 2e-7, 0),
    "exp2": (np.exp2, "small", 2e-7, 0),
    "exp10": (lambda x: 10.0**x, "small", 2e-7, 0),
    "log": (np.log, "pos", 2e-7, 1e-7),
    "log2": (np.log2, "pos", 2e-7, 1e-7),
    "log10": (np.log10, "pos", 2e-7, 1e-7),
    "sin": (np.sin, "any", 2e-7, 1e-7),
    "cos": (np.cos, "any", 2e-7, 1e-7),
    "tan": (np.tan, "unit", 2e-7, 1e-7),
    "asin": (np.arcsin, "unit", 2e-7, 0),
    "acos": (np.arccos, "unit", 2e-7, 0),
    "atan": (np.arctan, "any", 2e-7, 0),
    "sinh": (np.sinh, "small", 2e-7, 0),
    "cosh": (np.cosh, "small", 2e-7, 0),
    "tanh": (np.tanh, "small", 2e-7, 1e-7),
    "asinh": (np.arcsinh, "any", 2e-7, 0),
    "acosh": (np.arccosh, "ge1", 2e-7, 1e-7),
    "atanh": (np.arctanh, "unit", 2e-7, 0),
    "sinpi": (lambda x: np.sin(np.pi * x), "halves", 1e-7, 1e-7),
    "cospi": (lambda x: np.cos(np.pi * x), "halves", 1e-7, 1e-7),
    "tanpi": (lambda x: np.tan(np.pi * x), "unit", 2e-7, 1e-7),
    "asinpi": (lambda x: np.arcsin(x) / np.pi, "unit", 2e-7, 0),
    "acospi": (lambda x: np.arccos(x) / np.pi, "unit", 2e-7, 0),
    "atanpi": (lambda x: np.arctan(x) / np.pi, "any", 2e-7, 0),
    "floor": (np.floor, "halves", 0, 0),
    "ceil": (np.ceil, "halves", 0, 0),
    "round": (_round_away, "halves", 0, 0),
    "rint": (np.rint, "halves", 0, 0),
    "trunc": (np.trunc, "halves", 0, 0),
    "fract": (_fract, "any", 1e-6, 1e-6),
    "fabs": (np.abs, "any", 0, 0),
    "abs": (np.abs, "any", 0, 0),
    "sign": (np.sign, "halves", 0, 0),
    "saturate": (lambda x: np.clip(x, 0, 1), "unit", 0, 0),
    "logb": (lambda x: np.floor(np.log2(np.abs(x))), "any", 0, 0),
}

# name -> (reference, domain x, domain y, rtol, atol)
BINARY = {
    "pow": (np.power, "pos", "small", 2e-7, 0),
    "powr": (np.power, "pos", "small", 2e-7, 0),
    "atan2": (np.arctan2, "any", "small", 2e-7, 0),
    "atan2pi": (lambda y, x: np.arctan2(y, x) / np.pi, "any", "small", 2e-7, 0),
    "fmod": (np.fmod, "any", "pos", 0, 0),
    "fmin": (np.fmin, "any", "small", 0, 0),
    "fmax": (np.fmax, "any", "small", 0, 0),
    "min": (np.fmin, "any", "small", 0, 0),
    "max": (np.fmax, "any", "small", 0, 0),
    "fdim": (lambda x, y: np.maximum(x - y, 0), "any", "small", 1e-7, 0),
    "copysign": (np.copysign, "pos", "any", 0, 0),
    "step": (lambda e, x: np.where(x < e, 0.0, 1.0), "small", "any", 0, 0),
    "divide": (np.divide, "any", "pos", 1e-7, 0),
}

# name -> (reference, domains, rtol, atol)
TERNARY = {
    "fma": (lambda a, b, c: a * b + c, ("any", "small", "any"), 1e-7, 1e-6),
    "mix": (lambda a, b, t: a + (b - a) * t, ("any", "small", "unit"), 1e-6, 1e-6),
    "clamp": (lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi), ("any", "unit", "ge1"), 0, 0),
    "smoothstep": (lambda e0, e1, x: (lambda t: t * t * (3 - 2 * t))(np.clip((x - e0) / (e1 - e0), 0, 1)),
                   ("unit", "ge1", "small"), 1e-6, 1e-6),
    "fmin3": (lambda a, b, c: np.minimum(np.minimum(a, b), c), ("any", "small", "unit"), 0, 0),
    "fmax3": (lambda a, b, c: np.maximum(np.maximum(a, b), c), ("any", "small", "unit"), 0, 0),
    "fmedian3": (lambda a, b, c: np.median(np.stack([a, b, c]), axis=0), ("any", "small", "unit"), 0, 0),
    "median3": (lambda a, b, c: np.median(np.stack([a, b, c]), axis=0), ("any", "small", "unit"), 0, 0),
}


def _float_math_source() -> str:
    src = [PRELUDE]
    for f in UNARY:
        src.append(kernel(f"s_{f}", ["device const float* x", "device float* out"], f"out[i] = {f}(x[i]);"))
        src.append(kernel(f"v_{f}", ["device const float4* x", "device float4* out"], f"out[i] = {f}(x[i]);"))
        src.append(kernel(f"h_{f}", ["device const half* x", "device half* out"], f"out[i] = {f}(x[i]);"))
        # Metal's math functions take no bfloat: the argument converts to float, and the
        # float result back to bfloat only explicitly.
        src.append(kernel(f"b_{f}", ["device const bfloat* x", "device bfloat* out"], f"out[i] = bfloat({f}(x[i]));"))
    for f in BINARY:
        src.append(kernel(f"s_{f}", ["device const float* x", "device const float* y", "device float* out"],
                          f"out[i] = {f}(x[i], y[i]);"))
        src.append(kernel(f"v_{f}", ["device const float4* x", "device const float4* y", "device float4* out"],
                          f"out[i] = {f}(x[i], y[i]);"))
    for f in TERNARY:
        src.append(kernel(f"s_{f}", ["device const float* x", "device const float* y", "device const float* z",
                                     "device float* out"], f"out[i] = {f}(x[i], y[i], z[i]);"))
        src.append(kernel(f"v_{f}", ["device const float4* x", "device const float4* y", "device const float4* z",
                                     "device float4* out"], f"out[i] = {f}(x[i], y[i], z[i]);"))
    # vector with scalar arguments (broadcast)
    src.append(kernel("v_clamp_scalar", ["device const float4* x", "device float4* out"],
                      "out[i] = clamp(x[i], -1.5f, 2.0f);"))
    src.append(kernel("v_pow_scalar", ["device const float4* x", "device float4* out"], "out[i] = pow(x[i], 2.0f);"))
    src.append(kernel("v_mix_scalar", ["device const float4* x", "device float4* out"],
                      "out[i] = mix(x[i], float4(1.0f), 0.25f);"))
    src.append(kernel("v_step_scalar", ["device const float4* x", "device float4* out"], "out[i] = step(0.5f, x[i]);"))
    # swizzle arguments
    src.append(kernel("v_swizzle_arg", ["device const float4* x", "device float4* out"],
                      "out[i] = float4(sqrt(abs(x[i].wzy)), max(x[i].x, x[i].y));"))
    # double (emulator only)
    src.append("#ifdef __METAL_EMULATOR__\n")
    src.append(kernel("d_mix", ["device const double* x", "device double* out"],
                      "out[i] = sqrt(abs(x[i])) + sin(x[i]) * exp(x[i] * 0.1) + fract(x[i]);"))
    src.append("#endif\n")
    return "".join(src)


@pytest.fixture(scope="module")
def fmath():
    return compile_shader(_float_math_source())


def _domain(name: str) -> np.ndarray:
    return DOMAINS[name].astype(np.float32)


@pytest.mark.parametrize("fn", sorted(UNARY))
def test_unary_float(fmath, fn):
    ref, dom, rtol, atol = UNARY[fn]
    x = _domain(dom)
    want = ref(x.astype(np.float64))
    for path in ("s", "v"):
        out = torch.zeros(N)
        xt = f32(x)
        if path == "v":
            run(fmath, f"v_{fn}", xt.view(-1, 4), out.view(-1, 4), threads=N // 4)
        else:
            run(fmath, f"s_{fn}", xt, out, threads=N)
        np.testing.assert_allclose(out.numpy(), want, rtol=rtol, atol=atol, err_msg=f"{fn} ({path})")


@pytest.mark.parametrize("fn", sorted(UNARY))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unary_half_bfloat(fmath, fn, dtype):
    """half/bfloat compute in float and round once: within one ulp of the rounded reference."""
    ref, dom, _, _ = UNARY[fn]
    x = torch.tensor(_domain(dom)).to(dtype)
    out = torch.zeros(N, dtype=dtype)
    run(fmath, f"{'h' if dtype == torch.float16 else 'b'}_{fn}", x, out, threads=N)
    want = torch.tensor(ref(x.double().numpy())).to(dtype).double().numpy()
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    np.testing.assert_allclose(out.double().numpy(), want, rtol=ulp, atol=ulp * 1e-3, err_msg=fn)


@pytest.mark.parametrize("fn", sorted(BINARY))
def test_binary_float(fmath, fn):
    ref, dx, dy, rtol, atol = BINARY[fn]
    x, y = _domain(dx), np.roll(_domain(dy), 7)
    want = ref(x.astype(np.float64), y.astype(np.float64))
    for path in ("s", "v"):
        out = torch.zeros(N)
        xt, yt = f32(x), f32(y)
        if path == "v":
            run(fmath, f"v_{fn}", xt.view(-1, 4), yt.view(-1, 4), out.view(-1, 4), threads=N // 4)
        else:
            run(fmath, f"s_{fn}", xt, yt, out, threads=N)
        np.testing.assert_allclose(out.numpy(), want, rtol=rtol, atol=atol, err_msg=f"{fn} ({path})")


@pytest.mark.parametrize("fn", sorted(TERNARY))
def test_ternary_float(fmath, fn):
    ref, doms, rtol, atol = TERNARY[fn]
    args = [np.roll(_domain(d), 5 * k) for k, d in enumerate(doms)]
    want = ref(*(a.astype(np.float64) for a in args))
    for path in ("s", "v"):
        out = torch.zeros(N)
        ts = [f32(a) for a in args]
        if path == "v":
            run(fmath, f"v_{fn}", *(t.view(-1, 4) for t in ts), out.view(-1, 4), threads=N // 4)
        else:
            run(fmath, f"s_{fn}", *ts, out, threads=N)
        np.testing.assert_allclose(out.numpy(), want, rtol=rtol, atol=atol, err_msg=f"{fn} ({path})")


@pytest.mark.parametrize("name, ref", [
    ("v_clamp_scalar", lambda x: np.clip(x, -1.5, 2.0)),
    ("v_pow_scalar", lambda x: x * x),
    ("v_mix_scalar", lambda x: x + (1 - x) * 0.25),
    ("v_step_scalar", lambda x: np.where(x < 0.5, 0.0, 1.0)),
    ("v_swizzle_arg", lambda x: np.stack([np.sqrt(np.abs(x[:, 3])), np.sqrt(np.abs(x[:, 2])),
                                          np.sqrt(np.abs(x[:, 1])), np.maximum(x[:, 0], x[:, 1])], axis=1)),
])
def test_vector_with_scalar_arguments(fmath, name, ref):
    x = _domain("any").reshape(-1, 4)
    out = torch.zeros(N // 4, 4)
    run(fmath, name, f32(x), out, threads=N // 4)
    np.testing.assert_allclose(out.numpy(), ref(x.astype(np.float64)), rtol=1e-6, atol=1e-6)


def test_double_is_computed_in_double(fmath):
    x = np.linspace(-3.3, 3.3, N)
    out = torch.zeros(N, dtype=torch.float64)
    run(fmath, "d_mix", torch.tensor(x), out, threads=N)
    want = np.sqrt(np.abs(x)) + np.sin(x) * np.exp(x * 0.1) + (x - np.floor(x))
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------------------------------
# Special values, predicates, geometry, select
# ---------------------------------------------------------------------------------------
SPECIALS = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-40, -3.4e38, 1.1754944e-38,
                     0.5, -2.5], dtype=np.float32)

PREDICATES = {
    "isnan": np.isnan,
    "isinf": np.isinf,
    "isfinite": np.isfinite,
    "isnormal": lambda x: np.isfinite(x) & (np.abs(x) >= np.finfo(np.float32).tiny),
    "signbit": np.signbit,
}

# expression of x (a float) -> reference on float64 arrays (NaN compares equal to NaN)
SPECIAL_EXPRS = {
    # fract(+-inf) = +-0 (as OpenCL specifies), fract(NaN) = NaN
    "fract(x)": lambda x: np.where(np.isinf(x), np.copysign(0.0, x), _fract(np.where(np.isinf(x), 0.0, x))),
    "sign(x)": lambda x: np.where(np.isnan(x), 0.0, np.where(x == 0, x, np.sign(x))),  # sign(-0) = -0
    "saturate(x)": lambda x: np.where(np.isnan(x), 0.0, np.clip(x, 0, 1)),
    "max(x, 0.25f)": lambda x: np.fmax(x, 0.25),
    "min(x, 0.25f)": lambda x: np.fmin(x, 0.25),
    "clamp(x, -1.0f, 1.0f)": lambda x: np.where(np.isnan(x), -1.0, np.clip(x, -1, 1)),
    "float(half(x))": lambda x: torch.tensor(x).to(torch.float16).double().numpy(),
    "select(x, -x, x < 0.0f)": lambda x: np.where(x < 0, -x, x),
    "copysign(1.0f, x)": lambda x: np.copysign(1.0, x),
}


def _special_source() -> str:
    src = [PRELUDE]
    for p in PREDICATES:
        src.append(kernel(f"p_{p}", ["device const float* x", "device bool* out"], f"out[i] = {p}(x[i]);"))
        src.append(kernel(f"pv_{p}", ["device const float4* x", "device bool4* out"], f"out[i] = {p}(x[i]);"))
    for k, expr in enumerate(SPECIAL_EXPRS):
        src.append(kernel(f"e{k}", ["device const float* xs", "device float* out"],
                          f"float x = xs[i]; out[i] = {expr};"))
    src.append(kernel("geometry", ["device const float4* a", "device const float4* b", "device float* out"], """
        float4 p = a[i], q = b[i];
        out[i * 8 + 0] = dot(p, q);
        out[i * 8 + 1] = length(p);
        out[i * 8 + 2] = distance(p.xyz, q.xyz);
        out[i * 8 + 3] = length_squared(p.xy);
        float3 c = cross(p.xyz, q.xyz);
        out[i * 8 + 4] = c.x; out[i * 8 + 5] = c.y; out[i * 8 + 6] = c.z;
        out[i * 8 + 7] = normalize(p).w;"""))
    src.append(kernel("relational", ["device const float4* a", "device int* out"], """
        float4 p = a[i];
        bool4 neg = p < 0.0f;
        out[i * 6 + 0] = all(neg);
        out[i * 6 + 1] = any(neg);
        out[i * 6 + 2] = all(p == p.xyzw);
        out[i * 6 + 3] = any(isnan(p));
        int4 pick = select(int4(0), int4(1, 2, 3, 4), neg);
        out[i * 6 + 4] = pick.x + pick.y + pick.z + pick.w;
        out[i * 6 + 5] = select(10, 20, neg.x);"""))
    return "".join(src)


@pytest.fixture(scope="module")
def special():
    return compile_shader(_special_source())


@pytest.mark.parametrize("pred", sorted(PREDICATES))
def test_predicates(special, pred):
    x = np.resize(SPECIALS, 16)
    want = PREDICATES[pred](x)
    out = torch.zeros(16, dtype=torch.bool)
    run(special, f"p_{pred}", f32(x), out, threads=16)
    np.testing.assert_array_equal(out.numpy(), want)
    out4 = torch.zeros(4, 4, dtype=torch.bool)
    run(special, f"pv_{pred}", f32(x).view(-1, 4), out4, threads=4)
    np.testing.assert_array_equal(out4.numpy().ravel(), want)


@pytest.mark.parametrize("k, expr", list(enumerate(SPECIAL_EXPRS)))
def test_special_values(special, k, expr):
    x = SPECIALS
    out = torch.zeros(len(x))
    run(special, f"e{k}", f32(x), out, threads=len(x))
    want = SPECIAL_EXPRS[expr](x.astype(np.float64)).astype(np.float32)
    got = out.numpy()
    np.testing.assert_array_equal(got, want, err_msg=expr)
    if not expr.startswith(("saturate", "clamp", "max", "min")):  # IEEE leaves max(-0, +0) open
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want), err_msg=f"{expr}: sign of zero")


def test_geometry(special):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(16, 4)).astype(np.float32)
    b = rng.normal(size=(16, 4)).astype(np.float32)
    out = torch.zeros(16 * 8)
    run(special, "geometry", f32(a), f32(b), out, threads=16)
    got = out.numpy().reshape(16, 8)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = np.column_stack([
        (a64 * b64).sum(1), np.linalg.norm(a64, axis=1), np.linalg.norm(a64[:, :3] - b64[:, :3], axis=1),
        (a64[:, :2] ** 2).sum(1), np.cross(a64[:, :3], b64[:, :3]), a64[:, 3] / np.linalg.norm(a64, axis=1)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_select_all_any(special):
    a = np.array([[-1, -2, -3, -4], [1, -2, 3, -4], [1, 2, 3, 4], [np.nan, 1, -1, 2]], dtype=np.float32)
    out = torch.zeros(4 * 6, dtype=torch.int32)
    run(special, "relational", f32(a), out, threads=4)
    neg = a < 0
    want = np.column_stack([neg.all(1), neg.any(1), [1, 1, 1, 0], np.isnan(a).any(1),
                            (neg * np.arange(1, 5)).sum(1), np.where(neg[:, 0], 20, 10)])
    np.testing.assert_array_equal(out.numpy().reshape(4, 6), want)


# ---------------------------------------------------------------------------------------
# Vector types: layout, constructors, swizzles, operators
# ---------------------------------------------------------------------------------------
SIZES = {  # type -> (sizeof, alignof) as in Metal
    "float2": (8, 8), "float3": (16, 16), "float4": (16, 16), "half2": (4, 4), "half3": (8, 8),
    "half4": (8, 8), "bfloat4": (8, 8), "int3": (16, 16), "uint2": (8, 8), "short3": (8, 8),
    "ushort4": (8, 8), "char3": (4, 4), "uchar4": (4, 4), "bool3": (4, 4), "long3": (32, 32),
    "ulong2": (16, 16), "packed_float3": (12, 4), "packed_half3": (6, 2), "packed_int2": (8, 4),
    "packed_uint4": (16, 4), "half": (2, 2), "bfloat": (2, 2), "ulong": (8, 8), "size_t": (8, 8),
}

# (expression producing a float4, expected value)
VECTOR_EXPRS = [
    ("float4(1.0f, 2.0f, float2(3, 4))", [1, 2, 3, 4]),
    ("float4(float2(1, 2), float2(3, 4))", [1, 2, 3, 4]),
    ("float4(1, float3(2, 3, 4))", [1, 2, 3, 4]),
    ("float4(7.5f)", [7.5] * 4),
    ("float4()", [0, 0, 0, 0]),
    ("float4(int4(-1, 2, 3, 4)) * 0.5f", [-0.5, 1, 1.5, 2]),
    ("float4(int4(float4(1.7f, -1.7f, 2.5f, -0.5f)))", [1, -1, 2, 0]),
    ("float4(bool4(int4(0, 1, 2, 0)))", [0, 1, 1, 0]),
    ("v.wzyx", [4, 3, 2, 1]),
    ("v.xxyy", [1, 1, 2, 2]),
    ("v.abgr", [4, 3, 2, 1]),
    ("float4(v.zw, v.rg)", [3, 4, 1, 2]),
    ("float4(v.zyx, v.w)", [3, 2, 1, 4]),
    ("float4(float3(v.xyz).zzx, 0.0f)", [3, 3, 1, 0]),
    ("float4(v.x, v.g, v[2], v.a)", [1, 2, 3, 4]),
    ("[&] { float4 m = v; m.xy = m.yx; return m; }()", [2, 1, 3, 4]),
    ("[&] { float4 m = v; m.zw = v.xy; return m; }()", [1, 2, 1, 2]),
    ("[&] { float4 m = v; m.rgb = float3(9); return m; }()", [9, 9, 9, 4]),
    ("[&] { float4 m = v; const float4 c = v * 2.0f; m.wx = c.wx; return m; }()", [2, 2, 3, 8]),
    ("[&] { float4 m = v; m.x += 10; m.yz *= 2.0f; m[3] = -1; return m; }()", [11, 4, 6, -1]),
    ("[&] { float4 m = v; m.xz -= float2(1, 2); m++; return m; }()", [1, 3, 2, 5]),
    ("[&] { packed_float3 p = v.xyz; float3 q = p; return float4(q + 1.0f, float(sizeof(p))); }()",
     [2, 3, 4, 12]),
    ("2.0f * v - v / 2.0f + 1", [2.5, 4, 5.5, 7]),
    ("-v.yxwz", [-2, -1, -4, -3]),
    ("float4(v < 2.5f)", [1, 1, 0, 0]),
    ("float4(v == float4(1, 0, 3, 0))", [1, 0, 1, 0]),
    ("float4(!(v > 1.0f) || v == 4.0f)", [1, 0, 0, 1]),
    ("float4(int4(7, -7, 9, 12) % 4)", [3, -3, 1, 0]),
    ("float4(int4(1) << int4(0, 1, 4, 33))", [1, 2, 16, 2]),  # shift count modulo 32
    ("float4(int4(-8, 8, -1, 7) >> 1)", [-4, 4, -1, 3]),
    ("float4(uint4(0xffffffffu, 1u, 2u, 3u) + 1u)", [0, 2, 3, 4]),
    ("float4(uchar4(250, 6, 255, 0) + uchar4(10))", [4, 16, 9, 10]),
    ("float4(ushort4(65535, 2, 300, 1) * ushort4(65535, 2, 300, 1))", [1, 4, 24464, 1]),
    ("float4(int4(5, 6, 7, 8) & 6 | 1 ^ int4(1, 0, 0, 0))", [4, 7, 7, 1]),
    ("float4(half4(1.0h, 0.5h, 2049.0h, -0.0h))", [1, 0.5, 2048, 0]),
    ("float4(bfloat4(1.0f, 3.0f, 257.0f, 1e-3f)) * 1000.0f", [1000, 3000, 256000, 0.99945068359375]),
]


def _vector_source() -> str:
    sizes = "".join(f"out[{2 * k}] = int(sizeof({t})); out[{2 * k + 1}] = int(alignof({t}));\n"
                    for k, t in enumerate(SIZES))
    exprs = "".join(f"out[{k}] = {e};\n" for k, (e, _) in enumerate(VECTOR_EXPRS))
    return (PRELUDE
            + kernel("sizes", ["device int* out"], "if (i != 0) return;\n" + sizes)
            + kernel("exprs", ["device float4* out"], "if (i != 0) return;\nconst float4 v = float4(1, 2, 3, 4);\n"
                     + exprs))


@pytest.fixture(scope="module")
def vectors():
    return compile_shader(_vector_source())


def test_sizeof_alignof(vectors):
    out = torch.zeros(2 * len(SIZES), dtype=torch.int32)
    run(vectors, "sizes", out, threads=1)
    got = dict(zip(SIZES, out.view(-1, 2).tolist()))
    assert got == {t: list(v) for t, v in SIZES.items()}


def test_constructors_swizzles_operators(vectors):
    out = torch.zeros(len(VECTOR_EXPRS), 4)
    run(vectors, "exprs", out, threads=1)
    for k, (expr, want) in enumerate(VECTOR_EXPRS):
        np.testing.assert_allclose(out[k].numpy(), np.float32(want), rtol=1e-7, err_msg=expr)


# ---------------------------------------------------------------------------------------
# half / bfloat conversions and arithmetic against torch; as_type against NumPy views
# ---------------------------------------------------------------------------------------
def _conversion_source() -> str:
    k = [PRELUDE]
    k.append(kernel("to_half", ["device const float* x", "device half* out"], "out[i] = half(x[i]);"))
    k.append(kernel("to_bfloat", ["device const float* x", "device bfloat* out"], "out[i] = bfloat(x[i]);"))
    k.append(kernel("from_half", ["device const half* x", "device float* out"], "out[i] = x[i];"))
    k.append(kernel("from_bfloat", ["device const bfloat* x", "device float* out"], "out[i] = x[i];"))
    for op in "+-*/":
        name = {"+": "add", "-": "sub", "*": "mul", "/": "div"}[op]
        k.append(kernel(f"h_{name}", ["device const half* a", "device const half* b", "device half* out"],
                        f"out[i] = a[i] {op} b[i];"))
        k.append(kernel(f"b_{name}", ["device const bfloat* a", "device const bfloat* b", "device bfloat* out"],
                        f"out[i] = a[i] {op} b[i];"))
        k.append(kernel(f"h4_{name}", ["device const half4* a", "device const half4* b", "device half4* out"],
                        f"out[i] = a[i] {op} b[i];"))
        k.append(kernel(f"b4_{name}", ["device const bfloat4* a", "device const bfloat4* b",
                                       "device bfloat4* out"], f"out[i] = a[i] {op} b[i];"))
    k.append(kernel("as_uint", ["device const float* x", "device uint* out"], "out[i] = as_type<uint>(x[i]);"))
    k.append(kernel("as_float", ["device const uint* x", "device float* out"], "out[i] = as_type<float>(x[i]);"))
    k.append(kernel("as_half2", ["device const uint* x", "device half2* out"], "out[i] = as_type<half2>(x[i]);"))
    k.append(kernel("as_uchar4", ["device const float* x", "device uchar4* out"],
                    "out[i] = as_type<uchar4>(x[i]);"))
    k.append(kernel("as_ushort_bf", ["device const bfloat* x", "device ushort* out"],
                    "out[i] = as_type<ushort>(x[i]);"))
    k.append(kernel("as_int2_swz", ["device const float4* x", "device int2* out"],
                    "out[i] = as_type<int2>(x[i].wy);"))
    return "".join(k)


@pytest.fixture(scope="module")
def conv():
    return compile_shader(_conversion_source())


def _rounding_inputs() -> np.ndarray:
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, size=2048, dtype=np.uint64).astype(np.uint32)
    rand = bits.view(np.float32)
    rand = rand[np.isfinite(rand)]
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65520.0, 65519.99, 70000.0, 1e-8, 6e-8, 3e-8,
                         2.0**-24, 2.0**-25, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8,
                         3.3895314e38, 3.4e38, 1e-40, -1e-45], dtype=np.float32)
    scaled = (rng.normal(size=1024) * np.exp2(rng.integers(-30, 30, size=1024))).astype(np.float32)
    return np.concatenate([specials, rand, scaled])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float_to_half_bfloat_rounding_matches_torch(conv, dtype):
    x = torch.tensor(_rounding_inputs())
    out = torch.zeros(x.numel(), dtype=dtype)
    run(conv, "to_half" if dtype == torch.float16 else "to_bfloat", x, out, threads=x.numel())
    want = x.to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_bfloat_to_float_is_exact(conv, dtype):
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    out = torch.zeros(x.numel())
    run(conv, "from_half" if dtype == torch.float16 else "from_bfloat", x, out, threads=x.numel())
    want = x.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32))


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 4])
def test_half_bfloat_arithmetic_matches_torch(conv, op, dtype, width):
    """One operation: computed in float, rounded once to nearest even, as torch does on CPU."""
    rng = np.random.default_rng(2)
    n = 512
    a = torch.tensor(rng.normal(size=n) * 100, dtype=torch.float32).to(dtype)
    b = torch.tensor(rng.normal(size=n) * 3, dtype=torch.float32).to(dtype)
    out = torch.zeros(n, dtype=dtype)
    prefix = ("h" if dtype == torch.float16 else "b") + ("4" if width == 4 else "")
    shape = (-1, 4) if width == 4 else (-1,)
    run(conv, f"{prefix}_{op}", a.view(shape), b.view(shape), out.view(shape), threads=n // width)
    want = {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b}[op]
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_as_type_matches_numpy_views(conv):
    x = _rounding_inputs()[:256]
    n = len(x)
    u = torch.zeros(n, dtype=torch.int32)
    run(conv, "as_uint", f32(x), u, threads=n)
    np.testing.assert_array_equal(u.numpy().view(np.uint32), x.view(np.uint32))
    f = torch.zeros(n)
    run(conv, "as_float", torch.tensor(x.view(np.int32)), f, threads=n)
    np.testing.assert_array_equal(f.numpy().view(np.uint32), x.view(np.uint32))
    h = torch.zeros(n, 2, dtype=torch.float16)
    run(conv, "as_half2", torch.tensor(x.view(np.int32)), h, threads=n)
    np.testing.assert_array_equal(h.numpy().view(np.uint16).ravel(), x.view(np.uint16))
    c = torch.zeros(n, 4, dtype=torch.uint8)
    run(conv, "as_uchar4", f32(x), c, threads=n)
    np.testing.assert_array_equal(c.numpy().ravel(), x.view(np.uint8))
    bf = torch.tensor(x).to(torch.bfloat16)
    s = torch.zeros(n, dtype=torch.int16)
    run(conv, "as_ushort_bf", bf, s, threads=n)
    np.testing.assert_array_equal(s.numpy(), bf.view(torch.int16).numpy())
    x4 = x.reshape(-1, 4)
    i2 = torch.zeros(n // 4, 2, dtype=torch.int32)
    run(conv, "as_int2_swz", f32(x4), i2, threads=n // 4)
    np.testing.assert_array_equal(i2.numpy(), x4[:, [3, 1]].view(np.int32))


# ---------------------------------------------------------------------------------------
# Integer functions against Python ints
# ---------------------------------------------------------------------------------------
INT_TYPES = {  # MSL type -> (bits, signed, NumPy dtype, torch storage dtype of the same width)
    "char": (8, True, np.int8, torch.int8),
    "uchar": (8, False, np.uint8, torch.uint8),
    "short": (16, True, np.int16, torch.int16),
    "ushort": (16, False, np.uint16, torch.int16),
    "int": (32, True, np.int32, torch.int32),
    "uint": (32, False, np.uint32, torch.int32),
    "long": (64, True, np.int64, torch.int64),
    "ulong": (64, False, np.uint64, torch.int64),
}


def _wrap(v: int, bits: int, signed: bool) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if signed and v >> (bits - 1) else v


def _limits(bits: int, signed: bool):
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


def _sat(v: int, bits: int, signed: bool) -> int:
    lo, hi = _limits(bits, signed)
    return min(max(v, lo), hi)


def _rev(v: int, bits: int, signed: bool) -> int:
    return _wrap(int(format(v & ((1 << bits) - 1), f"0{bits}b")[::-1], 2), bits, signed)


def _rot(v: int, s: int, bits: int, signed: bool) -> int:
    u, s = v & ((1 << bits) - 1), (s & ((1 << bits) - 1)) % bits
    return _wrap((u << s) | (u >> (bits - s)), bits, signed)


def _extract(v: int, off: int, n: int, bits: int, signed: bool) -> int:
    field = (v >> off) & ((1 << n) - 1)
    return _wrap(field, n, signed) if signed else field


def _insert(base: int, ins: int, off: int, n: int, bits: int, signed: bool) -> int:
    mask = ((1 << n) - 1) << off
    return _wrap((base & ~mask) | ((ins << off) & mask), bits, signed)


# name -> (arity, reference(args..., bits, signed))
INT_FUNCS = {
    "popcount": (1, lambda x, b, s: bin(x & ((1 << b) - 1)).count("1")),
    "clz": (1, lambda x, b, s: b - (x & ((1 << b) - 1)).bit_length()),
    "ctz": (1, lambda x, b, s: b if x & ((1 << b) - 1) == 0 else ((x & -x).bit_length() - 1)),
    "reverse_bits": (1, _rev),
    "abs": (1, lambda x, b, s: _wrap(abs(x), b, s)),
    "absdiff": (2, lambda x, y, b, s: abs(x - y)),  # unsigned result
    "addsat": (2, lambda x, y, b, s: _sat(x + y, b, s)),
    "subsat": (2, lambda x, y, b, s: _sat(x - y, b, s)),
    "hadd": (2, lambda x, y, b, s: (x + y) >> 1),
    "rhadd": (2, lambda x, y, b, s: (x + y + 1) >> 1),
    "mulhi": (2, lambda x, y, b, s: _wrap((x * y) >> b, b, s)),
    "rotate": (2, _rot),
    "min": (2, lambda x, y, b, s: min(x, y)),
    "max": (2, lambda x, y, b, s: max(x, y)),
    "clamp": (3, lambda x, lo, hi, b, s: min(max(x, lo), hi)),
    "madsat": (3, lambda x, y, z, b, s: _sat(x * y + z, b, s)),
    "madhi": (3, lambda x, y, z, b, s: _wrap(((x * y) >> b) + z, b, s)),
    "extract_bits(x, 3u, 5u)": (1, lambda x, b, s: _extract(x, 3, 5, b, s)),
    "extract_bits(x, 0u, 0u)": (1, lambda x, b, s: 0),
    "insert_bits(x, y, 3u, 5u)": (2, lambda x, y, b, s: _insert(x, y, 3, 5, b, s)),
}


def _int_kernel_name(fn: str, t: str) -> str:
    return "i_" + "".join(c if c.isalnum() else "_" for c in fn) + "_" + t


def _integer_source() -> str:
    src = [PRELUDE]
    for t in INT_TYPES:
        for fn, (arity, _) in INT_FUNCS.items():
            names = "xyz"[:arity]
            params = [f"device const {t}* {a}s" for a in names]
            out_t = ("u" + t if not t.startswith("u") else t) if fn == "absdiff" else t
            decl = " ".join(f"{t} {a} = {a}s[i];" for a in names)
            call = fn if "(" in fn else f"{fn}({', '.join(names)})"
            src.append(kernel(_int_kernel_name(fn, t), params + [f"device {out_t}* out"],
                              f"{decl} out[i] = {call};"))
    src.append(kernel("i_vec", ["device const int4* x", "device const int4* y", "device int4* out"], """
        out[i * 4 + 0] = int4(popcount(x[i]));
        out[i * 4 + 1] = clamp(x[i], -5, 5);
        out[i * 4 + 2] = int4(absdiff(x[i], y[i]));
        out[i * 4 + 3] = min(max(x[i], y[i].wzyx), 100);"""))
    return "".join(src)


@pytest.fixture(scope="module")
def ints():
    return compile_shader(_integer_source())


def _int_inputs(bits: int, signed: bool, n: int, seed: int):
    lo, hi = _limits(bits, signed)
    rng = np.random.default_rng(seed)
    edge = [lo, hi, 0, 1, lo + 1, hi - 1, 2, 3, 5, 6, hi // 2, hi // 3] + ([-1, -2, -3] if signed else [])
    rand = [int(v) for v in rng.integers(lo, hi, size=n - len(edge), endpoint=True, dtype=np.int64 if bits < 64
                                         else (np.int64 if signed else np.uint64))]
    return edge + rand


@pytest.mark.parametrize("t", list(INT_TYPES))
@pytest.mark.parametrize("fn", list(INT_FUNCS))
def test_integer_functions(ints, fn, t):
    bits, signed, npdt, tdt = INT_TYPES[t]
    arity, ref = INT_FUNCS[fn]
    n = 64
    args = [_int_inputs(bits, signed, n, seed) for seed in range(arity)]
    if fn == "clamp":  # Metal leaves lo > hi undefined
        args[1], args[2] = ([min(a, b) for a, b in zip(args[1], args[2])],
                            [max(a, b) for a, b in zip(args[1], args[2])])
    if fn == "rotate":
        args[1] = [v % (2 * bits) if not signed else v % (2 * bits) - bits for v in args[1]]
    tensors = [torch.from_numpy(np.array(a, dtype=npdt).view(np.dtype(str(tdt).replace("torch.", ""))))
               for a in args]
    out = torch.zeros(n, dtype=tdt)
    run(ints, _int_kernel_name(fn, t), *tensors, out, threads=n)
    out_dt = np.dtype(npdt).str.replace("i", "u") if fn == "absdiff" else npdt
    got = [int(v) for v in out.numpy().view(out_dt)]
    want = [ref(*vals, bits, signed) for vals in zip(*args)]
    bad = [(vals, g, w) for vals, g, w in zip(zip(*args), got, want) if g != w]
    assert not bad, f"{fn}({t}): first mismatches (args, got, want): {bad[:5]}"


def test_integer_vector_functions(ints):
    x = np.array([[0, -1, 7, 1 << 30], [-200, 3, 4, 5], [2, 4, 8, 16], [-7, 0, 300, -300]], dtype=np.int32)
    y = np.array([[1, 1, -7, 0], [5, -5, 9, 9], [0, 0, 0, 0], [1000, -1000, 3, -3]], dtype=np.int32)
    out = torch.zeros(4, 4, 4, dtype=torch.int32)
    run(ints, "i_vec", torch.from_numpy(x), torch.from_numpy(y), out.view(-1, 4), threads=4)
    got = out.numpy()
    popc = np.vectorize(lambda v: bin(int(v) & 0xFFFFFFFF).count("1"))(x)
    np.testing.assert_array_equal(got[:, 0], popc)
    np.testing.assert_array_equal(got[:, 1], np.clip(x, -5, 5))
    np.testing.assert_array_equal(got[:, 2], np.abs(x.astype(np.int64) - y).astype(np.uint32).view(np.int32))
    np.testing.assert_array_equal(got[:, 3], np.minimum(np.maximum(x, y[:, ::-1]), 100))


# ---------------------------------------------------------------------------------------
# Constants and numeric_limits
# ---------------------------------------------------------------------------------------
F32 = np.finfo(np.float32)
F16 = np.finfo(np.float16)
FLOAT_CONSTANTS = {
    "MAXFLOAT": F32.max, "FLT_MAX": F32.max, "FLT_MIN": F32.tiny, "FLT_EPSILON": F32.eps,
    "HUGE_VALF": np.inf, "INFINITY": np.inf, "float(HALF_MAX)": F16.max, "float(HALF_MIN)": F16.tiny,
    "float(HALF_EPSILON)": F16.eps, "M_PI_F": math.pi, "M_PI_2_F": math.pi / 2, "M_PI_4_F": math.pi / 4,
    "M_1_PI_F": 1 / math.pi, "M_2_PI_F": 2 / math.pi, "M_E_F": math.e, "M_LN2_F": math.log(2),
    "M_LN10_F": math.log(10), "M_LOG2E_F": math.log2(math.e), "M_LOG10E_F": math.log10(math.e),
    "M_SQRT2_F": math.sqrt(2), "M_SQRT1_2_F": math.sqrt(0.5), "M_2_SQRTPI_F": 2 / math.sqrt(math.pi),
    "float(M_PI_H)": float(np.float16(math.pi)),
    "numeric_limits<float>::max()": F32.max, "numeric_limits<float>::min()": F32.tiny,
    "numeric_limits<float>::lowest()": -F32.max, "numeric_limits<float>::epsilon()": F32.eps,
    "numeric_limits<float>::infinity()": np.inf,
    "float(numeric_limits<half>::max())": F16.max, "float(numeric_limits<half>::min())": F16.tiny,
    "float(numeric_limits<half>::lowest())": -F16.max, "float(numeric_limits<half>::epsilon())": F16.eps,
    "float(numeric_limits<half>::infinity())": np.inf,
    "float(numeric_limits<bfloat>::max())": float(torch.finfo(torch.bfloat16).max),
    "float(numeric_limits<bfloat>::min())": float(torch.finfo(torch.bfloat16).tiny),
    "float(numeric_limits<bfloat>::lowest())": -float(torch.finfo(torch.bfloat16).max),
    "float(numeric_limits<bfloat>::epsilon())": float(torch.finfo(torch.bfloat16).eps),
}
INT_CONSTANTS = {
    "INT_MAX": 2**31 - 1, "INT_MIN": -(2**31), "UINT_MAX": 2**32 - 1, "CHAR_BIT": 8, "SCHAR_MAX": 127,
    "SCHAR_MIN": -128, "UCHAR_MAX": 255, "CHAR_MAX": 127, "CHAR_MIN": -128, "SHRT_MAX": 32767,
    "SHRT_MIN": -32768, "USHRT_MAX": 65535, "LONG_MAX": 2**63 - 1, "LONG_MIN": -(2**63),
}
for _t, (_bits, _signed, _, _) in INT_TYPES.items():
    _lo, _hi = _limits(_bits, _signed)
    INT_CONSTANTS[f"numeric_limits<{_t}>::min()"] = _lo
    INT_CONSTANTS[f"numeric_limits<{_t}>::max()"] = _hi


@pytest.fixture(scope="module")
def consts():
    fl = "".join(f"out[{k}] = {c};\n" for k, c in enumerate(FLOAT_CONSTANTS))
    il = "".join(f"out[{k}] = (long)({c});\n" for k, c in enumerate(INT_CONSTANTS))
    return compile_shader(PRELUDE + kernel("floats", ["device float* out"], "if (i) return;\n" + fl)
                          + kernel("ints", ["device long* out"], "if (i) return;\n" + il)
                          + kernel("ulong_max", ["device ulong* out"],
                                   "out[i] = ULONG_MAX - numeric_limits<ulong>::max();"))


def test_float_constants(consts):
    out = torch.zeros(len(FLOAT_CONSTANTS))
    run(consts, "floats", out, threads=1)
    for (name, want), got in zip(FLOAT_CONSTANTS.items(), out.tolist()):
        assert got == np.float32(want), name


def test_integer_constants(consts):
    out = torch.zeros(len(INT_CONSTANTS), dtype=torch.int64)
    run(consts, "ints", out, threads=1)
    got = {name: _wrap(v, 64, True) for name, v in zip(INT_CONSTANTS, out.tolist())}
    want = {name: _wrap(v, 64, True) for name, v in INT_CONSTANTS.items()}  # ulong max wraps to -1
    assert got == want
    z = torch.ones(1, dtype=torch.int64)
    run(consts, "ulong_max", z, threads=1)
    assert z.item() == 0


# Vectors in constant expressions, and a vector's numeric_limits (its element type's, broadcast):
# PyTorch's c10 reads `constexpr auto inf = numeric_limits<T>::infinity().x` with T = float2.
CONSTEXPR_VECTORS = PRELUDE + """
template <typename T> float first_infinity() { constexpr auto inf = numeric_limits<T>::infinity().x; return inf; }
constexpr constant float4 coeffs = float4(float2(1.0f, 2.0f), 3.0f, 4.0f);
""" + kernel("constexpr_vectors", ["device float* out"], """
  if (i) return;
  constexpr float3 t = {5.0f, 6.0f};
  constexpr float picked = coeffs.w + coeffs[1] + t.y + t.z;  // 4 + 2 + 6 + 0
  static_assert(picked == 12.0f, "a constant expression");
  out[0] = first_infinity<float2>();
  out[1] = picked;
  out[2] = float(numeric_limits<half4>::max().w);
  out[3] = float(numeric_limits<int2>::lowest().y);
  out[4] = numeric_limits<float3>::epsilon().z;
  out[5] = numeric_limits<uint2>::is_integer && !numeric_limits<float2>::is_integer ? 1.0f : 0.0f;
  out[6] = isnan(numeric_limits<float4>::quiet_NaN().y) ? 1.0f : 0.0f;
  out[7] = float(numeric_limits<bfloat2>::lowest().x);""")


@pytest.mark.parametrize("sanitize", [False, True])
def test_vectors_in_constant_expressions_and_their_limits(sanitize):
    lib = compile_shader(CONSTEXPR_VECTORS, sanitize=sanitize)
    out = torch.zeros(8)
    run(lib, "constexpr_vectors", out, threads=1)
    np.testing.assert_array_equal(out.numpy(), np.array(
        [np.inf, 12.0, F16.max, -(2.0**31), F32.eps, 1.0, 1.0, -float(torch.finfo(torch.bfloat16).max)], np.float32))


# ---------------------------------------------------------------------------------------
# The generated swizzle table is up to date with its generator
# ---------------------------------------------------------------------------------------
def test_swizzles_inc_is_generated():
    root = Path(__file__).resolve().parents[2] / "csrc" / "emulator"
    spec = importlib.util.spec_from_file_location("gen_swizzles", root / "tools" / "gen_swizzles.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = (root / "include" / "tsm_emu" / "swizzles.inc").read_text()
    assert text == gen.render(), "run python csrc/emulator/tools/gen_swizzles.py"
    assert sum(line.startswith("TSM_SWZ(") for line in text.splitlines()) == (4 + 8 + 16) + (9 + 27 + 81) + (16 + 64 + 256)


# ---------------------------------------------------------------------------------------
# Unsuffixed floating literals, and the single-precision fast:: and precise:: variants
# ---------------------------------------------------------------------------------------
LITERALS = PRELUDE + kernel(
    "literals", ["device const float* x", "device float* y", "device float* thirds", "device int* sizes"], """
  y[i] = x[i] * 0.1;         // a float product in Metal, not a double one rounded
  auto third = 1.0 / 3.0;
  thirds[i] = third * x[i];
  if (i == 0) { sizes[0] = sizeof(1.0); sizes[1] = sizeof(third); sizes[2] = sizeof(2.5e-3 * x[i]); }""") + kernel(
    "single_variants", ["device const half* h", "device const bfloat* b", "device float* angle", "device int* sizes"], """
  float a = ::precise::atan2(h[i], 1.0 + h[i]);  // UnaryKernel.metal: the float overload, h converted
  angle[i] = a + fast::sqrt(int(i)) + precise::sqrt(b[i]);  // FusedOptimizerOps: sqrt of a bfloat
  if (i == 0) { auto e = precise::exp(h[i]); sizes[0] = sizeof(e); }""")


@pytest.mark.parametrize("sanitize", [False, True])
def test_an_unsuffixed_floating_literal_is_a_float(sanitize):
    lib = compile_shader(LITERALS, sanitize=sanitize)
    # values where x * 0.1 in float differs from x * 0.1 in double rounded to float
    x = np.array([2.5900002, 4.07, 5.1800003, 8.14, 9.99], dtype=np.float32)
    y, thirds = torch.zeros(5), torch.zeros(5)
    sizes = torch.zeros(3, dtype=torch.int32)
    run(lib, "literals", torch.from_numpy(x), y, thirds, sizes, threads=5)
    np.testing.assert_array_equal(y.numpy(), x * np.float32(0.1))
    assert (y.numpy() != (x.astype(np.float64) * 0.1).astype(np.float32)).all()
    np.testing.assert_array_equal(thirds.numpy(), np.float32(1 / 3) * x)
    assert sizes.tolist() == [4, 4, 4]
    h = torch.tensor([0.5, -0.25, 2.0], dtype=torch.float16)
    b = torch.tensor([4.0, 0.25, 9.0], dtype=torch.bfloat16)
    angle = torch.zeros(3)
    run(lib, "single_variants", h, b, angle, sizes, threads=3)
    hf = h.float().numpy()
    np.testing.assert_allclose(angle.numpy(), np.arctan2(hf, 1 + hf) + np.sqrt(np.arange(3)) + [2, 0.5, 3], rtol=1e-6)
    assert sizes[0] == 4  # precise::exp of a half is a float


def test_fast_and_precise_have_no_half_vector_variant():
    with pytest.raises(MetalCompileError, match="exp"):
        compile_shader(PRELUDE + kernel("k", ["device half2* h"], "h[i] = precise::exp(h[i]);"))
