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

echo "[test] running pytest" >&2
exec python -m pytest "$@"
