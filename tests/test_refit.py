"""qkrope refit: the name map (refitter weight names == ONNX initializer names == diffusers
state-dict keys) over the fake TensorRT Refitter; errors for missing/extra/mismatched weights;
the CLI writes the refitted engine and its sidecar as a pair."""

from __future__ import annotations

import sys

import fake_tensorrt as ft
import pytest
import torch

from qkrope.apps import refit as rf
from qkrope.apps.tiny_pipeline import tiny_transformer


@pytest.fixture(scope="module")
def state_dict():
    pytest.importorskip("diffusers")
    return tiny_transformer().state_dict()


def _engine_for(sd, **kw):
    return ft.RefittableEngine({k: ("FLOAT", v.numel()) for k, v in sd.items()}, **kw)


def test_name_map_covers_the_tiny_transformer(state_dict):
    trt, _ = ft.make_fake_trt()
    engine = _engine_for(state_dict)
    report = rf.refit_engine(trt, engine, None, state_dict)
    assert report.refitted == sorted(state_dict) and not report.not_covered
    assert not report.not_in_engine
    assert engine.refits == [sorted(state_dict)]
    assert any(k.endswith("attn.norm_q.weight") for k in report.refitted)


def test_missing_extra_and_mismatched_keys_are_clear_errors(state_dict):
    trt, _ = ft.make_fake_trt()
    engine = _engine_for(state_dict)
    key = sorted(state_dict)[0]
    fewer = {k: v for k, v in state_dict.items() if k != key}
    with pytest.raises(rf.RefitError, match=rf"1 engine weight\(s\) have no state-dict entry: "
                                            rf"{key}"):
        rf.refit_engine(trt, engine, None, fewer)
    more = dict(state_dict, **{"lora_A.weight": torch.zeros(2)})
    with pytest.raises(rf.RefitError, match=r"1 state-dict key\(s\) are not weights of the "
                                            r"engine: lora_A.weight"):
        rf.refit_engine(trt, engine, None, more)
    wrong = dict(state_dict)
    wrong[key] = state_dict[key].to(torch.int32)
    with pytest.raises(rf.RefitError, match=rf"not floating-point.*{key}: engine float32 x "
                                            rf"\d+, state dict int32"):
        rf.refit_engine(trt, engine, None, wrong)
    wrong[key] = torch.zeros(state_dict[key].numel() + 1)
    with pytest.raises(rf.RefitError, match=rf"{key}: engine float32 x \d+, state dict float32"):
        rf.refit_engine(trt, engine, None, wrong)
    assert engine.refits == []  # nothing was refitted by a refused call
    # allowed: the names in both are refitted, the rest reported
    report = rf.refit_engine(trt, engine, None, dict(fewer, **{"extra": torch.zeros(1)}),
                             allow_missing=True, allow_extra=True)
    assert report.not_covered == [key] and report.not_in_engine == ["extra"]
    assert engine.refits == [sorted(fewer)]


def test_other_float_dtypes_are_converted_like_the_export(state_dict):
    """fp32 weights into an fp16 engine (and bf16 into fp32): each weight rounded once to the
    engine's dtype, reported, and the bytes handed to TensorRT are what the export writes."""
    trt, _ = ft.make_fake_trt()
    fp16 = ft.RefittableEngine({k: ("HALF", v.numel()) for k, v in state_dict.items()})
    report = rf.refit_engine(trt, fp16, None, state_dict)
    assert report.cast == sorted(state_dict) and fp16.refits == [sorted(state_dict)]
    for key, value in state_dict.items():
        assert fp16.values[key] == value.half().numpy().tobytes(), key
    fp32 = _engine_for(state_dict)
    bf16 = {k: v.to(torch.bfloat16) for k, v in state_dict.items()}
    assert rf.refit_engine(trt, fp32, None, bf16).cast == sorted(state_dict)
    key = sorted(state_dict)[0]
    assert fp32.values[key] == bf16[key].float().numpy().tobytes()
    assert rf.refit_engine(trt, fp32, None, state_dict).cast == []  # same dtype: no conversion


def test_not_refittable_engine_is_refused(state_dict):
    trt, _ = ft.make_fake_trt()
    with pytest.raises(rf.RefitError, match="--refit"):
        rf.refit_engine(trt, _engine_for(state_dict, refittable=False), None, state_dict)


def test_refit_cli_writes_engine_pair(tmp_path, monkeypatch, state_dict, capsys):
    from safetensors.torch import save_file

    from qkrope import cli
    from qkrope.sidecars import EngineInfo, EngineTensor

    trt, state = ft.make_fake_trt()
    engine = _engine_for(state_dict)

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, data):
            assert data == b"OLD-ENGINE"
            return engine

    trt.Runtime = Runtime
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    import qkrope.runtime.engine as eng

    monkeypatch.setattr(eng.ctypes, "CDLL", lambda path, mode=0: None)
    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF fake")
    path = tmp_path / "t.engine"
    path.write_bytes(b"OLD-ENGINE")

    def info(refittable):
        return EngineInfo(tensorrt_version="10.14.1", onnx="/t.onnx",
                          inputs=[EngineTensor("hidden_states", "float32", [-1, -1, 64])],
                          outputs=[EngineTensor("out", "float32", [-1, -1, 64])], profiles=[],
                          plugin=None, plugin_layers=2, version_compatible=False,
                          strongly_typed=True, refittable=refittable)

    info(False).save(path)
    weights = tmp_path / "transformer"
    weights.mkdir()
    save_file({k: v.contiguous() for k, v in state_dict.items()},
              str(weights / "diffusion_pytorch_model.safetensors"))
    rc = cli.main(["refit", str(path), "--diffusers", str(tmp_path), "--plugin", str(lib)])
    assert rc != 0 and "qkrope build --refit" in capsys.readouterr().err
    info(True).save(path)
    rc = cli.main(["refit", str(path), "--diffusers", str(tmp_path), "--plugin", str(lib)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert path.read_bytes() == b"REFITTED-ENGINE-1"
    assert EngineInfo.load(path).refittable is True
    assert f"refitted {len(state_dict)} weight(s)" in captured.out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
