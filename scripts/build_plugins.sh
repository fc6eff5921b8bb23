#!/usr/bin/env bash
# One-line build of the qkrope native code (CUDA kernel, CPU kernel library, TensorRT plugins).
#
#   bash scripts/build_plugins.sh                      # kernel + both plugin libraries + host test
#   bash scripts/build_plugins.sh --host-only          # only the CPU build of the kernel (no CUDA)
#   bash scripts/build_plugins.sh --arch all           # the deployable fat binary (SASS 80;86;89;90;100 + PTX)
#   bash scripts/build_plugins.sh --arch "90;100"      # CUDA architectures (CMAKE_CUDA_ARCHITECTURES)
#   default: SASS for this machine's GPU (native), or PTX for sm_80 only where no GPU is visible
#   bash scripts/build_plugins.sh --tensorrt-root /opt/tensorrt
#   options: --build-dir DIR (default build/plugins), --jobs N (default 2), --debug, --clean,
#            --no-fetch (never download the fallback headers)
#
# TensorRT headers: a TensorRT install is used when found (--tensorrt-root, env TensorRT_ROOT, or
# the standard include paths of a TensorRT package / NGC container). Otherwise the TensorRT 10.14
# headers vendored by the PyPI wheel kernel-lens==2.0.1 are fetched (hash-pinned) into the ignored
# folder third_party/tensorrt-headers/include by scripts/fetch_trt_headers.py.
# Outputs: <build-dir>/libqkrope_plugin.so, libqkrope_vc_plugin.so, libqkrope_kernels.so,
#          libqkrope_kernel_host.so, qkrope_plugin_host_test.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD_DIR="$ROOT/build/plugins"
JOBS=2
HOST_ONLY=0
ARCH=""
TRT_ROOT="${TensorRT_ROOT:-}"
BUILD_TYPE=Release
CLEAN=0
FETCH=1

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --host-only) HOST_ONLY=1 ;;
    --arch) ARCH="${2:?--arch needs a list such as \"80;90\"}"; shift ;;
    --arch=*) ARCH="${1#*=}" ;;
    --tensorrt-root) TRT_ROOT="${2:?--tensorrt-root needs a directory}"; shift ;;
    --tensorrt-root=*) TRT_ROOT="${1#*=}" ;;
    --build-dir) BUILD_DIR="${2:?}"; shift ;;
    --build-dir=*) BUILD_DIR="${1#*=}" ;;
    --jobs|-j) JOBS="${2:?}"; shift ;;
    --debug) BUILD_TYPE=Debug ;;
    --clean) CLEAN=1 ;;
    --no-fetch) FETCH=0 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build_plugins.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

command -v cmake >/dev/null || { echo "build_plugins.sh: cmake not found (install cmake >= 3.18)" >&2; exit 1; }
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3 || true)"; fi
fi

# The SIMT emulation of the kernel is a test tool: tests/test_kernel_simt.py builds it in its own
# folder (build/kernel-simt, which its source mutants reuse), so it is not built here.
CMAKE_ARGS=(-S "$ROOT/plugins" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DQKROPE_BUILD_SIMT=OFF)

if [[ "$HOST_ONLY" == 1 ]]; then
  CMAKE_ARGS+=(-DQKROPE_WITH_CUDA=OFF -DQKROPE_BUILD_PLUGIN=OFF)
else
  CMAKE_ARGS+=(-DQKROPE_WITH_CUDA=ON)
  # the project's one rule for nvcc (runtime/toolchain.py: $CUDACXX, PATH, the default toolkit;
  # only one that runs), handed to CMake as CUDACXX
  [[ -n "$PY" ]] || { echo "build_plugins.sh: python3 is needed to find nvcc (runtime/toolchain.py)" >&2; exit 1; }
  if ! NVCC="$("$PY" "$ROOT/runtime/toolchain.py" nvcc)"; then
    echo "build_plugins.sh: nvcc not found. Install the CUDA toolkit (12.x or 13.x) and put nvcc on PATH" \
         "(or set CUDACXX), or build only the CPU kernel library with --host-only." >&2
    exit 1
  fi
  export CUDACXX="$NVCC"
  # --arch all: the deployable fat binary; a list (";" or "," separated) goes to CMake as is;
  # none: SASS for this machine's GPU, or PTX only where there is no GPU (plugins/cmake/QkropeCuda.cmake)
  case "$ARCH" in
    "") CMAKE_ARGS+=(-DQKROPE_CUDA_ARCHS=) ;;
    all) CMAKE_ARGS+=(-DQKROPE_CUDA_ARCHS=all) ;;
    *) CMAKE_ARGS+=(-DQKROPE_CUDA_ARCHS= "-DCMAKE_CUDA_ARCHITECTURES=${ARCH//,/;}") ;;
  esac

  # TensorRT headers: an install first, else the pinned fallback.
  FOUND=""
  if [[ -n "$TRT_ROOT" ]]; then
    if [[ -f "$TRT_ROOT/include/NvInferRuntime.h" ]]; then
      FOUND="$TRT_ROOT/include"
      CMAKE_ARGS+=("-DTensorRT_ROOT=$TRT_ROOT" "-DTensorRT_INCLUDE_DIR=$TRT_ROOT/include")
    else
      echo "build_plugins.sh: --tensorrt-root/TensorRT_ROOT '$TRT_ROOT' has no include/NvInferRuntime.h" >&2
      exit 1
    fi
  else
    for d in /usr/include/x86_64-linux-gnu /usr/include/aarch64-linux-gnu /usr/local/tensorrt/include \
             /opt/tensorrt/include /usr/include; do
      if [[ -f "$d/NvInferRuntime.h" ]]; then FOUND="$d"; break; fi
    done
  fi
  FALLBACK="$ROOT/third_party/tensorrt-headers/include"
  if [[ -z "$FOUND" && ! -f "$FALLBACK/NvInferRuntime.h" ]]; then
    if [[ "$FETCH" == 1 ]]; then
      [[ -n "$PY" ]] || { echo "build_plugins.sh: python3 is needed to fetch the TensorRT headers" >&2; exit 1; }
      echo "build_plugins.sh: no TensorRT install found; fetching the TensorRT headers (kernel-lens 2.0.1)"
      if ! "$PY" "$ROOT/scripts/fetch_trt_headers.py"; then
        echo "build_plugins.sh: could not fetch the TensorRT headers (see above; PyPI unreachable?):" \
             "building the CUDA kernel libraries without the TensorRT plugin. Fix: install TensorRT" \
             "(or pass --tensorrt-root DIR) and rerun." >&2
      fi
    else
      echo "build_plugins.sh: no TensorRT headers found and --no-fetch given; the plugin will not be built" >&2
    fi
  fi
fi

if [[ "$CLEAN" == 1 ]]; then rm -rf "$BUILD_DIR"; fi
echo "+ cmake ${CMAKE_ARGS[*]}"
cmake "${CMAKE_ARGS[@]}"
echo "+ cmake --build $BUILD_DIR -j$JOBS"
cmake --build "$BUILD_DIR" -j"$JOBS"
echo "build_plugins.sh: done; libraries in $BUILD_DIR"
ls -1 "$BUILD_DIR"/*.so 2>/dev/null || true
