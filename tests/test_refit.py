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
    state.engines[b"\x00OLD-ENGINE"] = engine  # what the fake Runtime deserialises
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    import qkrope.runtime.loader_tensorrt as lt

    monkeypatch.setattr(lt.ctypes, "CDLL", lambda path, mode=0: None)
    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF fake")
    path = tmp_path / "t.engine"
    path.write_bytes(b"\x00OLD-ENGINE")

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
    assert path.read_bytes() == b"\x00REFITTED-ENGINE-1"
    assert EngineInfo.load(path).refittable is True
    assert f"refitted {len(state_dict)} weight(s)" in captured.out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


# ---- weights that are wrong but the right size, files that are not state dicts ---------------

def _refittable_pair(engine, data: bytes, **kw):
    """A refittable engine file and its sidecar (one input, one output)."""
    from qkrope.sidecars import EngineInfo, EngineTensor

    engine.write_bytes(data)
    EngineInfo(tensorrt_version="10.14.1", onnx="/t.onnx",
               inputs=[EngineTensor("x", "float32", [-1])],
               outputs=[EngineTensor("y", "float32", [-1])], profiles=[], plugin=None,
               plugin_layers=1, version_compatible=kw.pop("version_compatible", False),
               strongly_typed=True, refittable=True, **kw).save(engine)


def _two_d_key(sd):
    return next(k for k, v in sd.items() if v.dim() == 2 and v.shape[0] != v.shape[1])


def test_a_transposed_weight_is_refused_by_its_shape(state_dict):
    """The element counts agree, the shapes the export recorded do not: refused, key named."""
    trt, _ = ft.make_fake_trt()
    key = _two_d_key(state_dict)
    shapes = {k: list(v.shape) for k, v in state_dict.items()}
    wrong = dict(state_dict)
    wrong[key] = state_dict[key].t().contiguous()
    with pytest.raises(rf.RefitError, match=rf"{key}: engine float32 x \d+ "
                                            rf"\[{shapes[key][0]}, {shapes[key][1]}\], state dict "
                                            rf"float32 \[{shapes[key][1]}, {shapes[key][0]}\]"):
        rf.refit_engine(trt, _engine_for(state_dict), None, wrong, shapes=shapes)
    # without recorded shapes (an older sidecar) only the count is known: accepted
    rf.refit_engine(trt, _engine_for(state_dict), None, wrong)
    rf.refit_engine(trt, _engine_for(state_dict), None, state_dict, shapes=shapes)


def test_non_finite_weights_are_refused_before_and_after_the_cast(state_dict):
    trt, _ = ft.make_fake_trt()
    key = _two_d_key(state_dict)
    bad = dict(state_dict)
    bad[key] = state_dict[key].clone()
    bad[key].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    with pytest.raises(rf.RefitError, match=rf"{key}: 3 of {bad[key].numel()} values are NaN or "
                                            rf"infinite"):
        rf.refit_engine(trt, _engine_for(state_dict), None, bad)
    # fp32 values beyond fp16's largest finite value (65504) become inf in an fp16 engine
    half = ft.RefittableEngine({k: ("HALF", v.numel()) for k, v in state_dict.items()})
    big = dict(state_dict)
    big[key] = state_dict[key].clone()
    big[key].view(-1)[:2] = torch.tensor([7e4, -1e6])
    big[key].view(-1)[2] = 65504.0  # representable: not counted
    with pytest.raises(rf.RefitError, match=rf"{key}: 2 of {big[key].numel()} values are beyond "
                                            rf"float16's range"):
        rf.refit_engine(trt, half, None, big)
    report = rf.refit_engine(trt, ft.RefittableEngine(
        {k: ("HALF", v.numel()) for k, v in state_dict.items()}), None, state_dict)
    assert key in report.cast


class _Opaque:
    pass


@pytest.mark.parametrize("name, write, says", [
    ("objects.pt", lambda p: torch.save({"w": _Opaque()}, p), "a pickle of Python objects"),
    ("tensor.pt", lambda p: torch.save(torch.ones(3, 2), p), "a single tensor [3, 2]"),
    ("ckpt.pt", lambda p: torch.save({"state_dict": {"w": torch.ones(2)}, "step": 3}, p),
     "'state_dict' entry is a dict"),
    ("notes.pt", lambda p: p.write_text("not weights\n"), "it is a text file"),
    ("truncated.pt", lambda p: p.write_bytes(b"PK\x03\x04" + bytes(40)), "cannot be read"),
    ("corrupt.SAFETENSORS", lambda p: p.write_bytes(b"\x40" + bytes(7) + b"{\"a\": 1"),
     "not a readable safetensors file"),
    ("weights.bin", lambda p: p.write_bytes(bytes(range(256)) * 4), "neither a torch-saved"),
])
def test_a_file_that_is_not_a_state_dict_is_one_line(tmp_path, name, write, says):
    path = tmp_path / name
    write(path)
    with pytest.raises(rf.RefitError) as exc:
        rf.load_state_dict(state_dict=str(path))
    msg = str(exc.value)
    assert says in msg and "save_file(model.state_dict()" in msg and "\n" not in msg, msg
    assert "weights_only=False" not in msg and "weights_only` set to `False" not in msg


