"""Packaging contract: import names, lazy optional imports, the CLI entry point."""

import subprocess
from pathlib import Path
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


def _source_packages(root):
    """Every package of the source tree by its installed name, walked here (not by setup.py):
    a folder below a root of setup.py's PACKAGE_DIRS whose every folder down has __init__.py."""
    import runpy

    dirs = runpy.run_path(str(root / "setup.py"), run_name="setup")["PACKAGE_DIRS"]
    out = {}
    for name, folder in dirs.items():
        for init in (root / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(root / folder).parts
            chain = [root / folder / Path(*parts[:i]) for i in range(len(parts) + 1)]
            if all((d / "__init__.py").is_file() for d in chain) and "__pycache__" not in parts:
                out[".".join((name, *parts))] = init.parent
    return dirs, out


def test_wheel_holds_every_package_and_family_hook(tmp_path):
    """The wheel built from this tree (setup.py reads its package list from the folders) holds
    every source package with each of its modules, every family folder of the registry and
    each hook module of a folder that serves a class (a folder that only refuses classes, e.g.
    ERNIE-Image's, is its record module alone)."""
    import zipfile

    from qkrope.families import FAMILY_PACKAGES, HOOK_KINDS, records

    import shutil

    root = Path(__file__).resolve().parents[1]
    # built from a copy: setuptools' build/ folder of an earlier build would fill the gaps
    source = tmp_path / "src"
    dirs, packages = _source_packages(root)
    for folder in dirs.values():
        shutil.copytree(root / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(root / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--no-index", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("qkrope-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(dirs) <= set(packages) and len(packages) > len(dirs)
    missing = []
    for name, folder in packages.items():
        base = name.replace(".", "/")
        missing += [f"{base}/{py.name}" for py in folder.glob("*.py")
                    if f"{base}/{py.name}" not in names]
    from qkrope.families._dual_stream import SHARED_HOOKS

    serving = {r.package for r in records()}  # a folder that only refuses has no hooks
    # a dual-stream clone's folder: its record and tiny builder; its other hooks are shared
    clones = {r.package for r in records() if r.dual_stream is not None}
    for package in FAMILY_PACKAGES:
        kinds = [k for k in (HOOK_KINDS if package in serving else ())
                 if not (package in clones and k in SHARED_HOOKS)]
        missing += [f"qkrope/families/{package}/{module}.py"
                    for module in ("__init__", *kinds)
                    if f"qkrope/families/{package}/{module}.py" not in names]
    missing += [f"{m.replace('.', '/')}.py" for m in SHARED_HOOKS.values()
                if f"{m.replace('.', '/')}.py" not in names]
    assert not missing, f"the wheel lacks {sorted(missing)}"
    # nothing installed under a generic top-level name
    assert not {n.split("/")[0] for n in names} - {"qkrope", *(
        n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))}
