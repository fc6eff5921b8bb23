"""Small helpers shared by the engine builder and the runners (no TensorRT import at module load).

- model descriptions: the exporter's sidecar ``<model>.onnx.json`` or, without one, the ONNX
  graph's own inputs/outputs;
- dtype names (:mod:`qkrope.runtime.dtypes`: one spelling for ONNX, TensorRT and torch);
- the engine sidecar path; the GPU name (atomic writes and sha256 re-exported from _fileio).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qkrope._fileio import sha256_file, write_atomic, write_json_atomic  # noqa: F401 (re-exported)

from qkrope import dtypes



def dtype_name(dtype: Any) -> str:
    """A torch dtype, a tensorrt.DataType, an ONNX elem type or a name -> ``"float32"`` style
    (:func:`qkrope.runtime.dtypes.canonical`)."""
    return dtypes.canonical(dtype)


# --------------------------------------------------------------------------------------------
# Model descriptions
# --------------------------------------------------------------------------------------------

def engine_sidecar_path(engine_path: str | os.PathLike) -> Path:
    return Path(str(engine_path) + ".json")


def read_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def describe_onnx_graph(onnx_path: str | os.PathLike) -> dict:
    """Inputs/outputs of an ONNX model as a sidecar-like dict (dims: int, ``dim_param`` name, or a
    generated name ``<input>.<i>`` for an unnamed dynamic dimension). Weights are not loaded."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)

    def io(values):
        out = []
        for vi in values:
            t = vi.type.tensor_type
            shape = []
            for i, d in enumerate(t.shape.dim):
                if d.HasField("dim_value"):
                    shape.append(int(d.dim_value))
                elif d.dim_param:
                    shape.append(d.dim_param)
                else:
                    shape.append(f"{vi.name}.{i}")
            out.append({"name": vi.name, "dtype": dtypes.canonical(int(t.elem_type)),
                        "shape": shape})
        return out

    init_names = {i.name for i in model.graph.initializer}
    return {"inputs": io(v for v in model.graph.input if v.name not in init_names),
            "outputs": io(model.graph.output), "config": {}, "dynamic_axes": {}, "sample": {}}


def load_model_description(onnx_path: str | os.PathLike) -> dict:
    """The exporter's sidecar as a dict when it exists (read and format-checked by
    :meth:`ModelInfo.load <qkrope.runtime.model_info.ModelInfo.load>`: axis names, config, export
    sample), otherwise what the ONNX graph says. ``"source"`` records which."""
    from .model_info import ModelInfo, sidecar_path

    side = sidecar_path(onnx_path)
    if side.exists():
        desc = ModelInfo.load(onnx_path).to_dict()
        desc["source"] = str(side)
        return desc
    desc = describe_onnx_graph(onnx_path)
    desc["source"] = str(onnx_path)
    return desc


def count_plugin_nodes(onnx_path: str | os.PathLike) -> list[str]:
    """Names of the QKNormRoPE nodes in the model's main graph (not inside function bodies)."""
    import onnx

    from qkrope import contract

    model = onnx.load(str(onnx_path), load_external_data=False)
    names = []
    for i, node in enumerate(model.graph.node):
        if node.op_type == contract.OP_TYPE and node.domain == contract.DOMAIN:
            names.append(node.name or f"{contract.OP_TYPE}_{i}")
    return names


def head_dim_from_onnx(onnx_path: str | os.PathLike) -> int | None:
    """head_dim read from the first QKNormRoPE node's q_weight initializer, if there is one."""
    import onnx

    from qkrope import contract

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == contract.OP_TYPE and len(node.input) > 2 and node.input[2] in inits:
            dims = list(inits[node.input[2]].dims)
            if len(dims) == 1:
                return int(dims[0])
    return None


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------

def gpu_info() -> dict | None:
    """Name and compute capability of the current CUDA device, or None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(dev)
        return {"name": torch.cuda.get_device_name(dev), "compute_capability": f"{major}.{minor}",
                "index": dev}
    except Exception:  # pragma: no cover - best effort metadata
        return None
