"""Where the CUDA tools and the project's native libraries are: the one rule for both.

- :func:`find_nvcc`: ``$CUDACXX``, ``nvcc`` on PATH, ``/usr/local/cuda/bin/nvcc``; a candidate
  counts only if ``nvcc --version`` runs (a wrapper left behind by a removed toolkit is "no nvcc",
  not a build failure).
- :func:`find_cuda_tool` (cuobjdump, nvdisasm): PATH, ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``,
  ``/usr/local/cuda/bin``, next to nvcc, then the bin folders of the PyPI wheels
  (``nvidia-cuda-cuobjdump``, ``nvidia-cuda-nvdisasm``); :func:`find_cxxfilt` for demangling.
- :data:`LIBRARIES`: each native library's file name, the environment variable that overrides
  its path, and the build folders looked in (``build/plugins`` from ``qkrope build-plugin``,
  ``build/kernel`` from a plain CMake build of ``plugins/kernel``, ``build/kernel-simt`` where the
  tests build the SIMT emulation); :func:`find_library` applies it.

The module uses the standard library only, so the shell scripts ask it before the package is
installed::

    python runtime/toolchain.py nvcc           # prints the path, exit 1 when there is none
    python runtime/toolchain.py cuobjdump      # likewise nvdisasm, c++filt
    python runtime/toolchain.py library kernels_simt
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "REPO_ROOT", "BUILD_ROOT", "PLUGINS_BUILD_DIR", "KERNEL_BUILD_DIR", "KERNEL_HOST_BUILD_DIR",
    "KERNEL_SIMT_BUILD_DIR", "CUDA_DEFAULT_HOME", "NVCC_DEFAULT_PATH", "NativeLibrary", "LIBRARIES",
    "runs", "find_nvcc", "wheel_bin_dirs", "find_cuda_tool", "find_cxxfilt", "library_candidates",
    "find_library",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILD_ROOT = REPO_ROOT / "build"
PLUGINS_BUILD_DIR = BUILD_ROOT / "plugins"          # qkrope build-plugin / scripts/build_plugins.sh
KERNEL_BUILD_DIR = BUILD_ROOT / "kernel"            # cmake -S plugins/kernel -B build/kernel
KERNEL_HOST_BUILD_DIR = BUILD_ROOT / "kernel-host"  # tests/test_kernel_host.py's CPU build
KERNEL_SIMT_BUILD_DIR = BUILD_ROOT / "kernel-simt"  # the SIMT emulation the tests and the report share

CUDA_DEFAULT_HOME = "/usr/local/cuda"
NVCC_DEFAULT_PATH = f"{CUDA_DEFAULT_HOME}/bin/nvcc"


class NativeLibrary(NamedTuple):
    """A native library (or program) the project builds: its file name, the environment variable
    naming its path instead, and the build folders looked in, in order."""

    file: str
    env: str
    folders: tuple[Path, ...]


_KERNEL_FOLDERS = (PLUGINS_BUILD_DIR, KERNEL_BUILD_DIR)
LIBRARIES = {
    "plugin": NativeLibrary("libqkrope_plugin.so", "QKROPE_PLUGIN_LIB", (PLUGINS_BUILD_DIR,)),
    "vc": NativeLibrary("libqkrope_vc_plugin.so", "QKROPE_VC_PLUGIN_LIB", (PLUGINS_BUILD_DIR,)),
    "kernels": NativeLibrary("libqkrope_kernels.so", "QKROPE_KERNELS_LIB", _KERNEL_FOLDERS),
    "kernel_host": NativeLibrary("libqkrope_kernel_host.so", "QKROPE_KERNEL_HOST_LIB", _KERNEL_FOLDERS),
    "host_test": NativeLibrary("qkrope_plugin_host_test", "QKROPE_PLUGIN_HOST_TEST", (PLUGINS_BUILD_DIR,)),
    "kernels_simt": NativeLibrary("libqkrope_kernels_simt.so", "QKROPE_KERNELS_SIMT_LIB",
                                  _KERNEL_FOLDERS + (KERNEL_SIMT_BUILD_DIR,)),
}


def runs(cmd: str) -> bool:
    """Whether ``cmd --version`` runs and exits 0 (within 60 s)."""
    try:
        res = subprocess.run([cmd, "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0


def find_nvcc(explicit: str | None = None) -> str | None:
    """The CUDA compiler the build uses ($CUDACXX, nvcc on PATH, /usr/local/cuda/bin/nvcc), or
    None; ``explicit`` (a --nvcc flag) replaces the search. A candidate counts only if it runs."""
    cands = [explicit] if explicit else [os.environ.get("CUDACXX"), shutil.which("nvcc"),
                                         NVCC_DEFAULT_PATH]
    return next((c for c in cands if c and runs(c)), None)


def _site_packages() -> list[Path]:
    dirs: list[str] = []
    for key in ("purelib", "platlib"):
        try:
            dirs.append(sysconfig.get_paths()[key])
        except KeyError:
            pass
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    dirs += sorted(glob.glob(str(REPO_ROOT / ".venv" / "lib" / "python*" / "site-packages")))
    out: list[Path] = []
    for d in dirs:
        p = Path(d)
        if p.is_dir() and p not in out:
            out.append(p)
    return out


def wheel_bin_dirs() -> list[Path]:
    """Where the PyPI wheels put their binaries: nvidia-cuda-cuobjdump/-nvdisasm 13.x install
    into site-packages/nvidia/cu13/bin (12.x used nvidia/cuda_cuobjdump/bin)."""
    subs = ("nvidia/cu13/bin", "nvidia/cuda_cuobjdump/bin", "nvidia/cuda_nvdisasm/bin")
    return [sp / s for sp in _site_packages() for s in subs if (sp / s).is_dir()]


def find_cuda_tool(name: str, explicit: str | None = None, nvcc: str | None = None,
                   beside: str | None = None) -> str | None:
    """A CUDA binary tool (cuobjdump, nvdisasm): ``explicit`` if it runs, else PATH,
    $CUDA_HOME/bin, $CUDA_PATH/bin, /usr/local/cuda/bin, next to ``nvcc``, then the PyPI wheels'
    bin folders; failing those, next to the tool ``beside`` (nvdisasm beside cuobjdump: both
    wheels install into one folder). None if absent."""
    found = _search_cuda_tool(name, explicit, nvcc)
    if found is None and beside:
        side = os.path.join(os.path.dirname(beside), name)
        found = side if os.path.isfile(side) and runs(side) else None
    return found


def _search_cuda_tool(name: str, explicit: str | None, nvcc: str | None) -> str | None:
    if explicit:
        return explicit if runs(explicit) else None
    cands: list[str | None] = [shutil.which(name)]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", name))
    cands.append(f"{CUDA_DEFAULT_HOME}/bin/{name}")
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), name))
    cands += [str(d / name) for d in wheel_bin_dirs()]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK) and runs(c):
            return c
    return None


def find_cxxfilt() -> str | None:
    """A C++ demangler: c++filt (binutils), else the CUDA toolkit's cu++filt."""
    for c in (shutil.which("c++filt"), shutil.which("cu++filt"), f"{CUDA_DEFAULT_HOME}/bin/cu++filt"):
        if c and os.path.isfile(c):
            return c
    return None