def test_upper_case_safetensors_suffix_loads(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "W.SAFETENSORS"
    save_file({"w": torch.arange(4.0)}, str(path))
    assert torch.equal(rf.load_state_dict(state_dict=str(path))["w"], torch.arange(4.0))


@pytest.mark.parametrize("target", ["model.onnx", "sd.pt", "t.engine.json", "notes.txt",
                                    "notes.md"])
def test_refit_output_that_is_an_input_or_another_kind_is_refused(tmp_path, capsys, target):
    """-o naming an ONNX model, the state dict, the engine's sidecar, or a path whose sidecar
    would replace a JSON file of someone else's: refused before any work, nothing changed."""
    import json

    from qkrope import cli

    engine = tmp_path / "t.engine"
    _refittable_pair(engine, b"\x00ENGINE")
    torch.save({"w": torch.ones(2)}, tmp_path / "sd.pt")
    import onnx
    from onnx import helper

    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])),
        str(tmp_path / "model.onnx"))
    (tmp_path / "notes.txt.json").write_text(json.dumps({"mine": True}))
    (tmp_path / "notes.md").write_text("# my notes\n")  # a text file where the engine goes
    out = tmp_path / target
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    rc = cli.main(["refit", str(engine), "--state-dict", str(tmp_path / "sd.pt"), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "choose another -o" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before



# ---- the failure modes of TensorRT's refitter (the fake has them) ------------------------------

def test_weights_tensorrt_still_needs_are_an_error(state_dict):
    """get_missing_weights() non-empty after the weights are set: refused, names given."""
    trt, _ = ft.make_fake_trt()
    need = sorted(state_dict)[:2]
    engine = ft.RefittableEngine({k: ("FLOAT", v.numel()) for k, v in state_dict.items()},
                                 required=need)
    partial = {k: v for k, v in state_dict.items() if k not in need}
    with pytest.raises(rf.RefitError, match=rf"TensorRT still needs 2 weight\(s\) before it can "
                                            rf"refit: {need[0]}, {need[1]}"):
        rf.refit_engine(trt, engine, None, partial, allow_missing=True)
    assert engine.refits == []
    rf.refit_engine(trt, engine, None, state_dict)  # given them all: refitted
    assert engine.refits == [sorted(state_dict)]


def test_a_name_tensorrt_has_no_prototype_for_is_an_error(state_dict):
    """get_weights_prototype of a name that is no refittable weight has size -1 (the real API):
    refused as such, not compared as a count of -1."""
    trt, _ = ft.make_fake_trt()
    assert trt.Refitter(_engine_for(state_dict), None).get_weights_prototype("nope").size == -1

    class Listing(trt.Refitter):  # a refitter listing a name it has no weight for
        def get_all_weights(self):
            return super().get_all_weights() + ["ghost.weight"]

    trt.Refitter = Listing
    sd = dict(state_dict, **{"ghost.weight": torch.ones(2)})
    with pytest.raises(rf.RefitError, match="ghost.weight: TensorRT has no weight of that name"):
        rf.refit_engine(trt, _engine_for(state_dict), None, sd)


def test_an_engine_tensorrt_cannot_deserialise_is_an_error(tmp_path, monkeypatch, capsys):
    from qkrope import cli

    trt, state = ft.make_fake_trt()  # state.engines is empty: no bytes deserialise
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    engine = tmp_path / "t.engine"
    _refittable_pair(engine, b"\x00not a plan", version_compatible=True)
    torch.save({"w": torch.ones(2)}, tmp_path / "sd.pt")
    assert cli.main(["refit", str(engine), "--state-dict", str(tmp_path / "sd.pt"),
                     "--allow-host-code"]) == 2
    err = capsys.readouterr().err
    assert "could not deserialise" in err and err.count("\n") == 1, err
    assert engine.read_bytes() == b"\x00not a plan"


def test_a_corrupt_diffusers_shard_is_one_line(tmp_path):
    from safetensors.torch import save_file

    import json

    first, second = ("diffusion_pytorch_model-00001-of-00002.safetensors",
                     "diffusion_pytorch_model-00002-of-00002.safetensors")
    save_file({"a": torch.ones(2)}, str(tmp_path / first))
    (tmp_path / second).write_bytes(b"\x10" + bytes(7) + b"{broken")
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": first, "b": second}}))
    # named when the folder's files are listed (diffusers_weights.check_complete), before any
    # shard is read
    from qkrope.diffusers_weights import DiffusersWeightsError

    with pytest.raises(DiffusersWeightsError, match=r"00002-of-00002.safetensors is not a "
                                                    r"safetensors file") as exc:
        rf.load_state_dict(diffusers=str(tmp_path))
    assert "\n" not in str(exc.value)


def test_refit_refuses_a_sidecar_config_the_engine_was_not_built_from(tmp_path, monkeypatch,
                                                                      capsys):
    """The refit writes the sidecar it read beside the new engine: one whose config is not the
    engine's build (its name's tag) is refused, nothing written."""
    from qkrope import cli
    from qkrope.sidecars import EngineInfo, config_tag

    trt, state = ft.make_fake_trt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    engine = tmp_path / "t.engine"
    _refittable_pair(engine, b"\x00PLAN", config={"axes_dims_rope": [16, 56, 56]},
                     version_compatible=True)  # its plugin inside: no library to find
    built = ft.RefittableEngine({"w": ("FLOAT", 2)},
                                name=config_tag({"axes_dims_rope": [56, 16, 56]}))
    state.engines[b"\x00PLAN"] = built
    torch.save({"w": torch.ones(2)}, tmp_path / "sd.pt")
    before = (engine.read_bytes(), EngineInfo.load(engine).config)
    assert cli.main(["refit", str(engine), "--state-dict", str(tmp_path / "sd.pt"),
                     "--allow-host-code"]) == 2
    err = capsys.readouterr().err
    assert "describes another config" in err and err.count("\n") == 1, err
    assert (engine.read_bytes(), EngineInfo.load(engine).config) == before and not built.refits
