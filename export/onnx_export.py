"""``qkrope export``: the Qwen-Image attention block or a whole diffusers transformer (any family
of :mod:`qkrope.families`, through its export hooks) to ONNX.

Exporter path: ``torch.onnx.export(..., dynamo=True)`` (torch.export + onnxscript/torchlib) with
``custom_translation_table={torch.ops.qkrope.qk_norm_rope.default: qk_norm_rope_translation}``:
every call of the fused op becomes one ``qkrope::QKNormRoPE`` node (docs/spec.md section 4). After the
export the model-local function body is added (one body per model, see
:mod:`qkrope.export.onnx_function`), the IR version is pinned to 10, or 11 at opset 23
(:func:`ir_version_for`; ONNX Runtime 1.31 rejects the IR 14 that onnx 1.23 writes), and the file is checked (``onnx.checker`` full check, strict
shape inference with every graph output shaped, QKNormRoPE node count, no complex types).

The weights are never in memory as a whole: the module traced has placeholder parameters and
each initializer is read from the weight files by its state-dict key when it is written
(:mod:`qkrope.export.streaming`), external data first, that form checked, then inlined in chunks
into one file for a model under :data:`EXTERNAL_DATA_THRESHOLD`.

Files are written to a hidden staging folder next to the destination and moved into place as a
group by :func:`qkrope._fileio.staged_outputs` (the sidecar ``.onnx.json`` first, then the
``.onnx.data`` external-data companion of models over 1.5 GiB, then the ``.onnx``; any failure
puts the old files back): a failed re-export leaves the old model and sidecar as they were. The
sidecar records the model's sha256, so a kill between two renames leaves a pair the reader
refuses ("does not describe this model"), never a silently mixed one.

Graph inputs are named after diffusers' arguments: ``hidden_states``, ``encoder_hidden_states``,
``encoder_hidden_states_mask`` (**bool** ``[batch, txt_tokens]``, True = attend, in both models:
diffusers normalises any mask to bool before attention, and a float mask fed to SDPA would be
*additive*, so bool removes the ambiguity; pass ``mask > 0`` for a 1.0/0.0 mask), ``timestep``
(transformer; ``[batch]`` in the model dtype, as the pipeline passes it), ``img_cos_sin_cache``,
``txt_cos_sin_cache`` (fp32 ``[rows, rotary_dim]``). Outputs: ``img_out``, ``txt_out`` (attention)
or ``sample`` (transformer). Dynamic axes: ``batch``, ``img_tokens``, ``txt_tokens``,
``img_cache_rows``, ``txt_cache_rows``.

torch.export specialises dimensions whose sample value is 0 or 1, so tracing always uses a batch
of at least 2 and at least 2 tokens per stream (the sidecar records the traced sample).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from qkrope.errors import InputError, InputFileNotFoundError, QkropeError
from qkrope.sidecars import METADATA_PREFIX, ModelConfig, ModelInfo, TensorInfo, sidecar_path
from qkrope._fileio import (EXTERNAL_DATA, MODEL_SIDECAR, ONNX_MODEL, check_output_folder,
                            check_outputs, sha256_file, staged_outputs)
from qkrope import dtypes, quantization
from qkrope.runtime.caches import default_axes_dims  # noqa: F401 (part of this module's API)

from qkrope import contract, model_io
from qkrope.model_io import QWEN_IMAGE
from qkrope._progress import Steps
from qkrope.file_record import new_write_id

from . import latent_axes
from .attention import (ATTENTION_FORMS, DEFAULT_ATTENTION_FORM,  # noqa: F401 (API)
                        attention_form, check_attention_form)
from .patch_diffusers import check_fits_in_memory as _check_fits_in_memory, itemsize as _itemsize
from .onnx_function import (DEFAULT_OPSET, FUNCTION_BODY_KEY, MAX_OPSET, MIN_OPSET,
                            FunctionVariant, make_function_proto, qk_norm_rope_translation)

IR_VERSION = 10  # the floor: ONNX Runtime 1.31/1.32 reject the IR 14 onnx 1.23 writes


def ir_version_for(opset: int) -> int:
    """IR_VERSION, or the IR version ONNX pairs with ``opset`` where that is newer (11 for
    opset 23, so an ``--attention onnx23`` model declares what its operators need)."""
    import onnx

    need = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", int(opset))],
                                               ignore_unknown=True)
    return max(IR_VERSION, int(need))

EXTERNAL_DATA_THRESHOLD = 1536 * 1024 * 1024  # bytes of initializers; protobuf's limit is 2 GiB
TORCH_DTYPES = dtypes.TORCH_BY_SHORT  # "fp32" | "fp16" | "bf16" -> torch dtype
# the graphs' input and output names (qkrope/model_io.py)
ATTENTION_INPUTS = model_io.ATTENTION.input_names
ATTENTION_OUTPUTS = model_io.ATTENTION.output_names
TRANSFORMER_INPUTS = model_io.TRANSFORMER.input_names
TRANSFORMER_OUTPUTS = model_io.TRANSFORMER.output_names
DEFAULT_ATTENTION_SAMPLE = dict(img_shapes=[(1, 16, 16)], txt_len=32, batch=2)
DEFAULT_TRANSFORMER_SAMPLE = dict(img_shapes=[(1, 8, 8)], txt_len=16, batch=2)


class ExportError(QkropeError, RuntimeError):
    """The export failed or produced a model that breaks the node contract."""


# --------------------------------------------------------------------------------------------
# Wrappers whose forward arguments are the graph inputs
# --------------------------------------------------------------------------------------------

class CacheInputAttention(nn.Module):
    """QwenImageAttention with the graph's input order and names."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attn = attention

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                img_cos_sin_cache, txt_cos_sin_cache):
        return self.attn(hidden_states, encoder_hidden_states,
                         (img_cos_sin_cache, txt_cos_sin_cache), encoder_hidden_states_mask)