def library_candidates(kind: str) -> list[Path]:
    """The paths :func:`find_library` looks at for ``kind``, in order (the environment variable's
    value alone when it is set)."""
    lib = LIBRARIES[kind]
    explicit = os.environ.get(lib.env)
    if explicit:
        return [Path(explicit)]
    return [folder / lib.file for folder in lib.folders]


def find_library(kind: str) -> Path | None:
    """A native library of :data:`LIBRARIES`: the path its environment variable names (returned
    as given, even if missing: the caller reports it), else the first of its build folders that
    holds the file; None when none does."""
    lib = LIBRARIES[kind]
    if os.environ.get(lib.env):
        return Path(os.environ[lib.env])
    return next((p for p in library_candidates(kind) if p.is_file()), None)


def _main(argv: list[str]) -> int:
    finders = {"nvcc": find_nvcc, "cuobjdump": lambda: find_cuda_tool("cuobjdump", nvcc=find_nvcc()),
               "nvdisasm": lambda: find_cuda_tool("nvdisasm", nvcc=find_nvcc()), "c++filt": find_cxxfilt}
    if len(argv) == 1 and argv[0] in finders:
        found = finders[argv[0]]()
    elif len(argv) == 2 and argv[0] == "library" and argv[1] in LIBRARIES:
        found = find_library(argv[1])
    else:
        print(f"usage: toolchain.py {{{','.join(finders)}}} | library {{{','.join(LIBRARIES)}}}; "
              f"got {' '.join(argv) or 'nothing'}", file=sys.stderr)
        return 2
    if found is None:
        return 1
    print(found)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
