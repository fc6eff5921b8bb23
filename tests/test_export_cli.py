"""``qkrope export`` on the command line: bad arguments, unreadable weights, outputs that are
inputs or files of another kind, internal failures: one line, exit 2, nothing written
(export/arguments.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qkrope.cli import main
from qkrope.export.onnx_export import ExportError, export_attention

HEADS, HEAD_DIM = 2, 64


def _no_outputs(directory: Path):
    leftovers = [p.name for p in directory.iterdir()]
    assert leftovers == [], leftovers


@pytest.mark.parametrize("argv,message", [
    (["--model", "transformer", "--diffusers", "/nonexistent/qwen"], "does not exist"),
    (["--model", "transformer"], "needs --diffusers"),
    (["--model", "transformer", "--diffusers", "/x", "--weights", "w.pt", "--heads", "4"],
     "--heads, --weights apply to --model attention only"),
    (["--heads", "2", "--head-dim", "64", "--rotary-dim", "70"], "rotary-dim"),
    (["--heads", "2", "--head-dim", "64", "--img-shape", "1", "0", "4"], "positive"),
    (["--heads", "2", "--head-dim", "64", "--txt-len", "5000"], "text cache overflow"),
    (["--heads", "2", "--head-dim", "64", "--opset", "13"], "--opset"),
    (["--heads", "0"], "--heads must be >= 1"),
    (["--heads", "2", "--head-dim", "63"], "--head-dim must be even"),
    (["--heads", "2", "--head-dim", "64", "--weights", "/nonexistent/w.safetensors"],
     "does not exist"),
])
def test_cli_bad_input(tmp_path, capsys, argv, message):
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    assert main(["export", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert "qkrope export: error:" in err and message in err
    _no_outputs(out.parent)


def test_cli_unreadable_weights(tmp_path, capsys):
    weights = tmp_path / "w.pt"
    weights.write_text("{}")
    out = tmp_path / "out" / "m.onnx"
    out.parent.mkdir()
    assert main(["export", "--out", str(out), "--heads", "2", "--head-dim", "64", "--weights",
                 str(weights)]) == 2
    err = capsys.readouterr().err
    assert "is not a state dict: it is a JSON file" in err and "save_file(" in err
    _no_outputs(out.parent)


@pytest.mark.parametrize("target, says", [
    ("link.onnx", "same file as"),                 # a symlink to the --weights file
    ("notes.onnx", "is a text file, not an ONNX model"),
    ("side.onnx", "is a JSON file, not a model sidecar"),   # side.onnx.json is someone's JSON
    ("eng.onnx", "is a qkrope engine sidecar, not a model sidecar"),
])
def test_cli_outputs_that_are_inputs_or_other_files_are_refused(tmp_path, capsys, target, says):
    """--out, its .data and its sidecar: none may be the weights read, nor replace an existing
    file of another kind; refused before the trace, nothing changed."""
    from safetensors.torch import save_file

    weights = tmp_path / "w.safetensors"
    save_file({"to_q.weight": torch.ones(2, 2)}, str(weights))
    (tmp_path / "link.onnx").symlink_to(weights)
    (tmp_path / "notes.onnx").write_text("my notes\n")
    (tmp_path / "side.onnx.json").write_text('{"mine": 1}')
    (tmp_path / "eng.onnx.json").write_text('{"format": "qkrope-engine", "format_version": 1}')
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["export", "--out", str(tmp_path / target), "--heads", "2", "--head-dim", "16",
                 "--weights", str(weights)]) == 2
    err = capsys.readouterr().err
    assert says in err and "choose another --out" in err and err.count("\n") == 1, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_export_records_parameter_shapes(tmp_path):
    """config.parameter_shapes: each exported parameter's shape (qkrope refit checks them)."""
    from qkrope.export.onnx_export import build_attention, export_attention

    info, _ = export_attention(tmp_path / "m.onnx", heads=2, head_dim=16)
    sd = build_attention(info).state_dict()
    assert info.config.parameter_shapes == {k: list(v.shape) for k, v in sd.items()}
    assert any(len(v) == 2 for v in info.config.parameter_shapes.values())


def test_cli_keeps_tracebacks_of_internal_failures(tmp_path, monkeypatch):
    """Only input errors become one-line messages; a failure inside a dependency propagates."""
    from qkrope.export import attention_export

    def broken(*a, **k):
        raise RuntimeError("internal failure in a dependency")

    monkeypatch.setattr(attention_export, "_torch_export", broken)
    with pytest.raises(RuntimeError, match="internal failure"):
        main(["export", "--out", str(tmp_path / "m.onnx"), "--heads", "2", "--head-dim", "64"])
    assert not (tmp_path / "m.onnx").exists()


def test_cli_unknown_dtype(tmp_path, capsys):
    out = tmp_path / "m.onnx"
    with pytest.raises(SystemExit) as exc:
        main(["export", "--out", str(out), "--dtype", "int8"])
    assert exc.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err
    assert not out.exists()


def test_failed_export_leaves_nothing(tmp_path, monkeypatch):
    from qkrope.export import save

    def boom(path):
        raise ExportError("simulated checker failure")

    monkeypatch.setattr(save, "verify_onnx_file", boom)
    with pytest.raises(ExportError):
        export_attention(tmp_path / "m.onnx", heads=HEADS, head_dim=HEAD_DIM)
    _no_outputs(tmp_path)


