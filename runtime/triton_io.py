"""What a served model accepts, recorded in its Triton ``config.pbtxt`` for the client.

``qkrope triton-repo`` writes the export's I/O (names, dtypes, shapes with their axis names),
the runner roles of its inputs and the model config the drop-ins need (the diffusers config,
the family, the RoPE axes, ``head_dim``) as one JSON string parameter, :data:`IO_PARAMETER`, of
the model that takes the RoPE caches, and the export's identity (:func:`export_identity`,
:data:`IDENTITY_PARAMETER`). :class:`qkrope.runtime.runner_triton.TritonRunner` reads it
back with the model's config (``GET /v2/models/<m>/config`` or gRPC ``ModelConfig``) and checks
every call as a local runner does, so that ``pipe.transformer`` needs nothing but a URL and a
model name. The state-dict key lists of the sidecar (``parameters``, ``parameter_shapes``, ...)
are left out: they are the refit's, not the client's, and would make the config large.

Light: imports neither torch nor tritonclient (the repository writer uses it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

from qkrope.errors import QkropeError
from qkrope.model_io import ModelIO, spec_from_shape

#: the ``parameters`` key of a model's config.pbtxt that holds the record
IO_PARAMETER = "qkrope_model_io"
#: the ``parameters`` key that holds the served export's identity (:func:`export_identity`)
IDENTITY_PARAMETER = "qkrope_export_identity"
#: the record's format (a reader refuses another)
FORMAT = 1
#: sidecar config fields a client does not need (long lists of state-dict keys, local paths)
LEFT_OUT = ("parameters", "parameter_shapes", "parameters_not_in_graph", "diffusers_dir",
            "weights")


class ServedModelError(QkropeError, ValueError):
    """A served model's record is missing or not one qkrope wrote (the message says the fix)."""


def _tensors(items, axes_of=lambda t: None) -> list[list[Any]]:
    out = []
    for t in items:
        axes = axes_of(t) or []
        shape = [(axes[j] if j < len(axes) and axes[j] and (not isinstance(d, int) or d < 0)
                  else d) for j, d in enumerate(t.shape)]
        out.append([t.name, t.dtype, shape])
    return out


def record_of(sidecar) -> str:
    """The record (JSON text) of a model sidecar (:class:`qkrope.sidecars.ModelInfo`) or an
    engine sidecar (:class:`qkrope.sidecars.EngineInfo`, whose shapes name axes in ``axes``)."""
    axes_of = lambda t: getattr(t, "axes", None)  # noqa: E731
    config = {k: v for k, v in sidecar.config.to_dict().items() if k not in LEFT_OUT}
    return json.dumps({"format": FORMAT, "inputs": _tensors(sidecar.inputs, axes_of),
                       "outputs": _tensors(sidecar.outputs, axes_of),
                       "roles": sidecar.roles(), "config": config},
                      separators=(",", ":"))  # the config in its own key order


def export_identity(sidecar) -> str | None:
    """The identity of the export a sidecar describes: the sha256 of the content hashes it
    records of the export's files (the ONNX model and its external data, or the engine) and of
    its write id; None when the sidecar records none (a model described from its graph alone).
    ``qkrope triton-repo`` writes it into the served config (:data:`IDENTITY_PARAMETER`); the
    client compares it with the export it was given, once at connect."""
    parts = []
    model_file = getattr(sidecar, "model_file", None)
    if model_file is not None and getattr(model_file, "sha256", None):
        parts.append(f"model={model_file.sha256}")
    for location, rec in sorted((getattr(sidecar, "external_data", None) or {}).items()):
        parts.append(f"data {location}={getattr(rec, 'sha256', None)}")
    engine = getattr(sidecar, "engine_sha256", None) or getattr(
        getattr(sidecar, "engine_file", None), "sha256", None)
    if engine:
        parts.append(f"engine={engine}")
    if not parts:
        return None
    write_id = getattr(sidecar, "write_id", None)
    parts.append(f"write_id={write_id}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def model_io_of(record: str, *, source: str) -> ModelIO:
    """The :class:`~qkrope.model_io.ModelIO` a record describes (``source``: how messages name
    the served model)."""
    from qkrope.sidecars import ModelConfig

    try:
        d = json.loads(record)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format') if isinstance(d, dict) else d!r}")
        inputs = [spec_from_shape(n, dt, shape) for n, dt, shape in d["inputs"]]
        outputs = [spec_from_shape(n, dt, shape) for n, dt, shape in d["outputs"]]
        config = ModelConfig.from_dict(d["config"], source=source)
        roles = {str(k): str(v) for k, v in d["roles"].items()}
    except Exception as exc:  # noqa: BLE001 - any malformed record is the same error
        raise ServedModelError(
            f"{source}: its {IO_PARAMETER} parameter is not a record this qkrope reads "
            f"({type(exc).__name__}: {str(exc)[:80]}). Fix: rewrite the repository with this "
            f"version's `qkrope triton-repo`, or pass sidecar= (the exported model)") from None
    return ModelIO(inputs, outputs, config.head_dim, roles, source=source, config=config)


def check_served_io(io: ModelIO, names: Sequence[str], out_names: Sequence[str], *,
                    source: str) -> None:
    """The record (or a sidecar) describes the model the server serves: the same input and
    output names."""
    want_in, want_out = {s.name for s in io.inputs}, {s.name for s in io.outputs}
    if want_in != set(names) or not want_out <= set(out_names):
        raise ServedModelError(
            f"{source} serves inputs {sorted(names)} and outputs {sorted(out_names)}, but its "
            f"description has inputs {sorted(want_in)} and outputs {sorted(want_out)}. Fix: "
            f"pass sidecar= of the export this model was served from (or name the model that "
            f"takes the RoPE caches)")


__all__ = ["FORMAT", "IDENTITY_PARAMETER", "IO_PARAMETER", "ServedModelError", "check_served_io",
           "export_identity", "model_io_of", "record_of"]
