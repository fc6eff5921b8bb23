"""What an export records about itself: the sidecar's tensors with their roles
(:func:`_tensor_infos`), the versions that wrote it, and the model's own ``metadata_props`` and
input doc strings (:func:`annotate_model`) that the sidecar is checked against on load."""

from __future__ import annotations

from typing import Sequence

from qkrope import contract, model_io, quantization
from qkrope.sidecars import METADATA_PREFIX, ModelConfig, TensorInfo

from .finalize import ExportError

def _versions(extra: Sequence[str] = ()) -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("qkrope", "torch", "onnx", "onnxscript", "onnx-ir", "onnxruntime", *extra):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def _tensor_infos(model, axis_names: set[str],
                  decl: model_io.ModelDecl) -> tuple[list[TensorInfo], list[TensorInfo]]:
    """The sidecar's inputs and outputs: the graph's names, dtypes and shapes, each with the role
    the model's declaration gives it (:mod:`qkrope.model_io`)."""
    roles = {t.name: t.role for t in decl.inputs + decl.outputs}

    def desc(v):
        if v.name not in roles:
            raise ExportError(f"the graph has a tensor {v.name!r} that the {decl.kind} model "
                              f"does not declare ({list(roles)})")
        shape = []
        for d in v.shape:
            if isinstance(d, int):
                shape.append(d)
            else:
                name = str(d)
                if name not in axis_names:
                    raise ExportError(f"{v.name} has an unexpected dynamic axis {name!r}; the "
                                      f"export fixed the wrong dimensions")
                shape.append(name)
        return TensorInfo(v.name, v.dtype.numpy().name if v.dtype.name != "BFLOAT16"
                          else "bfloat16", shape, roles[v.name])

    return [desc(v) for v in model.graph.inputs], [desc(v) for v in model.graph.outputs]


#: What each graph input is (the ONNX file's doc strings on its inputs).
INPUT_DOCS = {t.name: t.doc for t in model_io.TENSORS.values() if t.doc}


def annotate_model(model, *, kind: str, dtype: str, config: ModelConfig,
                   attributes: contract.NodeAttributes | None = None,
                   write_id: str | None = None, io: dict | None = None) -> None:
    """metadata_props (qkrope version, node contract version, model kind, dtype, config, node
    attributes and the sidecar's I/O facts (``io``: :meth:`ModelInfo.io_facts`) as JSON: what
    the sidecar is checked against; the sidecar's ``write_id``) and a doc string on every graph
    input (in place)."""
    import json

    from qkrope import __version__

    props = {"version": __version__, "contract_version": contract.CONTRACT_VERSION,
             "domain_version": str(contract.DOMAIN_VERSION), "model": kind, "dtype": dtype,
             "config": json.dumps(config.to_dict(), sort_keys=True)}
    if attributes is not None:
        props["node_attributes"] = json.dumps(attributes.to_node(), sort_keys=True)
    if write_id:  # the sidecar records the same id: a pair from two writers is refused
        props["write_id"] = write_id
    if io is not None:
        props["io"] = json.dumps(io, sort_keys=True)
    if config.quantization:  # qkrope.quantization: what a reader checks first
        props[quantization.METADATA_KEY] = json.dumps(config.quantization, sort_keys=True)
    for key, value in props.items():
        model.metadata_props[METADATA_PREFIX + key] = value
    for value in model.graph.inputs:
        if value.name in INPUT_DOCS:
            value.doc_string = INPUT_DOCS[value.name]
