"""qkrope.export.finalize.check_no_double, the post-export check every family whose diffusers
RoPE is float64 calls: a Cast to DOUBLE or a DOUBLE value anywhere is refused, naming it and the
graph; a float32 graph passes."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from qkrope.export.finalize import ExportError, check_no_double


def _model(cast_to: int, out_type: int) -> ir.Model:
    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], name="cast0", to=cast_to)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", out_type, [2])])
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17)]))


def test_a_float32_graph_passes():
    check_no_double(_model(TensorProto.FLOAT16, TensorProto.FLOAT16), "the test graph")


def test_a_cast_to_double_is_refused_naming_the_node_and_the_graph():
    with pytest.raises(ExportError, match="node cast0 casts to DOUBLE: the test graph must"):
        check_no_double(_model(TensorProto.DOUBLE, TensorProto.DOUBLE), "the test graph")


def test_a_double_value_is_refused_naming_it():
    model = _model(TensorProto.FLOAT, TensorProto.FLOAT)
    model.graph.inputs[0].dtype = ir.DataType.DOUBLE
    with pytest.raises(ExportError, match="graph value x is DOUBLE: the graph must have no"):
        check_no_double(model)
