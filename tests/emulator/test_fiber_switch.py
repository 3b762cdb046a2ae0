"""Both ways of switching between Metal threads give the same results: the user-space
switch (x86-64 and AArch64) and the ucontext one (Linux: other architectures, or
TSM_EMU_UCONTEXT=1; macOS has none, so there both runs use the user-space switch). The
AArch64 switch itself runs in test_aarch64_qemu.py."""
import json
import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(r'''
    import json, torch
    from torch_sparse_metal.emulator import compile_shader
    lib = compile_shader("""
    #include <metal_stdlib>
    using namespace metal;
    kernel void k(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                  uint gid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]]) {
      threadgroup float t[64];
      t[lid] = x[gid];
      threadgroup_barrier(mem_flags::mem_threadgroup);
      float s = simd_sum(t[63 - lid]);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      out[gid] = s + t[lid ^ 1u] * 0.5f + fma(x[gid], 2.0f, 1.0f);
    }
    """)
    x = torch.arange(256, dtype=torch.float32) / 7
    out = torch.zeros(256)
    lib.k(x, out, threads=256, group_size=64)
    print(json.dumps(out.tolist()))
''')


def run(env_extra):
    env = dict(os.environ, **env_extra)
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    return json.loads(done.stdout)


def test_ucontext_and_user_space_switch_agree():
    default = run({})
    portable = run({"TSM_EMU_UCONTEXT": "1"})
    assert default == portable
    # and both are right: lanes sum mirrored values of their SIMD-group
    import numpy as np
    x = np.arange(256, dtype=np.float32) / 7
    g = x.reshape(4, 64)
    mirrored = g[:, ::-1]
    sums = np.repeat(mirrored.reshape(4, 2, 32).sum(axis=2), 32, axis=1).reshape(-1)
    neighbour = g[:, np.arange(64) ^ 1].reshape(-1)
    expected = sums + neighbour * 0.5 + (x * 2 + 1)
    np.testing.assert_allclose(default, expected, rtol=1e-5)
