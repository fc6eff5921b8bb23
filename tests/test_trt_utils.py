"""qkrope.runtime.trt_utils: queries of an ONNX file's QKNormRoPE nodes."""

from __future__ import annotations

from _tiny_model import write_tiny_onnx

from qkrope.runtime import trt_utils as tu


def test_count_nodes_and_head_dim(tmp_path):
    p = write_tiny_onnx(tmp_path / "m.onnx", sidecar=False)
    assert tu.count_plugin_nodes(p) == ["img_qknorm", "txt_qknorm"]
    assert tu.head_dim_from_onnx(p) == 16
