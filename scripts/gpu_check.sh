#!/usr/bin/env bash
# One prepared check of the CUDA kernel on a GPU machine (PyTorch CUDA build + nvcc; TensorRT,
# pip and the network not needed), as ONE script well within 8 minutes:
#   1. build with cmake (plain nvcc/g++ if cmake is missing) into build/kernel, sm_90 by default:
#      libqkrope_kernels.so (CUDA) and libqkrope_kernel_host.so (CPU build of the arithmetic);
#      beside it, where plugins/kernel/CMakeLists.txt has the target, the SIMT emulator library
#      qkrope_kernels_simt (+ self-test) in build/kernel-simt, the CPU-only build that
#      tests/test_kernel_simt.py uses as is                timeout 180 s (2 min on 2 cores here)
#   2. pytest tests/test_kernel_cuda.py tests/test_kernel_host.py, plus
#      tests/test_kernel_simt.py (the emulator suite) and tests/test_kernel_report.py where
#      they exist (--quick: -m "not slow"; PYTEST_ARGS adds arguments)  timeout 200 s
#   3. scripts/kernel_report.py --arch 90 --check --json $OUT/kernel_report.json where the
#      script exists (registers, spills, SASS of the hot loop), in the background while step 2
#      runs (it only compiles and disassembles); skipped with a message, not a failure, when it
#      reports a missing tool (cuobjdump/nvdisasm)                      timeout 90 s
#   4. scripts/bench_kernel.py: fused (raw C-ABI launches in a CUDA graph, L2-cold) vs torch
#      eager vs torch.compile, 512^2/1024^2, batch 1/2, img/txt/block; the rest of the budget
#      (GPU_CHECK_BUDGET_S, default 450 s, minus what steps 1-3 used; at most 330 s, at least
#      60 s), passed on as --budget-s so it prints its table before the hard timeout; its JSON is
#      rewritten after every row (fused/eager first, torch.compile last), so a timeout never
#      loses what was measured. Expected on an H200 box: build ~1 min, tests (+ report beside
#      them) ~1-2 min, benchmark ~2-3 min. Worst case, build and tests at their timeouts
#      (180 + 200 s): the benchmark gets its minimum 60 s, total ~460 s, inside the device
#      tool's 540 s. The bandwidth check's time (step 5) is held back from this budget.
#   5. scripts/bandwidth_check.py: achieved bandwidth against a 128-bit copy kernel
#      (scripts/copy128.cu, built here into libqkrope_copy128.so) on the same GPU, for every
#      launch of the kernel report's tables, the current kernel ("new") and, side by side, the
#      kernel of OLD_KERNEL_REF ("old", default the last commit with the register-prefetch
#      schedule), built with plain nvcc into $BUILD-old from `git archive` of that commit, or from
#      OLD_KERNEL_SRC (a folder holding that commit's plugins/kernel) where the copy has no git
#      history; without either the old column is skipped with a message. Outputs bit for bit
#      equal between the two kernels.                   timeout GPU_CHECK_BW_S (default 150 s)
# Outputs, all in $OUT (default build/gpu_check), at most 8 files because the device tool brings
# back only 8: gpu_check.log (summary of everything, nvidia-smi included), build.log, pytest.log,
# pytest.xml, kernel_report.json, bench.log (with the markdown tables: the benchmark's, then the
# bandwidth check's), bench_kernel.json, bandwidth.json.
#
# Through the device tool (from the repository root of this checkout; the working tree is copied,
# ignored build outputs are not, so build/gpu_pydeps must be carried):
#   run(command="bash scripts/gpu_check.sh", carry=["build/gpu_pydeps", "build/kernel-old-src"], timeout_s=600)
#   run(command="bash scripts/gpu_check.sh --quick", carry=["build/gpu_pydeps"], timeout_s=300)
# --quick: the same build, the tests without those marked slow (kernel-source mutants, SASS
# report), the benchmark on one shape (1024x1024, batch 1) with few iterations: a rerun after a
# fix. The GPU box has PyTorch but may lack pytest and has no
# pip; prepare pytest here once, for any Python >= 3.10 on the box (pure-Python wheels, ~16 MB;
# exceptiongroup and tomli are named because pip does not apply --python-version to pytest's
# `python_version < "3.11"` markers; they are unused on 3.11+):
#   .venv/bin/python -m pip install --target build/gpu_pydeps --only-binary=:all: \
#       --python-version 3.10 pytest exceptiongroup tomli
# The script appends build/gpu_pydeps to PYTHONPATH only when the box's python cannot import
# pytest, and imports qkrope through a symlink shim when it is not installed. The old kernel's
# source for step 5, prepared here once (the device copy carries no git history):
#   mkdir -p build/kernel-old-src && git archive 0974064da4b73ff9d954b2827a4862965808fe17 plugins/kernel \
#       | tar -x -C build/kernel-old-src          # then OLD_KERNEL_SRC=build/kernel-old-src/plugins/kernel
#
#   bash scripts/gpu_check.sh [--quick]      # CUDA_ARCH=90 by default; CUDA_ARCH=native works
#                                            # (cmake < 3.24: the GPU's compute capability)
#   CUDA_ARCH=100 BENCH_ARGS="--no-compile" bash scripts/gpu_check.sh
#   PYTHON=/path/to/python OUT=/tmp/x GPU_CHECK_BUDGET_S=400 GPU_CHECK_BUILD=/tmp/b bash scripts/gpu_check.sh
#   OLD_KERNEL_SRC=build/kernel-old-src/plugins/kernel bash scripts/gpu_check.sh
# Exit status: 0 when the build, the tests, the kernel report (where it runs) and the benchmark
# pass, else non-zero (1; each failure is named in gpu_check.log).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/build/gpu_check}"
ARCH="${CUDA_ARCH:-90}"
BUILD="${GPU_CHECK_BUILD:-$ROOT/build/kernel}"
SIMT_BUILD="${GPU_CHECK_SIMT_BUILD:-$ROOT/build/kernel-simt}"  # where tests/test_kernel_simt.py looks (it links mutants
                                      # against that build's objects)
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-450}"
BW_T="${GPU_CHECK_BW_S:-150}"
OLD_REF="${OLD_KERNEL_REF:-0974064da4b73ff9d954b2827a4862965808fe17}"
OLD_SRC="${OLD_KERNEL_SRC:-}"
[[ -z "$OLD_SRC" && -d "$ROOT/build/kernel-old-src/plugins/kernel" ]] && OLD_SRC="$ROOT/build/kernel-old-src/plugins/kernel"
QUICK=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (only --quick)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT" "$BUILD"
cd "$ROOT"
START=$SECONDS
status=0
failed=()

say() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$OUT/gpu_check.log"; }
fail() { say "FAIL: $1${2:+ ($2)}"; status=1; failed+=("$1"); }

say "repo $ROOT, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), arch $ARCH," \
    "budget ${BUDGET}s$([[ $QUICK == 1 ]] && echo ', --quick')"
SMI="$(nvidia-smi 2>&1)" || say "nvidia-smi failed:"
echo "$SMI" | head -15 | tee -a "$OUT/gpu_check.log"

# the project's one rule for nvcc ($CUDACXX, PATH, the default toolkit; runtime/toolchain.py, a
# standard-library-only file, so it runs before qkrope is importable)
if ! NVCC="$("$PY" runtime/toolchain.py nvcc)"; then
  say "FAIL: nvcc not found (\$CUDACXX, PATH or the default CUDA toolkit: runtime/toolchain.py nvcc)"
  exit 1
fi
export PATH="$(dirname "$NVCC"):$PATH"   # cuobjdump and friends sit next to nvcc
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
  say "cmake build (log: $OUT/build.log): CUDA + host libraries in $BUILD, SIMT emulator in $SIMT_BUILD, side by side"
  build_cuda() {  # $1 dir, $2 nvcc, $3 arch, $4 jobs (the SIMT emulator is built on its own)
    cmake -S plugins/kernel -B "$1" -DQKROPE_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$2" -DCMAKE_CUDA_ARCHITECTURES="$3" -DQKROPE_BUILD_SIMT=OFF \
    && cmake --build "$1" -j "$4"
  }
  build_simt() {  # $1 dir, $2 jobs: the CPU-only configuration tests/test_kernel_simt.py makes
    cmake -S plugins/kernel -B "$1" -DQKROPE_WITH_CUDA=OFF -DCMAKE_BUILD_TYPE=Release || return 1
    if grep -qw qkrope_kernels_simt <<< "$(cmake --build "$1" --target help 2>/dev/null)"; then
      echo "-- building the SIMT emulator (qkrope_kernels_simt) in $1"
      cmake --build "$1" -j "$2" --target qkrope_kernels_simt simt_selftest qkrope_kernel_host
    else
      echo "-- no qkrope_kernels_simt target in plugins/kernel/CMakeLists.txt: SIMT emulator not built"
    fi
  }
  export -f build_cuda build_simt
  JOBS="$(nproc)"
  SIMT_LOG="$(mktemp)"
  timeout 180 bash -c 'build_simt "$@"' _ "$SIMT_BUILD" "$JOBS" > "$SIMT_LOG" 2>&1 &
  SIMT_PID=$!
  timeout 180 bash -c 'build_cuda "$@"' _ "$BUILD" "$NVCC" "$ARCH" "$JOBS" > "$OUT/build.log" 2>&1
  rc=$?
  wait "$SIMT_PID"
  simt_rc=$?
  { echo; echo "==== SIMT emulator build in $SIMT_BUILD (rc=$simt_rc) ===="; cat "$SIMT_LOG"; } >> "$OUT/build.log"
  rm -f "$SIMT_LOG"
  if [[ $simt_rc -ne 0 ]]; then
    grep -iE "error|timed out" "$OUT/build.log" | tail -10 | tee -a "$OUT/gpu_check.log"
    fail simt_build "rc=$simt_rc$([[ $simt_rc == 124 ]] && echo ', timed out after 180 s'); the CUDA checks go on"
  fi
