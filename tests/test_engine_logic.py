"""`qkrope build` logic that does not need TensorRT: profiles, plugin-layer detection, progress
display, sidecars, the missing-TensorRT message, and the whole build driven through a fake
``tensorrt`` module (checks the glue: flags, profile shapes, atomic writes, sidecar contents).
"""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import pytest

from qkrope import contract
from qkrope.runtime import engine as eng
from qkrope.runtime import profiles as prof
from qkrope._fileio import sha256_file, write_atomic
from qkrope.runtime import trt_utils as tu
from qkrope.sidecars import (ENGINE_FORMAT, EngineInfo, EngineTensor, ModelInfo, PluginRecord,
                             TensorInfo, engine_tensors)

C = 32  # model width of the tiny test model


def sidecar_dict(batch=2, img=16, txt=5, with_timestep=False):
    inputs = [
        {"name": "hidden_states", "dtype": "float32", "shape": ["batch", "img_tokens", C]},
        {"name": "encoder_hidden_states", "dtype": "float32", "shape": ["batch", "txt_tokens", C]},
        {"name": "encoder_hidden_states_mask", "dtype": "bool", "shape": ["batch", "txt_tokens"]},
        {"name": "img_cos_sin_cache", "dtype": "float32", "shape": ["img_cache_rows", 16]},
        {"name": "txt_cos_sin_cache", "dtype": "float32", "shape": ["txt_cache_rows", 16]},
    ]
    if with_timestep:
        inputs.insert(3, {"name": "timestep", "dtype": "float32", "shape": ["batch"]})
    return {
        "format": "qkrope-onnx", "format_version": 1, "model": "attention", "opset": 18,
        "ir_version": 10,
        "dtype": "fp32", "node_attributes": {},
        "inputs": inputs,
        "outputs": [{"name": "img_out", "dtype": "float32", "shape": ["batch", "img_tokens", C]},
                    {"name": "txt_out", "dtype": "float32", "shape": ["batch", "txt_tokens", C]}],
        "dynamic_axes": {"batch": {"export_value": batch}, "img_tokens": {"export_value": img},
                         "txt_tokens": {"export_value": txt},
                         "img_cache_rows": {"export_value": img},
                         "txt_cache_rows": {"export_value": txt}},
        "config": {"dim": C, "heads": 2, "head_dim": 16},
        "sample": {"img_shapes": [[1, 4, 4]], "txt_len": txt, "batch": batch},
    }


def model(**kw) -> ModelInfo:
    return ModelInfo.from_dict(sidecar_dict(**kw))


# --------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------

def test_parse_shape_specs():
    assert prof.parse_shape_spec("hidden_states:1x4096x3072") == ("hidden_states",
                                                                   (1, 4096, 3072))
    assert prof.parse_shape_spec("t:") == ("t", ())
    assert prof.parse_shape_specs(["a:1x2 b:3", "c:4,5"]) == {"a": (1, 2), "b": (3,), "c": (4, 5)}
    with pytest.raises(prof.ProfileError, match="NAME:DIMxDIM"):
        prof.parse_shape_spec("model.onnx")
    with pytest.raises(prof.ProfileError, match="twice"):
        prof.parse_shape_specs(["a:1x2", "a:1x3"])


def test_parse_shape_specs_polygraphy_syntax():
    """polygraphy's --trt-*-shapes NAME:[d0,d1,...] is accepted beside trtexec's NAME:DxD."""
    assert prof.parse_shape_spec("hidden_states:[1,4096,3072]") == ("hidden_states",
                                                                     (1, 4096, 3072))
    assert prof.parse_shape_spec("hidden_states:[1, 4096, 3072]") == ("hidden_states",
                                                                       (1, 4096, 3072))
    assert prof.parse_shape_spec("t:[]") == ("t", ())
    assert prof.parse_shape_specs(["a:[1,2] b:3x4", "c:[5, 6] d:[7]"]) == {
        "a": (1, 2), "b": (3, 4), "c": (5, 6), "d": (7,)}
    assert prof.parse_shape_specs(["a:[1,2]", "a:1x2"]) == {"a": (1, 2)}  # same shape, twice
    for bad in ("a:[1x2]", "a:[1,2", "a:1,2]", "a:[1,,2]", "[1,2]"):
        with pytest.raises(prof.ProfileError, match=r"NAME:DIMxDIM.*trtexec.*NAME:\[DIM,DIM"):
            prof.parse_shape_spec(bad)


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


