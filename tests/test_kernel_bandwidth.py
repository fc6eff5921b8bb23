"""scripts/bandwidth_check.py (gpu_check.sh's bandwidth step) without a GPU: its arguments and
refusals; the measurement itself runs only on a GPU machine (scripts/gpu_check.sh)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bandwidth_check.py"


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_names_the_copy_kernel_and_the_sides():
    res = _run("--help")
    assert res.returncode == 0, res.stderr
    assert "--copy-lib" in res.stdout and "--kernel NAME=LIB" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--kernel", "new"], "expected NAME=LIB"),
    (["--kernel", "new=/nonexistent/libqkrope_kernels.so"], "no library at /nonexistent"),
])
def test_bad_arguments_are_refused_with_the_fix(tmp_path, args, message):
    copy = tmp_path / "libqkrope_copy128.so"
    copy.write_bytes(b"")
    res = _run("--copy-lib", str(copy), *args)
    assert res.returncode == 2 and message in res.stderr, res.stderr


def test_missing_copy_library_names_who_builds_it(tmp_path):
    lib = tmp_path / "libqkrope_kernels.so"
    lib.write_bytes(b"")
    res = _run("--copy-lib", str(tmp_path / "none.so"), "--kernel", f"new={lib}")
    assert res.returncode == 2 and "scripts/gpu_check.sh builds it" in res.stderr, res.stderr


def test_no_gpu_is_one_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would measure")
    lib = tmp_path / "libqkrope_kernels.so"
    lib.write_bytes(b"")
    res = _run("--copy-lib", str(lib), "--kernel", f"new={lib}")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "bandwidth_check: error: no CUDA device (torch.cuda.is_available() is False)"]
