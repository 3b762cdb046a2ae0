"""Every kernel of shaders/ passes the Metal check under every language version the Metal
launcher may choose (MSL 3.1 on macOS 14, 3.2 on 15, 4.0 on 26), and translates for the
emulator under each. The rest of the suite runs them built with the default version."""
import pytest

from torch_sparse_metal._paths import SHADERS_DIR
from torch_sparse_metal.emulator import LAUNCHER_LANGUAGE_VERSIONS, _compiler

SHADERS = sorted(p.relative_to(SHADERS_DIR).as_posix() for p in SHADERS_DIR.rglob("*.metal"))


@pytest.mark.parametrize("version", LAUNCHER_LANGUAGE_VERSIONS)
@pytest.mark.parametrize("shader", SHADERS)
def test_shader_passes_the_metal_check(shader, version):
    translated = _compiler.generated_cxx(SHADERS_DIR / shader, language_version=version)
    assert translated.kernels
    if "matmul" in shader:  # bfloat kernels exist from MSL 3.1, which every launcher version has
        assert any("bfloat" in k.host_name for k in translated.kernels)
