"""``qkrope.apps.bench.backends``: the exported block and its inputs, ONNX Runtime's opset-23
probe, the engine builds (no plugin first; detailed layer information) and the TensorRT rows'
loading."""

from __future__ import annotations

from pathlib import Path

import fake_tensorrt as ft
import pytest
import torch

from qkrope.apps import bench
from qkrope.apps.bench import backends, config

try:
    import qkrope.export.onnx_export  # noqa: F401
    HAVE_EXPORTER = True
except ImportError:
    HAVE_EXPORTER = False


@pytest.mark.skipif(not HAVE_EXPORTER, reason="needs the exporter")
def test_eager_block_runs_the_exported_weights(tmp_path):
    """torch-eager and onnxruntime-cpu rows must time the same model: the eager block is the
    exporter's build_attention of the exported sidecar, the inputs ModelInfo.make_inputs."""
    import onnxruntime as ort

    cfg = config.Config(sizes=[64], batches=[2], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", seed=3)
    info = backends._export_onnx(cfg, tmp_path / "a.onnx")
    block = backends._make_block(cfg, info)
    hs, ehs, caches, mask = backends._make_inputs(cfg, info, 64, 2)
    with torch.no_grad():
        img, txt = block(hs, ehs, caches, mask)
    feeds = backends._make_feeds(cfg, info, 64, 2)
    sess = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    ort_img, ort_txt = sess.run(None, feeds)
    assert torch.allclose(img, torch.from_numpy(ort_img), atol=1e-4, rtol=1e-4)
    assert torch.allclose(txt, torch.from_numpy(ort_txt), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not HAVE_EXPORTER, reason="requires the exporter's dependencies")
def test_ort_probe_of_opset23_attention_agrees_with_the_export(tmp_path, monkeypatch):
    """The probe says "" exactly when ONNX Runtime runs a real onnx23 export (bool text mask
    with padding), and a reason naming ONNX Runtime's version when its session fails."""
    import onnxruntime as ort

    from qkrope.export.onnx_export import export_attention
    from qkrope.runtime.inputs import make_inputs

    info, _ = export_attention(tmp_path / "a.onnx", heads=2, head_dim=16, attention="onnx23")
    feeds = make_inputs(info, [(1, 3, 3)], 5, 2, seed=0)
    feeds["encoder_hidden_states_mask"][0, -2:] = False
    try:
        ort.InferenceSession(str(tmp_path / "a.onnx"),
                             providers=["CPUExecutionProvider"]).run(None, feeds)
        runs = True
    except Exception:  # noqa: BLE001
        runs = False
    assert (backends.ort_attention23_reason() == "") == runs

    def refuse(*a, **k):
        raise RuntimeError("no kernel for Attention(23)")

    monkeypatch.setattr(ort, "InferenceSession", refuse)
    reason = backends.ort_attention23_reason()
    assert ort.__version__ in reason and "no kernel for Attention(23)" in reason


def test_engines_are_built_per_form_no_plugin_first(tmp_path, monkeypatch):
    """_build_engines: every form's no-plugin engine before any plugin engine (the plugin must
    not be registered yet), given engines not rebuilt, failures as reasons."""
    from qkrope.runtime import engine as E

    built, seen_options = [], []

    def fake_build(onnx_path, engine_path, opts):
        built.append((Path(onnx_path).name, Path(engine_path).name, opts.use_plugin))
        seen_options.append({"profiling_verbosity": opts.profiling_verbosity})
        if "onnx23" in str(engine_path) and opts.use_plugin:
            raise RuntimeError("parser: no importer for Attention")

    monkeypatch.setattr(E, "build_engine", fake_build)
    cfg = config.Config(sizes=[256, 512], batches=[1], dtype="bfloat16", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cuda")
    paths = {"primitive": tmp_path / "attention.primitive.onnx",
             "onnx23": tmp_path / "attention.onnx23.onnx"}
    out = backends._build_engines(cfg, paths, tmp_path, lambda s: None,
                               skip={("trt-plugin", "primitive")})
    assert built == [("attention.primitive.onnx", "attention.primitive.noplugin.engine", False),
                     ("attention.onnx23.onnx", "attention.onnx23.noplugin.engine", False),
                     ("attention.onnx23.onnx", "attention.onnx23.engine", True)]
    assert out[("trt-function-body", "onnx23")][0].endswith("attention.onnx23.noplugin.engine")
    path, reason = out[("trt-plugin", "onnx23")]
    assert path is None and "no importer for Attention" in reason
    assert ("trt-plugin", "primitive") not in out
    assert all(kw["profiling_verbosity"] == "detailed" for kw in seen_options)


def test_build_options_profiling_verbosity_reaches_the_builder_config(tmp_path, monkeypatch):
    """BuildOptions.profiling_verbosity sets config.profiling_verbosity (the fake TensorRT of
    tests/fake_tensorrt.py); unset, the config keeps TensorRT's default (LAYER_NAMES_ONLY); a
    bad value is refused before TensorRT is asked."""
    import io
    import sys

    from _tiny_model import parse_tiny, write_tiny_onnx

    from qkrope.runtime import engine as E
    from qkrope.runtime import loader_tensorrt as lt

    trt, state = ft.make_fake_trt(parse=parse_tiny)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(lt.ctypes, "CDLL", lambda path, mode=0: None)
    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF fake")
    onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
    E.build_engine(onnx_path, tmp_path / "a.engine",
                   E.BuildOptions(plugin=str(lib), progress=False,
                                  profiling_verbosity="detailed"), log=io.StringIO())
    assert state.config.profiling_verbosity == trt.ProfilingVerbosity.DETAILED
    E.build_engine(onnx_path, tmp_path / "b.engine",
                   E.BuildOptions(plugin=str(lib), progress=False), log=io.StringIO())
    assert state.config.profiling_verbosity == trt.ProfilingVerbosity.LAYER_NAMES_ONLY  # default
    with pytest.raises(E.EngineBuildError, match="profiling_verbosity"):
        E.check_options(E.BuildOptions(profiling_verbosity="loud"))


def test_cuda_graph_reaches_the_tensorrt_rows(monkeypatch):
    """`qkrope bench --cuda-graph`: the engines are loaded with cuda_graph=True."""
    import argparse

    from qkrope import runtime

    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    args = ap.parse_args(["bench", "--device", "cpu", "--cuda-graph"])
    cfg = config.config_from_args(args)
    assert cfg.cuda_graph is True
    assert config.config_from_args(ap.parse_args(["bench", "--device", "cpu"])).cuda_graph is False
    seen = {}

    class Stop(Exception):
        pass

    def fake_load(path, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(runtime, "load", fake_load)
    with pytest.raises(Stop):
        backends._engine_backend(cfg, "trt-plugin", "primitive", "m.engine", "p.so", None, {})
    assert seen == {"plugin": "p.so", "cuda_graph": True, "allow_host_code": False}


def test_a_version_compatible_engine_runs_only_with_allow_host_code(tmp_path, monkeypatch, capsys):
    """`qkrope bench --engine VC.engine`: refused in one line naming --allow-host-code (a flag
    bench has), before any work; with it, the consent reaches qkrope.runtime.load."""
    import argparse
    import json

    from _oneline import error_line
    from test_triton import _sidecar

    from qkrope import runtime
    from qkrope.cli import main as cli_main

    plugin = tmp_path / "libqkrope_vc_plugin.so"
    plugin.write_bytes(b"\x7fELF fake VC plugin")
    eng = tmp_path / "vc.engine"
    eng.write_bytes(b"not really a TensorRT plan" * 10)
    side = _sidecar(plugin)
    side["version_compatible"] = True
    (tmp_path / "vc.engine.json").write_text(json.dumps(side))
    out = tmp_path / "out"
    assert cli_main(["bench", "--device", "cpu", "--engine", str(eng), "--out", str(out)]) != 0
    msg = error_line(capsys)
    assert "version-compatible" in msg and "--allow-host-code" in msg, msg
    assert not out.exists()

    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    cfg = config.config_from_args(ap.parse_args(["bench", "--device", "cpu", "--engine",
                                                 str(eng), "--allow-host-code"]))
    seen = {}

    class Stop(Exception):
        pass

    def fake_load(path, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(runtime, "load", fake_load)
    with pytest.raises(Stop):
        backends._engine_backend(cfg, "trt-plugin", "primitive", str(eng), str(plugin), None, {})
    assert seen["allow_host_code"] is True