# --------------------------------------------------------------------------------------------
# One dtype table; one sidecar reader
# --------------------------------------------------------------------------------------------

def test_dtypes_module_maps_every_layer():
    import numpy as np
    import torch
    from onnx import TensorProto

    from qkrope import dtypes

    rows = [("fp32", "float32", torch.float32, TensorProto.FLOAT, "FLOAT", "TYPE_FP32"),
            ("fp16", "float16", torch.float16, TensorProto.FLOAT16, "HALF", "TYPE_FP16"),
            ("bf16", "bfloat16", torch.bfloat16, TensorProto.BFLOAT16, "BF16", "TYPE_BF16")]
    for short, name, tdt, onnx_code, trt_name, triton_name in rows:
        for spelling in (short, name, tdt, onnx_code, trt_name, f"DataType.{trt_name}",
                         triton_name, str(tdt)):
            assert dtypes.canonical(spelling) == name, spelling
        assert dtypes.NAME_BY_SHORT[short] == name and dtypes.short_name(tdt) == short
        assert dtypes.TORCH_BY_SHORT[short] is tdt and dtypes.torch_dtype(name) is tdt
        assert dtypes.onnx_code(short) == onnx_code and dtypes.triton_type(tdt) == triton_name
        assert dtypes.TRT_BY_NAME[name] == trt_name
    assert dtypes.numpy_dtype("bf16").name == "bfloat16"
    assert dtypes.numpy_dtype("fp16") == np.float16
    assert dtypes.canonical("tensor(float)") == "float32"
    assert dtypes.canonical(TensorProto.BOOL) == "bool" and dtypes.canonical("BOOL") == "bool"
    assert dtypes.canonical("half") == "float16" and dtypes.canonical("float") == "float32"
    assert dtypes.canonical("DataType.FP8") == "float8_e4m3fn"
    with pytest.raises(ValueError):
        dtypes.torch_dtype("float8_e4m3fn")
    with pytest.raises(ValueError):
        dtypes.short_name("int64")
    # the runtime modules use it (no private tables left)
    from qkrope import sidecars
    from qkrope.runtime import triton
    assert sidecars.DTYPES is dtypes.NAME_BY_SHORT
    for mod, names in ((tu, ("ONNX_DTYPES", "ONNX_DTYPE_CODES", "ORT_DTYPES", "TRT_DTYPES",
                             "torch_dtype")), (triton, ("_TRITON_DTYPES",))):
        for n in names:
            assert not hasattr(mod, n), f"{mod.__name__}.{n}"


def test_model_description_is_read_through_model_info(tmp_path):
    """ModelInfo.describe reads the sidecar with ModelInfo.load (format checked); the dict forms
    of the description are gone, and the sidecar path has one definition."""
    from qkrope.sidecars import ModelInfoError, sidecar_path

    for gone in ("onnx_sidecar_path", "load_model_description", "describe_onnx_graph",
                 "read_json", "engine_sidecar_path"):
        assert not hasattr(tu, gone), gone
    p = write_tiny_onnx(tmp_path / "m.onnx")
    desc = ModelInfo.describe(p)
    assert desc.source == str(sidecar_path(p)) and desc.to_dict()["format"] == "qkrope-onnx"
    assert desc.to_dict()["format_version"] == 1
    side = json.loads(sidecar_path(p).read_text())
    side["format"] = "someone-elses/2"
    sidecar_path(p).write_text(json.dumps(side))
    with pytest.raises(ModelInfoError, match="not a qkrope sidecar"):
        ModelInfo.describe(p)


def test_derive_profile_defaults_from_sidecar():
    p = prof.derive_profile(model())
    assert p["hidden_states"] == {"min": (1, 1, C), "opt": (2, 16, C), "max": (2, 4096, C)}
    assert p["encoder_hidden_states"] == {"min": (1, 1, C), "opt": (2, 5, C), "max": (2, 512, C)}
    assert p["encoder_hidden_states_mask"]["max"] == (2, 512)
    # cache rows follow the tokens of their stream
    assert p["img_cos_sin_cache"] == {"min": (1, 16), "opt": (16, 16), "max": (4096, 16)}
    assert p["txt_cos_sin_cache"] == {"min": (1, 16), "opt": (5, 16), "max": (512, 16)}
    prof.validate_profile(p, model().inputs)
    assert "hidden_states" in prof.format_profile(p)


