"""Packaging contract: import names, lazy optional imports, the CLI entry point."""

import subprocess
import sys

import pytest

import qkrope
from qkrope import cli


def test_import_is_light():
    """`import qkrope`, `qkrope.export` and `qkrope.runtime` pull in neither diffusers, TensorRT
    nor CUDA code (checked in a fresh interpreter)."""
    code = (
        "import sys, qkrope, qkrope.export, qkrope.runtime, qkrope.cli\n"
        "cli_parser = qkrope.cli.build_parser()\n"
        "bad = [m for m in ('diffusers', 'tensorrt', 'pycuda', 'cuda', 'tritonclient', 'matplotlib')"
        " if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# The package faces and the modules the commands take their constants from (dtype names, levels,
# the build folder, library names, opsets, defaults): importing them imports none of these.
HEAVY = ("torch", "onnx", "onnxscript", "onnxruntime", "tensorrt")
LIGHT_MODULES = ("qkrope", "qkrope.dtypes", "qkrope.contract", "qkrope.sidecars",
                 "qkrope.families", "qkrope.quantization", "qkrope.runtime", "qkrope.runtime.plugin_build",
                 "qkrope.runtime.profiles", "qkrope.runtime.triton", "qkrope.export",
                 *(module for _, module, _ in cli._SUBCOMMANDS))


def _imported_by(statements: str) -> list[str]:
    code = f"import sys\n{statements}\nprint(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_faces_and_constant_sources_import_nothing_heavy(module):
    """Each in a fresh interpreter: sys.modules says what the import pulled in."""
    assert _imported_by(f"import {module}") == [], module


def test_lazy_names_of_the_faces_still_resolve():
    """The names that need torch import it on first use, and are the defining modules' own."""
    got = _imported_by(
        "import qkrope.dtypes as d, qkrope.export as e, qkrope.runtime as r\n"
        "from qkrope.runtime import backends, caches\n"
        "from qkrope.export import attention\n"
        "assert r.load is backends.load and r.caches_for is caches.caches_for\n"
        "assert e.QwenImageAttention is attention.QwenImageAttention\n"
        "assert d.TORCH_BY_SHORT['bf16'] is sys.modules['torch'].bfloat16")
    assert "torch" in got


def test_no_generic_top_level_names_installed(tmp_path):
    """export/ and runtime/ are importable only as qkrope.export / qkrope.runtime."""
    code = (
        "import importlib.util, qkrope.export, qkrope.runtime\n"
        "assert qkrope.export.__name__ == 'qkrope.export'\n"
        "print([n for n in ('export', 'runtime', 'plugins', 'scripts', 'tests')"
        " if importlib.util.find_spec(n) is not None])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]"


def test_cli_version_and_help():
    out = subprocess.run([sys.executable, "-m", "qkrope", "--version"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == f"qkrope {qkrope.__version__}"
    out = subprocess.run([sys.executable, "-m", "qkrope", "--help"], capture_output=True,
                         text=True, check=True)
    for command in ("export", "check", "build", "build-plugin", "triton-repo", "bench", "demo"):
        assert f"    {command}" in out.stdout, f"subcommand {command} missing from --help"


def test_cli_without_command_prints_help_and_fails():
    assert cli.main([]) == 2
