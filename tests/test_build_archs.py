"""Which device code the native build compiles (plugins/cmake/QkropeCuda.cmake): SASS for the GPU
of the building machine, PTX for sm_80 only where no GPU is visible, the deployable fat binary
with --arch all, and a user's list as given. Configure-only CMake runs (no compile)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from qkrope.runtime import plugin_build

ROOT = Path(__file__).resolve().parents[1]


def _configure(build: Path, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    nvcc = plugin_build.find_nvcc()
    if not nvcc:
        pytest.skip("requires nvcc (the CUDA toolkit)")
    if shutil.which("cmake") is None:
        pytest.skip("requires cmake")
    import os
    env = dict(os.environ, CUDACXX=nvcc, **(env_extra or {}))
    env.pop("CUDAARCHS", None)
    # the plugin itself is not configured (no TensorRT headers needed): the kernel's CMake alone
    return subprocess.run(["cmake", "-S", str(ROOT / "plugins" / "kernel"), "-B", str(build),
                           "-DQKROPE_WITH_CUDA=ON", "-DQKROPE_BUILD_SIMT=OFF", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def _gpu_visible() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    res = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return res.returncode == 0 and res.stdout.strip() != ""


@pytest.mark.slow
def test_default_build_compiles_only_device_code_this_machine_can_run(tmp_path):
    res = _configure(tmp_path / "b", "-DQKROPE_CUDA_ARCHS=")
    assert res.returncode == 0, res.stderr[-2000:]
    archs = plugin_build.built_architectures(tmp_path / "b")
    if _gpu_visible():
        assert archs == "native" or archs.endswith("-real"), archs
    else:
        assert archs == "80-virtual", archs
        assert "--arch all" in res.stdout     # the command of the deployable fat binary is printed
    # a re-configure keeps the automatic choice automatic; --arch all then gives the fat binary
    res = _configure(tmp_path / "b", f"-DQKROPE_CUDA_ARCHS={plugin_build.DEPLOY_ARCH}")
    assert res.returncode == 0, res.stderr[-2000:]
    deploy = plugin_build.built_architectures(tmp_path / "b").split(";")
    assert deploy[:3] == ["80-real", "86-real", "89-real"] and deploy[-1] in ("90", "100"), deploy
    res = _configure(tmp_path / "b", "-DQKROPE_CUDA_ARCHS=")
    assert plugin_build.built_architectures(tmp_path / "b") == archs


@pytest.mark.slow
def test_a_chosen_list_is_kept_and_a_bad_mode_refused(tmp_path):
    res = _configure(tmp_path / "c", "-DQKROPE_CUDA_ARCHS=", "-DCMAKE_CUDA_ARCHITECTURES=90-real")
    assert res.returncode == 0, res.stderr[-2000:]
    assert plugin_build.built_architectures(tmp_path / "c") == "90-real"
    res = _configure(tmp_path / "d", "-DQKROPE_CUDA_ARCHS=everything")
    assert res.returncode != 0 and "expected 'all' or empty" in res.stderr


def test_built_architectures_reads_the_cache(tmp_path):
    assert plugin_build.built_architectures(tmp_path) is None
    (tmp_path / "CMakeCache.txt").write_text("X:BOOL=ON\nCMAKE_CUDA_ARCHITECTURES:STRING=80-virtual\n")
    assert plugin_build.built_architectures(tmp_path) == "80-virtual"
