"""tools/check_macos_build.py: its stub parsing and symbol resolution on synthetic inputs
(everywhere), and the whole check against a real macOS SDK when ``TSM_MACOS_SDK`` names
one (it needs clang and llvm-nm then; CI has no SDK and skips it)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "check_macos_build.py"
SDK = os.environ.get("TSM_MACOS_SDK")


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("check_macos_build", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TBD_DEMO = """--- !tapi-tbd
tbd-version:     4
targets:         [ x86_64-macos, arm64-macos,
                   arm64e-macos ]
install-name:    '/usr/lib/libDemo.dylib'
reexported-libraries:
  - targets:         [ x86_64-macos, arm64-macos ]
    libraries:       [ '/usr/lib/system/libpart.dylib' ]
exports:
  - targets:         [ x86_64-macos ]
    symbols:         [ _only_intel ]
  - targets:         [ x86_64-macos, arm64-macos ]
    symbols:         [ _both, 'R8289209$_close',
                       _both_too ]
    objc-classes:    [ DemoObject ]
    weak-symbols:    [ __ZTISt9exception ]
undefineds:
  - targets:         [ arm64-macos ]
    symbols:         [ _needed_from_elsewhere ]
"""
TBD_PART = """--- !tapi-tbd
tbd-version:     4
targets:         [ arm64-macos ]
install-name:    '/usr/lib/system/libpart.dylib'
exports:
  - targets:         [ arm64-macos ]
    symbols:         [ _from_part ]