def _dynamic_shapes(names: Sequence[str]) -> dict[str, dict[int, Any]]:
    """torch.export's dynamic dimensions of each graph input: its named axes
    (:data:`qkrope.model_io.TENSORS`; a 5-D latent's: :mod:`.latent_axes`)."""
    return latent_axes.dynamic_shapes(names, None)


# --------------------------------------------------------------------------------------------
# Export core
# --------------------------------------------------------------------------------------------

def _torch_export(module: nn.Module, args: tuple, input_names: Sequence[str],
                  output_names: Sequence[str], opset: int, *, parameters_of: str,
                  steps: Steps | None = None, what: str = "the model",
                  attention: str = DEFAULT_ATTENTION_FORM, weights=None, patch=None):
    """torch.onnx.export (dynamo) -> onnx_ir Model with QKNormRoPE nodes (no body yet) whose
    parameters are named by their state-dict keys (:func:`_keep_parameters`).

    ``parameters_of`` is the attribute of the wrapper ``module`` that holds the diffusers module
    (``"attn"``, ``"transformer"``): its state-dict keys name the initializers. ``weights``
    (a :class:`qkrope.export.streaming.TensorSource`, e.g. the shards' DiskWeights): the
    module's parameters are placeholders and each initializer reads its value from there when
    it is written."""
    import logging
    import warnings

    # torch.onnx logs one warning per torchvision op it cannot register when torchvision is
    # absent; that is noise for this model, so it is silenced for the duration of the export.
    registration_log = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration_log.level
    registration_log.setLevel(logging.ERROR)
    steps = steps or Steps("qkrope export", 0, enabled=False)
    with steps.step(f"tracing {what} (torch.export, ONNX translation)"), \
            warnings.catch_warnings(), torch.no_grad(), attention_form(attention):
        warnings.simplefilter("ignore")
        try:
            program = torch.onnx.export(
                module, args, dynamo=True, opset_version=opset, optimize=False, verbose=False,
                input_names=list(input_names), output_names=list(output_names),
                dynamic_shapes=latent_axes.dynamic_shapes(input_names, patch),
                custom_translation_table={
                    torch.ops.qkrope.qk_norm_rope.default: qk_norm_rope_translation},
            )
        finally:
            registration_log.setLevel(level)
    model = program.model
    latent_axes.rename(model, patch)  # a 5-D latent's axes by name (export/latent_axes.py)
    inner = getattr(module, parameters_of)
    keys = _rename_parameters(model, inner.state_dict(), prefix=parameters_of + ".")
    if weights is not None:
        from .streaming import check_no_placeholders, stream_initializers

        stream_initializers(model, weights, keys)
        check_no_placeholders(model, inner)
    with steps.step(f"optimising the graph (onnxscript; {len(keys)} parameters kept by name)"):
        _optimize(model, keys)
    return model