else
  say "cmake not found: building with nvcc/g++ directly (log: $OUT/build.log; no SIMT library)"
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
  tail -30 "$OUT/build.log" | tee -a "$OUT/gpu_check.log"
  say "FAIL: build (rc=$rc$([[ $rc == 124 ]] && echo ', timed out'))"
  exit 1
fi
grep -i "warning" "$OUT/build.log" | head -20 | tee -a "$OUT/gpu_check.log"
grep -- "-- .*SIMT emulator" "$OUT/build.log" | tail -1 | tee -a "$OUT/gpu_check.log"
say "build ok: $(ls "$BUILD"/*.so | xargs -n1 basename | tr '\n' ' ')$(ls "$SIMT_BUILD"/*simt*.so 2>/dev/null | xargs -r -n1 basename | sed 's/^/+ /' | tr '\n' ' ')"
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
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$ROOT/build/gpu_pydeps"
  say "pytest from build/gpu_pydeps"
fi
"$PY" - << 'EOF' 2>&1 | tee -a "$OUT/gpu_check.log"
import sys, torch
try:
    import pytest
    pt = pytest.__version__
except ImportError:
    pt = "NOT importable (carry build/gpu_pydeps: see the top of scripts/gpu_check.sh)"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"pytest {pt}, cuda available: {torch.cuda.is_available()}, "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else '-'}")
EOF

# ---- 3. kernel report, started first: it only compiles (CPU) and reads SASS, so it runs beside
# the tests (registers, spills, SASS facts; needs cuobjdump and nvdisasm) ------------------------
REPORT_PID=""
if [[ ! -f scripts/kernel_report.py ]]; then
  say "kernel report skipped: scripts/kernel_report.py not present"
