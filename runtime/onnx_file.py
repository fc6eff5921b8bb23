"""Reading an ONNX file (onnx imported only when a file is read): the model with its
external-data and node-contract checks (what every consumer of an ONNX file does first), the
QKNormRoPE nodes of a model, and head_dim from its weights."""

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


def _tensors_with_data(model):
    """Every TensorProto of a model that may carry external data: initializers (dense and
    sparse), Constant-like attribute tensors, in the main graph, its subgraphs and functions."""
    def graph_tensors(graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from node_tensors(graph.node)

    def node_tensors(nodes):
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    yield from graph_tensors(attr.g)
                for g in attr.graphs:
                    yield from graph_tensors(g)

    yield from graph_tensors(model.graph)
    for function in model.functions:
        yield from node_tensors(function.node)


def external_data_files(model, onnx_path: str | os.PathLike) -> list[Path]:
    """The external-data files of an ``onnx.ModelProto`` read from ``onnx_path``, each checked:
    its ``location`` is relative, has no ``..`` component and resolves (symlinks followed) to a
    file inside the model's folder. Anything else (an absolute path, ``../x.bin``, a symlink out
    of the folder, a missing file) is an :class:`OnnxModelError`: a model must not make a reader
    open, hand to TensorRT, or copy into a repository a file from outside its folder."""
    path = Path(onnx_path)
    folder = path.parent.resolve()
    fix = f"Fix: re-export the model with `qkrope export --out {path}` (it writes {path.name}.data)"
    files: list[Path] = []
    for tensor in _tensors_with_data(model):
        if tensor.data_location != 1:  # TensorProto.EXTERNAL
            continue
        locations = [e.value for e in tensor.external_data if e.key == "location"]
        if len(locations) != 1 or not locations[0]:
            raise OnnxModelError(f"{path}: tensor {tensor.name!r} is stored externally but names "
                                 f"{len(locations)} locations. {fix}")
        loc = locations[0]
        parts = Path(loc.replace("\\", "/")).parts
        if os.path.isabs(loc) or loc.startswith(("/", "\\")) or ".." in parts or ":" in loc:
            raise OnnxModelError(
                f"{path}: tensor {tensor.name!r} keeps its data at {loc!r}, outside the model's "
                f"folder (an absolute path or one with '..'); qkrope reads external data only "
                f"from files beside the model. {fix}")
        target = path.parent / loc
        resolved = target.resolve()
        if resolved != folder and folder not in resolved.parents:
            raise OnnxModelError(
                f"{path}: tensor {tensor.name!r} keeps its data in {target}, which resolves to "
                f"{resolved}, outside the model's folder {folder} (a symlink out of it); qkrope "
                f"reads external data only from files inside the model's folder. {fix}")
        if not resolved.is_file():
            raise OnnxModelError(f"{path}: the external data file {target} of tensor "
                                 f"{tensor.name!r} is missing. {fix}")
        if target not in files:
            files.append(target)
    return files


def checked_onnx_model(onnx_path: str | os.PathLike, *, require_nodes: bool = False):
    """What every consumer of an ONNX file does first: read it (:func:`read_onnx_model`), check
    its external-data locations (:func:`external_data_files`) and validate its QKNormRoPE nodes against the node contract
    (:func:`qkrope.contract.validate_qknorm_rope_nodes`: domain, inputs, outputs, every
    attribute present, typed and in range; the error names the node and the attribute).
    ``require_nodes``: a model without any QKNormRoPE node is an error too."""
    model = read_onnx_model(onnx_path)
    external_data_files(model, onnx_path)
    contract.validate_qknorm_rope_nodes(model, where=str(onnx_path))
    if require_nodes and not plugin_node_names(model):
        raise OnnxModelError(
            f"{onnx_path} has no {contract.OP_TYPE} nodes (domain {contract.DOMAIN!r}), so "
            f"nothing in it would use the fused plugin. Fix: export with `qkrope export` (it "
            f"writes the nodes), or build the decomposed model with trtexec/polygraphy if that "
            f"is what you want")
    return model


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
