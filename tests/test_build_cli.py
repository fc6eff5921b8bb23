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
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.onnx").write_bytes(b"")  # the app checks the path before build_engine
    args = ap.parse_args(["build", "m.onnx", "--max", "encoder_hidden_states:[2,40,32]",
                          "--min", "encoder_hidden_states:1x1x32"])
    build_app.run(args)
    assert seen["opts"].max_shapes == {"encoder_hidden_states": (2, 40, 32)}
    assert seen["opts"].min_shapes == {"encoder_hidden_states": (1, 1, 32)}


# --------------------------------------------------------------------------------------------
# Arguments and the model before TensorRT: without TensorRT, every
# one of these is reported as itself, in one line, and nothing is written
# --------------------------------------------------------------------------------------------

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from _bad_nodes import BAD_NODE_CASES, BROKEN_FILES, write_bad_copy  # noqa: E402
from _bad_nodes import write_broken_copy  # noqa: E402
from _tiny_model import write_tiny_onnx  # noqa: E402


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError


def _build(tmp_path, capsys, onnx_path, *extra):
    from qkrope import cli

    before = sorted(p.name for p in tmp_path.iterdir())
    rc = cli.main(["build", str(onnx_path), "-o", str(tmp_path / "m.engine"), *extra])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "NGC TensorRT container" not in err, f"TensorRT was required first: {err}"
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    return err


@pytest.mark.parametrize("case", list(BAD_NODE_CASES))
def test_build_refuses_nodes_that_break_the_contract(tmp_path, capsys, no_tensorrt, case):
    good = write_tiny_onnx(tmp_path / "good.onnx")
    bad, attribute, node = write_bad_copy(good, tmp_path / "bad.onnx", case)
    err = _build(tmp_path, capsys, bad)
    assert attribute in err and node in err


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_build_unreadable_onnx_is_reported_without_tensorrt(tmp_path, capsys, no_tensorrt,
                                                            case):
    good = write_tiny_onnx(tmp_path / "good.onnx")
    bad = write_broken_copy(good, tmp_path / "bad.onnx", case)
    assert "not a readable ONNX model" in _build(tmp_path, capsys, bad)


def test_build_model_without_qknorm_rope_nodes(tmp_path, capsys, no_tensorrt):
    import onnx

    path = write_tiny_onnx(tmp_path / "m.onnx")
    model = onnx.load(str(path))
    keep = [n for n in model.graph.node if n.op_type != "QKNormRoPE"]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    onnx.save(model, str(path))
    assert "no QKNormRoPE nodes" in _build(tmp_path, capsys, path)


@pytest.mark.parametrize("args,match", [
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-img-tokens", "-4"], "--max-img-tokens must be >= 1"),
    (["--max", "hidden_states:0x16x32"], "dimension < 1"),
    (["--max", "hidden_states:2x16"], "hidden_states"),
    (["--opt", "nosuchinput:1x2"], "nosuchinput"),
    (["--plugin", "/nonexistent/libqkrope_plugin.so"], "does not exist"),
    (["--workspace", "0"], "--workspace"),
    (["--resolutions", "1000x1000"], "multiples of 16"),
    (["--resolutions", "1024"], "WIDTHxHEIGHT"),
    (["--txt-tokens", "512:1"], "--txt-tokens"),
    (["--batch", "0:2"], "--batch"),
    (["--resolutions", "512x512", "--max-txt-tokens", "40"], "--txt-tokens MIN:MAX"),
    # Qwen-Image's RoPE tables hold 4096 positions per axis and direction: 131088 px = 8193
    # patches, centred 4097 one way; a 1024x1024 image (64 patches) starts the text at 32
    (["--resolutions", "131088x16"], "needs 4097 RoPE positions"),
    (["--resolutions", "512x512,1024x1024", "--txt-tokens", "1:4065"],
     "more than the 4064 text positions"),
    (["--workspace", str((1 << 20) + 1)], "1 TiB"),
])
def test_build_arguments_are_checked_before_tensorrt(tmp_path, capsys, no_tensorrt, args, match):
    path = write_tiny_onnx(tmp_path / "m.onnx")
    assert match in _build(tmp_path, capsys, path, *args)


@pytest.mark.parametrize("sidecar", ["[]", '{"format": "qkrope-onnx", "format_version": 1}',
                                     '{"format": "qkrope-engine", "format_version": 1}'])