...
"""
TBD_V4 = TBD_DEMO + TBD_PART  # one file may hold a library and those it re-exports


def test_tbd_v4_per_target_with_objc_classes_and_reexports(tool):
    demo, part = tool.parse_tbd(TBD_V4, "arm64-apple-macos14")
    assert demo.install_name == "/usr/lib/libDemo.dylib"
    assert demo.symbols == {"_both", "R8289209$_close", "_both_too", "__ZTISt9exception",
                            "_OBJC_CLASS_$_DemoObject", "_OBJC_METACLASS_$_DemoObject"}
    assert demo.reexports == ["/usr/lib/system/libpart.dylib"]
    assert (part.install_name, part.symbols) == ("/usr/lib/system/libpart.dylib", {"_from_part"})
    intel, _ = tool.parse_tbd(TBD_V4, "x86_64-apple-macos11")
    assert "_only_intel" in intel.symbols and "_needed_from_elsewhere" not in intel.symbols


def test_tbd_v5_json(tool):
    text = json.dumps({
        "tapi_tbd_version": 5,
        "main_library": {
            "target_info": [{"target": "arm64-macos"}, {"target": "x86_64-macos"}],
            "install_names": [{"name": "/System/Library/Frameworks/Demo.framework/Demo"}],
            "reexported_libraries": [{"names": ["/usr/lib/libother.dylib"]}],
            "exported_symbols": [
                {"text": {"global": ["_f"], "weak": ["_w"]}, "data": {"objc_class": ["K"]}},
                {"targets": ["x86_64-macos"], "text": {"global": ["_intel_only"]}}],
            "undefined_symbols": [{"text": {"global": ["_undef"]}}],
        }})
    (demo,) = tool.parse_tbd(text, "arm64-apple-macos14")
    assert demo.symbols == {"_f", "_w", "_OBJC_CLASS_$_K", "_OBJC_METACLASS_$_K"}
    assert demo.reexports == ["/usr/lib/libother.dylib"]


def test_sdk_stubs_follow_reexports_and_report_missing_stubs(tool, tmp_path):
    (tmp_path / "usr/lib/system").mkdir(parents=True)
    (tmp_path / "usr/lib/libDemo.tbd").write_text(TBD_DEMO)
    stubs = tool.SdkStubs(tmp_path, "arm64-apple-macos14")
    assert stubs.exports(tmp_path / "usr/lib/libDemo.tbd") >= {"_both"}
    assert stubs.missing == ["/usr/lib/system/libpart.dylib"]  # re-exported, stub absent
    (tmp_path / "usr/lib/system/libpart.tbd").write_text(TBD_PART)
    stubs = tool.SdkStubs(tmp_path, "arm64-apple-macos14")
    assert "_from_part" in stubs.exports(tmp_path / "usr/lib/libDemo.tbd")
    assert stubs.missing == []
    assert stubs.exports(tmp_path / "usr/lib/libNope.tbd") is None
    assert stubs.missing == ["usr/lib/libNope.tbd"]


HEADERS = """
FOUNDATION_EXPORT Class _Nullable NSClassFromString(NSString *aClassName);
@interface NSString : NSObject <NSCopying>
// NSNotExported(void) is mentioned in a comment only
"""


@pytest.mark.parametrize("symbol, declared", [
    ("_NSClassFromString", True), ("_OBJC_CLASS_$_NSString", True),
    ("_OBJC_METACLASS_$_NSString", True), ("_OBJC_CLASS_$_NSStr", False),
    ("_NSNotExported", False), ("_NSClass", False)])
def test_header_declarations_stand_in_for_a_missing_stub(tool, symbol, declared):
    assert tool.declared_in_headers(symbol, HEADERS) is declared


def test_symbols_resolve_to_the_first_provider_or_are_reported(tool):
    report = tool.resolve_symbols(
        ["_a", "_b", "_NSClassFromString", "_nowhere", "_a"],
        [("one", {"_a"}), ("two", {"_a", "_b"})],
        [("Foundation.framework", HEADERS)])
    assert report.resolved == {"one": 1, "two": 1,
                               "Foundation.framework (declared in its headers; no .tbd in "
                               "this SDK)": 1}
    assert report.unresolved == ["_nowhere"] and not report.ok


def test_summary_is_one_line_with_the_counts(tool):
    unit = tool.Unit("a.cpp [t]", [], Path("a.o"), ok=True)
    failed = tool.Unit("b.cpp [t]", [], Path("b.o"))
    passed = tool.LinkReport({"libc++": 3}, [], [])
    broken = tool.LinkReport({}, ["_x"], [])
    assert tool.summary_line([unit, failed], [("2.13.0", passed)]) == (
        "check_macos_build: 1 units compiled, 1 failed (b.cpp [t]); link check passed "
        "(3 symbols)")
    assert tool.summary_line([unit], [("2.13.0", None)]).endswith(
        "link check not run (the arm64 launcher did not compile)")
    assert "link check failed (1 unresolved symbols)" in tool.summary_line(
        [unit], [("2.13.0", broken)])
    assert tool.summary_line([unit], [("2.4.1", None), ("2.7.1", passed), ("2.13.0", passed),
                                      ("2.14.1", broken)]) == (
        "check_macos_build: 1 units compiled, 0 failed; link check passed for torch 2.7.1, "
        "2.13.0; link check failed for torch 2.14.1; link check not run for torch 2.4.1")


def _release(tool, version, std="-std=c++17"):
    return tool.TorchRelease(version, Path(f"torch-{version}.whl"), Path("."),
                             (std, "-DTORCH_API_INCLUDE_EXTENSION_H", tool.EXTENSION_NAME_FLAG))


def test_each_release_is_one_line(tool):
    release = _release(tool, "2.4.1")
    arm64, intel = (tool.launcher_unit_name(release, t) for t in tool.LAUNCHER_TARGETS)
    assert arm64 == "launcher.mm [torch 2.4.1, arm64-apple-macos14]"
    units = [tool.Unit(arm64, [], Path("a.o"), ok=True), tool.Unit(intel, [], Path("i.o")),
             tool.Unit(tool.launcher_unit_name(_release(tool, "2.5.1"), tool.LINK_TARGET), [],
                       Path("other.o"))]
    assert tool.release_line(release, units, tool.LinkReport({"libc++": 3}, [], [])) == (
        "torch 2.4.1 (-std=c++17): launcher compiled for arm64-apple-macos14, FAILED for "
        "x86_64-apple-macos11; link check passed (3 symbols)")
    units[0].ok = False
    assert tool.release_line(release, units, None) == (
        "torch 2.4.1 (-std=c++17): launcher FAILED for arm64-apple-macos14, "
        "x86_64-apple-macos11; link check not run (the arm64 launcher did not compile)")


# The shape of BuildExtension's standard flag in torch/utils/cpp_extension.py (2.4 to 2.14).
CPP_EXTENSION = """
            self._add_compile_flag(extension, '-DTORCH_API_INCLUDE_EXTENSION_H')
        def append_std17_if_no_std_present(cflags) -> None:
            cpp_format_prefix = '/{}:' if self.compiler.compiler_type == 'msvc' else '-{}='
            cpp_flag_prefix = cpp_format_prefix.format('std')
            cpp_flag = cpp_flag_prefix + 'c++%s'
    common_cflags += ['-std=c++14', '-fPIC']  # the JIT's flags: not what setup.py builds use
