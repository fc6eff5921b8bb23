"""`qkrope build` keeps an engine whose sidecar records the same model hash, build options,
TensorRT version, GPU and plugin hash (and says so); anything changed, or --force, rebuilds.
The decision runs through the fake TensorRT (tests/fake_tensorrt.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import fake_tensorrt as ft
import pytest
from _tiny_model import parse_tiny, write_tiny_onnx

from qkrope import cli
from qkrope.runtime import engine as eng
from qkrope.runtime import loader_tensorrt as lt
from qkrope.runtime import trt_utils as tu


@pytest.fixture
def setup(tmp_path, monkeypatch):
    """``setup(version)``: a fake TensorRT whose builds are counted in ``state.builds``."""
    monkeypatch.setattr(lt.ctypes, "CDLL", lambda path, mode=0: None)
    monkeypatch.setattr(tu, "gpu_info", lambda: {"name": "NVIDIA H200", "compute_capability": "9.0",
                                                 "index": 0})
    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF fake")
    onnx_path = write_tiny_onnx(tmp_path / "m.onnx")

    def make(version="10.14.1"):
        trt, state = ft.make_fake_trt(version, parse=parse_tiny)
        state.builds = 0
        build = trt.Builder.build_serialized_network

        def counted(self, network, config):
            state.builds += 1
            return build(self, network, config)

        trt.Builder.build_serialized_network = counted
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        return state

    return make, onnx_path, lib


def _build(onnx_path, lib, *extra):
    return cli.main(["build", str(onnx_path), "--plugin", str(lib), "--no-progress", *extra])


def test_an_unchanged_build_keeps_the_engine_and_says_so(setup, capsys):
    make, onnx_path, lib = setup
    state = make()
    assert _build(onnx_path, lib) == 0 and state.builds == 1
    engine = onnx_path.with_suffix(".engine")
    side = json.loads(Path(str(engine) + ".json").read_text())
    key = side["build_key"]
    assert set(key) == {"model_sha256", "options", "tensorrt_version", "gpu", "plugin_sha256",
                        "engine_sha256"}
    assert key["tensorrt_version"] == "10.14.1" and key["gpu"] == {
        "name": "NVIDIA H200", "compute_capability": "9.0"}
    capsys.readouterr()
    mtime = engine.stat().st_mtime_ns
    assert _build(onnx_path, lib) == 0
    out = capsys.readouterr()
    assert state.builds == 1, "an up-to-date engine was rebuilt"
    assert f"kept {engine}: up to date" in out.out and "--force" in out.out
    assert engine.stat().st_mtime_ns == mtime
    assert _build(onnx_path, lib, "--force") == 0 and state.builds == 2
    assert "wrote" in capsys.readouterr().out


def _changed(setup, capsys, change) -> str:
    """Build, ``change`` something, build again: it must rebuild; returns the reason it gave."""
    make, onnx_path, lib = setup
    make()
    assert _build(onnx_path, lib) == 0
    args = change(onnx_path, lib)
    args = args if isinstance(args, list) else []
    state = make("10.15.1") if args == ["new-trt"] else make()
    capsys.readouterr()
    assert _build(onnx_path, lib, *([] if args == ["new-trt"] else args)) == 0
    err = capsys.readouterr().err
    assert state.builds == 1, f"not rebuilt: {err}"
    (line,) = [ln for ln in err.splitlines() if "[build] building" in ln]
    return line.split(": ", 1)[1]


def test_a_changed_model_option_tensorrt_gpu_or_plugin_rebuilds(setup, capsys, monkeypatch):
    def weights(onnx_path, lib):
        import onnx

        m = onnx.load(str(onnx_path))
        m.graph.initializer[0].float_data[0] = 2.0
        onnx.save(m, str(onnx_path))
        side = Path(str(onnx_path) + ".json")
        data = json.loads(side.read_text())
        data.pop("model_sha256", None)
        side.write_text(json.dumps(data))

    assert _changed(setup, capsys, weights) == "changed since it was built: model_sha256"
    assert _changed(setup, capsys, lambda o, lib: ["--max-img-tokens", "32"]) == \
        "changed since it was built: options"
    assert _changed(setup, capsys, lambda o, lib: lib.write_bytes(b"\x7fELF other")) == \
        "changed since it was built: plugin_sha256"
    assert _changed(setup, capsys, lambda o, lib: ["new-trt"]) == \
        "changed since it was built: tensorrt_version"

    def other_gpu(o, lib):
        monkeypatch.setattr(tu, "gpu_info", lambda: {"name": "NVIDIA L40S",
                                                     "compute_capability": "8.9", "index": 0})

    assert _changed(setup, capsys, other_gpu) == "changed since it was built: gpu"


def test_an_engine_without_a_build_key_is_rebuilt(setup, capsys):
    def drop_key(onnx_path, lib):
        side = Path(str(onnx_path.with_suffix(".engine")) + ".json")
        data = json.loads(side.read_text())
        del data["build_key"]
        side.write_text(json.dumps(data))

    # the build key is one of the facts the engine's tag covers: a sidecar that lost it no
    # longer describes the engine (an older qkrope's engine, without the tag, would be rebuilt
    # for "records no build key")
    assert "edited or belongs to another build" in _changed(setup, capsys, drop_key)


def test_external_data_files_are_part_of_the_model_hash(tmp_path):
    import onnx

    import numpy as np
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", 1, [1, 4])],
                              [helper.make_tensor_value_info("y", 1, [1, 4])], [w])
    path = tmp_path / "x.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True,
              location="x.onnx.data", size_threshold=0)
    before = eng.model_sha256(path)
    data = tmp_path / "x.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    assert eng.model_sha256(path) != before


def test_an_engine_file_replaced_since_the_build_is_rebuilt(setup, capsys):
    why = _changed(setup, capsys,
                   lambda onnx_path, lib: onnx_path.with_suffix(".engine").write_bytes(b"\x00x"))
    assert "not what the build wrote" in why and "does not describe this engine" in why, why


def test_the_up_to_date_check_reads_no_weights(setup, capsys, monkeypatch):
    """A model whose sidecar has the file records (ModelInfo.save: the exporter's writer) and
    an engine built from it: the second `qkrope build` decides "up to date" from the stat
    records, hashing neither the model, its external data nor the engine."""
    from _tiny_model import move_weights_out, sidecar_dict

    from qkrope import file_record
    from qkrope.sidecars import ModelInfo

    make, onnx_path, lib = setup
    move_weights_out(onnx_path, "m.onnx.data")
    ModelInfo.from_dict(sidecar_dict()).save(onnx_path)
    state = make()
    assert _build(onnx_path, lib) == 0 and state.builds == 1
    hashed = []
    real = file_record.sha256_file

    def spy(path):
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(file_record, "sha256_file", spy)
    monkeypatch.setattr(eng, "sha256_file", spy)
    capsys.readouterr()
    assert _build(onnx_path, lib) == 0 and state.builds == 1
    assert "up to date" in capsys.readouterr().out
    assert hashed == [lib.name], hashed  # the plugin library only (its hash is in the key)
    (onnx_path.parent / "m.onnx.data").write_bytes(b"\0" * 64)  # new weights, same size
    assert _build(onnx_path, lib) == 2  # the sidecar no longer describes the data: refused
    err = capsys.readouterr().err
    assert "does not describe this model's external data file" in err and "m.onnx.data" in err, err
