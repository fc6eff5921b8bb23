"""``qkrope.apps.bench.inspector``: the fused-attention verdict from TensorRT's engine inspector
(layer information as TensorRT writes it), the span nodes of both attention forms, and the
inspector asked on a runner's engine (the fake TensorRT's)."""

from __future__ import annotations

import json

import fake_tensorrt as ft
import onnx
import pytest
from _layer_info import _layers

from qkrope.apps.bench import inspector


SPAN = ("node_softmax",)  # the model's Softmax node (attention_span_nodes of the export)


@pytest.mark.parametrize("info, want, basis", [
    # a fused MHA kernel as a layer's tactic
    (_layers({"Name": "q_proj"}, {"Name": "_gemm_mha_v2_myl0_3", "LayerType": "kgen",
                                  "TacticName": "fmha_v2_flash_attention_bf16_64_64_S_128_sm90"}),
     "yes", "fmha_v2_flash_attention"),
    # an IAttention layer holding the span node, its kernel not named: inferred only
    (_layers({"Name": "attn", "LayerType": "Attention", "TacticName": "",
              "Metadata": "[ONNX Layer: node_softmax]"}), "likely", "IAttention layer"),
    # the softmax inside a Myelin region: inferred only
    (_layers({"Name": "{ForeignNode[node_matmul...node_matmul_1]}", "LayerType": "Myelin",
              "TacticName": "", "Metadata": "[ONNX Layer: node_matmul]\u001f"
                                            "[ONNX Layer: node_softmax]\u001f"
                                            "[ONNX Layer: node_matmul_1]"}),
     "likely", "Myelin region"),
    # a Myelin region whose metadata names a node called ...attention..., not the span node
    (_layers({"Name": "{ForeignNode[node_linear...node_attention_out]}", "LayerType": "Myelin",
              "TacticName": "", "Metadata": "[ONNX Layer: node_attention_out]"}),
     "unknown", "no attention kernel"),
    # the softmax as its own layer: BMM1, Softmax, BMM2 apart
    (_layers({"Name": "node_matmul"}, {"Name": "node_softmax", "LayerType": "CaskSoftMax",
                                       "TacticName": "0x3e8"}, {"Name": "node_matmul_1"}),
     "no", "its own layer"),
    # a Myelin region elsewhere and a separate softmax: not fused
    (_layers({"Name": "{ForeignNode[node_view...node_linear]}", "LayerType": "Myelin",
              "TacticName": "", "Metadata": "[ONNX Layer: node_linear]"},
             {"Name": "node_softmax", "LayerType": "SoftMax", "TacticName": ""}),
     "no", "node_softmax"),
    # layer names only (no DETAILED verbosity), nothing said
    (json.dumps({"Layers": ["node_matmul", "node_add", "node_matmul_1"]}), "unknown",
     "names only"),
    # names only, a separate softmax named
    (json.dumps({"Layers": ["node_matmul", "node_softmax", "node_matmul_1"]}), "no",
     "node_softmax"),
    # an ONNX node *named* attention is no evidence of a fused kernel
    (_layers({"Name": "node_attention_out", "Metadata": "[ONNX Layer: node_attention_out]"}),
     "unknown", "no attention kernel"),
    (json.dumps({"Layers": []}), "unknown", "no layers"),
])
def test_fused_attention_from_inspector(info, want, basis):
    got, why = inspector.fused_attention_from_inspector(info, SPAN)
    assert got == want and basis in why, why
    assert want in inspector.VERDICTS
    # a dict reads the same as its JSON text
    assert inspector.fused_attention_from_inspector(json.loads(info), SPAN)[0] == want


def test_attention_span_nodes_of_both_forms(tmp_path):
    """The span nodes are the export's Softmax (primitive) or Attention (onnx23) nodes."""
    from qkrope.export.onnx_export import export_attention

    for form, op in (("primitive", "Softmax"), ("onnx23", "Attention")):
        path = tmp_path / f"{form}.onnx"
        export_attention(path, heads=2, head_dim=16, attention=form)
        nodes = inspector.attention_span_nodes(path)
        graph = onnx.load(str(path)).graph
        assert nodes and nodes == [n.name for n in graph.node if n.op_type == op], form


def test_engine_inspector_of_a_runner(tmp_path):
    """_inspect_engine asks the engine's inspector (the fake TensorRT's, with the real calls)
    for JSON layer information and writes it out; unreadable information is a reason."""
    trt, _ = ft.make_fake_trt()
    engine = trt.ICudaEngine(layer_info=_layers({"Name": "node_softmax",
                                                 "LayerType": "SoftMax"}))
    runner = type("R", (), {"engine": engine, "trt": trt})()
    fused, basis = inspector._inspect_engine(runner, tmp_path / "layers.json")
    assert fused == "no" and "node_softmax" in basis
    assert json.loads((tmp_path / "layers.json").read_text())["Layers"][0]["Name"] == \
        "node_softmax"
    assert inspector._inspect_engine(object()) == ("unknown", "the runner exposes no TensorRT "
                                                          "engine to inspect")
    broken = trt.ICudaEngine(layer_info="not json")
    runner = type("R", (), {"engine": broken, "trt": trt})()
    assert inspector._inspect_engine(runner)[0] == "unknown"
    assert "unreadable inspector JSON" in inspector._inspect_engine(runner)[1]
