"""The ONNX side of an export after the trace: onnxscript's optimiser with the parameters kept by
name, the parameters checked against the state dict, the QKNormRoPE function body added, the
IR version pinned (:func:`ir_version_for`), the node contract checked, and the file checked
(``onnx.checker`` full check, strict shape inference)."""

from __future__ import annotations

import os
from typing import Sequence

from qkrope import contract, dtypes
from qkrope.errors import QkropeError

from .onnx_function import FUNCTION_BODY_KEY, FunctionVariant, make_function_proto

IR_VERSION = 10  # the floor: ONNX Runtime 1.31/1.32 reject the IR 14 onnx 1.23 writes


def ir_version_for(opset: int) -> int:
    """IR_VERSION, or the IR version ONNX pairs with ``opset`` where that is newer (11 for
    opset 23, so an ``--attention onnx23`` model declares what its operators need)."""
    import onnx

    need = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", int(opset))],
                                               ignore_unknown=True)
    return max(IR_VERSION, int(need))

class ExportError(QkropeError, RuntimeError):
    """The export failed or produced a model that breaks the node contract."""

def _optimize(model, parameters: Sequence[str]) -> None:
    """What ``torch.onnx.export(optimize=True)`` runs (onnxscript's optimizer, then its opset-23
    fusions), with the parameters left as they are.

    The optimizer would otherwise fold ``Transpose(weight)`` of every Linear into an unnamed
    transposed copy and merge parameters whose values happen to be equal (all-ones norm weights
    of a fresh model), so weights could not be mapped back by name (``qkrope refit``, a LoRA
    fused after export). While it runs, the parameters are also graph inputs: ONNX's overridable
    initializers, which constant folding and initializer deduplication never touch. TensorRT
    and ONNX Runtime fold the transposes when they load the model."""
    import logging

    import onnx_ir as ir
    import onnxscript.optimizer
    from onnxscript.rewriter import onnx_fusions

    graph = model.graph
    protected = [graph.initializers[k] for k in parameters]
    graph.inputs.extend(protected)
    # the deduplication pass logs one warning per skipped (= protected) initializer
    dedup_log = logging.getLogger("onnx_ir.passes.common.initializer_deduplication")
    level = dedup_log.level
    dedup_log.setLevel(logging.ERROR)
    from .streaming import user_errors_unwrapped

    try:
        with user_errors_unwrapped():  # a weight refused while read: its own line
            onnxscript.optimizer.optimize_ir(model)
            onnx_fusions.fuse(model)
    finally:
        dedup_log.setLevel(level)
        for value in protected:
            graph.inputs.remove(value)
    ir.passes.common.RemoveUnusedNodesPass()(model)  # parameters the outputs do not use


def check_parameters(model, state_dict) -> list[str]:
    """Every state-dict key the graph uses is an initializer of that name with the tensor's
    shape and dtype; returns the keys the graph does not use (sorted): blocks past ``--layers``,
    and the last block's text-stream output path, which no output depends on."""
    missing = []
    for key, tensor in state_dict.items():
        value = model.graph.initializers.get(key)
        if value is None:
            missing.append(key)
            continue
        got = value.const_value
        if (got is None or list(got.shape) != list(tensor.shape)
                or dtypes.canonical(int(got.dtype), source="onnx")
                != dtypes.canonical(tensor.dtype, source="torch")):
            raise ExportError(f"initializer {key} is {got!r}, the state dict has "
                              f"{list(tensor.shape)} {tensor.dtype}: the export changed a "
                              f"parameter (refit by name would be wrong)")
    return sorted(missing)


def _qk_nodes(model) -> list:
    return [n for n in model.graph.all_nodes()
            if n.domain == contract.DOMAIN and n.op_type == contract.OP_TYPE]


def finalize_model(model, *, opset: int, head_dim: int, rotary_dim: int,
                   expected_nodes: int | None = None):
    """Add the function body, pin the IR version, check the node contract (in place)."""
    import onnx_ir as ir

    nodes = _qk_nodes(model)
    if expected_nodes is not None and len(nodes) != expected_nodes:
        raise ExportError(f"expected {expected_nodes} QKNormRoPE nodes (one per stream per "
                          f"attention), the export wrote {len(nodes)}")
    variants = set()
    for node in nodes:
        attrs = {k: v.value for k, v in node.attributes.items()}
        why = contract.attribute_names_error(attrs)  # norm_scope may be absent (0)
        if why is not None:
            raise ExportError(f"QKNormRoPE node {node.name} {why}")
        variants.add(FunctionVariant.of_node(attrs, partial=rotary_dim < head_dim))
    if len(variants) > 1:
        raise ExportError(f"the model's QKNormRoPE nodes use different interleaved/rounding"
                          f"/norm_scope "
                          f"settings {sorted(v.tag for v in variants)}; one model carries one "
                          f"function body, so export them as separate models")
    variant = variants.pop() if variants else FunctionVariant(partial=rotary_dim < head_dim)
    opset = int(model.opset_imports.get("", opset))  # the body imports the model's own opset
    function = ir.serde.deserialize_function(make_function_proto(variant, opset=opset))
    model.functions[function.identifier()] = function
    model.metadata_props[FUNCTION_BODY_KEY] = variant.tag  # what function_variant() reads
    model.opset_imports[contract.DOMAIN] = contract.DOMAIN_VERSION
    model.ir_version = ir_version_for(opset)
    values = list(model.graph.inputs) + [o for n in model.graph.all_nodes() for o in n.outputs]
    for value in values:
        if value.dtype is not None and "COMPLEX" in value.dtype.name:
            raise ExportError(f"graph value {value.name} is complex ({value.dtype.name})")
    return model

def check_no_double(model, what: str = "the graph") -> None:
    """No float64 anywhere in the traced graph: no DOUBLE input, output, initializer, value or
    Cast (TensorRT's parser demotes DOUBLE to FLOAT, so ONNX Runtime and TensorRT would
    disagree). diffusers builds many models' RoPE tables in float64; an export takes caches in
    their place, and a family's ``post_export`` hook calls this with ``what`` naming its graph."""
    import onnx_ir as ir

    double = ir.DataType.DOUBLE
    values = list(model.graph.inputs) + list(model.graph.outputs) + list(
        model.graph.initializers.values())
    for node in model.graph.all_nodes():
        values += list(node.outputs)
        if node.op_type == "Cast" and "to" in node.attributes and \
                int(node.attributes["to"].value) == int(double):
            raise ExportError(f"node {node.name} casts to DOUBLE: {what} must have no float64")
    for value in values:
        if value is not None and value.dtype == double:
            raise ExportError(f"graph value {value.name} is DOUBLE: {what} must have no "
                              f"float64")


def verify_onnx_file(path: str | os.PathLike) -> None:
    """onnx.checker full check + strict shape inference; every graph output must get a shape."""
    import onnx

    path = str(path)
    try:
        onnx.checker.check_model(path, full_check=True)
        model = onnx.load(path, load_external_data=False)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        raise ExportError(f"the exported model fails onnx's checks: {exc}") from exc
    for out in inferred.graph.output:
        if not out.type.tensor_type.HasField("shape"):
            raise ExportError(f"shape inference gave output {out.name} no shape")