else
  REPORT_ARCH="$ARCH"; [[ "$REPORT_ARCH" =~ ^[0-9]+$ ]] || REPORT_ARCH=90
  say "kernel report in the background (arch $REPORT_ARCH, --check, json: $OUT/kernel_report.json)"
  REPORT_LOG="$(mktemp)"   # outside $OUT: the device tool returns only 8 files
  timeout -k 5 90 "$PY" scripts/kernel_report.py --arch "$REPORT_ARCH" --check --no-launches \
    --json "$OUT/kernel_report.json" > "$REPORT_LOG" 2>&1 &
  REPORT_PID=$!
fi

# ---- 2. tests -------------------------------------------------------------------------------
TESTS=(tests/test_kernel_cuda.py tests/test_kernel_host.py)
for t in tests/test_kernel_simt.py tests/test_kernel_report.py; do
  if [[ -f "$t" ]]; then TESTS+=("$t"); else say "($t not present: not run)"; fi
done
say "pytest ${TESTS[*]}$([[ $QUICK == 1 ]] && echo ' -m "not slow"') (log: $OUT/pytest.log, junit: $OUT/pytest.xml)"
PYTEST_EXTRA=(-m "")  # every test, the slow ones included (pyproject's addopts leaves them out)
[[ $QUICK == 1 ]] && PYTEST_EXTRA=(-m "not slow")
# shellcheck disable=SC2086
timeout -k 10 200 "$PY" -m pytest -p no:cacheprovider -q -rs ${PYTEST_EXTRA[@]+"${PYTEST_EXTRA[@]}"} \
  ${PYTEST_ARGS:-} "${TESTS[@]}" --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
rc=$?
tail -25 "$OUT/pytest.log" | tee -a "$OUT/gpu_check.log"
if [[ $rc -ne 0 ]]; then
  fail pytest "rc=$rc$([[ $rc == 124 ]] && echo ', timed out after 200 s (no junit then; see pytest.log)')"
else
  say "pytest ok"
fi

if [[ -n "$REPORT_PID" ]]; then
  wait "$REPORT_PID"
  rc=$?
  say "kernel report finished (rc=$rc):"
  tail -60 "$REPORT_LOG" | tee -a "$OUT/gpu_check.log"
  if [[ $rc -eq 2 ]] && grep -qE "kernel_report: error: (cuobjdump|nvdisasm|c\+\+filt) not found" "$REPORT_LOG"; then
    say "kernel report skipped: a tool it needs is missing on this machine (above); not a failure"
  elif [[ $rc -ne 0 ]]; then
    fail kernel_report "rc=$rc$([[ $rc == 124 ]] && echo ', timed out after 90 s')"
  else
    say "kernel report ok"
  fi
  rm -f "$REPORT_LOG"
fi

# ---- 4. benchmark -----------------------------------------------------------------------------
BENCH_T=$((BUDGET - (SECONDS - START) - 10 - BW_T))
(( BENCH_T > 330 )) && BENCH_T=330
(( BENCH_T < 60 )) && BENCH_T=60
SOFT=$((BENCH_T - 50))
(( SOFT < 30 )) && SOFT=30
EXTRA=()
[[ $QUICK == 1 ]] && EXTRA+=(--quick)
say "benchmark, timeout ${BENCH_T}s, soft budget ${SOFT}s (log: $OUT/bench.log, json: $OUT/bench_kernel.json)"
# shellcheck disable=SC2086
timeout -k 10 "$BENCH_T" "$PY" scripts/bench_kernel.py --json "$OUT/bench_kernel.json" \
  --budget-s "$SOFT" ${EXTRA[@]+"${EXTRA[@]}"} ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
rc=$?
grep -v "^\s*$" "$OUT/bench.log" | tail -45 | tee -a "$OUT/gpu_check.log"
if [[ $rc -ne 0 ]]; then
  fail benchmark "rc=$rc$([[ $rc == 124 ]] && echo ", timed out after ${BENCH_T}s; rows so far in bench_kernel.json")"
fi

