"""The transformer export as a Python function (``qkrope.export.export_transformer``): the same
options and defaults as ``qkrope export --model transformer`` (one home: qkrope.export.api), the
same files, and nothing heavy imported until it is called."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

import qkrope.export
from qkrope.errors import QkropeError
from qkrope.export import api


def test_lazy_and_light():
    """``import qkrope.export`` and looking the function up import neither torch nor onnx."""
    code = ("import sys, qkrope.export as e; f = e.export_transformer; "
            "print(f.__module__, 'torch' in sys.modules, 'onnx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["qkrope.export.api", "False", "False"]
    assert qkrope.export.export_transformer is api.export_transformer
    assert "export_transformer" in dir(qkrope.export)


def test_the_cli_and_the_api_share_their_defaults():
    """Every option of the function is one of the command's, with the command's default."""
    from qkrope.cli import build_parser

    params = inspect.signature(api.export_transformer).parameters
    options = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - {"progress"}
    assert options == set(api.DEFAULTS)
    assert {n: params[n].default for n in options} == api.DEFAULTS
    args = build_parser().parse_args(["export", "--model", "transformer", "--diffusers", "d"])
    cli_name = {"img_shapes": "img_shape"}
    assert {n: getattr(args, cli_name.get(n, n)) for n in options} == api.DEFAULTS


def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(QkropeError) as info:  # InputFileNotFoundError: the CLI's one line
        api.export_transformer(tmp_path / "missing", progress=False)
    assert "--diffusers" in str(info.value) and "\n" not in str(info.value)


def test_export_writes_what_the_cli_writes(tmp_path, capsys):
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    import onnx
    from onnx import numpy_helper

    from qkrope.apps import tiny_pipeline as tp
    from qkrope.cli import main

    folder = tp.save_transformer(tp.tiny_transformer(), tmp_path / "t")
    result = qkrope.export.export_transformer(folder, tmp_path / "api.onnx", layers=1,
                                              progress=False)
    assert capsys.readouterr().err == ""  # progress=False prints nothing
    assert result.dtype == "fp32" and "checkpoint's dtype" in result.dtype_reason
    assert result.out == tmp_path / "api.onnx"
    assert [p.name for p in result.paths] == ["api.onnx", "api.onnx.json"]
    assert result.info.config.num_layers_exported == 1
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--layers", "1",
                 "--out", str(tmp_path / "cli.onnx")]) == 0

    def initializers(path):
        graph = onnx.load(str(path)).graph
        return {t.name: numpy_helper.to_array(t).tobytes() for t in graph.initializer}

    assert initializers(tmp_path / "api.onnx") == initializers(tmp_path / "cli.onnx")
    sides = [json.loads((tmp_path / f"{n}.onnx.json").read_text()) for n in ("api", "cli")]
    for side in sides:
        for key in ("write_id", "model_sha256", "model_file", "created"):
            side.pop(key, None)
    assert sides[0] == sides[1]


@pytest.mark.parametrize("case", ["variant", "out under a file", "out deeper under a file",
                                  "out a folder"])
def test_bad_paths_are_the_documented_input_error(tmp_path, case):
    """A variant the folder does not hold and an output that cannot be written are bad
    arguments: InputError in one line, before any work (nothing written)."""
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.errors import InputError

    folder = tp.save_transformer(tp.tiny_transformer(), tmp_path / "t")
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "adir").mkdir()
    kwargs, match = {
        "variant": (dict(out=tmp_path / "m.onnx", variant="x"), r"has no variant 'x' weights"),
        "out under a file": (dict(out=tmp_path / "afile" / "m.onnx"),
                             r"afile is a file, not a folder"),
        "out deeper under a file": (dict(out=tmp_path / "afile" / "b" / "m.onnx"),
                                    r"afile is a file, not a folder"),
        "out a folder": (dict(out=tmp_path / "adir.onnx"), r"is a folder"),
    }[case]
    if case == "out a folder":
        (tmp_path / "adir.onnx").mkdir()
    with pytest.raises(InputError, match=match) as info:
        api.export_transformer(folder, progress=False, **kwargs)
    assert "\n" not in str(info.value) and "Errno" not in str(info.value)
    assert (tmp_path / "afile").read_text() == "mine"
    assert not (tmp_path / "m.onnx").exists()
