"""Host-side contract tests of the QKNormRoPE TensorRT plugin: no GPU, no libnvinfer.

The C++ driver ``plugins/tests/plugin_host_test.cpp`` (its checks in ``plugin_host_test_*.cpp``),
built with the plugin as ``qkrope_plugin_host_test``, dlopens ``libqkrope_vc_plugin.so`` and
``libqkrope_plugin.so`` and drives them the way TensorRT and its ONNX parser do: creator identity
and field list, plugin creation from the parser's field forms (kFLOAT32 / kINT32 / kCHAR with the
NUL counted), defaults for missing fields, every bad field, output shapes through a test
IExprBuilder, the format matrix, output dtypes, configure / onShapeChange / enqueue refusing
malformed shapes, serialise -> recreate, clone, attachToContext, logging through the logger finder,
and self-registration through a fake getPluginRegistry. This module builds the libraries if needed,
runs the driver once, and turns its output into one test per group of checks; the expected names,
fields and defaults come from qkrope.export.contract.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _native import build_lock, require_native_tools

from qkrope.export import contract
from qkrope.runtime import plugin_build

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = plugin_build.DEFAULT_BUILD_DIR


def _built() -> bool:
    return all((BUILD_DIR / plugin_build.LIBRARY_FILES[k][0]).is_file() for k in ("plugin", "vc", "host_test"))


@pytest.fixture(scope="module")
def build_dir() -> Path:
    require_native_tools("the plugin libraries")
    if plugin_build.find_nvcc() is None:
        pytest.skip("nvcc not found (CUDA toolkit): the plugin libraries cannot be built; "
                    "install the CUDA toolkit or set CUDACXX")
    with build_lock(BUILD_DIR):
        if (BUILD_DIR / "CMakeCache.txt").is_file() and _built():
            # Incremental: rebuilds only what changed since the last build.
            res = subprocess.run(["cmake", "--build", str(BUILD_DIR), "-j2"], capture_output=True,
                                 text=True)
            assert res.returncode == 0, \
                f"incremental plugin build failed:\n{(res.stdout + res.stderr)[-4000:]}"
        else:
            plugin_build.build_plugins(build_dir=BUILD_DIR, quiet=True)
    if not _built():
        cache = (BUILD_DIR / "CMakeCache.txt").read_text() if (BUILD_DIR / "CMakeCache.txt").is_file() else ""
        if "TensorRT_INCLUDE_DIR:PATH=TensorRT_INCLUDE_DIR-NOTFOUND" in cache or "QKROPE_BUILD_PLUGIN:BOOL=OFF" in cache:
            pytest.skip("requires TensorRT headers: none installed and scripts/fetch_trt_headers.py "
                        "could not fetch the pinned ones (is PyPI reachable?)")
    assert _built(), f"the build did not produce the plugin libraries in {BUILD_DIR}"
    return BUILD_DIR


def _driver_args(build: Path) -> list[str]:
    args = [str(build / "qkrope_plugin_host_test"),
            "--vc", str(build / "libqkrope_vc_plugin.so"),
            "--plugin", str(build / "libqkrope_plugin.so"),
            "--expect-name", contract.PLUGIN_NAME,
            "--expect-version", contract.PLUGIN_VERSION,
            "--expect-namespace", contract.PLUGIN_NAMESPACE]
    for name, ftype in contract.PLUGIN_FIELDS:
        args += ["--expect-field", f"{name}:{ftype}"]
    for name, _ in contract.PLUGIN_FIELDS:
        default = contract.ATTRIBUTE_BY_NAME[name].default
        args += ["--default", f"{name}={float(default)!r}"]
    return args


class DriverRun:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.returncode = proc.returncode
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self.results: dict[str, tuple[bool, str]] = {}
        self.fields: list[tuple[str, str]] = []
        self.serialized: list[tuple[str, str]] = []
        self.messages: dict[str, str] = {}
        self.summary: tuple[int, int] | None = None
        for line in proc.stdout.splitlines():
            if line.startswith("PASS "):
                self.results[line[5:].strip()] = (True, "")
            elif line.startswith("FAIL "):
                name, _, detail = line[5:].partition(": ")
                self.results[name.strip()] = (False, detail)
            elif line.startswith("FIELD "):
                _, name, ftype, _length = line.split()
                self.fields.append((name, ftype))
            elif line.startswith("SERIALIZED "):
                _, name, ftype, _length = line.split()
                self.serialized.append((name, ftype))
            elif line.startswith("MESSAGE "):
                _, case, text = line.split(" ", 2)
                self.messages[case] = text
            elif m := re.match(r"SUMMARY passed=(\d+) failed=(\d+)", line):
                self.summary = (int(m.group(1)), int(m.group(2)))

    def group(self, prefix: str) -> dict[str, tuple[bool, str]]:
        return {k: v for k, v in self.results.items() if k == prefix or k.startswith(prefix + ".")}


@pytest.fixture(scope="module")
def driver(build_dir: Path) -> DriverRun:
    proc = subprocess.run(_driver_args(build_dir), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LD_PRELOAD": ""})
    run = DriverRun(proc)
    assert run.summary is not None, (
        f"the driver did not finish (exit {proc.returncode}); it may have crashed.\n"
        f"stdout tail:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return run


def test_driver_ran_to_completion(driver: DriverRun):
    passed, failed = driver.summary
    assert passed + failed == len(driver.results)
    assert passed >= 100, f"only {passed} checks ran"
    assert (driver.returncode == 0) == (failed == 0)


GROUPS = {
    "vc": "the version-compatible library: entry points, no self-registration, logger finder",
    "creator": "creator name/version/namespace/interface and field list",
    "create": "creation from the parser's field forms, string fields, defaults, wide types",
    "bad_field": "every bad field -> nullptr + one logged error naming the field (build and runtime)",
    "plugin": "capabilities, names, outputs, timing-cache ID; self-registering library",
    "shapes": "getOutputShapes through a test IExprBuilder, good and bad shapes",
    "formats": "supportsFormatCombination matrix",
    "dtypes": "getOutputDataTypes",
    "configure": "configurePlugin (dynamic and static shapes)",
    "shape_change": "onShapeChange",
    "enqueue": "enqueue refuses malformed runtime shapes without touching memory",
    "serialize": "getFieldsToSerialize -> createPlugin(kRUNTIME) round trip",
    "clone": "clone is complete and independent",
    "attach_to_context": "attachToContext returns a complete clone",
}


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_contract_group(driver: DriverRun, group: str):
    checks = driver.group(group)
    assert checks, f"no '{group}' checks ran ({GROUPS[group]})"
    failed = {k: d for k, (ok, d) in checks.items() if not ok}
    assert not failed, f"{GROUPS[group]}: " + "; ".join(f"{k}: {d}" for k, d in failed.items())


def test_every_check_belongs_to_a_group(driver: DriverRun):
    orphans = [k for k in driver.results if k.split(".")[0] not in GROUPS]
    assert not orphans


def test_field_list_is_the_node_contract(driver: DriverRun):
    assert tuple(driver.fields) == contract.PLUGIN_FIELDS
    assert driver.results.get("creator.fields.match_contract") == (True, "")


def test_serialized_fields_are_the_node_contract(driver: DriverRun):
    assert tuple(driver.serialized) == contract.PLUGIN_FIELDS


def test_identity_is_the_node_contract(driver: DriverRun):
    for name in ("creator.name", "creator.version", "creator.namespace", "plugin.registered_creator_identity",
                 "plugin.registered_namespace"):
        assert driver.results.get(name) == (True, ""), name


@pytest.mark.parametrize("case,field", [
    ("epsilon_zero", "epsilon"), ("epsilon_nan", "epsilon"), ("interleaved_2", "interleaved"),
    ("rounding_3", "rounding"), ("epsilon_wrong_type_int32", "epsilon"),
    ("interleaved_wrong_type_float", "interleaved"), ("unknown_field", "theta"),
])
def test_bad_field_message_says_what_and_how(driver: DriverRun, case: str, field: str):
    msg = driver.messages.get(case)
    assert msg is not None, f"no message recorded for {case}"
    assert f"'{field}'" in msg and "QKNormRoPE" in msg and "'bad_node'" in msg
    assert "expected" in msg or "accepted" in msg
    assert "Fix:" in msg


def _defined_dynamic_symbols(lib: Path) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not found")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_vc_library_exports_only_get_creators_and_set_logger_finder(build_dir: Path):
    assert _defined_dynamic_symbols(build_dir / "libqkrope_vc_plugin.so") == {"getCreators", "setLoggerFinder"}


def test_self_registering_library_exports_nothing(build_dir: Path):
    assert _defined_dynamic_symbols(build_dir / "libqkrope_plugin.so") == set()


def _needed(lib: Path) -> list[str]:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) not found")
    out = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


@pytest.mark.parametrize("lib", ["libqkrope_plugin.so", "libqkrope_vc_plugin.so"])
def test_no_tensorrt_or_cudart_link(build_dir: Path, lib: str):
    needed = _needed(build_dir / lib)
    assert not [n for n in needed if "nvinfer" in n], needed   # TensorRT resolved at run time
    assert not [n for n in needed if "cudart" in n], needed    # CUDA runtime linked statically


def test_libraries_load_in_a_bare_python_process(build_dir: Path):
    """dlopen without TensorRT in the process: loading succeeds and registers nothing."""
    code = ("import ctypes, sys\n"
            "for p in sys.argv[1:]:\n"
            "    ctypes.CDLL(p)\n"
            "print('loaded')\n")
    res = subprocess.run([sys.executable, "-c", code, str(build_dir / "libqkrope_plugin.so"),
                          str(build_dir / "libqkrope_vc_plugin.so")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "loaded" in res.stdout, res.stderr


def test_find_plugin_library(build_dir: Path, monkeypatch):
    monkeypatch.delenv("QKROPE_PLUGIN_LIB", raising=False)
    monkeypatch.delenv("QKROPE_VC_PLUGIN_LIB", raising=False)
    assert plugin_build.find_plugin_library("plugin") == (build_dir / "libqkrope_plugin.so").resolve()
    assert plugin_build.find_plugin_library("vc") == (build_dir / "libqkrope_vc_plugin.so").resolve()
    assert plugin_build.find_plugin_library("trt") == plugin_build.find_plugin_library("plugin")
    with pytest.raises(plugin_build.PluginNotBuiltError, match="qkrope build-plugin"):
        plugin_build.find_plugin_library("vc", build_dir=build_dir / "does-not-exist")
    with pytest.raises(ValueError):
        plugin_build.find_plugin_library("nope")
