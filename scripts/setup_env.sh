#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment in .venv and installs qkrope in
# editable mode with its test extras, at the versions pinned in constraints.txt.
# Re-running is cheap: nothing is reinstalled unless pyproject.toml or constraints.txt changed.
# Usage: scripts/setup_env.sh            (then: . .venv/bin/activate)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${QKROPE_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

stamp="$venv/.qkrope-setup"
want="$(cat "$root/pyproject.toml" "$root/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "[setup] creating virtual environment $venv" >&2
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# torch first and alone: with the pinned version pip takes the CPU wheel where one is provided
# locally; on a CUDA machine the same pin takes the CUDA build from PyPI.
echo "[setup] installing torch (pinned in constraints.txt)" >&2
"${pip[@]}" install -c "$root/constraints.txt" torch 2> >(grep -v "^WARNING: Location" >&2)
echo "[setup] installing qkrope (editable) with test extras" >&2
"${pip[@]}" install -c "$root/constraints.txt" -e "$root[test]" 2> >(grep -v "^WARNING: Location" >&2)
echo "$want" > "$stamp"
echo "[setup] ready: $venv" >&2