def test_derive_profile_max_flags_and_small_max_pulls_opt():
    p = prof.derive_profile(model(), max_batch=4, max_img_tokens=8, max_txt_tokens=64)
    assert p["hidden_states"]["max"] == (4, 8, C)
    assert p["hidden_states"]["opt"] == (2, 8, C)  # export value 16 > max 8
    assert p["txt_cos_sin_cache"]["max"] == (64, 16)
    with pytest.raises(prof.ProfileError, match="--max-batch"):
        prof.derive_profile(model(), max_batch=0)


def test_explicit_shapes_override_and_cache_rows_are_raised():
    p = prof.derive_profile(
        model(),
        max_shapes={"hidden_states": (2, 8192, C), "img_cos_sin_cache": (100, 16)},
        opt_shapes={"img_cos_sin_cache": (3, 16)})
    assert p["hidden_states"]["max"] == (2, 8192, C)
    # cache rows raised to the tokens at each level, whatever was given
    assert p["img_cos_sin_cache"]["max"] == (8192, 16)
    assert p["img_cos_sin_cache"]["opt"] == (16, 16)
    prof.validate_profile(p, model().inputs)


def test_profile_errors():
    inputs = model().inputs
    with pytest.raises(prof.ProfileError, match="does not have"):
        prof.derive_profile(model(), min_shapes={"nope": (1,)})
    with pytest.raises(prof.ProfileError, match="has 2 dimensions but hidden_states has 3"):
        prof.derive_profile(model(), max_shapes={"hidden_states": (1, 2)})
    good = prof.derive_profile(model())

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["hidden_states"]["min"] = [1, 32, C]  # min > opt (16)
    with pytest.raises(prof.ProfileError, match="min <= opt <= max"):
        prof.validate_profile(bad, inputs)

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["hidden_states"]["opt"] = [2, 16, 64]
    with pytest.raises(prof.ProfileError, match="static"):
        prof.validate_profile(bad, inputs)

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["encoder_hidden_states"]["max"] = [3, 512, C]  # batch max 3 vs 2 elsewhere
    with pytest.raises(prof.ProfileError, match="axis 'batch'"):
        prof.validate_profile(bad, inputs)

    bad = json.loads(json.dumps(prof.profile_to_json(good)))
    bad["img_cos_sin_cache"]["max"] = [10, 16]
    bad["img_cos_sin_cache"]["opt"] = [10, 16]
    with pytest.raises(prof.ProfileError, match="one row per token"):
        prof.validate_profile(bad, inputs)

    bad = dict(prof.profile_to_json(good))
    del bad["txt_cos_sin_cache"]
    with pytest.raises(prof.ProfileError, match="no profile shapes"):
        prof.validate_profile(bad, inputs)


def test_unknown_axis_needs_explicit_shapes():
    side = model()
    side.inputs.append(TensorInfo("extra", "float32", ["mystery", 4]))
    with pytest.raises(prof.ProfileError, match="mystery"):
        prof.derive_profile(side)
    p = prof.derive_profile(side, min_shapes={"extra": (1, 4)}, opt_shapes={"extra": (2, 4)},
                            max_shapes={"extra": (3, 4)})
    assert p["extra"] == {"min": (1, 4), "opt": (2, 4), "max": (3, 4)}


# --------------------------------------------------------------------------------------------
# Plugin-layer detection over fake networks
# --------------------------------------------------------------------------------------------

class LT:
    PLUGIN = "PLUGIN"
    PLUGIN_V2 = "PLUGIN_V2"
    PLUGIN_V3 = "PLUGIN_V3"
    MATRIX_MULTIPLY = "MATRIX_MULTIPLY"
    ELEMENTWISE = "ELEMENTWISE"


class FakeCore:
    def __init__(self, name, version, namespace):
        self.plugin_name, self.plugin_version, self.plugin_namespace = name, version, namespace


class FakePlugin:
    def __init__(self, core=None, broken=False):
        self.core, self.broken = core, broken

    def get_capability_interface(self, kind):
        assert kind == "CORE"
        if self.broken:
            raise RuntimeError("cannot cast")
        return self.core


