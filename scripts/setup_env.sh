#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs qkrope in
# editable mode with its test extras, at the versions pinned in constraints.txt.
# Re-running is cheap: nothing is reinstalled unless pyproject.toml or constraints.txt changed.
# It prints what it installs: each phase with its pins, pip's lines naming each package it
# collects, downloads and installs (the rest of pip's output dropped), and each phase's time.
# Usage: scripts/setup_env.sh            (then: . .venv/bin/activate)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${QKROPE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

stamp="$venv/.qkrope-setup"
want="$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "[setup] $venv is up to date with pyproject.toml and constraints.txt: nothing to install" >&2
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "[setup] creating virtual environment $venv" >&2
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
show() {  # pip's lines that name what it fetches and installs, prefixed; the rest dropped
    { grep --line-buffered -E '^(Collecting|Processing|  Downloading|  Using cached|Installing collected|Successfully installed)' || true; } \
        | sed -u 's/^ */[setup]   /' >&2
}
pins="$(grep -E '^[A-Za-z0-9_.-]+==' "$root/constraints.txt" | cut -d';' -f1 | tr '\n' ' ')"
t0=$SECONDS
# torch first and alone: with the pinned version pip takes the CPU wheel where one is provided
# locally; on a CUDA machine the same pin takes the CUDA build from PyPI.
echo "[setup] 1/2 installing $(grep -E '^torch==' "$root/constraints.txt") (constraints.txt; the largest download)" >&2
"${pip[@]}" install --progress-bar off -c "$root/constraints.txt" torch 2> >(grep -v "^WARNING: Location" >&2) | show
echo "[setup] 1/2 torch done in $((SECONDS - t0)) s" >&2
t1=$SECONDS
echo "[setup] 2/2 installing qkrope (editable) with its test extras, pinned by constraints.txt: $pins" >&2
"${pip[@]}" install --progress-bar off -c "$root/constraints.txt" -e "$root[test]" 2> >(grep -v "^WARNING: Location" >&2) | show
echo "[setup] 2/2 done in $((SECONDS - t1)) s" >&2
echo "$want" > "$stamp"
echo "[setup] ready: $venv ($((SECONDS - t0)) s)" >&2
