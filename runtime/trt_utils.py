"""Small queries shared by the engine builder and the runners (no TensorRT import at module load):
the QKNormRoPE nodes of an ONNX file, head_dim from its weights, and the current GPU."""

from __future__ import annotations

import os

from qkrope import contract


def count_plugin_nodes(onnx_path: str | os.PathLike) -> list[str]:
    """Names of the QKNormRoPE nodes in the model's main graph (not inside function bodies)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    names = []
    for i, node in enumerate(model.graph.node):
        if node.op_type == contract.OP_TYPE and node.domain == contract.DOMAIN:
            names.append(node.name or f"{contract.OP_TYPE}_{i}")
    return names


def head_dim_from_onnx(onnx_path: str | os.PathLike) -> int | None:
    """head_dim read from the first QKNormRoPE node's q_weight initializer, if there is one."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == contract.OP_TYPE and len(node.input) > 2 and node.input[2] in inits:
            dims = list(inits[node.input[2]].dims)
            if len(dims) == 1:
                return int(dims[0])
    return None


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
