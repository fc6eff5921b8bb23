#!/usr/bin/env bash
# One prepared check of the CUDA kernel on a GPU machine (PyTorch + nvcc; TensorRT not needed):
#   1. build libqkrope_kernels.so (CUDA, sm_90 by default) and libqkrope_kernel_host.so with cmake
#      (plain nvcc/g++ if cmake is missing) into build/kernel
#   2. pytest tests/test_kernel_cuda.py tests/test_kernel_host.py
#   3. scripts/bench_kernel.py (fused vs eager vs torch.compile at Qwen-Image shapes)
# Logs and the benchmark JSON go to $OUT (default build/gpu_check). Total well under 8 minutes.
# The benchmark rewrites its JSON after every measured row (fused/eager first, torch.compile last),
# so its 300 s timeout never loses figures already measured.
#
#   bash scripts/gpu_check.sh                 # CUDA_ARCH=90 by default; CUDA_ARCH=native also works
#                                             # (cmake < 3.24: the GPU's compute capability instead)
#   CUDA_ARCH=100 BENCH_ARGS="--no-compile" bash scripts/gpu_check.sh
# Exit status: 0 when the build and both test files pass (and the benchmark ran), else non-zero.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/build/gpu_check}"
ARCH="${CUDA_ARCH:-90}"
BUILD="$ROOT/build/kernel"
PY="${PYTHON:-python3}"
mkdir -p "$OUT" "$BUILD"
cd "$ROOT"
START=$SECONDS
status=0

say() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$OUT/gpu_check.log"; }

say "repo $ROOT, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), arch $ARCH"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || say "nvidia-smi failed (see $OUT/nvidia-smi.txt)"
head -15 "$OUT/nvidia-smi.txt" | tee -a "$OUT/gpu_check.log"

NVCC="$(command -v nvcc || true)"
[[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]] && NVCC=/usr/local/cuda/bin/nvcc
if [[ -z "$NVCC" ]]; then
  say "FAIL: nvcc not found (PATH or /usr/local/cuda/bin)"
  exit 1
fi
say "nvcc: $($NVCC --version | tail -2 | head -1)"

# ---- 1. build -------------------------------------------------------------------------------
if command -v cmake > /dev/null; then
  # CMAKE_CUDA_ARCHITECTURES=native needs CMake >= 3.24: with an older cmake use this GPU's
  # compute capability (nvidia-smi, else PyTorch), else 90.
  CMAKE_VER="$(cmake --version | head -1 | grep -oE '[0-9]+\.[0-9]+' | head -1)"
  if [[ "$ARCH" == native ]] && ! printf '3.24\n%s\n' "$CMAKE_VER" | sort -V -C; then
    CAP="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')"
    [[ -z "$CAP" ]] && CAP="$("$PY" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())' 2>/dev/null)"
    ARCH="${CAP:-90}"
    say "cmake $CMAKE_VER < 3.24 does not know CMAKE_CUDA_ARCHITECTURES=native: using $ARCH"
  fi
  say "cmake build (log: $OUT/build.log)"
  { cmake -S plugins/kernel -B "$BUILD" -DQKROPE_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    && cmake --build "$BUILD" -j "$(nproc)"; } > "$OUT/build.log" 2>&1
  rc=$?
else
  say "cmake not found: building with nvcc/g++ directly (log: $OUT/build.log)"
  if [[ "$ARCH" == native ]]; then GENCODE=(-arch=native); else GENCODE=(-gencode "arch=compute_${ARCH},code=sm_${ARCH}"); fi
  {
    "$NVCC" -O3 -std=c++17 "${GENCODE[@]}" -shared --cudart static -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra \
      -Iplugins/kernel -o "$BUILD/libqkrope_kernels.so" \
      plugins/kernel/qknorm_rope.cu plugins/kernel/qknorm_rope_capi.cu plugins/kernel/qknorm_rope_check.cpp \
    && "${CXX:-g++}" -O2 -std=c++17 -fPIC -shared -fvisibility=hidden -ffp-contract=off -Wall -Wextra \
      -Iplugins/kernel -o "$BUILD/libqkrope_kernel_host.so" \
      plugins/kernel/qknorm_rope_host.cpp plugins/kernel/qknorm_rope_check.cpp
  } > "$OUT/build.log" 2>&1
  rc=$?
fi
if [[ $rc -ne 0 ]]; then
  tail -30 "$OUT/build.log"
  say "FAIL: build (rc=$rc)"
  exit 1
fi
grep -i "warning" "$OUT/build.log" | head -20 | tee -a "$OUT/gpu_check.log"
say "build ok: $(ls "$BUILD"/*.so | xargs -n1 basename | tr '\n' ' ')"
export QKROPE_KERNELS_LIB="$BUILD/libqkrope_kernels.so"
export QKROPE_KERNEL_HOST_LIB="$BUILD/libqkrope_kernel_host.so"

# ---- Python environment: qkrope importable without installing it; pytest from build/gpu_pydeps
if ! "$PY" -c "import qkrope.export, qkrope.runtime" > /dev/null 2>&1; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/qkrope"
  for f in "$ROOT"/qkrope/*; do ln -s "$f" "$SHIM/qkrope/$(basename "$f")"; done
  ln -s "$ROOT/export" "$SHIM/qkrope/export"
  ln -s "$ROOT/runtime" "$SHIM/qkrope/runtime"
  export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  say "qkrope not installed: using an import shim at $SHIM"
fi
if ! "$PY" -c "import pytest" > /dev/null 2>&1 && [[ -d "$ROOT/build/gpu_pydeps" ]]; then
  export PYTHONPATH="$PYTHONPATH:$ROOT/build/gpu_pydeps"
  say "pytest from build/gpu_pydeps"
fi
"$PY" - << 'EOF' 2>&1 | tee -a "$OUT/gpu_check.log"
import torch, pytest
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), pytest {pytest.__version__}, "
      f"cuda available: {torch.cuda.is_available()}, "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else '-'}")
EOF

# ---- 2. tests -------------------------------------------------------------------------------
say "pytest (log: $OUT/pytest.log, junit: $OUT/pytest.xml)"
timeout 300 "$PY" -m pytest -p no:cacheprovider -q -rs tests/test_kernel_cuda.py tests/test_kernel_host.py \
  --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
rc=$?
tail -25 "$OUT/pytest.log" | tee -a "$OUT/gpu_check.log"
if [[ $rc -ne 0 ]]; then
  say "FAIL: pytest (rc=$rc)"
  status=1
else
  say "pytest ok"
fi

# ---- 3. benchmark -----------------------------------------------------------------------------
say "benchmark (log: $OUT/bench.log)"
# shellcheck disable=SC2086
timeout 300 "$PY" scripts/bench_kernel.py --json "$OUT/bench_kernel.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
rc=$?
cat "$OUT/bench.log" | grep -v "^\s*$" | tail -30 | tee -a "$OUT/gpu_check.log"
if [[ $rc -ne 0 ]]; then
  say "FAIL: benchmark (rc=$rc)"
  status=1
fi

say "done, status $status, logs in $OUT"
exit $status
