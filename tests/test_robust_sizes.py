"""Issue 34, class 4 (the export side): sizes are checked against the weights before anything is
built from them. A config.json claiming 1,000,000 blocks over two blocks' shards is refused from
the headers before the placeholder skeleton is built (the builder is never called); a build that
registers far more parameters than the files hold stops at once (counted, not timed)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from _oneline import error_lines  # noqa: E402

from qkrope import diffusers_weights as dw  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402
from qkrope.export import streaming  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("sizes") / "tiny"
    tp.tiny_transformer().save_pretrained(str(d), max_shard_size="200KB")  # 2 blocks
    return d


@pytest.mark.parametrize("field, value", [("num_layers", 1_000_000), ("num_layers", 3)])
def test_a_config_claiming_more_blocks_than_the_shards_is_refused_before_the_skeleton(
        saved, tmp_path, monkeypatch, capsys, field, value):
    d = tmp_path / "model"
    shutil.copytree(saved, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[field] = value
    (d / "config.json").write_text(json.dumps(cfg))
    built = []
    monkeypatch.setattr(streaming, "placeholder_module",
                        lambda *a, **kw: built.append(a) or pytest.fail("skeleton built"))
    rc = main(["export", "--model", "transformer", "--diffusers", str(d), "--out",
               str(tmp_path / "o" / "m.onnx")])
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert rc == 2 and not built and "Traceback" not in err and len(lines) == 1, err
    assert f"{field} is {value}" in lines[0] and "at most 2 numbered blocks" in lines[0]


def test_numbered_lists_from_the_headers(saved):
    lists = streaming.numbered_lists(dw.tensor_headers(saved))
    assert lists["transformer_blocks"] == 2
    assert streaming.numbered_lists(["a.0.w", "a.1.w", "a.1.b", "b.w", "c.x.3.w"]) == {
        "a": 2, "c.x": 1}


def test_the_skeleton_build_stops_at_what_the_files_hold(saved):
    """A build of 100,000 Linear layers over the tiny folder's headers stops after about twice
    their count of tensors: the number of modules built is bounded by the files, not the
    config."""
    headers = dw.tensor_headers(saved)
    made = []

    def build():
        layers = []
        for _ in range(100_000):
            layers.append(nn.Linear(4, 4))
            made.append(1)
        return nn.Sequential(*layers)

    with pytest.raises(streaming.SizeError, match="more parameters than the weight files hold"):
        streaming.placeholder_module(build, dtype=torch.float32, within=headers, source="D")
    # each Linear registers 2 parameters; the budget is 2 * len(headers) + 64
    assert len(made) <= (2 * len(headers) + 64) // 2 + 1


def test_a_model_that_fits_is_built_as_before(saved):
    import diffusers

    headers = dw.tensor_headers(saved)
    cls = diffusers.QwenImageTransformer2DModel
    config = cls.load_config(str(saved))
    streaming.check_config_sizes(config, headers, source="D")
    model = streaming.placeholder_module(lambda: cls.from_config(config), dtype=torch.float32,
                                         within=headers, source="D")
    assert {k for k, _ in model.named_parameters()} <= set(headers)
