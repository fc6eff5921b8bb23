"""polygraphy's own ``run`` with qkrope's data loader on every family's export (the tiny builders
of ``tests/_families.py``): the loader gives each graph its inputs (the caches from the
positions the family's pipelines pass, its 5-D latent or its joined text inputs), ONNX Runtime
runs them, and the inputs polygraphy saved are :func:`qkrope.runtime.inputs.make_inputs`'s,
the ones ``qkrope check`` compares with diffusers' forward."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Every family's export through polygraphy's command line:
# a heavy matrix, run in the slow step (`bash scripts/test.sh -m slow`)
pytestmark = pytest.mark.slow

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime (pip install -e '.[test]')")
pytest.importorskip("polygraphy", reason="requires polygraphy (pip install -e '.[test]')")

# the representatives; a clone family (smoke=True) runs the smoke test (tests/test_families.py)
from _families import FULL_PARAMS  # noqa: E402

POLYGRAPHY = Path(sys.executable).parent / "polygraphy"  # the CLI installed with the package


@pytest.mark.parametrize("builder", FULL_PARAMS)
def test_polygraphy_run_with_the_data_loader(builder, tmp_path, tiny_root):
    from polygraphy.json import load_json

    from qkrope.runtime.inputs import make_inputs
    from qkrope.sidecars import ModelInfo

    if not POLYGRAPHY.is_file():
        pytest.skip(f"requires the polygraphy command line next to {sys.executable}")
    out = builder.exported(tiny_root)  # the session's (polygraphy only reads it)
    script = subprocess.run([sys.executable, "-m", "qkrope.apps.polygraphy_data_loader"],
                            capture_output=True, text=True, check=True).stdout.strip()
    saved = tmp_path / "inputs.json"
    res = subprocess.run([str(POLYGRAPHY), "run", str(out), "--onnxrt",
                          "--data-loader-script", script, "--save-inputs", str(saved)],
                         capture_output=True, text=True,
                         env={**os.environ, "POLYGRAPHY_AUTOINSTALL_DEPS": "0"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    fed = load_json(str(saved))[0]
    want = make_inputs(ModelInfo.load(out))
    assert sorted(fed) == sorted(want)
    for name, value in want.items():
        assert np.array_equal(np.asarray(fed[name]), np.asarray(value)), name
