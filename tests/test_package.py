"""Packaging contract: import names, lazy optional imports, the CLI entry point."""

import subprocess
import sys

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