def test_build_wrong_shape_sidecar_is_one_line(tmp_path, capsys, no_tensorrt, sidecar):
    path = write_tiny_onnx(tmp_path / "m.onnx")
    Path(str(path) + ".json").write_text(sidecar)
    assert "m.onnx.json" in _build(tmp_path, capsys, path)


def test_build_preset_flags_reach_the_builder(monkeypatch, tmp_path):
    """--resolutions / --txt-tokens / --batch / --refit become BuildOptions."""
    import argparse

    seen = {}
    monkeypatch.setattr(eng, "build_engine",
                        lambda onnx, out, opts: seen.setdefault("opts", opts) and types.SimpleNamespace(
                            gpu={}, tensorrt_version="x", plugin_layers=2,
                            version_compatible=False, refittable=True, profiles=[{}, {}]))
    ap = argparse.ArgumentParser()
    from qkrope.apps import build as build_app

    build_app.add_parser(ap.add_subparsers())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.onnx").write_bytes(b"")  # the app checks the path before build_engine
    build_app.run(ap.parse_args(["build", "m.onnx", "--resolutions", "512x512,1328x1328",
                                 "--txt-tokens", "1:256", "--batch", "1:2", "--refit"]))
    opts = seen["opts"]
    assert opts.resolutions == [(512, 512), (1328, 1328)]
    assert opts.txt_tokens == (1, 256) and opts.batch == (1, 2) and opts.refit is True


def _other_model(d):
    write_tiny_onnx(d / "other.onnx")


def _notes(d):
    (d / "notes.txt").write_text("my notes\n")


def _readme(d):
    (d / "notes.md").write_text("# notes\n\nkept\n")


def _json(d):
    (d / "settings.json").write_text('{"theme": "dark"}\n')


def _other_engine(d):
    (d / "old.engine").write_bytes(b"\x00\x01 a serialised engine")
    (d / "old.engine.json").write_text('{"format": "qkrope-engine", "format_version": 1}')


def _link_to_model(d):
    (d / "link.engine").symlink_to(d / "m.onnx")


@pytest.mark.parametrize("setup, extra, says", [
    (None, ["-o", "{d}/m.onnx.json"], "same file as"),               # the model's own sidecar
    (_link_to_model, ["-o", "{d}/link.engine"], "same file as"),     # the model, by a symlink
    (_other_model, ["-o", "{d}/other.onnx"], "is an ONNX model, not a TensorRT engine"),
    (_other_model, ["-o", "{d}/other.engine.x"], None),               # control: a new name builds
    (None, ["--timing-cache", "{d}/m.onnx"], "same file as"),
    (None, ["--timing-cache", "{d}/m.onnx.json"], "same file as"),
    (None, ["--timing-cache", "{d}/m.engine"], "same file as"),      # the engine it writes
    (_other_model, ["--timing-cache", "{d}/other.onnx"], "is an ONNX model, not a TensorRT "
                                                         "timing cache"),
    (_notes, ["--timing-cache", "{d}/notes.txt"], "is a text file"),
    (_other_engine, ["--timing-cache", "{d}/old.engine"], "has the sidecar"),
    (_notes, ["-o", "{d}/notes.txt.engine"], None),                   # control
    (_notes, ["-o", "{d}/notes.txt"], "is a text file, not a TensorRT engine"),  # issue 26
    (_readme, ["-o", "{d}/notes.md"], "is a text file, not a TensorRT engine"),
    (_json, ["-o", "{d}/settings.json"], "is a JSON file, not a TensorRT engine"),
])
def test_build_outputs_that_are_inputs_or_other_files_are_refused(tmp_path, capsys, no_tensorrt,
                                                                  setup, extra, says):
    """Every output the build writes (engine, its sidecar, the timing cache) is checked before
    any work: none may be a file the build reads or writes otherwise, or an existing file of
    another kind (it is not replaced)."""
    path = write_tiny_onnx(tmp_path / "m.onnx")
    if setup is not None:
        setup(tmp_path)
    extra = [a.format(d=tmp_path) for a in extra]
    if says is None:  # passes the checks, then needs TensorRT
        from qkrope import cli

        assert cli.main(["build", str(path), *extra]) == 2
        assert "tensorrt" in capsys.readouterr().err.lower()
        return
    err = _build(tmp_path, capsys, path, *extra)
    assert says in err and ("choose another" in err), err
