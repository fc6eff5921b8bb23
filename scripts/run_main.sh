#!/usr/bin/env bash
# The project's main job (README): on the built-in default (the Qwen-Image attention block,
# 24 heads x 128) export to ONNX, check parity (ONNX Runtime and diffusers), build the plugin,
# and, where TensorRT and a GPU exist, build the engine, check TensorRT parity and benchmark.
# Every skipped step is named with its reason. Outputs go to out/ (override: --out DIR).
# Usage: bash scripts/run_main.sh [qkrope demo args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec qkrope demo "$@"
