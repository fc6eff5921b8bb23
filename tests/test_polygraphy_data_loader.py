"""The shipped polygraphy data-loader script feeds the real RoPE caches (not polygraphy's random
values) and the sample activations from the model's sidecar, to `polygraphy run` itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qkrope.apps import polygraphy_data_loader as dl
from qkrope.cli import main
from qkrope.errors import InputError
from qkrope.runtime import build_qwen_rope_caches
from qkrope.sidecars import ModelInfo


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("dl") / "attn.onnx"
    assert main(["export", "--heads", "2", "--head-dim", "16", "--out", str(out)]) == 0
    return out


def test_polygraphy_run_feeds_the_real_caches(model, tmp_path):
    script = subprocess.run([sys.executable, "-m", "qkrope.apps.polygraphy_data_loader"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert Path(script).resolve() == Path(dl.__file__).resolve()
    saved = tmp_path / "inputs.json"
    polygraphy = Path(sys.executable).parent / "polygraphy"  # the CLI installed with the package
    if not polygraphy.is_file():
        pytest.skip(f"requires the polygraphy command line next to {sys.executable}")
    res = subprocess.run([str(polygraphy), "run", str(model), "--onnxrt",
                          "--data-loader-script", script, "--save-inputs", str(saved)],
                         capture_output=True, text=True, env={**os.environ, "POLYGRAPHY_AUTOINSTALL_DEPS": "0"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    from polygraphy.json import load_json

    feeds = load_json(str(saved))[0]
    info = ModelInfo.load(model)
    caches = build_qwen_rope_caches(info.sample["img_shapes"], info.sample["txt_len"],
                                    axes_dim=info.axes_dims_rope())
    assert np.array_equal(feeds["img_cos_sin_cache"], caches.img.numpy())
    assert np.array_equal(feeds["txt_cos_sin_cache"], caches.txt.numpy())
    assert feeds["hidden_states"].shape[0] == info.sample["batch"]


def test_sizes_from_the_environment(model, monkeypatch):
    monkeypatch.setenv("QKROPE_MODEL", str(model))
    monkeypatch.setenv("QKROPE_IMG_SHAPES", "1x2x3,1x2x2")
    monkeypatch.setenv("QKROPE_TXT_LEN", "4")
    monkeypatch.setenv("QKROPE_BATCH", "1")
    feeds = next(iter(dl.load_data()))
    assert feeds["hidden_states"].shape[:2] == (1, 10)
    assert feeds["txt_cos_sin_cache"].shape[0] == 4
    monkeypatch.setenv("QKROPE_IMG_SHAPES", "1x2")
    with pytest.raises(InputError, match="FxHxW"):
        next(iter(dl.load_data()))


def test_model_from_the_command_line(model, monkeypatch):
    monkeypatch.delenv("QKROPE_MODEL", raising=False)
    assert dl.find_model(["polygraphy", "run", str(model), "--onnxrt"]) == model
    with pytest.raises(InputError, match="QKROPE_MODEL"):
        dl.find_model(["polygraphy", "run", "--onnxrt"])


@pytest.mark.parametrize("name, value", [("QKROPE_BATCH", "0"), ("QKROPE_BATCH", "two"),
                                         ("QKROPE_BATCH", "-1"), ("QKROPE_TXT_LEN", "0"),
                                         ("QKROPE_TXT_LEN", "1.5"), ("QKROPE_SEED", "x")])
def test_junk_or_zero_sizes_are_one_line_errors(model, monkeypatch, name, value):
    """QKROPE_BATCH=0 used to be replaced by the export sample without a word."""
    monkeypatch.setenv("QKROPE_MODEL", str(model))
    monkeypatch.setenv(name, value)
    with pytest.raises(InputError, match=rf"{name} must be an integer.*; got '{value}'\. Fix: "):
        next(iter(dl.load_data()))


def test_a_deeply_nested_sidecar_is_a_sidecar_error(model, tmp_path, monkeypatch):
    import shutil

    from qkrope.sidecars import SidecarError

    bad = tmp_path / "deep.onnx"
    shutil.copy(model, bad)
    Path(str(bad) + ".json").write_text("[" * 100000 + "]" * 100000)
    monkeypatch.setenv("QKROPE_MODEL", str(bad))
    with pytest.raises(SidecarError, match="nested deeper than"):
        next(iter(dl.load_data()))
