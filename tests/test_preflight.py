"""Every command checks its paths and arguments before it imports torch, onnx or TensorRT, and
says what the file is and which command makes or takes it (qkrope/_preflight.py): a mistyped
path answers as fast as `qkrope --help`. Checked by which modules a run imported, not by time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "onnx", "onnxscript", "onnxruntime", "tensorrt", "diffusers")

_CODE = """
import contextlib, io, json, sys
from qkrope.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    rc = main({argv!r})
print(json.dumps({{"rc": rc, "stderr": err.getvalue(),
                  "heavy": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""

LONG = "n" * 300
CASES = [
    (["build", "nothere.onnx"],
     "nothere.onnx does not exist. Fix: export it with `qkrope export --out nothere.onnx`"),
    (["build", "t.onnx.json"], "t.onnx.json is the JSON sidecar of t.onnx, not a model. Fix: "
                               "qkrope build t.onnx"),
    (["build", "t.engine"], "t.engine is a TensorRT engine; qkrope build takes the ONNX model"),
    (["build", "t.onnx", "--timing-cache", "folder"],
     "--timing-cache folder is a folder; it takes a file. Fix: --timing-cache folder/timing.cache"),
    (["build", "t.onnx", "--max-batch", "0"], "--max-batch must be >= 1; got 0"),
    (["build", "t.onnx", "--workspace", "-5"], "--workspace must be >= 1; got -5"),
    (["build", "t.onnx", "--resolutions", "1024"], "1024"),
    (["build", "t.onnx", "--txt-tokens", "a:b"], "--txt-tokens"),
    (["build", "t.onnx", "--plugin", "nothere.so"], "--plugin nothere.so does not exist. Fix: "
                                                    "build it with `qkrope build-plugin`"),
    (["refit", "nothere.engine", "--state-dict", "sd.pt"],
     "nothere.engine does not exist. Fix: build it with `qkrope build nothere.onnx --refit -o "
     "nothere.engine`"),
    (["refit", "t.onnx", "--state-dict", "sd.pt"],
     "t.onnx is an ONNX model, not a TensorRT engine; qkrope refit takes an engine built with "
     "`qkrope build --refit`. Fix: qkrope build t.onnx --refit -o t.engine, then qkrope refit "
     "t.engine"),
    (["refit", "t.engine.json", "--state-dict", "sd.pt"], "is the JSON sidecar of t.engine"),
    (["refit", "t.engine", "--state-dict", "nothere.pt"], "--state-dict nothere.pt does not "
                                                          "exist. Fix: pass a .safetensors"),
    (["refit", "t.engine", "--diffusers", "nothere"], "--diffusers nothere does not exist. Fix:"),
    (["check", "nothere.onnx"], "nothere.onnx does not exist. Fix: export it"),
    (["check", "t.onnx", "--engine", "nothere.engine", "--plugin", "p.so"],
     "--engine nothere.engine does not exist. Fix: build it with `qkrope build nothere.onnx"),
    (["export", "--model", "transformer", "--diffusers", "nothere"],
     "--diffusers nothere does not exist. Fix: pass the local folder"),
    (["export", "--weights", "nothere.safetensors"], "--weights nothere.safetensors does not "
                                                     "exist"),
    (["export", "--out", "folder"], "--out folder is a folder; it takes a file"),
    (["export", "--out", "m.onnx.json"], "--out must end in .onnx; got 'm.onnx.json'"),
    (["triton-repo", "--engine", "nothere.engine", "-o", "repo"],
     "--engine nothere.engine does not exist. Fix: build it with `qkrope build nothere.onnx"),
    (["triton-repo", "--backend", "onnxruntime", "--onnx", "t.onnx", "-o", "repo", "--name", LONG],
     "--name is 300 bytes long"),
    (["bench", "--engine", "nothere.engine"], "--engine nothere.engine does not exist"),
    (["build-plugin", "--tensorrt-root", "nothere"], "--tensorrt-root nothere does not exist"),
    (["build-plugin", "--jobs", "0"], "--jobs must be >= 1; got 0"),
    (["bench", "--engine", "t.engine", "--plugin", "nothere.so"], "--plugin nothere.so does not "
                                                                  "exist"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("preflight")
    for name in ("t.onnx", "t.onnx.json", "t.engine", "t.engine.json"):
        (d / name).write_bytes(b"")
    (d / "folder").mkdir()
    return d


def _run(cwd, argv) -> dict:
    """One command in a fresh interpreter (sys.modules says what it imported)."""
    out = subprocess.run([sys.executable, "-c", _CODE.format(heavy=HEAVY, argv=argv)],
                         capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(CASES)), ids=[" ".join(a)[:50] for a, _ in CASES])
def test_paths_are_checked_before_heavy_imports(folder, i):
    argv, message = CASES[i]
    got = _run(folder, argv)
    assert got["rc"] == 2, got
    assert message in got["stderr"], got["stderr"]
    assert len(got["stderr"].strip().splitlines()) == 1, got["stderr"]
    assert got["heavy"] == [], f"`qkrope {' '.join(argv)}` imported {got['heavy']} first"