class FakeLayer:
    def __init__(self, type, name, plugin=None):
        self.type, self.name = type, name
        if plugin is not None:
            self.plugin = plugin


class FakeNetwork:
    def __init__(self, layers, inputs=(), outputs=()):
        self.layers, self.inputs, self.outputs = list(layers), list(inputs), list(outputs)

    @property
    def num_layers(self):
        return len(self.layers)

    def get_layer(self, i):
        return self.layers[i]

    @property
    def num_inputs(self):
        return len(self.inputs)

    def get_input(self, i):
        return self.inputs[i]

    @property
    def num_outputs(self):
        return len(self.outputs)

    def get_output(self, i):
        return self.outputs[i]


FAKE_TRT_TYPES = types.SimpleNamespace(
    LayerType=LT, PluginCapabilityType=types.SimpleNamespace(CORE="CORE"), IPluginV3Layer=FakeLayer)


def ours(name="node_qk_0"):
    return FakeLayer(LT.PLUGIN_V3, name, FakePlugin(FakeCore(
        contract.PLUGIN_NAME, contract.PLUGIN_VERSION, contract.PLUGIN_NAMESPACE)))


def test_plugin_layers_found():
    net = FakeNetwork([FakeLayer(LT.MATRIX_MULTIPLY, "mm"), ours("a"), ours("b"),
                       FakeLayer(LT.PLUGIN_V3, "other", FakePlugin(FakeCore("QKNormRoPE", "1",
                                                                            "someone_else")))])
    found = eng.check_plugin_layers(net, FAKE_TRT_TYPES, ["a", "b"])
    assert [f.layer_name for f in found] == ["a", "b"]
    assert all(f.identified_by == "plugin" for f in found)
    mine, others = eng.find_plugin_layers(net, FAKE_TRT_TYPES)
    assert [o.plugin_namespace for o in others] == ["someone_else"]


def test_function_body_fallback_fails_loudly():
    body = FakeNetwork([FakeLayer(LT.ELEMENTWISE, f"QKNormRoPE_body_{i}") for i in range(20)])
    with pytest.raises(eng.PluginFallbackError) as exc:
        eng.check_plugin_layers(body, FAKE_TRT_TYPES, ["a", "b"], trt_version="10.6.0")
    msg = str(exc.value)
    assert "0 of 2" in msg and "function body" in msg and "10.7" in msg


def test_partial_fallback_and_no_nodes():
    with pytest.raises(eng.PluginFallbackError, match="1 of 2"):
        eng.check_plugin_layers(FakeNetwork([ours("a")]), FAKE_TRT_TYPES, ["a", "b"])
    with pytest.raises(eng.PluginFallbackError, match="no QKNormRoPE nodes"):
        eng.check_plugin_layers(FakeNetwork([ours("a")]), FAKE_TRT_TYPES, [])


def test_uninspectable_plugin_matched_by_node_name():
    net = FakeNetwork([FakeLayer(LT.PLUGIN_V3, "node_QKNormRoPE_0", FakePlugin(broken=True)),
                       FakeLayer(LT.PLUGIN_V3, "unrelated", FakePlugin(broken=True))])
    found = eng.check_plugin_layers(net, FAKE_TRT_TYPES, ["node_QKNormRoPE_0"])
    assert found[0].identified_by == "layer name"


# --------------------------------------------------------------------------------------------
# Progress display
# --------------------------------------------------------------------------------------------

def test_progress_plain_lines_and_cancel():
    out = io.StringIO()
    t = iter(range(100))
    p = eng.BuildProgress(out, tty=False, clock=lambda: float(next(t)))
    p.phase_start("Building engine", None, 3)
    p.phase_start("Tactic selection", "Building engine", 10)
    p.phase_start("deep", "Tactic selection", 2)  # depth 2: not printed
    assert p.step_complete("deep", 0) is True
    p.phase_finish("deep")
    p.phase_finish("Tactic selection")
    p.cancel()
    assert p.step_complete("Building engine", 1) is False
    p.phase_finish("Building engine")
    text = out.getvalue()
    assert "[build] Building engine (3 steps)" in text
    assert "  [build] Tactic selection (10 steps)" in text
    assert "deep" not in text and "\r" not in text
    assert "Building engine done in" in text


