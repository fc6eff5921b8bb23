#!/usr/bin/env bash
# The project's test command (README): sets up .venv, builds the plugin libraries (the CPU build
# of the kernel always; the CUDA kernels and the TensorRT plugin where nvcc is found, against an
# installed TensorRT or the pinned TensorRT 10.14 headers), then runs pytest.
# GPU and TensorRT tests skip with their reason where neither exists.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate

# the project's one rule for nvcc (runtime/toolchain.py), which build_plugins.sh applies too
if python runtime/toolchain.py nvcc >/dev/null; then
    echo "[test] building the kernel and plugin libraries (build/plugins)" >&2
    bash scripts/build_plugins.sh
else
    echo "[test] nvcc not found: building only the CPU kernel library; the CUDA kernel and" \
         "TensorRT plugin tests will skip (install the CUDA toolkit to build them)" >&2
    bash scripts/build_plugins.sh --host-only
fi

# the test files run in parallel, one file per worker at a time (pytest-xdist, --dist loadfile:
# a file's module fixtures are built once): min(cores, 4) workers, QKROPE_TEST_WORKERS=N to
# choose (1: one process, as plain pytest). The build folders the files share are locked
# (tests/_native.py build_lock).
cores="$(nproc 2>/dev/null || echo 1)"
workers="${QKROPE_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
if [ "$workers" -gt 1 ]; then
    echo "[test] running pytest on $workers workers (QKROPE_TEST_WORKERS=1: one process)" >&2
    exec python -m pytest -n "$workers" --dist loadfile "$@"
fi
echo "[test] running pytest" >&2
exec python -m pytest "$@"
