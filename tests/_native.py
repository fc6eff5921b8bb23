"""The C++ compiler and CMake the native-code tests build with; a test without them skips, saying
what could not be built."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from qkrope.runtime import toolchain

REPO = Path(__file__).resolve().parent.parent
SIMT_BUILD_DIR = toolchain.KERNEL_SIMT_BUILD_DIR


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Held while a test configures or builds into ``build_dir``, a folder of the checkout that
    several test files share: one build at a time when pytest-xdist runs those files in parallel
    (an flock on ``<build_dir>.lock``, released when the process ends, whatever happens)."""
    build_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(build_dir.parent / f"{build_dir.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def find_cxx() -> str | None:
    """$CXX (default c++), else g++, else clang++."""
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++") or shutil.which("clang++")


def require_native_tools(what: str) -> tuple[str, str]:
    """``(c++ compiler, cmake)``, or skip with ``cannot build <what>`` and the fix."""
    cxx = find_cxx()
    if cxx is None:
        pytest.skip(f"no C++ compiler found (set CXX or install g++): cannot build {what}")
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip(f"cmake not found: cannot build {what} (pip install cmake)")
    return cxx, cmake


def build_simt(targets: tuple[str, ...] = ("qkrope_kernels_simt",)) -> Path:
    """Build the SIMT emulation of the kernel (cmake on plugins/kernel, CUDA off) into
    build/kernel-simt, which the emulator tests and the kernel report share; returns the folder."""
    _, cmake = require_native_tools("the SIMT emulation")
    with build_lock(SIMT_BUILD_DIR):
        if not (SIMT_BUILD_DIR / "CMakeCache.txt").is_file():
            res = subprocess.run([cmake, "-S", str(REPO / "plugins" / "kernel"), "-B",
                                  str(SIMT_BUILD_DIR), "-DQKROPE_WITH_CUDA=OFF",
                                  "-DCMAKE_BUILD_TYPE=Release"], capture_output=True, text=True)
            assert res.returncode == 0, \
                f"configuring the SIMT build failed:\n{res.stdout}\n{res.stderr}"
        res = subprocess.run([cmake, "--build", str(SIMT_BUILD_DIR), "--target", *targets, "-j2"],
                             capture_output=True, text=True)
    assert res.returncode == 0, f"building the SIMT emulation failed:\n{res.stdout}\n{res.stderr}"
    return SIMT_BUILD_DIR
