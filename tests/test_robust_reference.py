"""Issue 34, class 7 (reference folders): `qkrope check`'s --diffusers folder of another width,
or with a malformed config.json (`num_layers: "two"`), is one line naming the field, before
anything is built or compared (it used to raise a raw traceback or compare the wrong model)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from _oneline import error_lines  # noqa: E402

from qkrope import diffusers_weights as dw  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("ref")
    tp.tiny_transformer().save_pretrained(str(d / "tiny"))
    out = d / "out" / "m.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(d / "tiny"), "--layers",
                 "1", "--out", str(out)]) == 0
    return d / "tiny", out


def _check(out, folder, tmp_path, capsys) -> str:
    rc = main(["check", str(out), "--diffusers", str(folder), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_a_reference_folder_of_another_width_is_one_line(exported, tmp_path, capsys):
    import diffusers

    _, out = exported
    cfg = dict(tp.TRANSFORMER_CONFIG, num_attention_heads=4)
    wide = tmp_path / "wide"
    diffusers.QwenImageTransformer2DModel(**cfg).save_pretrained(str(wide))
    line = _check(out, wide, tmp_path, capsys)
    assert "num_attention_heads" in line and "4" in line and "2" in line and "--diffusers" in line


@pytest.mark.parametrize("field, value", [("num_layers", "two"), ("attention_head_dim", 1.5),
                                          ("axes_dims_rope", [8, "x", 12])])
def test_a_reference_folder_with_a_malformed_config_is_one_line(exported, tmp_path, capsys,
                                                                field, value):
    folder, out = exported
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg[field] = value
    (bad / "config.json").write_text(json.dumps(cfg))
    line = _check(out, bad, tmp_path, capsys)
    assert field in line and json.dumps(value) in line


def test_without_a_recorded_config_the_sizes_are_still_checked(tmp_path):
    """An older sidecar without diffusers_config: the folder's sizes are still integers."""
    (tmp_path / "config.json").write_text(json.dumps({"num_layers": "two"}))
    with pytest.raises(dw.DiffusersWeightsError, match="num_layers = \"two\", not a size"):
        dw.check_reference_config(tmp_path, None, source="s")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(dw.DiffusersWeightsError, match="not readable JSON"):
        dw.check_reference_config(tmp_path, None, source="s")
    (tmp_path / "config.json").write_text(json.dumps({"num_layers": 2, "out_channels": None,
                                                      "mlp_ratio": 3.0}))
    assert dw.check_reference_config(tmp_path, {"num_layers": 2}, source="s")["num_layers"] == 2
