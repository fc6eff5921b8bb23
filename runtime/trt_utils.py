"""Small queries shared by the engine builder and the runners (no TensorRT import at module load):
reading an ONNX file with its node-contract check (what every consumer does first), the
QKNormRoPE nodes of a model, head_dim from its weights, and the current GPU."""

from __future__ import annotations

import os

from pathlib import Path

from qkrope import contract
from qkrope.errors import InputFileNotFoundError, QkropeError


class OnnxModelError(QkropeError, ValueError):
    """A file given as an ONNX model is not one (truncated, another format, empty)."""


def read_onnx_model(onnx_path: str | os.PathLike):
    """The ``onnx.ModelProto`` of a file (external data not loaded), or :class:`OnnxModelError`
    when the file is not a readable ONNX model: a truncated file, another format, an empty
    file (which protobuf reads as an empty model)."""
    import onnx

    path = Path(onnx_path)
    if not path.is_file():
        raise InputFileNotFoundError(f"{path} does not exist (or is not a file). Fix: export "
                                     f"it with `qkrope export`")
    fix = f"Fix: re-export it with `qkrope export --out {path}`"
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf DecodeError, OSError, onnx's own errors
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise OnnxModelError(f"{path} is not a readable ONNX model (truncated, or not ONNX: "
                             f"{type(exc).__name__}: {first}). {fix}") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.output:
        what = ("an empty file" if path.stat().st_size == 0 else
                "no IR version" if model.ir_version <= 0 else "no graph outputs")
        raise OnnxModelError(f"{path} is not a readable ONNX model ({what}; truncated, or "
                             f"not ONNX). {fix}")
    return model


def checked_onnx_model(onnx_path: str | os.PathLike, *, require_nodes: bool = False):
    """What every consumer of an ONNX file does first: read it (:func:`read_onnx_model`) and
    validate its QKNormRoPE nodes against the node contract
    (:func:`qkrope.contract.validate_qknorm_rope_nodes`: domain, inputs, outputs, every
    attribute present, typed and in range; the error names the node and the attribute).
    ``require_nodes``: a model without any QKNormRoPE node is an error too."""
    model = read_onnx_model(onnx_path)
    contract.validate_qknorm_rope_nodes(model, where=str(onnx_path))
    if require_nodes and not plugin_node_names(model):
        raise OnnxModelError(
            f"{onnx_path} has no {contract.OP_TYPE} nodes (domain {contract.DOMAIN!r}), so "
            f"nothing in it would use the fused plugin. Fix: export with `qkrope export` (it "
            f"writes the nodes), or build the decomposed model with trtexec/polygraphy if that "
            f"is what you want")
    return model


class NotAnEngineError(QkropeError, ValueError):
    """A file given as a TensorRT engine is not one (an ONNX model, an empty file)."""


def _looks_like_onnx(path: Path) -> bool:
    """The first bytes of a ModelProto as onnx writes it: ir_version (field 1, a small varint),
    then another ModelProto field in order (producer_name ... opset_import)."""
    with open(path, "rb") as f:
        head = f.read(3)
    return (len(head) == 3 and head[0] == 0x08 and 1 <= head[1] <= 64
            and head[2] in (0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42))


def check_engine_file(engine: str | os.PathLike) -> None:
    """Refuse, before TensorRT is needed, what is not a serialised engine: an empty file or an
    ONNX model (by its suffix or its content; its QKNormRoPE nodes are checked against the node
    contract first, as every consumer of an ONNX file does). ``engine`` must exist."""
    engine = Path(engine)
    fix = (f"Fix: build an engine with `qkrope build {engine} -o "
           f"{engine.with_suffix('.engine').name}` and pass that")
    if engine.suffix.lower() == ".onnx" or _looks_like_onnx(engine):
        try:
            checked_onnx_model(engine)
        except OnnxModelError:
            if engine.suffix.lower() != ".onnx":
                return  # a plan whose first bytes happen to look like ONNX
            raise NotAnEngineError(f"{engine} is not a TensorRT engine (an .onnx file). "
                                   f"{fix}") from None
        raise NotAnEngineError(f"{engine} is an ONNX model, not a TensorRT engine. {fix}")
    if engine.stat().st_size == 0:
        raise NotAnEngineError(f"{engine} is empty, not a TensorRT engine. Fix: rebuild it "
                               f"with `qkrope build`")


def plugin_node_names(model) -> list[str]:
    """Names of the QKNormRoPE nodes in an ``onnx.ModelProto``'s main graph."""
    names = []
    for i, node in enumerate(model.graph.node):
        if node.op_type == contract.OP_TYPE and node.domain == contract.DOMAIN:
            names.append(node.name or f"{contract.OP_TYPE}_{i}")
    return names


def count_plugin_nodes(onnx_path: str | os.PathLike) -> list[str]:
    """Names of the QKNormRoPE nodes in the model's main graph (not inside function bodies)."""
    import onnx

    return plugin_node_names(onnx.load(str(onnx_path), load_external_data=False))


def head_dim_from_onnx(onnx_path: str | os.PathLike, model=None) -> int | None:
    """head_dim read from the first QKNormRoPE node's q_weight initializer, if there is one
    (``model``: the file's ``onnx.ModelProto`` when it is already read)."""
    import onnx

    if model is None:
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
