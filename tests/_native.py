"""The C++ compiler and CMake the native-code tests build with; a test without them skips, saying
what could not be built."""

from __future__ import annotations

import os
import shutil

import pytest


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
