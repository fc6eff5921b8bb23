"""A tiny attention-like model for the tests that need no real export: its sidecar (as a dict
and as a ModelInfo), an ONNX file with two QKNormRoPE nodes (not runnable; for counting and the
fake build), and how the fake TensorRT parser reads it."""

from __future__ import annotations

import json
from pathlib import Path

import fake_tensorrt as ft

from qkrope import contract
from qkrope.runtime import onnx_file
from qkrope.sidecars import ModelInfo

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
        "config": {"dim": C, "heads": 2, "head_dim": 16,
                   "parameters": ["w"]},  # the initializer that is a model parameter
        "sample": {"img_shapes": [[1, 4, 4]], "txt_len": txt, "batch": batch},
    }


def model(**kw) -> ModelInfo:
    return ModelInfo.from_dict(sidecar_dict(**kw))


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


def parse_tiny(network, path, state) -> None:
    """The fake parser: the ONNX file's inputs/outputs as tensors (-1 = dynamic), and one
    QKNormRoPE plugin layer per node (or, with ``state.fallback``, its function body)."""
    desc = ModelInfo.from_onnx_graph(path)
    dt = {"float32": "FLOAT", "bool": "BOOL"}
    network.inputs = [ft.ITensor(i.name, dt[i.dtype],
                                 [d if isinstance(d, int) else -1 for d in i.shape])
                      for i in desc.inputs]
    network.outputs = [ft.ITensor(o.name, "FLOAT", [-1, -1, C]) for o in desc.outputs]
    import onnx

    network.weights = {t.name for t in onnx.load(str(path)).graph.initializer}
    state.network = network
    for name in onnx_file.count_plugin_nodes(path):
        if state.fallback:
            network.layers += [(ft.LayerType.ELEMENTWISE, f"{name}_body{i}", None)
                               for i in range(5)]
        else:
            network.layers.append(ft.qknorm_rope_layer(name))


def move_weights_out(onnx_path: Path, location: str, *, data: Path | None = None) -> Path:
    """Rewrite the tiny model so that its weight ``w`` is external data at ``location`` (as
    written in the file; relative to its folder), its 64 bytes written to ``data`` (default: the
    file ``location`` names). Returns where the bytes went."""
    import onnx
    import numpy as np
    from onnx import numpy_helper

    model = onnx.load(str(onnx_path))
    w = next(t for t in model.graph.initializer if t.name == "w")
    values = numpy_helper.to_array(w)
    target = data if data is not None else onnx_path.parent / location
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(np.ascontiguousarray(values).tobytes())
    w.ClearField("float_data")
    w.ClearField("raw_data")
    w.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"),
                       ("length", str(values.nbytes))):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(onnx_path))
    return target


def one_node_model(**attrs):
    """An in-memory ONNX model of one QKNormRoPE node with the default node attributes
    (``attrs`` on top), for the node validator's tests."""
    import onnx
    from onnx import helper

    node = helper.make_node(contract.OP_TYPE, list(contract.INPUTS), list(contract.OUTPUTS),
                            domain=contract.DOMAIN, name="n0",
                            **dict(contract.NodeAttributes().to_node(), **attrs))
    vi = [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None)
          for n in contract.INPUTS + contract.OUTPUTS]
    graph = helper.make_graph([node], "g", vi[:5], vi[5:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid(contract.DOMAIN, 1)])


def fake_tensorrt(monkeypatch, tmp_path: Path, **kw):
    """The fake TensorRT (tests/fake_tensorrt.py, ``kw`` to it) imported as ``tensorrt`` with
    this module's parser, the plugin's dlopen recorded in ``state.loaded``, and a plugin
    library file to pass: ``(trt, state, lib)``."""
    import sys

    from qkrope.runtime import loader_tensorrt as lt

    trt, state = ft.make_fake_trt(parse=parse_tiny, **kw)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(lt.ctypes, "CDLL",
                        lambda path, mode=0: state.loaded.append(("dlopen", path)))
    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF\x02\x01\x01\x00 fake")
    return trt, state, lib


def export_tiny_transformer(d: Path, folder: str = "transformer", onnx: str = "transformer.onnx",
                            transformer=None) -> tuple[Path, Path]:
    """The tiny Qwen-Image transformer (qkrope.apps.tiny_pipeline; ``transformer``: one the
    caller built) saved in ``d / folder`` and exported by ``qkrope export --model
    transformer`` to ``d / onnx``: ``(folder, onnx)``."""
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.cli import main

    tp.save_transformer(tp.tiny_transformer() if transformer is None else transformer, d / folder)
    assert main(["export", "--model", "transformer", "--diffusers", str(d / folder),
                 "--out", str(d / onnx)]) == 0
    return d / folder, d / onnx
