#!/usr/bin/env bash
# The project's main job (README): on the built-in default (the Qwen-Image attention block,
# 24 heads x 128, fp32) export to ONNX, check parity (ONNX Runtime and diffusers), run a tiny
# pipeline on an exported transformer (the checkpoint's dtype, fp32), FP8, build the plugin,
# and, where TensorRT and a GPU exist, build the engine, check TensorRT parity and benchmark.
# Every skipped step is named with its reason. Outputs go to out/ (override: --out DIR).
# It says what it does first: the set-up (scripts/setup_env.sh prints what it installs), then
# each step of `qkrope demo`, then the time of each and in all.
# Usage: bash scripts/run_main.sh [qkrope demo args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

t0=$SECONDS
echo "[main] 1/2 set-up: .venv with the versions pinned in constraints.txt (scripts/setup_env.sh; a fresh machine downloads or reuses pip's cache: minutes)" >&2
bash scripts/setup_env.sh
echo "[main] set-up done in $((SECONDS - t0)) s" >&2
# shellcheck disable=SC1091
. .venv/bin/activate
echo "[main] 2/2 qkrope demo $* (it lists its steps, then prints each one's output and status)" >&2
t1=$SECONDS
status=0
qkrope demo "$@" || status=$?
echo "[main] qkrope demo done in $((SECONDS - t1)) s (exit status $status); $((SECONDS - t0)) s in all" >&2
exit "$status"