def _rename_parameters(model, state_dict, *, prefix: str) -> list[str]:
    """Name each initializer torch.export lifted from a parameter or buffer by its key in the
    wrapped module's state dict (``transformer.img_in.weight`` -> ``img_in.weight``); returns
    the keys found in the graph."""
    found = []
    for key in state_dict:
        value = model.graph.initializers.get(prefix + key)
        if value is not None:
            value.name = key
            found.append(key)
    return found


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
        if sorted(attrs) != sorted(a.name for a in contract.ATTRIBUTES):
            raise ExportError(f"QKNormRoPE node {node.name} has attributes {sorted(attrs)}, the "
                              f"contract lists {[a.name for a in contract.ATTRIBUTES]}")
        variants.add(FunctionVariant(bool(attrs["interleaved"]), int(attrs["rounding"]),
                                     rotary_dim < head_dim))
    if len(variants) > 1:
        raise ExportError(f"the model's QKNormRoPE nodes use different interleaved/rounding "
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


def _initializer_bytes(model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
    return total


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


def _save_staged(model, out: Path, st, steps: Steps) -> tuple[bool, dict[str, str]]:
    """Save and verify the model into the staging folder ``st``; ``(True when it has external
    data, the sha256 by location ("": the model file) of the files hashed as they were written:
    the sidecar records them without reading the files again)``.

    The initializers are written one at a time (each may be a lazy tensor read from the weight
    files, :mod:`qkrope.export.streaming`) into external data first, and that form is checked;
    a model under :data:`EXTERNAL_DATA_THRESHOLD` is then made one file by copying the data into
    it in chunks (:func:`qkrope.export.streaming.inline_external_data`). Neither step holds
    more than one large tensor in memory."""
    import onnx
    import onnx_ir as ir

    from .streaming import WrittenDigest, inline_external_data

    data_name = out.name + ".data"
    nbytes = _initializer_bytes(model)
    external = nbytes > EXTERNAL_DATA_THRESHOLD
    form = st.dir / ".external"  # the external-data form, checked before it is moved or inlined
    form.mkdir()
    ext_model, ext_data = form / out.name, form / data_name
    gib = nbytes / 2**30
    with steps.step(f"writing {out.name} with {gib:.2f} GiB of external data {data_name}"
                    if external else f"writing {out.name} ({gib:.2f} GiB of initializers, "
                                     f"inside the file)"), \
            steps.counter("written", total=nbytes, unit="B", every=2**30) as bar, \
            WrittenDigest() as digest:
        last = [0]  # the bytes of the tensor being written (the callback comes before each)

        def written(tensor, info) -> None:
            digest.before(tensor, info)
            bar.update(last[0])
            last[0] = tensor.nbytes

        ir.save(model, ext_model, external_data=data_name, callback=written)
        bar.update(last[0])
        digests = {}
        if external:
            data_digest = digest.hexdigest(ext_data)
            if data_digest is not None:
                digests[data_name] = data_digest
        else:
            digests[""] = inline_external_data(ext_model, st.path(out.name))
    with steps.step("checking it (onnx.checker full check, strict shape inference, node "
                    "contract)"):
        verify_onnx_file(ext_model)  # the same model as the single file, without its data
        contract.validate_qknorm_rope_nodes(onnx.load(str(ext_model), load_external_data=False),
                                            where=str(out))
    if external:
        ext_model.replace(st.path(out.name))
        if ext_data.exists():
            ext_data.replace(st.path(data_name))
        else:  # every initializer under onnx_ir's size threshold: an empty companion
            st.path(data_name).touch()
    ext_model.unlink(missing_ok=True)
    ext_data.unlink(missing_ok=True)
    form.rmdir()
    return external, digests


def _commit_order(out: Path, external: bool) -> tuple[list[str], list[str]]:
    """The sidecar first, the external data next, the model last (and a stale ``.data`` of an
    older, larger export removed after): a kill between two renames leaves a sidecar whose
    model_sha256 does not match the model, which the reader refuses, and every state where the
    sidecar matches the model has the data file that model was written with."""
    data_name, side = out.name + ".data", sidecar_path(out).name
    if external:
        return [side, data_name, out.name], []
    return [side, out.name], [data_name]


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


def _write_outputs(model, out: Path, info_fields: dict, steps: Steps,
                   decl: model_io.ModelDecl | None = None):
    """The model (+ external data) and its sidecar, replaced as a group or not at all
    (:func:`qkrope._fileio.staged_outputs`; the commit order is :func:`_commit_order`).
    ``decl``: the graph's declaration (default: that of the model kind; FLUX's differ)."""
    axis_values = info_fields.pop("axis_values")
    inputs, outputs = _tensor_infos(model, set(axis_values),
                                    decl or model_io.MODELS[info_fields["model"]])
    info_fields["dynamic_axes"] = {a: {"export_value": int(v)} for a, v in axis_values.items()}
    info = ModelInfo(inputs=inputs, outputs=outputs, write_id=new_write_id(), **info_fields)
    annotate_model(model, kind=info.model, dtype=info.dtype, config=info.config,
                   attributes=info.node_attributes, write_id=info.write_id,
                   io=info.io_facts())
    names = [out.name, out.name + ".data", sidecar_path(out).name]
    kinds = dict(zip(names, (ONNX_MODEL, EXTERNAL_DATA, MODEL_SIDECAR)))
    with staged_outputs(out.parent, names, kinds=kinds) as st:
        external, digests = _save_staged(model, out, st, steps)
        # records the staged files' sha256 (hashed as they were written) and stat records (the
        # commit's renames keep them)
        info.save(st.path(out.name), external_data=[out.name + ".data"] if external else [],
                  digests=digests)
        order, remove = _commit_order(out, external)
        st.commit(order, remove=remove)
    written = [out] + ([out.parent / (out.name + ".data")] if external else [])
    return info, written + [sidecar_path(out)]


@dataclass
class Sample:
    img_shapes: list[tuple[int, int, int]]
    txt_len: int
    batch: int

    @property
    def img_tokens(self) -> int:
        return sum(f * h * w for f, h, w in self.img_shapes)


def _sample(img_shapes, txt_len, batch, defaults) -> Sample:
    shapes = [tuple(int(v) for v in s) for s in (img_shapes or defaults["img_shapes"])]
    txt_len = int(txt_len if txt_len is not None else defaults["txt_len"])
    batch = int(batch if batch is not None else defaults["batch"])
    for s in shapes:
        if len(s) != 3 or min(s) < 1:
            raise InputError(f"--img-shape takes three positive integers F H W (latent patches); "
                             f"got {s}")
    if batch < 1:
        raise InputError(f"--batch must be >= 1; got {batch}")
    if txt_len < 2:
        raise InputError(f"--txt-len must be >= 2 for tracing (torch.export fixes axes whose "
                         f"sample size is 0 or 1); got {txt_len}")
    sample = Sample(shapes, txt_len, max(batch, 2))
    if sample.img_tokens < 2:
        raise InputError(f"the sample image must have >= 2 tokens for tracing; got {shapes}")
    return sample


#: torch.Generator.manual_seed takes seeds below 2**64; the sample generator is seeded seed + 1
MAX_SEED = 2**63 - 1


def _sample_args(sample: Sample, dtype: torch.dtype, feat_img: int, feat_txt: int,
                 axes_dim: Sequence[int], with_timestep: bool, seed: int):
    from qkrope.runtime.caches import build_qwen_rope_caches

    _check_fits_in_memory(
        f"the export sample (batch {sample.batch}, {sample.img_tokens} image and "
        f"{sample.txt_len} text tokens)",
        sample.batch * (sample.img_tokens * feat_img + sample.txt_len * feat_txt)
        * _itemsize(dtype) * 4,  # the inputs, and the activations the trace keeps of them
        "give smaller --batch / --img-shape / --txt-len")

    g = torch.Generator().manual_seed(seed + 1)
    caches = build_qwen_rope_caches(sample.img_shapes, sample.txt_len, axes_dim=tuple(axes_dim))
    hs = torch.randn(sample.batch, sample.img_tokens, feat_img, generator=g).to(dtype)
    ehs = torch.randn(sample.batch, sample.txt_len, feat_txt, generator=g).to(dtype)
    mask = torch.ones(sample.batch, sample.txt_len, dtype=torch.bool)
    mask[-1, -1] = False
    args = [hs, ehs, mask]
    if with_timestep:
        args.append(torch.full((sample.batch,), 0.5, dtype=dtype))
    args += [caches.img.clone(), caches.txt.clone()]
    return tuple(args)


def default_opset(attention: str = DEFAULT_ATTENTION_FORM, quant: str | None = None) -> int:
    """DEFAULT_OPSET, or the lowest opset that has the attention form (23 for ``onnx23``) and
    the quantisation (19 for FP8 Q/DQ)."""
    return max(DEFAULT_OPSET,
               contract.ATTENTION_MIN_OPSET.get(check_attention_form(attention), DEFAULT_OPSET),
               FP8_MIN_OPSET if quant else DEFAULT_OPSET)


FP8_MIN_OPSET = 19  # QuantizeLinear/DequantizeLinear take float8 types from opset 19


def _check_quant_opset(quant: str | None, opset: int) -> None:
    if quant is not None and opset < FP8_MIN_OPSET:
        raise InputError(f"--quant {quant} needs --opset {FP8_MIN_OPSET} or later (float8 "
                         f"QuantizeLinear/DequantizeLinear); got {opset}")


def _check_opset(opset: int) -> int:
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise InputError(f"--opset must be between {MIN_OPSET} and {MAX_OPSET} (the dynamo exporter "
                         f"targets opset 18+; the default {DEFAULT_OPSET} has the widest TensorRT/"
                         f"ONNX Runtime support); got {opset}")
    return int(opset)


def _check_dtype(dtype: str) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise InputError(f"--dtype must be one of {sorted(TORCH_DTYPES)}; got {dtype!r}")
    return TORCH_DTYPES[dtype]


def _check_out(out: str | os.PathLike, inputs: Sequence[str | os.PathLike | None] = ()) -> Path:
    """``--out`` before the trace: a .onnx path in a writable folder whose three outputs are
    none of the ``inputs`` (the weights, the diffusers folder's files) and replace no file of
    another kind (:func:`qkrope._fileio.check_outputs`)."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise InputError(f"--out must end in .onnx; got {str(out)!r}")
    if out.is_dir():
        raise InputError(f"--out {str(out)!r} is a directory")
    check_output_folder(out.parent)  # before the trace: a file in the path, a read-only folder
    check_outputs([(out, ONNX_MODEL),
                   (out.parent / (out.name + ".data"), EXTERNAL_DATA),
                   (sidecar_path(out), MODEL_SIDECAR)],
                  list(inputs))
    return out


# --------------------------------------------------------------------------------------------
# Attention block
# --------------------------------------------------------------------------------------------

def load_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A safetensors file or a torch-saved state dict (diffusers parameter names); anything else
    is one InputError saying what the file is
    (:func:`qkrope.runtime.state_dict.read_state_dict_file`)."""
    from qkrope.runtime.state_dict import read_state_dict_file

    state = read_state_dict_file(path, what="--weights")
    _refuse_quantized(state, path)
    return state


def _refuse_quantized(keys, path) -> None:
    quantization.refuse_quantized_state_dict(
        keys, source=f"--weights {str(path)!r}",
        fix="the attention-block export has no quantised form: quantise the whole transformer "
            f"(`{quantization.QUANTIZE_COMMAND}`) and export it with "
            f"`{quantization.EXPORT_COMMAND.format(dir='QDIR')}`")


def _attention_module(info: ModelInfo, *, placeholders: bool = False) -> nn.Module:
    """The QwenImageAttention of ``info``'s config and node attributes (float32 parameters as
    nn.Linear initialises them, or placeholders in the export dtype: see
    :func:`qkrope.export.streaming.placeholder_module`)."""
    from .attention import QwenImageAttention
    from .streaming import placeholder_module

    config, attrs = info.config, info.attributes

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own init must not move the RNG
            return QwenImageAttention(int(config.dim), int(config.heads), int(config.head_dim),
                                      **attrs.as_kwargs(), validate=False)

    if placeholders:
        return placeholder_module(build, dtype=TORCH_DTYPES[info.dtype])
    return build()


def _random_parameter(name: str, shape, g: torch.Generator) -> torch.Tensor:
    """The seeded random value (float32) of the attention parameter ``name``: the next draw
    of ``g``, RMSNorm weights near 1 (not all 1), the others scaled by 1/sqrt(fan-in)."""
    noise = torch.randn(shape, generator=g)
    if name.startswith("norm"):
        return 1.0 + 0.3 * noise
    return noise / shape[-1] ** 0.5


def _check_attention_weights(keys, state_keys, weights: str) -> None:
    missing = sorted(set(state_keys) - set(keys))
    unexpected = sorted(set(keys) - set(state_keys))
    if missing or unexpected:
        raise InputError(f"--weights {weights!r} does not match the attention block "
                         f"(diffusers names): missing {missing[:6]}, unexpected "
                         f"{unexpected[:6]}")


def build_attention(info: ModelInfo) -> nn.Module:
    """The QwenImageAttention an attention export was made from, rebuilt from its sidecar: the
    config's sizes, the node attributes, the dtype, seeded random weights or the weights file
    the config names."""
    config = info.config
    module = _attention_module(info)
    weights = config.weights
    if weights:
        state = load_state_dict(weights)
        _check_attention_weights(state, module.state_dict(), weights)
        module.load_state_dict(state, strict=False)
    else:
        g = torch.Generator().manual_seed(int(config.seed or 0))
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(_random_parameter(name, p.shape, g))
    return module.to(TORCH_DTYPES[info.dtype]).eval()


def _attention_weights(module: nn.Module, info: ModelInfo):
    """The values :func:`build_attention` gives ``module``'s (placeholder) parameters, one
    tensor at a time (:class:`qkrope.export.streaming.TensorSource`): from a safetensors
    ``--weights`` file by its header, from a torch-saved one as ``torch.load`` maps it, or
    drawn again from the seed (the generator's state before each parameter is recorded in one
    pass that draws and drops each)."""
    from qkrope.runtime.state_dict import looks_like_safetensors

    from .streaming import TensorSource

    config, dtype = info.config, TORCH_DTYPES[info.dtype]
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    weights = config.weights
    if weights and looks_like_safetensors(weights):
        from qkrope.diffusers_weights import DiffusersWeightsError, _read_header, read_tensor

        try:
            headers = _read_header(Path(weights))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(f"--weights {weights!r} is not a readable safetensors file "
                             f"({exc})") from None
        _refuse_quantized(headers, weights)
        _check_attention_weights(headers, shapes, weights)
        for key, header in headers.items():
            if tuple(header.shape) != shapes[key]:
                raise InputError(f"--weights {weights!r}: {key} is {list(header.shape)}, the "
                                 f"attention block has {list(shapes[key])}")

        def value(key: str) -> torch.Tensor:
            try:
                return read_tensor(headers[key])
            except DiffusersWeightsError as exc:
                raise InputError(f"--weights {weights!r}: {exc}") from None
    elif weights:
        state = load_state_dict(weights)
        _check_attention_weights(state, shapes, weights)

        def value(key: str) -> torch.Tensor:
            return state[key]
    else:
        g = torch.Generator().manual_seed(int(config.seed or 0))
        states = {}
        for key, shape in shapes.items():  # named_parameters order (no buffers)
            states[key] = g.get_state()
            torch.randn(shape, generator=g)

        def value(key: str) -> torch.Tensor:
            draw = torch.Generator()
            draw.set_state(states[key])
            return _random_parameter(key, shapes[key], draw)

    from qkrope.weight_values import checked_cast

    # as build_attention: the float32 module's value, then the export dtype (values it
    # cannot hold refused: qkrope.weight_values)
    return TensorSource(lambda key: checked_cast(value(key).to(torch.float32), dtype, name=key,
                                                 source=f"--weights {weights}"), shapes)


def export_attention(out: str | os.PathLike, *, heads: int = QWEN_IMAGE.heads,
                     head_dim: int = QWEN_IMAGE.head_dim,
                     rotary_dim: int | None = None, dtype: str = "fp32",
                     opset: int | None = None, eps: float = contract.DEFAULT_EPS,
                     interleaved: bool = contract.DEFAULT_INTERLEAVED,
                     rounding: int = contract.DEFAULT_ROUNDING,
                     weights: str | os.PathLike | None = None, seed: int = 0,
                     img_shapes: Sequence[Sequence[int]] | None = None,
                     txt_len: int | None = None, batch: int | None = None,
                     attention: str = DEFAULT_ATTENTION_FORM, progress: bool = False):
    """Export the Qwen-Image attention block; returns ``(ModelInfo, [written paths])``.

    ``attention``: how softmax attention is written (:data:`ATTENTION_FORMS`); ``opset``
    defaults to the lowest that has it (:func:`default_opset`)."""
    out = _check_out(out, [weights])
    tdtype = _check_dtype(dtype)
    opset = _check_opset(default_opset(attention) if opset is None else opset)
    check_attention_form(attention, opset)
    if int(heads) < 1:
        raise InputError(f"--heads must be >= 1; got {heads}")
    contract.check_head_dim(head_dim, what="--head-dim")
    contract.check_epsilon(eps, what="--eps")
    if weights is not None and not os.path.isfile(weights):
        raise InputFileNotFoundError(f"--weights {str(weights)!r} does not exist: give a safetensors "
                                f"file or a torch state dict with diffusers' attention names")
    rotary_dim = head_dim if rotary_dim is None else int(rotary_dim)
    if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise InputError(f"--rotary-dim must be even and in (0, head_dim={head_dim}]; got "
                         f"{rotary_dim}")
    attributes = contract.NodeAttributes(eps, interleaved, rounding)  # checked
    if isinstance(seed, bool) or not isinstance(seed, int) or not -MAX_SEED <= seed < MAX_SEED:
        raise InputError(f"--seed must be an integer in {-MAX_SEED}..{MAX_SEED - 1} (torch's "
                         f"generator seeds); got {seed!r}")
    # the block's weights: Q, K, V and out projections of both streams, dim x dim each
    _check_fits_in_memory(f"the attention block of {heads} heads x {head_dim} (width "
                          f"{int(heads) * int(head_dim)})",
                          8 * (int(heads) * int(head_dim)) ** 2 * _itemsize(tdtype),
                          "give smaller --heads / --head-dim")
    axes_dim = default_axes_dims(rotary_dim)
    sample = _sample(img_shapes, txt_len, batch, DEFAULT_ATTENTION_SAMPLE)
    config = ModelConfig(dim=heads * head_dim, heads=int(heads), head_dim=int(head_dim),
                         rotary_dim=rotary_dim, axes_dims_rope=list(axes_dim), seed=int(seed),
                         dtype=dtype, weights=str(Path(weights).resolve()) if weights else None,
                         weights_sha256=sha256_file(weights) if weights else None,
                         attention=attention)
    fields = dict(model="attention", opset=opset, ir_version=ir_version_for(opset), dtype=dtype,
                  dynamic_axes={}, node_attributes=attributes, config=config,
                  sample=_sample_dict(sample))
    t0 = time.perf_counter()
    info = ModelInfo(inputs=[], outputs=[], **fields)
    module = _attention_module(info, placeholders=True)  # traced without its weights
    weights = _attention_weights(module, info)
    args = _sample_args(sample, tdtype, config.dim, config.dim, axes_dim, False, seed)
    with Steps("qkrope export", 5, enabled=progress) as steps:
        model = _torch_export(CacheInputAttention(module), args, ATTENTION_INPUTS,
                              ATTENTION_OUTPUTS, opset, parameters_of="attn", steps=steps,
                              what=f"the attention block ({heads} heads x {head_dim}, {dtype}, "
                                   f"opset {opset}, {attention} attention)",
                              attention=attention, weights=weights)
        not_in_graph = check_parameters(model, module.state_dict())
        if not_in_graph:
            raise ExportError(f"the attention graph does not use the parameters {not_in_graph}")
        config.parameters = list(module.state_dict())  # initializer names (--refit)
        config.parameter_shapes = _shapes(module.state_dict(), config.parameters)
        with steps.step("adding the QKNormRoPE function body"):
            finalize_model(model, opset=opset, head_dim=head_dim, rotary_dim=rotary_dim,
                           expected_nodes=2)
        info, written = _write_outputs(model, out, dict(
            fields, versions=_versions(), axis_values=_axis_values(sample)), steps)
        steps.note(f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return info, written


def _shapes(state_dict: Mapping[str, torch.Tensor], keys: Sequence[str]) -> dict[str, list[int]]:
    """``config.parameter_shapes``: each exported parameter's shape, as the state dict has it."""
    return {k: [int(d) for d in state_dict[k].shape] for k in keys}


def _sample_dict(sample: Sample) -> dict:
    return {"img_shapes": [list(s) for s in sample.img_shapes], "txt_len": sample.txt_len,
            "batch": sample.batch}


def _axis_values(sample: Sample) -> dict[str, int]:
    return {model_io.BATCH: sample.batch, model_io.IMG_TOKENS: sample.img_tokens,
            model_io.TXT_TOKENS: sample.txt_len, model_io.IMG_CACHE_ROWS: sample.img_tokens,
            model_io.TXT_CACHE_ROWS: sample.txt_len}


# --------------------------------------------------------------------------------------------
# Whole transformer
# --------------------------------------------------------------------------------------------

def diffusers_config_record(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The sidecar's ``diffusers_config``: the model's config without diffusers' private keys
    (but its class and version), tuples as lists."""
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()
            if not k.startswith("_") or k in ("_class_name", "_diffusers_version")}


def _skeleton(steps: Steps, diffusers_dir, what: str, tdtype: torch.dtype,
              quant: str | None, variant: str | None):
    """The streamed export's first step, for every family: ``(transformer, weights,
    fp8_table)``, the placeholder skeleton and its shard-backed weights
    (:func:`qkrope.export.patch_diffusers.skeleton_transformer`) and, with ``quant``, the
    quantised Linear layers' FP8 table."""
    from .patch_diffusers import skeleton_transformer

    with steps.step(f"reading {diffusers_dir}'s config and weight headers ({what}; the "
                    f"weights stay on disk)"):
        transformer, weights = skeleton_transformer(str(diffusers_dir), dtype=tdtype,
                                                    quant=quant, variant=variant)
    fp8_table = None
    if quant is not None:
        from . import quantize

        fp8_table = quantize.linear_fp8_table(transformer)
    return transformer, weights, fp8_table


@dataclass
class TransformerPlan:
    """What a family's export hook (``qkrope/families/<family>/export.py``, ``prepare``) gives
    :func:`export_transformer`: the cache-input wrapper whose ``forward`` arguments are the
    graph inputs in graph order (the diffusers model as its ``transformer`` attribute), the
    traced sample arguments, the graph's declaration, the RoPE setting recorded in the sidecar,
    the node rounding, the QKNormRoPE node count the graph must have, the blocks exported
    (``num_layers_exported``: None when every block is, and the record has no ``blocks``) and a
    phrase naming the blocks for the progress line.

    The hook module also has ``check_config(directory, model_class, dtype, *, memory)`` (before
    diffusers builds the model; :mod:`qkrope.export.patch_diffusers`) and ``post_export(model)``
    (checks of the traced graph, before the FP8 Q/DQ and the function body)."""

    wrapper: nn.Module
    args: tuple
    decl: model_io.ModelDecl
    axes: tuple[int, ...]
    theta: float
    rounding: int
    nodes: int
    num_layers_exported: int | None
    blocks: str
    interleaved: bool = contract.DEFAULT_INTERLEAVED  # the nodes' rotation pairs
    eps: float | None = None  # the nodes' epsilon (None: the first block's attn.norm_q's)


def export_transformer(out: str | os.PathLike, diffusers_dir: str | os.PathLike, *,
                       layers: int | None = None, dtype: str | None = None,
                       opset: int | None = None, rounding: int | None = None,
                       img_shapes: Sequence[Sequence[int]] | None = None,
                       txt_len: int | None = None, batch: int | None = None,
                       attention: str = DEFAULT_ATTENTION_FORM, progress: bool = True,
                       quant: str | None = None, variant: str | None = None):
    """Export a local diffusers transformer with cache inputs, of any family the registry
    knows (:mod:`qkrope.families`; the family from config.json, refused with the list
    otherwise): the family's export hooks (``qkrope/families/<family>/export.py``) patch its
    attentions and give the wrapper, the sample and the graph (:class:`TransformerPlan`);
    ``rounding`` None: the family's. ``dtype`` None: the checkpoint's
    (:func:`qkrope.export.checkpoint_dtype.checkpoint_dtype`). ``layers``: the first N blocks (families whose record has
    ``blocks``; refused otherwise). ``attention`` and ``opset``: as for
    :func:`export_attention`; ``variant``: diffusers' weights variant, e.g. ``"fp16"``.
    ``quant="fp8"``: a folder quantised with ModelOpt (``qkrope quantize``) exported with FP8
    Q/DQ (:mod:`qkrope.export.quantize`; opset 19 or later); a quantised folder without it is
    refused.

    Streamed: the graph is traced on a skeleton with placeholder parameters and each
    initializer is read from the shards (by its key), converted to ``dtype`` (and quantised,
    FP8) as it is written (:mod:`qkrope.export.streaming`), so the peak memory is the trace's
    plus about one tensor, whatever the model's size."""
    from qkrope import families
    from qkrope.runtime.latents import latent_of
    from qkrope.runtime.state_dict import model_folder_files

    from .patch_diffusers import folder_family

    out = _check_out(out, model_folder_files(diffusers_dir))
    if dtype is not None:
        _check_dtype(dtype)
    opset = _check_opset(default_opset(attention, quant) if opset is None else opset)
    check_attention_form(attention, opset)
    _check_quant_opset(quant, opset)
    sample = _sample(img_shapes, txt_len, batch, DEFAULT_TRANSFORMER_SAMPLE)
    family = folder_family(str(diffusers_dir))  # any other class: refused with the list
    if layers is not None:
        families.check_blocks_option(family, "--layers", layers)
    if dtype is None:  # the checkpoint's (qkrope.export.checkpoint_dtype)
        from .checkpoint_dtype import checkpoint_dtype

        dtype = checkpoint_dtype(diffusers_dir, variant=variant).dtype
    tdtype = _check_dtype(dtype)
    if rounding is not None:
        rounding = contract.check_rounding(rounding, what="--rounding")
    rounding = family.rounding if rounding is None else rounding
    hooks = families.hooks(family, "export")
    t0 = time.perf_counter()
    with Steps("qkrope export", 7 if quant else 6, enabled=progress) as steps:
        transformer, weights, fp8_table = _skeleton(steps, diffusers_dir,
                                                    f"{family.label}, {dtype}", tdtype, quant,
                                                    variant)
        if quant is not None:
            from . import quantize
        cfg = dict(transformer.config)
        head_dim = int(cfg["attention_head_dim"])
        plan = hooks.prepare(family, transformer, sample=sample, dtype=tdtype, layers=layers,
                             rounding=rounding)
        rotary_dim = sum(plan.axes)
        latent = latent_of(family, cfg)  # a 5-D latent's patch: its axes (export/latent_axes)
        patch = latent.patch if latent.rank == 5 else None
        eps = plan.eps if plan.eps is not None else \
            float(transformer.transformer_blocks[0].attn.norm_q.eps)
        with (quantize.quantizers_disabled(transformer) if quant else contextlib.nullcontext()):
            model = _torch_export(   # the float graph; FP8 Q/DQ go in below
                plan.wrapper, plan.args, plan.decl.input_names, plan.decl.output_names, opset,
                parameters_of="transformer", steps=steps, attention=attention,
                what=f"{plan.blocks} (sample {sample.img_shapes}, {sample.txt_len} text "
                     f"tokens, batch {sample.batch}; {attention} attention, opset {opset})",
                weights=weights, patch=patch)
        state = {k: v for k, v in transformer.state_dict().items()
                 if quantization.QUANTIZER_MARK not in k}
        not_in_graph = check_parameters(model, state)
        hooks.post_export(model)
        quant_record = None
        if fp8_table is not None:
            with steps.step(f"FP8 Q/DQ on {len(fp8_table)} quantised Linear layers"):
                quant_record = quantize.apply_fp8(model, transformer, fp8_table,
                                                  weights=weights.tensor)
        with steps.step(f"adding the QKNormRoPE function body ({plan.nodes} nodes)"):
            finalize_model(model, opset=opset, head_dim=head_dim, rotary_dim=rotary_dim,
                           expected_nodes=plan.nodes)
        attributes = contract.NodeAttributes(eps, plan.interleaved, plan.rounding)
        config = ModelConfig(
            dim=int(cfg["num_attention_heads"]) * head_dim,
            heads=int(cfg["num_attention_heads"]), head_dim=head_dim, rotary_dim=rotary_dim,
            axes_dims_rope=list(plan.axes), family=family.name, rope_theta=plan.theta, seed=0,
            dtype=dtype, diffusers_dir=str(Path(diffusers_dir).resolve()),
            diffusers_config=diffusers_config_record(cfg),
            num_layers_exported=plan.num_layers_exported, attention=attention,
            # the state-dict keys that are initializers of that name (qkrope build --refit marks
            # them refittable) and those the graph does not use
            parameters=[k for k in state if k not in not_in_graph
                        and (quant_record is None or k in model.graph.initializers)],
            parameters_not_in_graph=not_in_graph)
        if quant_record is not None:
            config.quantization = quant_record
        # their shapes (the shards' headers): qkrope refit refuses a tensor of another shape
        config.parameter_shapes = {k: weights.shape(k) for k in config.parameters}
        info, written = _write_outputs(model, out, dict(
            model="transformer", opset=opset, ir_version=ir_version_for(opset), dtype=dtype,
            dynamic_axes={}, node_attributes=attributes, config=config,
            sample=_sample_dict(sample), versions=_versions(("diffusers",)),
            axis_values={**_axis_values(sample), **latent_axes.axis_values(
                sample.img_shapes[0], patch)}), steps, decl=plan.decl)
        steps.note(f"done in {time.perf_counter() - t0:.1f} s: {', '.join(map(str, written))}")
    return info, written