# ---- 5. bandwidth against a 128-bit copy, old and new kernel side by side ---------------------
BW_OK=1
if [[ "$ARCH" == native ]]; then GENCODE=(-arch=native); else GENCODE=(-gencode "arch=compute_${ARCH},code=sm_${ARCH}"); fi
say "bandwidth check: building the 128-bit copy kernel (scripts/copy128.cu) into $BUILD"
if ! "$NVCC" -O3 -std=c++17 "${GENCODE[@]}" -shared -Xcompiler -fPIC,-fvisibility=hidden \
     -o "$BUILD/libqkrope_copy128.so" scripts/copy128.cu >> "$OUT/build.log" 2>&1; then
  fail bandwidth "the copy kernel did not build (build.log)"
  BW_OK=0
fi
KERNEL_ARGS=(--kernel "new=$BUILD/libqkrope_kernels.so")
OLD_BUILD="$BUILD-old"
if [[ -z "$OLD_SRC" ]] && git -C "$ROOT" rev-parse --verify -q "$OLD_REF^{commit}" > /dev/null 2>&1; then
  OLD_SRC="$(mktemp -d)"
  git -C "$ROOT" archive "$OLD_REF" plugins/kernel | tar -x -C "$OLD_SRC" && OLD_SRC="$OLD_SRC/plugins/kernel"
fi
if [[ $BW_OK == 1 && -n "$OLD_SRC" && -f "$OLD_SRC/qknorm_rope.cu" ]]; then
  mkdir -p "$OLD_BUILD"
  say "bandwidth check: building the old kernel ($OLD_SRC, $OLD_REF) into $OLD_BUILD"
  if "$NVCC" -O3 -std=c++17 "${GENCODE[@]}" -shared --cudart static -Xcompiler -fPIC,-fvisibility=hidden \
       -I"$OLD_SRC" -o "$OLD_BUILD/libqkrope_kernels.so" \
       "$OLD_SRC/qknorm_rope.cu" "$OLD_SRC/qknorm_rope_capi.cu" "$OLD_SRC/qknorm_rope_check.cpp" >> "$OUT/build.log" 2>&1; then
    KERNEL_ARGS+=(--kernel "old=$OLD_BUILD/libqkrope_kernels.so")
  else
    say "the old kernel did not build (build.log): the bandwidth check runs the new kernel alone"
  fi
elif [[ $BW_OK == 1 ]]; then
  say "no old kernel source (no git history for $OLD_REF, OLD_KERNEL_SRC unset): the new kernel alone"
fi
if [[ $BW_OK == 1 ]]; then
  BW_EXTRA=()
  [[ $QUICK == 1 ]] && BW_EXTRA+=(--quick)
  say "bandwidth check, timeout ${BW_T}s (table in $OUT/bench.log, json: $OUT/bandwidth.json)"
  { echo; echo "==== bandwidth against a 128-bit copy (scripts/bandwidth_check.py) ===="; } >> "$OUT/bench.log"
  timeout -k 10 "$BW_T" "$PY" scripts/bandwidth_check.py --copy-lib "$BUILD/libqkrope_copy128.so" \
    "${KERNEL_ARGS[@]}" --json "$OUT/bandwidth.json" --budget-s $((BW_T - 30)) \
    ${BW_EXTRA[@]+"${BW_EXTRA[@]}"} >> "$OUT/bench.log" 2>&1
  rc=$?
  sed -n '/==== bandwidth/,$p' "$OUT/bench.log" | grep -v "^\s*$" | tail -40 | tee -a "$OUT/gpu_check.log"
  [[ $rc -ne 0 ]] && fail bandwidth "rc=$rc$([[ $rc == 124 ]] && echo ", timed out after ${BW_T}s; rows so far in bandwidth.json")"
fi

# leftovers of an interrupted atomic write would be a 9th file the device tool does not return
find "$OUT" -maxdepth 1 -name '.*.tmp' -delete 2>/dev/null
n_files=$(find "$OUT" -type f | wc -l)
(( n_files > 8 )) && say "note: $n_files files in $OUT; the device tool returns only 8"
say "done in $((SECONDS - START))s, status $status${failed[0]+ (failed: ${failed[*]})}, outputs in $OUT"
exit $status
