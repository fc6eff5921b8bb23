"""qkrope.apps.build: `qkrope build`'s arguments reach the builder."""

from __future__ import annotations

import types

import pytest

from qkrope.runtime import engine as eng


def test_build_help_names_both_shape_syntaxes(capsys):
    from qkrope import cli

    with pytest.raises(SystemExit):
        cli.main(["build", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "NAME:DIMxDIMx... (trtexec's --minShapes syntax)" in text
    assert "NAME:[DIM,DIM,...] (polygraphy's --trt-min-shapes syntax)" in text
    assert "(polygraphy syntax)" not in text


def test_fake_build_accepts_polygraphy_shapes(tmp_path, monkeypatch):
    """--max NAME:[...] reaches the profile exactly like NAME:DxD."""
    import argparse

    seen = {}
    monkeypatch.setattr(eng, "build_engine",
                        lambda onnx, out, opts: seen.setdefault("opts", opts) and types.SimpleNamespace(
                            gpu={}, tensorrt_version="x", plugin_layers=2,
                            version_compatible=False))
    ap = argparse.ArgumentParser()
    from qkrope.apps import build as build_app

    build_app.add_parser(ap.add_subparsers())
    args = ap.parse_args(["build", "m.onnx", "--max", "encoder_hidden_states:[2,40,32]",
                          "--min", "encoder_hidden_states:1x1x32"])
    build_app.run(args)
    assert seen["opts"].max_shapes == {"encoder_hidden_states": (2, 40, 32)}
    assert seen["opts"].min_shapes == {"encoder_hidden_states": (1, 1, 32)}
