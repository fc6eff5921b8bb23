"""`qkrope build` of an FP8 export through the fake tensorrt (tests/fake_tensorrt.py): strongly
typed, no precision flag, detailed profiling for the engine inspector, GPUs below compute
capability 8.9 refused with the reason, and the built engine's plugin and FP8 layers verified."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import fake_tensorrt as ft
import pytest
from _tiny_model import parse_tiny, write_tiny_onnx

from qkrope.runtime import engine as eng
from qkrope.runtime import loader_tensorrt as lt
from qkrope.runtime import fp8_engine
from qkrope.runtime import trt_utils as tu

HOPPER = {"name": "NVIDIA H200", "compute_capability": "9.0", "index": 0}
AMPERE = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "index": 0}


@pytest.fixture
def fp8_build(tmp_path, monkeypatch):
    def setup(gpu=HOPPER, **kw):
        trt, state = ft.make_fake_trt(parse=parse_tiny)
        ft.add_engine_inspector(trt, state, **kw)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setattr(lt.ctypes, "CDLL",
                            lambda path, mode=0: state.loaded.append(("dlopen", path)))
        monkeypatch.setattr(tu, "gpu_info", lambda: gpu)
        lib = tmp_path / "libqkrope_plugin.so"
        lib.write_bytes(b"\x7fELF fake")
        onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
        side = Path(str(onnx_path) + ".json")
        data = json.loads(side.read_text())
        data["config"]["quantization"] = {"mode": "fp8", "quantized_linears": ["to_q"]}
        side.write_text(json.dumps(data))
        return trt, state, onnx_path, lib
    return setup


def _opts(lib, **kw):
    return eng.BuildOptions(plugin=str(lib), progress=False, **kw)


def test_fp8_build_is_strongly_typed_without_precision_flags(fp8_build, tmp_path):
    trt, state, onnx_path, lib = fp8_build()
    log = io.StringIO()
    info = eng.build_engine(onnx_path, tmp_path / "m.engine", _opts(lib), log=log)
    assert state.flags == 1 << 1 and info.strongly_typed  # STRONGLY_TYPED (TensorRT 10)
    assert state.config.flags == []  # no FP8/FP16/BF16 builder flag
    assert state.config.profiling_verbosity == "DETAILED"
    assert state.deserialized == ft.plan_bytes(state.network_name)  # the inspector read it
    engine_q = info.config.quantization["engine"]
    assert engine_q == {"layers": 3, "plugin_layers": 2, "fp8_layers": 1}
    assert "1 of 3 layers in FP8, 2 plugin layer(s)" in log.getvalue()
    side = json.loads(Path(str(tmp_path / "m.engine") + ".json").read_text())
    assert side["config"]["quantization"]["engine"]["fp8_layers"] == 1


@pytest.mark.parametrize("gpu, match", [(AMPERE, "compute capability 8.0"),
                                        (None, "no CUDA GPU")])
def test_fp8_build_refuses_gpus_below_ada(fp8_build, tmp_path, gpu, match):
    trt, state, onnx_path, lib = fp8_build(gpu=gpu)
    with pytest.raises(fp8_engine.Fp8EngineError, match=match) as exc:
        eng.build_engine(onnx_path, tmp_path / "m.engine", _opts(lib), log=io.StringIO())
    assert "8.9" in str(exc.value) and state.flags is None  # refused before parsing
    assert not (tmp_path / "m.engine").exists()


def test_fp8_engine_without_fp8_layers_fails(fp8_build, tmp_path):
    trt, state, onnx_path, lib = fp8_build(fp8_layers=0)
    with pytest.raises(fp8_engine.Fp8EngineError, match="dropped the quantisation"):
        eng.build_engine(onnx_path, tmp_path / "m.engine", _opts(lib), log=io.StringIO())
    assert not (tmp_path / "m.engine").exists()


def test_fp8_engine_missing_plugin_layers_fails(fp8_build, tmp_path, monkeypatch):
    trt, state, onnx_path, lib = fp8_build()
    real = fp8_engine.inspect_engine

    def fewer(trt_, logger, serialized, names):  # the engine lost one of the plugin layers
        return real(trt_, logger, serialized, list(names) + ["node_missing"])

    monkeypatch.setattr(fp8_engine, "inspect_engine", fewer)
    with pytest.raises(fp8_engine.Fp8EngineError, match="node_missing"):
        eng.build_engine(onnx_path, tmp_path / "m.engine", _opts(lib), log=io.StringIO())


@pytest.mark.parametrize("kw, match", [(dict(refit=True), "--refit"),
                                       (dict(profiling_verbosity="none"), "detailed")])
def test_fp8_build_refuses_options_it_cannot_honour(fp8_build, tmp_path, kw, match):
    trt, state, onnx_path, lib = fp8_build()
    with pytest.raises(fp8_engine.Fp8EngineError, match=match):
        eng.build_engine(onnx_path, tmp_path / "m.engine", _opts(lib, **kw), log=io.StringIO())


def test_inspector_without_details_is_an_error(fp8_build):
    trt, state, onnx_path, lib = fp8_build()
    state.config = type("C", (), {"profiling_verbosity": "LAYER_NAMES_ONLY"})()
    with pytest.raises(fp8_engine.Fp8EngineError, match="DETAILED"):
        fp8_engine.inspect_engine(trt, None, b"x", [])


def test_float_model_build_is_unchanged(fp8_build, tmp_path):
    trt, state, onnx_path, lib = fp8_build()
    side = Path(str(onnx_path) + ".json")
    data = json.loads(side.read_text())
    del data["config"]["quantization"]
    side.write_text(json.dumps(data))
    info = eng.build_engine(onnx_path, tmp_path / "m.engine", _opts(lib), log=io.StringIO())
    assert info.config.quantization is None and not hasattr(state, "deserialized")
    # the float build leaves TensorRT's default verbosity (the FP8 build asks for DETAILED)
    assert state.config.profiling_verbosity == trt.ProfilingVerbosity.LAYER_NAMES_ONLY


@pytest.mark.parametrize("where", ["quantization entry", "config entry"])
def test_an_fp8_model_without_its_sidecar_is_still_an_fp8_build(tmp_path, monkeypatch, where):
    """Without the sidecar, the model's own metadata (qkrope.quantization, or the config's
    quantization) says it is FP8: --refit is refused as for a model with its sidecar (it used
    to build a float-model engine with the FP8 checks skipped)."""
    import onnx

    trt, state = ft.make_fake_trt(parse=parse_tiny)
    ft.add_engine_inspector(trt, state)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(lt.ctypes, "CDLL", lambda path, mode=0: None)
    monkeypatch.setattr(tu, "gpu_info", lambda: HOPPER)
    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF fake")
    onnx_path = write_tiny_onnx(tmp_path / "m.onnx", sidecar=False)
    model = onnx.load(str(onnx_path))
    record = {"mode": "fp8", "quantized_linears": ["to_q"]}
    key, value = (("qkrope.quantization", record) if where == "quantization entry"
                  else ("qkrope.config", {"heads": 2, "quantization": record}))
    model.metadata_props.add(key=key, value=json.dumps(value))
    onnx.save(model, str(onnx_path))
    assert fp8_engine.quantization_of(eng.ModelInfo.describe(onnx_path)) == record
    with pytest.raises(fp8_engine.Fp8EngineError, match="--refit is not available"):
        eng.build_engine(onnx_path, tmp_path / "m.engine", _opts(lib, refit=True),
                         log=io.StringIO())
    assert not (tmp_path / "m.engine").exists()