"""


@pytest.mark.parametrize("standard", ["17", "20"])
def test_each_releases_standard_comes_from_its_build_extension(tool, standard):
    assert tool.extension_flags(CPP_EXTENSION % standard) == (
        f"-std=c++{standard}", "-DTORCH_API_INCLUDE_EXTENSION_H",
        "-DTORCH_EXTENSION_NAME=_metal_launcher")
    without_define = (CPP_EXTENSION % standard).splitlines()[2:]
    assert "-DTORCH_API_INCLUDE_EXTENSION_H" not in tool.extension_flags("\n".join(without_define))


def test_a_build_extension_without_a_standard_is_refused(tool):
    with pytest.raises(tool.MissingInput, match=r"^torch-9\.0\.0\.whl: .* names no -std= for "
                                                r"BuildExtension's C\+\+ compiles"):
        tool.extension_flags("cflags.append('-std=c++20')", "torch-9.0.0.whl: cpp_extension.py")


def test_release_specs_pick_the_newest_cached_patch(tool, tmp_path):
    for name in ("torch-2.4.0-cp311-none-macosx_11_0_arm64.whl",
                 "torch-2.4.1-cp311-none-macosx_11_0_arm64.whl",
                 "torch-2.1.9-cp311-none-macosx_11_0_arm64.whl",
                 "torch-2.10.0-2-cp311-none-macosx_11_0_arm64.whl",
                 "torch-2.10.1-cp311-none-manylinux_2_28_x86_64.whl"):
        (tmp_path / name).touch()
    assert tool.wheel_version(tmp_path / "torch-2.10.0-2-cp311-none-macosx_11_0_arm64.whl") \
        == "2.10.0"
    picked = {spec: tool.cached_wheel(spec, tmp_path) for spec in
              ("2.4", "2.4.0", "2.1", "2.10", "2.10.1", "2.5")}
    assert {spec: w and tool.wheel_version(w) for spec, w in picked.items()} == {
        "2.4": "2.4.1", "2.4.0": "2.4.0", "2.1": "2.1.9", "2.10": "2.10.0", "2.10.1": None,
        "2.5": None}
    assert tool.pip_requirement("2.4") == "torch==2.4.*"
    assert tool.pip_requirement("2.4.1") == "torch==2.4.1"
    with pytest.raises(tool.MissingInput, match="give X.Y .* or X.Y.Z"):
        tool.torch_wheel("latest", tmp_path)


def _torch_range(text: str, pattern: str) -> str:
    found = re.findall(pattern, text, re.M)
    assert len(found) == 1, found
    return found[0]


def test_requirements_and_pyproject_admit_the_same_torch_on_a_mac():
    """The releases check_macos_build compiled the launcher against: one range, said twice."""
    requirements = _torch_range((REPO / "requirements.txt").read_text(),
                                r'^torch(>=[\d.]+,<[\d.]+);\s*sys_platform != "linux"$')
    pyproject = _torch_range((REPO / "pyproject.toml").read_text(), r'"torch(>=[\d.]+,<[\d.]+)"')
    assert requirements == pyproject


def test_missing_tools_are_named(tool):
    with pytest.raises(tool.MissingInput, match=r"clang\+\+ not found \(tried no-such-clang\+\+\); "
                                                "on Debian: apt-get install clang-19 llvm-19"):
        tool.find_tool("no-such-clang++", tool.CLANG_CANDIDATES, "clang++")


def test_the_frameworks_come_from_setup_py(tool):
    assert tool.linked_frameworks(REPO / "setup.py") == ("Metal", "Foundation")


def test_not_an_sdk_is_refused(tool, tmp_path):
    with pytest.raises(tool.MissingInput, match="is not a macOS SDK"):
        tool.check_sdk(tmp_path)


@pytest.mark.skipif(not SDK, reason="set TSM_MACOS_SDK to a macOS SDK directory to run the "
                                    "macOS build check (needs clang and llvm-nm)")
class TestAgainstTheSdk:
    def _check(self, *args):
        proc = subprocess.run([sys.executable, str(TOOL), "--sdk", SDK, *args],
                              capture_output=True, text=True, cwd=REPO)
        last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert " 0 failed" in last and "link check passed" in last, last
        return proc.stdout

    def test_everything_compiles_and_links(self):
        self._check()

    @pytest.mark.parametrize("end", ["oldest", "newest"])
    def test_both_ends_of_the_torch_range_admitted_on_a_mac_compile_and_link(self, end):
        low, major, minor = re.fullmatch(r">=([\d.]+),<(\d+)\.(\d+)", _torch_range(
            (REPO / "requirements.txt").read_text(),
            r'^torch(>=[\d.]+,<[\d.]+);\s*sys_platform != "linux"$')).groups()
        version = low if end == "oldest" else f"{major}.{int(minor) - 1}"
        out = self._check("--launcher-only", "--torch-versions", version)
        assert re.search(rf"^torch {re.escape(version)}\.\d+ \(-std=c\+\+\d+\): launcher "
                         r"compiled for arm64-apple-macos14, x86_64-apple-macos11; link check "
                         r"passed", out, re.M), out

    def test_the_link_check_catches_a_symbol_nothing_exports(self, tool, tmp_path):
        # A framework setup.py does not link, and a function no library has.
        source = tmp_path / "stray.mm"
        source.write_text("#import <MetalPerformanceShaders/MetalPerformanceShaders.h>\n"
                          "extern \"C\" void tsm_no_such_function(void);\n"
                          "void use(void) { (void)[MPSMatrixDescriptor class]; "
                          "tsm_no_such_function(); }\n")
        clang = tool.find_tool(None, tool.CLANG_CANDIDATES, "clang++")
        nm = tool.find_tool(None, tool.NM_CANDIDATES, "llvm-nm")
        obj = tmp_path / "stray.o"
        subprocess.run([clang, "-target", tool.LINK_TARGET, "-isysroot", SDK, "-fobjc-arc",
                        "-c", str(source), "-o", str(obj)], check=True)
        wheel = tool.torch_wheel(tool.installed_torch_version(), tool.cache_root() / "wheels")
        torch_root = tool.extract_torch(wheel, tool.cache_root() / "wheels")
        report = tool.link_check(obj, nm, Path(SDK), torch_root, ("Metal", "Foundation"))
        assert report.unresolved == ["_OBJC_CLASS_$_MPSMatrixDescriptor",
                                     "_tsm_no_such_function"]
