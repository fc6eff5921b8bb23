"""The model config (the sidecars' ``config``, the model's ``qkrope.config`` metadata) as a
checked record, the node attributes a sidecar stores once, and what an ONNX file's own
``metadata_props`` record."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from qkrope import families
from qkrope.contract import NodeAttributes
from qkrope.errors import InputError

from .fields import _Fields, _positive_int
from .formats import (DTYPES, METADATA_PREFIX, MODELS, ModelInfoError, SidecarError,
                      _ONNX_FIX)

def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# the RoPE axis counts of the known families (qkrope.families): "3 (A, B) or 4 (C)"
_AXES_COUNTS = {n: [r.short for r in families.records() if len(r.axes) == n]
                for n in sorted({len(r.axes) for r in families.records()})}
_AXES_COUNTS_TEXT = " or ".join(f"{n} ({', '.join(shorts)})" for n, shorts in _AXES_COUNTS.items())
# field -> (check, what it must be); every field is optional (absent: None)
_CONFIG_FIELDS: dict[str, tuple[Any, str]] = {
    "dim": (_positive_int, "a positive int"),
    "heads": (_positive_int, "a positive int"),
    "head_dim": (_positive_int, "a positive int"),
    "rotary_dim": (_positive_int, "a positive int"),
    "axes_dims_rope": (lambda v: isinstance(v, list) and len(v) in _AXES_COUNTS and all(
        isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in v),
        f"a list of {_AXES_COUNTS_TEXT} non-negative ints"),
    "family": (lambda v: v in families.names(), f"one of {sorted(families.names())}"),
    "rope_theta": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                   "a positive number"),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
    "dtype": (lambda v: isinstance(v, str) and v in DTYPES, f"one of {sorted(DTYPES)}"),
    "attention": (lambda v: isinstance(v, str), "a str"),
    "weights": (lambda v: isinstance(v, str), "a path (str) or null"),
    "weights_sha256": (lambda v: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v)
                       is not None, "a sha256 hex digest or null"),
    "parameters": (_str_list, "a list of str"),
    "parameter_shapes": (lambda v: isinstance(v, dict) and all(
        isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in s)
        for s in v.values()), "an object of int lists"),
    "diffusers_dir": (lambda v: isinstance(v, str), "a str"),
    "diffusers_config": (lambda v: isinstance(v, dict), "an object"),
    "num_layers_exported": (_positive_int, "a positive int"),
    "parameters_not_in_graph": (_str_list, "a list of str"),
    "quantization": (lambda v: isinstance(v, dict), "an object"),
}
# format 1 kept the node attributes here too; read (into ``extra``), never written
_LEGACY_NODE_FIELDS = ("eps", "interleaved", "rounding")


@dataclass
class ModelConfig:
    """What the exporter records about the model (the sidecar's ``config``; the ONNX file's
    ``qkrope.config`` metadata holds the same): sizes, RoPE axes, the weights it came from, the
    parameters kept by name, and for a transformer the diffusers folder and config. Every field
    is optional (None: not recorded, not written); fields this qkrope does not know (and the
    node attributes of a format-1 sidecar) are kept in ``extra`` as they were read, so a
    config read and written again is the same JSON (the engine's config tag hashes it)."""

    dim: int | None = None
    heads: int | None = None
    head_dim: int | None = None
    rotary_dim: int | None = None
    axes_dims_rope: list[int] | None = None
    family: str | None = None  # a transformer's model family (qkrope.families.by_name)
    rope_theta: float | None = None  # a transformer's RoPE base
    seed: int | None = None
    dtype: str | None = None  # the --dtype short name
    attention: str | None = None  # the attention form (contract.ATTENTION_FORMS)
    weights: str | None = None  # the attention block's --weights file
    weights_sha256: str | None = None
    parameters: list[str] | None = None  # state-dict keys kept as initializers of that name
    parameter_shapes: dict[str, list[int]] | None = None
    diffusers_dir: str | None = None
    diffusers_config: dict[str, Any] | None = None  # the transformer's diffusers config
    num_layers_exported: int | None = None
    parameters_not_in_graph: list[str] | None = None
    quantization: dict[str, Any] | None = None  # the FP8 record (qkrope.quantization)
    extra: dict[str, Any] = field(default_factory=dict)
    # known fields that were read as an explicit null (written back as null)
    nulls: frozenset = field(default=frozenset(), compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in _CONFIG_FIELDS:
            value = getattr(self, key)
            if value is not None:
                out[key] = (list(value) if isinstance(value, tuple) else value)
            elif key in self.nulls:
                out[key] = None
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>",
                  error: type[SidecarError] | None = None) -> "ModelConfig":
        """The config of a sidecar (or of the model's metadata), checked: a field of the wrong
        type is a :class:`ModelInfoError` (``error``) naming the file and the field."""
        error = error or ModelInfoError
        if isinstance(d, ModelConfig):
            return d
        if not isinstance(d, Mapping):
            raise error(f"{source}: 'config' must be a JSON object, got {type(d).__name__}. "
                        f"Fix: {_ONNX_FIX}")
        values, extra, nulls = {}, {}, set()
        for key, value in d.items():
            if key not in _CONFIG_FIELDS:
                extra[str(key)] = value
                continue
            if value is None:
                nulls.add(key)
                continue
            check, expected = _CONFIG_FIELDS[key]
            if isinstance(value, tuple):
                value = list(value)
            if not check(value):
                raise error(f"{source}: config field {key!r} must be {expected}, got "
                            f"{type(value).__name__} {value!r}. Fix: re-export with "
                            f"`qkrope export`")
            values[key] = value
        return cls(**values, extra=extra, nulls=frozenset(nulls))

    def legacy_node_attributes(self) -> dict[str, Any]:
        """A format-1 config's eps/interleaved/rounding, in the node's attribute names."""
        names = {"eps": "epsilon", "interleaved": "interleaved", "rounding": "rounding"}
        return {names[k]: self.extra[k] for k in _LEGACY_NODE_FIELDS if k in self.extra}


def _own_metadata(props: Mapping[str, str], where: str
                  ) -> tuple[str, str, "ModelConfig", NodeAttributes | None]:
    """(model kind, dtype, config, node attributes) that an ONNX file's ``metadata_props``
    record (``qkrope export``'s ``qkrope.*`` entries); "" / empty for what they do not. An
    entry that is there but not what the export writes is a :class:`ModelInfoError`."""
    from qkrope import quantization

    def entry(key: str):
        text = props.get(METADATA_PREFIX + key)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise ModelInfoError(f"{where}: its {METADATA_PREFIX}{key} metadata is not JSON. "
                                 f"Fix: {_ONNX_FIX}") from None

    kind = props.get(METADATA_PREFIX + "model", "")
    dtype = props.get(METADATA_PREFIX + "dtype", "")
    if kind and kind not in MODELS or dtype and dtype not in DTYPES:
        raise ModelInfoError(f"{where}: its metadata names an unknown model {kind!r} or dtype "
                             f"{dtype!r} (expected one of {MODELS} and {tuple(DTYPES)}). Fix: "
                             f"{_ONNX_FIX}")
    raw = entry("config")
    config = ModelConfig.from_dict(raw if raw is not None else {},
                                   source=f"{where} (metadata_props)")
    record = entry(quantization.METADATA_KEY)
    if record is not None and config.quantization is None:
        if not isinstance(record, dict):
            raise ModelInfoError(f"{where}: its {quantization.METADATA_PROP} metadata is not a "
                                 f"JSON object. Fix: {_ONNX_FIX}")
        config.quantization = record
    raw = entry("node_attributes")
    attributes = None
    if raw:
        try:
            attributes = NodeAttributes.from_node(raw)
        except (InputError, AttributeError, TypeError) as exc:
            raise ModelInfoError(f"{where}: its {METADATA_PREFIX}node_attributes metadata is "
                                 f"invalid ({exc}). Fix: {_ONNX_FIX}") from None
    return kind, dtype, config, attributes


def _node_attributes(f: _Fields, config: ModelConfig) -> NodeAttributes | None:
    """The sidecar's node_attributes (a format-1 sidecar without them: its config's)."""
    raw = f.obj("node_attributes", optional=True) or config.legacy_node_attributes()
    if not raw:
        return None
    fixed = {k: v for k, v in NodeAttributes().to_node().items()
             if k not in ("epsilon", "interleaved", "rounding")}  # the plugin's identity
    known = set(NodeAttributes().to_node())
    for key, value in raw.items():
        if key not in known:
            f.fail(f"field 'node_attributes' has {key!r}, which the QKNormRoPE node does not "
                   f"(it has {sorted(known)})")
        if key in fixed and value != fixed[key]:
            f.fail(f"field 'node_attributes' gives {key} {value!r}; every QKNormRoPE node of "
                   f"this qkrope has {fixed[key]!r}")
    try:
        return NodeAttributes.from_node(raw)
    except InputError as exc:
        f.fail(f"field 'node_attributes' is invalid: {exc}")