def test_progress_tty_bar():
    out = io.StringIO()
    p = eng.BuildProgress(out, tty=True)
    p.phase_start("Build", None, 4)
    p.step_complete("Build", 1)
    assert "\r[############............] 2/4 Build" in out.getvalue()
    p.phase_finish("Build")
    assert out.getvalue().rstrip().endswith("s")


# --------------------------------------------------------------------------------------------
# Files and sidecars
# --------------------------------------------------------------------------------------------

def test_write_atomic_replaces_and_cleans_up(tmp_path):
    target = tmp_path / "sub" / "m.engine"
    write_atomic(target, b"one")
    write_atomic(target, memoryview(b"two"))
    assert target.read_bytes() == b"two"

    class Boom:
        def __len__(self):
            raise RuntimeError("boom")

    with pytest.raises(TypeError):
        write_atomic(target, Boom())
    assert target.read_bytes() == b"two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["m.engine"]


def test_engine_sidecar_contents():
    side = model()
    profile = prof.derive_profile(side)
    info = EngineInfo(
        tensorrt_version="10.14.1", onnx="/m.onnx",
        inputs=engine_tensors([EngineTensor("hidden_states", "float32", [-1, -1, C])], side),
        outputs=engine_tensors([EngineTensor("img_out", "float32", [-1, -1, C])], side),
        profiles=[prof.profile_to_json(profile)],
        plugin=PluginRecord("/lib.so", "ab", True), plugin_layers=2, version_compatible=True,
        strongly_typed=True, builder_optimization_level=3,
        parser_flags=["ENABLE_PLUGIN_OVERRIDE"], config=side.config,
        gpu={"name": "H200", "compute_capability": "9.0"})
    doc = info.to_dict()
    assert doc["format"] == ENGINE_FORMAT and doc["format_version"] == 1
    assert doc["inputs"][0]["axes"] == ["batch", "img_tokens", None]
    assert doc["profiles"][0]["hidden_states"]["max"] == [2, 4096, C]
    assert doc["plugin"] == {"path": "/lib.so", "sha256": "ab", "serialized_in_engine": True}
    assert doc["config"]["head_dim"] == 16 and doc["version_compatible"] is True
    assert EngineInfo.from_dict(json.loads(json.dumps(doc))) == info


def test_trt_version_gate():
    assert eng.check_trt_version("10.14.1.48") == (10, 14)
    assert eng.check_trt_version("11.0.0") == (11, 0)
    with pytest.raises(eng.EngineBuildError, match="too old"):
        eng.check_trt_version("8.6.1")


# --------------------------------------------------------------------------------------------
# A small ONNX file with two QKNormRoPE nodes (not runnable; for counting and the fake build)
# --------------------------------------------------------------------------------------------

def write_tiny_onnx(path: Path, *, sidecar=True) -> Path:
    import onnx
    from onnx import TensorProto, helper

    side = sidecar_dict()
    types_ = {"float32": TensorProto.FLOAT, "bool": TensorProto.BOOL}
    ins = [helper.make_tensor_value_info(s["name"], types_[s["dtype"]], s["shape"])
           for s in side["inputs"]]
    outs = [helper.make_tensor_value_info(s["name"], types_[s["dtype"]], s["shape"])
            for s in side["outputs"]]
    w = helper.make_tensor("w", TensorProto.FLOAT, [16], [1.0] * 16)
    nodes = []
    for stream, src, cache in (("img", "hidden_states", "img_cos_sin_cache"),
                               ("txt", "encoder_hidden_states", "txt_cos_sin_cache")):
        nodes.append(helper.make_node("Reshape", [src, "shape4"], [f"{stream}_q"]))
        nodes.append(helper.make_node(
            contract.OP_TYPE, [f"{stream}_q", f"{stream}_q", "w", "w", cache],
            [f"{stream}_qo", f"{stream}_ko"], name=f"{stream}_qknorm", domain=contract.DOMAIN,
            **contract.node_attributes()))
    nodes.append(helper.make_node("Identity", ["hidden_states"], ["img_out"]))
    nodes.append(helper.make_node("Identity", ["encoder_hidden_states"], ["txt_out"]))
    shape4 = helper.make_tensor("shape4", TensorProto.INT64, [4], [0, 0, 2, 16])
    graph = helper.make_graph(nodes, "tiny", ins, outs, initializer=[w, shape4])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(contract.DOMAIN, 1)])
    onnx.save(model, str(path))
    if sidecar:
        Path(str(path) + ".json").write_text(json.dumps(side))
    return path


