"""Two small sidecar records (an attention model's, an engine's) that the sidecar tests write,
read and edit (tests/test_sidecars.py, tests/test_sidecar_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

from qkrope.sidecars import EngineInfo, EngineTensor, ModelInfo, PluginRecord, TensorInfo


def model_info() -> ModelInfo:
    return ModelInfo(model="attention", opset=18, ir_version=10, dtype="fp32",
                     inputs=[TensorInfo("hidden_states", "float32", ["batch", "img_tokens", 8])],
                     outputs=[TensorInfo("img_out", "float32", ["batch", "img_tokens", 8])],
                     dynamic_axes={"batch": {"export_value": 2}, "img_tokens": {"export_value": 4}},
                     node_attributes={}, config={"head_dim": 4}, sample={"batch": 2})


def engine_info() -> EngineInfo:
    return EngineInfo(tensorrt_version="10.14.1", onnx="/m.onnx",
                      inputs=[EngineTensor("x", "float32", [-1, 8], ["batch", None])],
                      outputs=[EngineTensor("y", "float32", [-1, 8])],
                      profiles=[{"x": {"min": [1, 8], "opt": [2, 8], "max": [4, 8]}}],
                      plugin=PluginRecord("/lib.so", "ab"), plugin_layers=2,
                      version_compatible=False, strongly_typed=True)


def edited(info, file: Path, sidecar_path, change) -> Path:
    """``info`` saved for ``file``, then its sidecar's JSON passed through ``change`` (a
    refusal test's one bad field): the sidecar's path, which the reader's error must name."""
    info.save(file)
    path = sidecar_path(file)
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path
