"""Small helpers shared by the engine builder and the runners (no TensorRT import at module load).

- model descriptions: the exporter's sidecar ``<model>.onnx.json`` or, without one, the ONNX
  graph's own inputs/outputs;
- dtype names (one spelling for ONNX, TensorRT and torch: ``float32``, ``bfloat16``, ...);
- atomic file writes; sha256; the GPU name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qkrope._fileio import sha256_file, write_atomic, write_json_atomic  # noqa: F401 (re-exported)

# ONNX TensorProto element type -> dtype name
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64",
               9: "bool", 10: "float16", 11: "float64", 16: "bfloat16"}
ONNX_DTYPE_CODES = {v: k for k, v in ONNX_DTYPES.items()}
# ONNX Runtime type strings
ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16",
              "tensor(bfloat16)": "bfloat16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8",
              "tensor(uint8)": "uint8", "tensor(bool)": "bool"}
# tensorrt.DataType member name -> dtype name
TRT_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8",
              "INT32": "int32", "INT64": "int64", "BOOL": "bool", "UINT8": "uint8",
              "FP8": "float8_e4m3fn", "INT4": "int4", "FP4": "float4_e2m1"}


def torch_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
             "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool, "int16": torch.int16}
    if name not in table:
        raise ValueError(f"dtype {name!r} has no torch equivalent the runner supports")
    return table[name]


def dtype_name(dtype: Any) -> str:
    """A torch dtype, a tensorrt.DataType, an ONNX elem type or a name -> ``"float32"`` style."""
    if isinstance(dtype, str):
        return ORT_DTYPES.get(dtype, dtype)
    if isinstance(dtype, int):
        return ONNX_DTYPES.get(dtype, str(dtype))
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    name = getattr(dtype, "name", None) or text.rsplit(".", 1)[-1]
    return TRT_DTYPES.get(name, name.lower())


# --------------------------------------------------------------------------------------------
# Model descriptions
# --------------------------------------------------------------------------------------------

def onnx_sidecar_path(onnx_path: str | os.PathLike) -> Path:
    return Path(str(onnx_path) + ".json")


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
            out.append({"name": vi.name, "dtype": ONNX_DTYPES.get(t.elem_type, str(t.elem_type)),
                        "shape": shape})
        return out

    init_names = {i.name for i in model.graph.initializer}
    return {"inputs": io(v for v in model.graph.input if v.name not in init_names),
            "outputs": io(model.graph.output), "config": {}, "dynamic_axes": {}, "sample": {}}


def load_model_description(onnx_path: str | os.PathLike) -> dict:
    """The exporter's sidecar when it exists (authoritative: axis names, config, export sample),
    otherwise what the ONNX graph says. ``"source"`` records which."""
    side = onnx_sidecar_path(onnx_path)
    if side.exists():
        desc = read_json(side)
        desc.setdefault("config", {})
        desc.setdefault("dynamic_axes", {})
        desc.setdefault("sample", {})
        desc["source"] = str(side)
        return desc
    desc = describe_onnx_graph(onnx_path)
    desc["source"] = str(onnx_path)
    return desc


def count_plugin_nodes(onnx_path: str | os.PathLike) -> list[str]:
    """Names of the QKNormRoPE nodes in the model's main graph (not inside function bodies)."""
    import onnx

    from qkrope.export import contract

    model = onnx.load(str(onnx_path), load_external_data=False)
    names = []
    for i, node in enumerate(model.graph.node):
        if node.op_type == contract.OP_TYPE and node.domain == contract.DOMAIN:
            names.append(node.name or f"{contract.OP_TYPE}_{i}")
    return names


def head_dim_from_onnx(onnx_path: str | os.PathLike) -> int | None:
    """head_dim read from the first QKNormRoPE node's q_weight initializer, if there is one."""
    import onnx

    from qkrope.export import contract

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