def test_count_nodes_and_describe_graph(tmp_path):
    p = write_tiny_onnx(tmp_path / "m.onnx", sidecar=False)
    assert tu.count_plugin_nodes(p) == ["img_qknorm", "txt_qknorm"]
    assert tu.head_dim_from_onnx(p) == 16
    desc = ModelInfo.describe(p)
    assert desc.source == str(p)
    assert desc.inputs[0] == TensorInfo("hidden_states", "float32", ["batch", "img_tokens", C])
    assert desc.input_names == [s["name"] for s in sidecar_dict()["inputs"]]


# --------------------------------------------------------------------------------------------
# Missing TensorRT
# --------------------------------------------------------------------------------------------

def test_build_without_tensorrt_one_message_exit_2(tmp_path, monkeypatch, capsys):
    from qkrope import cli

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
    out = tmp_path / "m.engine"
    rc = cli.main(["build", str(onnx_path), "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1, err  # one message
    assert "tensorrt" in err and "NGC TensorRT container" in err and "qkrope build" in err
    assert not out.exists() and not Path(str(out) + ".json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.json"]


# --------------------------------------------------------------------------------------------
# The whole build through a fake tensorrt module
# --------------------------------------------------------------------------------------------

class FakeDType:
    def __init__(self, name):
        self.name = name


class FakeTensor:
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, FakeDType(dtype), shape


def make_fake_trt(*, fallback=False, registered=True, build_ok=True):
    state = types.SimpleNamespace(flags=None, parser_flags=[], profile={}, config=None,
                                  loaded=[], progress_calls=0)

    class Registry:
        def get_creator(self, name, version, namespace):
            key = (name, version, namespace)
            ok = registered and key == (contract.PLUGIN_NAME, contract.PLUGIN_VERSION,
                                        contract.PLUGIN_NAMESPACE)
            return object() if ok else None

        def load_library(self, path):
            state.loaded.append(("registry", path))
            return object()

    registry = Registry()

    class Logger:
        WARNING, VERBOSE = "W", "V"

        def __init__(self, level):
            self.level = level

    class Network(FakeNetwork):
        def __init__(self, flags):
            super().__init__([])
            state.flags = flags

    class Parser:
        num_errors = 0

        def __init__(self, network, logger):
            self.network = network

        def set_flag(self, flag):
            state.parser_flags.append(flag)

        def parse_from_file(self, path):
            desc = ModelInfo.from_onnx_graph(path)
            dt = {"float32": "FLOAT", "bool": "BOOL"}
            self.network.inputs = [FakeTensor(i.name, dt[i.dtype],
                                              [d if isinstance(d, int) else -1 for d in i.shape])
                                   for i in desc.inputs]
            self.network.outputs = [FakeTensor(o.name, "FLOAT", [-1, -1, C])
                                    for o in desc.outputs]
            for name in tu.count_plugin_nodes(path):
                if fallback:
                    self.network.layers += [FakeLayer(LT.ELEMENTWISE, f"{name}_body{i}")
                                            for i in range(5)]
                else:
                    self.network.layers.append(ours(name))
            return True

    class Profile:
        def set_shape(self, name, lo, opt, hi):
            state.profile[name] = (tuple(lo), tuple(opt), tuple(hi))

    class TimingCache:
        def __init__(self, data):
            self.data = data

        def serialize(self):
            return b"TIMING" + bytes(self.data)

    class Config:
        def __init__(self):
            state.config = self
            self.flags, self.pools = [], {}
            self.builder_optimization_level = None
            self.plugins_to_serialize = []
            self.progress_monitor = None
            self.cache = None

        def add_optimization_profile(self, p):
            self.profile = p

        def set_memory_pool_limit(self, pool, size):
            self.pools[pool] = size

        def set_flag(self, f):
            self.flags.append(f)

        def create_timing_cache(self, data):
            return TimingCache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            mon = config.progress_monitor
            if mon is not None:
                mon.phase_start("Building", None, 2)
                mon.step_complete("Building", 0)
                mon.phase_finish("Building")
                state.progress_calls += 1
            return memoryview(b"SERIALIZED-ENGINE") if build_ok else None

    class IProgressMonitor:
        def __init__(self):
            pass

    trt = types.SimpleNamespace(
        __version__="10.14.1", Logger=Logger, Builder=Builder, OnnxParser=Parser,
        init_libnvinfer_plugins=lambda logger, ns: True,
        get_plugin_registry=lambda: registry,
        NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=1),
        OnnxParserFlag=types.SimpleNamespace(ENABLE_PLUGIN_OVERRIDE="OVERRIDE"),
        LayerType=LT, PluginCapabilityType=types.SimpleNamespace(CORE="CORE"),
        IPluginV3Layer=FakeLayer, IProgressMonitor=IProgressMonitor,
        MemoryPoolType=types.SimpleNamespace(WORKSPACE="WS"),
        BuilderFlag=types.SimpleNamespace(VERSION_COMPATIBLE="VC"))
    return trt, state


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    def setup(**kw):
        trt, state = make_fake_trt(**kw)
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        monkeypatch.setattr(eng.ctypes, "CDLL",
                            lambda path, mode=0: state.loaded.append(("dlopen", path)))
        lib = tmp_path / "libqkrope_plugin.so"
        lib.write_bytes(b"\x7fELF fake")
        onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
        return trt, state, onnx_path, lib
    return setup


def test_fake_build_writes_engine_and_sidecar(fake_build, tmp_path, capsys):
    from qkrope import cli

    trt, state, onnx_path, lib = fake_build()
    out = tmp_path / "out" / "m.engine"
    tc = tmp_path / "timing.cache"
    rc = cli.main(["build", str(onnx_path), "-o", str(out), "--plugin", str(lib),
                   "--max-img-tokens", "64", "--timing-cache", str(tc),
                   "--builder-optimization-level", "4", "--workspace", "256",
                   "--max", "encoder_hidden_states:2x40x32"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert out.read_bytes() == b"SERIALIZED-ENGINE"
    assert tc.read_bytes() == b"TIMING"
    assert state.flags == 1 << 1  # STRONGLY_TYPED
    assert state.parser_flags == ["OVERRIDE"]
    assert state.loaded == [("dlopen", str(lib.resolve()))]
    assert state.config.pools == {"WS": 256 << 20}
    assert state.config.builder_optimization_level == 4
    assert state.profile["hidden_states"] == ((1, 1, C), (2, 16, C), (2, 64, C))
    assert state.profile["txt_cos_sin_cache"][2] == (40, 16)  # raised to the text tokens
    assert state.progress_calls == 1 and "[build] Building" in captured.err
    side = json.loads(Path(str(out) + ".json").read_text())
    assert side["tensorrt_version"] == "10.14.1"
    assert side["plugin"]["sha256"] == sha256_file(lib)
    assert side["plugin_layers"] == 2 and side["strongly_typed"] is True
    assert side["inputs"][2] == {"name": "encoder_hidden_states_mask", "dtype": "bool",
                                 "shape": [-1, -1], "axes": ["batch", "txt_tokens"]}
    assert side["config"]["head_dim"] == 16
    assert "wrote" in captured.out


def test_fake_build_version_compatible_uses_registry(fake_build, tmp_path):
    trt, state, onnx_path, lib = fake_build()
    eng.build_engine(onnx_path, tmp_path / "vc.engine",
                     eng.BuildOptions(plugin=str(lib), version_compatible=True, progress=False),
                     log=io.StringIO())
    assert state.loaded == [("registry", str(lib.resolve()))]
    assert state.config.flags == ["VC"]
    assert state.config.plugins_to_serialize == [str(lib.resolve())]
    assert json.loads((tmp_path / "vc.engine.json").read_text())["version_compatible"] is True


@pytest.mark.parametrize("kw,match", [
    (dict(fallback=True), "function body"),
    (dict(registered=False), "no creator"),
    (dict(build_ok=False), "failed to build"),
])
def test_fake_build_failures_write_nothing(fake_build, tmp_path, kw, match):
    trt, state, onnx_path, lib = fake_build(**kw)
    out = tmp_path / "bad.engine"
    with pytest.raises(eng.EngineBuildError, match=match):
        eng.build_engine(onnx_path, out, eng.BuildOptions(plugin=str(lib), progress=False),
                         log=io.StringIO())
    assert not out.exists() and not Path(str(out) + ".json").exists()
