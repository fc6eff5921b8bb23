"""Saving an export: the model written into a staging folder (external data first, that form
checked, then inlined in chunks under :data:`EXTERNAL_DATA_THRESHOLD`), its sidecar beside it,
and the group committed in an order a kill cannot turn into a silently mixed pair
(:func:`_commit_order`, :func:`qkrope._fileio.staged_outputs`)."""

from __future__ import annotations

from pathlib import Path

from qkrope import contract, model_io
from qkrope._fileio import EXTERNAL_DATA, MODEL_SIDECAR, ONNX_MODEL, staged_outputs
from qkrope._progress import Steps
from qkrope.file_record import new_write_id
from qkrope.sidecars import ModelInfo, sidecar_path

from .annotate import _tensor_infos, annotate_model
from .finalize import verify_onnx_file

EXTERNAL_DATA_THRESHOLD = 1536 * 1024 * 1024  # bytes of initializers; protobuf's limit is 2 GiB

def _initializer_bytes(model) -> int:
    total = 0
    for value in model.graph.initializers.values():
        if value.const_value is not None:
            total += value.const_value.nbytes
    return total

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

def _write_outputs(model, out: Path, info_fields: dict, steps: Steps,
                   decl: model_io.ModelDecl | None = None):
    """The model (+ external data) and its sidecar, replaced as a group or not at all
    (:func:`qkrope._fileio.staged_outputs`; the commit order is :func:`_commit_order`).
    ``decl``: the graph's declaration (default: that of the model kind; a family's may differ)."""
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
