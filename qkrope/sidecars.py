"""The typed descriptions of models and engines: the two sidecar files, one writer and one reader
each, a format version, and a check on load.

``M.onnx.json`` (:class:`ModelInfo`), written by ``qkrope export`` next to every model and read by
``qkrope build``, ``qkrope check``, the runner and the benchmark::

    {
      "format": "qkrope-onnx", "format_version": 2 (1 is read too: no roles, eps/interleaved/
                                                   rounding also in config),
      "model": "attention" | "transformer",
      "opset": 18, "ir_version": 10,
      "dtype": "fp32" | "fp16" | "bf16",                 # weights and activations
      "inputs":  [{"name": str, "dtype": "float32"|"float16"|"bfloat16"|"bool"|...,
                   "shape": [int | axis-name str, ...],
                   "role": "hidden_states" | "img_cache" | ... (qkrope.model_io.ROLES) }, ...],
                                                                   # graph order
      "outputs": [same],
      "dynamic_axes": {"batch": {"export_value": 2}, "img_tokens": {...}, "txt_tokens": {...},
                       "img_cache_rows": {...}, "txt_cache_rows": {...}},
      "node_attributes": {"epsilon": 1e-06, "interleaved": 1, "rounding": 0,
                          "plugin_version": "1", "plugin_namespace": "qkrope"},
                         (the nodes' values, stored only here: contract.NodeAttributes)
      "config": {"dim", "heads", "head_dim", "rotary_dim", "axes_dims_rope", "seed", "dtype",
                 "attention", "weights" (path), "weights_sha256",
                 "parameters" (the state-dict keys kept as initializers of that name),
                 "parameter_shapes" ({key: shape}: `qkrope refit` checks them),
                 ... transformers add "diffusers_dir", "diffusers_config" (the model's config
                 dict), "num_layers_exported", "parameters_not_in_graph", "family"
                 ("qwen-image" | "flux1" | "flux2": qkrope.families) and
                 "rope_theta" (axes_dims_rope has 4 entries for FLUX.2); an FP8 export
                 "quantization"}  (read as a checked ModelConfig; every field optional)
      "sample": {"img_shapes": [[f, h, w], ...], "txt_len": int, "batch": int},
      "versions": {"qkrope", "torch", "onnx", "onnxscript", "onnxruntime"?, "diffusers"?},
      "model_sha256": sha256 hex of the M.onnx it describes (checked by ModelInfo.load: a sidecar
                      next to another model is "sidecar does not describe this model"; written
                      by save() whenever the model file exists; null/absent: not checked)
      "model_file": {"sha256", "size", "mtime_ns", "ino"} | null  (the model file as written:
                    a load compares size/mtime_ns/inode and hashes only on a difference,
                    qkrope.file_record),
      "external_data": {location: {"sha256", "size", "mtime_ns", "ino"}}  (each data file),
      "write_id": 16 hex digits | null (also the model's metadata_props qkrope.write_id: a pair
                  from two writers is refused)
    }

``M.engine.json`` (:class:`EngineInfo`), written by ``qkrope build`` next to the engine and read
by the TensorRT runner and ``qkrope triton-repo``::

    {
      "format": "qkrope-engine", "format_version": 2 (1 is read too: no roles),
      "tensorrt_version": str, "gpu": {"name", "compute_capability", "index"} | null,
      "onnx": absolute path of the source model,
      "inputs":  [{"name", "dtype", "shape": [int, -1 = dynamic], "axes"?: [axis name | null],
                   "role"?: the model sidecar's role}],
      "outputs": [same],
      "profiles": [{input name: {"min": [...], "opt": [...], "max": [...]}}],
      "plugin": {"path", "sha256", "serialized_in_engine"} | null (no plugin: function body),
      "plugin_layers": int, "version_compatible": bool, "strongly_typed": bool,
      "builder_optimization_level": int | null, "parser_flags": [str],
      "config", "dynamic_axes", "sample": copied from the model's sidecar,
      "build_seconds": float | null, "created": "YYYY-mm-ddTHH:MM:SSZ",
      "refittable": bool, "refit_mode": "individual" | "all" | null,
      "profile_labels": ["1024x1024" per profile, or ""],
      "engine_sha256": sha256 hex of the engine it describes (checked by EngineInfo.load, so
                       by the runner, `qkrope refit` and `qkrope triton-repo`: an engine beside
                       another engine's sidecar is refused; written by save() whenever the
                       engine file exists; null/absent: not checked)
      "engine_file": {"sha256", "size", "mtime_ns", "ino"} | null (as the model's model_file),
      "write_id": 16 hex digits | null (also in the engine's network name: <config tag>.write-<id>)
      "build_key": {"model_sha256", "options", "tensorrt_version", "gpu", "plugin_sha256",
                    "engine_sha256"} | null
                   (what the engine was built from; `qkrope build` reuses the engine when all
                   of it is unchanged)
    }

The engine itself keeps a tag of the model config it was built from as its network name
(:func:`config_tag`, ``ICudaEngine.name``); the runner and ``qkrope refit`` check the sidecar's
``config`` against it after deserialising (:meth:`EngineInfo.check_engine_name`).

Dtype names are numpy's (``"bfloat16"`` is ml_dtypes' name, :mod:`qkrope.dtypes`). A file of
another format or version, a missing or mistyped field, is a :class:`SidecarError` naming the file
and what is wrong (never a KeyError).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from qkrope import dtypes, families, model_io
import re

from qkrope._fileio import write_json_atomic
from qkrope.file_record import (WRITE_ID_RE, FileRecord, Verdict, full_by_default,
                                 refresh_sidecar, verify)
from qkrope.contract import NodeAttributes
from qkrope.errors import InputError, QkropeError

# The version written. 2: each tensor records its role; the node attributes (epsilon,
# interleaved, rounding) are stored once, in node_attributes, no longer in config too.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # a version 1 sidecar is read: its roles are guessed from the names
ONNX_FORMAT = "qkrope-onnx"
ENGINE_FORMAT = "qkrope-engine"
MODELS = tuple(model_io.MODELS)
DTYPES = dtypes.NAME_BY_SHORT  # --dtype -> numpy name (the one table, qkrope/dtypes.py)
AXES = model_io.AXES
LEVELS = ("min", "opt", "max")


class SidecarError(QkropeError, ValueError):
    """A sidecar is missing, unreadable, or not in its schema; the message names the file."""


class ModelInfoError(SidecarError):
    """The ONNX sidecar ``M.onnx.json`` is missing, unreadable or not in this schema."""


class EngineInfoError(SidecarError):
    """The engine sidecar ``M.engine.json`` is missing, unreadable or not in this schema."""


def sidecar_path(onnx_path: str | os.PathLike) -> Path:
    """``model.onnx`` -> ``model.onnx.json``."""
    return Path(str(onnx_path) + ".json")


def engine_sidecar_path(engine_path: str | os.PathLike) -> Path:
    """``model.engine`` -> ``model.engine.json``."""
    return Path(str(engine_path) + ".json")


# --------------------------------------------------------------------------------------------
# Reading helpers: every field read through these, so a bad file is one clear error
# --------------------------------------------------------------------------------------------

class _Fields:
    """Typed access to one JSON object of a sidecar; failures name the file and the field."""

    def __init__(self, data: Any, where: str, error: type[SidecarError], fix: str):
        self.where, self.error, self.fix = where, error, fix
        if not isinstance(data, Mapping):
            self.fail(f"holds a {type(data).__name__}, expected a JSON object")
        self.data = data

    def fail(self, what: str):
        raise self.error(f"{self.where} {what}. Fix: {self.fix}")

    def get(self, key: str, kind: type | tuple[type, ...], *, optional: bool = False,
            default: Any = None) -> Any:
        if key not in self.data:
            if optional:
                return default
            self.fail(f"has no {key!r} field")
        value = self.data[key]
        if value is None and optional:
            return default
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            self.fail(f"field {key!r} must be a number, got {value!r}")
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            self.fail(f"field {key!r} must be {names}, got {type(value).__name__} {value!r}")
        return value

    def obj(self, key: str, *, optional: bool = False) -> dict:
        return dict(self.get(key, dict, optional=optional, default={}))

    def sub(self, data: Any, where: str) -> "_Fields":
        return _Fields(data, f"{self.where}: {where}", self.error, self.fix)


def _read_json(path: Path, error: type[SidecarError], missing: str, fix: str) -> Any:
    if not path.is_file():
        raise error(missing)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"cannot read the sidecar {path}: {exc}. Fix: {fix}") from None
    except RecursionError:  # nested deeper than Python's JSON reader goes: no sidecar is
        raise error(f"cannot read the sidecar {path}: its JSON is nested deeper than "
                    f"{sys.getrecursionlimit()} levels (no qkrope sidecar is). Fix: {fix}") from None


METADATA_PREFIX = "qkrope."  # the export's metadata_props keys: qkrope.model, .dtype, .config
CONFIG_TAG_PREFIX = "qkrope-config-"
WRITE_ID_SEPARATOR = ".write-"  # network name: <facts tag>.write-<the sidecar's write_id>


def engine_network_name(info: "EngineInfo") -> str:
    """The network name ``qkrope build`` gives an engine (the engine keeps it): the
    :func:`facts_tag` of its sidecar and the write id the sidecar records (checked by
    :meth:`EngineInfo.check_engine_name`; the sidecar records it too, as ``network_name``)."""
    tag = facts_tag(info)
    return tag + WRITE_ID_SEPARATOR + info.write_id if info.write_id else tag


def config_tag(config: "ModelConfig | Mapping[str, Any]") -> str:
    """What ``qkrope build`` names the network (so the engine keeps it): a hash of the model
    config the engine is built from, checked against the engine sidecar's config on load
    (:meth:`EngineInfo.check_engine_name`)."""
    import hashlib

    if isinstance(config, ModelConfig):
        config = config.to_dict()
    text = json.dumps(config, sort_keys=True)
    return CONFIG_TAG_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


FACTS_TAG_PREFIX = "qkrope-facts-"
#: The tags an engine file may carry (its network name; a plan keeps it as text): a facts tag
#: (this qkrope's builds) or a config tag (older ones).
_TAG_RE = re.compile(rb"qkrope-(?:facts|config)-[0-9a-f]{32}")
#: Engine sidecar fields not in the facts tag: known only after the build (its time, when it
#: was written, the engine's own hash: checked against the file itself), or, inside build_key
#: and config.quantization, the built engine's hash and FP8 layer summary.
_POST_BUILD_FIELDS = ("build_seconds", "created", "engine_sha256", "engine_file", "network_name")


def engine_facts(info: "EngineInfo") -> dict[str, Any]:
    """The engine sidecar's facts that are known before TensorRT builds the engine (every field
    but :data:`_POST_BUILD_FIELDS`, the build key's ``engine_sha256`` and an FP8 config's
    ``quantization.engine``): what :func:`facts_tag` hashes."""
    d = info.to_dict()
    for key in _POST_BUILD_FIELDS:
        d.pop(key, None)
    if isinstance(d.get("build_key"), dict):
        d["build_key"] = {k: v for k, v in d["build_key"].items() if k != "engine_sha256"}
    quant = d["config"].get("quantization")
    if isinstance(quant, dict):
        d["config"] = {**d["config"], "quantization": {k: v for k, v in quant.items()
                                                       if k != "engine"}}
    return d


def facts_tag(info: "EngineInfo") -> str:
    """What ``qkrope build`` names the network (so the engine keeps it): a hash of every fact
    its sidecar states before the build (:func:`engine_facts`: the I/O with roles and axes, the
    profiles, the model config with its RoPE axes, the plugin, the build options and key).
    An engine sidecar edited beside its engine no longer gives its engine's tag: refused on
    load (:meth:`EngineInfo.load` reads the tag off the engine file, the runner off
    ``ICudaEngine.name``)."""
    import hashlib

    text = json.dumps(engine_facts(info), sort_keys=True, default=str)
    return FACTS_TAG_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def engine_file_tags(engine_path: str | os.PathLike) -> tuple[str, set[str]]:
    """``(sha256 hex, the qkrope tags in it)`` of an engine file, in one read: the tags are the
    network names qkrope builds give (:func:`facts_tag`, :func:`config_tag`) where the plan
    keeps them as text."""
    import hashlib

    digest, tags, tail = hashlib.sha256(), set(), b""
    keep = len(FACTS_TAG_PREFIX) + 32
    with open(engine_path, "rb") as f:
        while True:
            chunk = f.read(1 << 22)
            if not chunk:
                break
            digest.update(chunk)
            window = tail + chunk
            tags.update(m.decode("ascii") for m in _TAG_RE.findall(window))
            tail = window[-keep:]
    return digest.hexdigest(), tags


def _brief(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _varint(f) -> int | None:
    shift = value = 0
    while True:
        b = f.read(1)
        if not b:
            return None
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def onnx_metadata_props(onnx_path: str | os.PathLike) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file, read without parsing its graph
    (:func:`onnx_header`). {} for a file that is not one."""
    return onnx_header(onnx_path)[0]


def onnx_header(onnx_path: str | os.PathLike) -> tuple[dict[str, str], int | None,
                                                      dict[str, int]]:
    """``(metadata_props, ir_version, {opset domain: version})`` of an ONNX file, read without
    parsing its graph: the top-level fields of the ModelProto are walked (the graph and
    everything else skipped by length) and only the metadata entries (field 14), the IR version
    (field 1) and the opset imports (field 8) decoded. ``({}, None, {})`` for a file that is not
    one."""
    import onnx

    out: dict[str, str] = {}
    ir_version, opsets = None, {}
    nothing: tuple[dict[str, str], int | None, dict[str, int]] = ({}, None, {})
    try:
        with open(onnx_path, "rb") as f:
            while True:
                tag = _varint(f)
                if tag is None:
                    return out, ir_version, opsets
                field_no, wire = tag >> 3, tag & 7
                if wire == 0:
                    value = _varint(f)
                    if value is None:
                        return nothing
                    if field_no == 1:
                        ir_version = value
                elif wire == 1:
                    f.seek(8, os.SEEK_CUR)
                elif wire == 5:
                    f.seek(4, os.SEEK_CUR)
                elif wire == 2:
                    n = _varint(f)
                    if n is None:
                        return nothing
                    if field_no == 14:
                        entry = onnx.StringStringEntryProto.FromString(f.read(n))
                        out[entry.key] = entry.value
                    elif field_no == 8:
                        op = onnx.OperatorSetIdProto.FromString(f.read(n))
                        opsets[op.domain] = int(op.version)
                    else:
                        f.seek(n, os.SEEK_CUR)
                else:
                    return nothing
    except Exception:  # noqa: BLE001 - unreadable, or not a protobuf: nothing recorded
        return nothing


def _sha256_field(f: _Fields, key: str) -> str | None:
    value = f.get(key, str, optional=True)
    if value is not None and not re.fullmatch(r"[0-9a-f]{64}", value):
        f.fail(f"field {key!r} must be a sha256 hex digest, got {value!r}")
    return value


def _check_file(path: str | os.PathLike, side: Path, recorded: str | None,
                record: "FileRecord | None", error: type[SidecarError], what: str, fix: str, *,
                full: bool) -> "Verdict | None":
    """``error`` when the sidecar ``side`` records the sha256 ``recorded`` of its file and
    ``path`` is another file (a stale sidecar, a pair of two writers, an interrupted write, a
    file replaced by hand). The stat record ``record`` answers without reading the file when it
    still matches (:func:`qkrope.file_record.verify`; ``full``: always hash). None: nothing
    recorded or no such file (not checked)."""
    if recorded is None or not os.path.isfile(path):
        return None
    try:
        verdict = verify(path, recorded, record, full=full)
    except OSError as exc:
        raise error(f"cannot read {path} to check it against its sidecar: {exc}") from None
    if not verdict.ok:
        actual, noun = verdict.actual or "?", what.removeprefix("the ")
        raise error(
            f"the sidecar {side} does not describe this {noun} ({path} has sha256 "
            f"{actual[:12]}…, the sidecar describes {recorded[:12]}…): {what} or its sidecar was "
            f"replaced, or a write was interrupted. Fix: {fix}")
    return verdict


def _records(f: _Fields, key: str) -> "dict[str, FileRecord]":
    raw = f.get(key, dict, optional=True, default={})
    out = {}
    for name, rec in raw.items():
        if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
            f.fail(f"field {key!r} names {name!r}, not a file beside the model")
        out[name] = FileRecord.from_dict(rec, f.fail, f"{key}[{name!r}]")
    return out


def _record(f: _Fields, key: str) -> "FileRecord | None":
    raw = f.get(key, dict, optional=True)
    return None if raw is None else FileRecord.from_dict(raw, f.fail, key)


def _write_id(f: _Fields) -> str | None:
    value = f.get("write_id", str, optional=True)
    if value is not None and not WRITE_ID_RE.fullmatch(value):
        f.fail(f"field 'write_id' must be 16 hex digits, got {value!r}")
    return value


def _two_writers(side: Path, path: str | os.PathLike, mine: str, theirs: str, what: str,
                 error: type[SidecarError], fix: str) -> SidecarError:
    return error(f"the sidecar {side} and {path} are from two different writes (write id "
                 f"{mine} in the sidecar, {theirs} in the {what}): one of the pair was replaced "
                 f"by another export/build's file. Fix: {fix}")


def _external_locations(onnx_path: str | os.PathLike) -> list[str]:
    """The external-data locations the graph of ``onnx_path`` names (weights not loaded)."""
    import onnx

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not an ONNX file (a test's stand-in): none
        return []
    return sorted({e.value for t in model.graph.initializer for e in t.external_data
                   if e.key == "location"})


def _check_format(f: _Fields, fmt: str) -> None:
    got = f.data.get("format")
    if got != fmt:
        f.fail(f"is not a qkrope sidecar of format {fmt!r} (got format={got!r})")
    version = f.data.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        f.fail(f"has format_version {version!r}; this qkrope reads versions "
               f"{', '.join(map(str, READ_VERSIONS))}")


def _dims(f: _Fields, value: Any, key: str, allowed: tuple[type, ...]) -> list:
    if not isinstance(value, list) or any(isinstance(d, bool) or not isinstance(d, allowed)
                                          for d in value):
        f.fail(f"field {key!r} must be a list of {'/'.join(t.__name__ for t in allowed)}, got "
               f"{value!r}")
    return list(value)


# --------------------------------------------------------------------------------------------
# The model config (the sidecars' "config", the model's qkrope.config metadata)
# --------------------------------------------------------------------------------------------

def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


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


# --------------------------------------------------------------------------------------------
# The ONNX sidecar
# --------------------------------------------------------------------------------------------

def _role(f: _Fields) -> str | None:
    role = f.get("role", str, optional=True)
    known = model_io.ROLES + model_io.OUTPUT_ROLES
    if role is not None and role not in known:
        f.fail(f"field 'role' must be one of {list(known)}, got {role!r}")
    return role


#: role -> the declarations of that role (a role may have a token form and a 5-D latent form)
_DECL_BY_ROLE: dict = {}
for _t in model_io.TENSORS.values():
    _DECL_BY_ROLE.setdefault(_t.role, []).append(_t)


def _dtype(f: _Fields) -> str:
    """A tensor's dtype: one of qkrope's names (:data:`qkrope.dtypes.NAMES`)."""
    value = f.get("dtype", str)
    if value not in dtypes.NAMES:
        f.fail(f"field 'dtype' must be a dtype name such as 'float32' or 'bfloat16', got "
               f"{value!r}")
    return value


def _check_role(f: _Fields, name: str, role: str | None, axes: Sequence[Any]) -> None:
    """A recorded role is checked against the two facts that state it too: the tensor's name
    (``qkrope export`` names every tensor by what it is, :data:`qkrope.model_io.TENSORS`: the
    name ``hidden_states`` is the image stream, whatever the role says) and its axis names (the
    image stream is ``[batch, img_tokens, C]``, the text stream ``[batch, txt_tokens, C]``, a
    cache ``[<stream>_cache_rows, rotary_dim]``). Roles swapped by an edit (the runner would
    feed each stream's data to the other) are refused; a renamed model's roles still load."""
    if role is None:
        return
    declared = model_io.role_of(name)
    if declared is not None and role != declared:
        f.fail(f"gives the tensor {name!r} the role {role!r}, but {name!r} is the {declared!r} "
               f"of every model qkrope exports: the roles were edited or swapped")
    forms = [d.axes for d in _DECL_BY_ROLE[role]]
    want = next((w for w in forms if len(w) == len(axes)), forms[0])
    if len(axes) != len(want):
        f.fail(f"gives the tensor {name!r} the role {role!r}, which has {len(want)} dimensions "
               f"({list(want)}), but its shape has {len(axes)}: the roles were edited or "
               f"swapped")
    for got, expected in zip(axes, want):
        if isinstance(got, str) and expected is not None and got != expected:
            f.fail(f"gives the tensor {name!r} the role {role!r}, whose dimensions are "
                   f"{list(want)}, but its shape names {list(axes)}: the roles were edited or "
                   f"swapped")


def _check_unique(f: _Fields, key: str, tensors: Sequence[Any]) -> None:
    """No tensor name and no role twice among the ``key`` tensors."""
    for what, values in (("name", [t.name for t in tensors]),
                         ("role", [t.role for t in tensors if t.role is not None])):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            f.fail(f"lists the {what} {twice[0]!r} twice among its {key}")


def _roles(tensors: Sequence[Any]) -> dict[str, str]:
    """role -> input name: the roles the sidecar records, else (a version 1 sidecar, which
    records none) guessed from the names and axes (:func:`qkrope.model_io.assign_roles`)."""
    if any(t.role is not None for t in tensors):
        return {t.role: t.name for t in tensors if t.role is not None}
    specs = []
    for t in tensors:
        axes = getattr(t, "axes", None) or [None] * len(t.shape)  # an engine's axis names
        shape = [a if a is not None else d for a, d in zip(axes, t.shape)]
        specs.append(model_io.spec_from_shape(t.name, t.dtype, shape))
    return model_io.assign_roles(specs)


@dataclass
class TensorInfo:
    """One model input or output: dims are ints or axis names (a dynamic axis); ``role``: what
    it is to the runner (:data:`qkrope.model_io.ROLES`), None where the sidecar records none."""

    name: str
    dtype: str
    shape: list  # int or axis name
    role: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.role is not None:
            d["role"] = self.role
        return d

    @classmethod
    def _read(cls, f: _Fields) -> "TensorInfo":
        t = cls(f.get("name", str), _dtype(f), _dims(f, f.get("shape", list), "shape", (int, str)),
                _role(f))
        _check_role(f, t.name, t.role, t.shape)
        return t


_ONNX_FIX = "re-export with `qkrope export`"


@dataclass
class ModelInfo:
    """One exported model's description (the module docstring has the JSON schema).
    ``source`` says where it was read from (not written)."""

    model: str
    opset: int
    ir_version: int
    dtype: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    dynamic_axes: dict[str, dict[str, int]]
    # the values of the model's QKNormRoPE nodes, stored once (None: not recorded)
    node_attributes: NodeAttributes | None
    config: ModelConfig
    sample: dict[str, Any]
    versions: dict[str, str] = field(default_factory=dict)
    model_sha256: str | None = None
    # the stat record of the model file and of each external-data file (by its location), and
    # the id this write also put into the model's metadata_props (qkrope.write_id)
    model_file: FileRecord | None = None
    external_data: dict[str, FileRecord] = field(default_factory=dict)
    write_id: str | None = None
    source: str = field(default="", compare=False, repr=False)
    # set by load(): how the files were found to be the described ones ("stat": the stat
    # records matched, nothing read; "sha256": hashed; None: nothing recorded), and their sha256
    verified: str | None = field(default=None, compare=False, repr=False)
    digests: dict[str, str] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # the mapping forms (as in the JSON) are accepted and read into the records
        self.config = ModelConfig.from_dict(self.config, source=self.source or "<config>")
        if isinstance(self.node_attributes, Mapping):
            self.node_attributes = (NodeAttributes.from_node(self.node_attributes)
                                    if self.node_attributes else None)

    @property
    def attributes(self) -> NodeAttributes:
        """The node values (the contract's defaults where the sidecar records none)."""
        return self.node_attributes if self.node_attributes is not None else NodeAttributes()

    # ---------------------------------------------------------------- the one writer / reader
    def to_dict(self) -> dict[str, Any]:
        return {"format": ONNX_FORMAT, "format_version": FORMAT_VERSION, "model": self.model,
                "opset": self.opset, "ir_version": self.ir_version, "dtype": self.dtype,
                "inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs],
                "dynamic_axes": {k: dict(v) for k, v in self.dynamic_axes.items()},
                "node_attributes": (self.node_attributes.to_node()
                                    if self.node_attributes is not None else {}),
                "config": self.config.to_dict(),
                "sample": dict(self.sample), "versions": dict(self.versions),
                "model_sha256": self.model_sha256,
                "model_file": self.model_file.to_dict() if self.model_file else None,
                "external_data": {k: v.to_dict() for k, v in self.external_data.items()},
                "write_id": self.write_id}

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> "ModelInfo":
        f = _Fields(d, source, ModelInfoError, _ONNX_FIX)
        _check_format(f, ONNX_FORMAT)
        axes = {}
        for name, v in f.obj("dynamic_axes").items():
            value = f.sub(v, f"dynamic_axes[{name!r}]").get("export_value", int)
            if value < 1:
                f.fail(f"field 'dynamic_axes': {name!r} has export_value {value}; a size is >= 1")
            axes[str(name)] = {"export_value": value}
        config = ModelConfig.from_dict(f.obj("config"), source=source)
        info = cls(
            model=f.get("model", str), opset=f.get("opset", int),
            ir_version=f.get("ir_version", int), dtype=f.get("dtype", str),
            inputs=[TensorInfo._read(f.sub(t, f"inputs[{i}]"))
                    for i, t in enumerate(f.get("inputs", list))],
            outputs=[TensorInfo._read(f.sub(t, f"outputs[{i}]"))
                     for i, t in enumerate(f.get("outputs", list))],
            dynamic_axes=axes, node_attributes=_node_attributes(f, config), config=config,
            sample=_sample(f), versions=f.obj("versions", optional=True),
            model_sha256=_sha256_field(f, "model_sha256"), model_file=_record(f, "model_file"),
            external_data=_records(f, "external_data"), write_id=_write_id(f), source=source)
        _check_unique(f, "inputs", info.inputs)
        _check_unique(f, "outputs", info.outputs)
        if info.model not in MODELS or info.dtype not in DTYPES:
            f.fail(f"names an unknown model {info.model!r} or dtype {info.dtype!r} (expected one "
                   f"of {MODELS} and {tuple(DTYPES)})")
        return info

    @classmethod
    def load(cls, onnx_path: str | os.PathLike, *, full: bool | None = None) -> "ModelInfo":
        """Read ``<onnx_path>.json``; a clear error when it is missing or invalid, or when it does
        not describe the files beside it (:meth:`check_describes`: by their stat records, the
        full hash with ``full``; None: ``QKROPE_VERIFY``) or disagrees with the model's
        metadata (:meth:`check_agrees_with_model`)."""
        path = sidecar_path(onnx_path)
        data = _read_json(path, ModelInfoError,
                          f"no sidecar {path} next to {onnx_path}: qkrope reads model sizes, axes "
                          f"and the source weights from it. Fix: export the model with `qkrope "
                          f"export --out {onnx_path}`.", _ONNX_FIX)
        info = cls.from_dict(data, source=str(path))
        info.check_describes(onnx_path, full=full, read=data)
        info.check_agrees_with_model(onnx_path)
        return info

    def check_describes(self, onnx_path: str | os.PathLike, *, full: bool | None = None,
                        read: Any = None) -> None:
        """A :class:`ModelInfoError` when this sidecar records a model hash and ``onnx_path`` (or
        an external-data file it records) is another file (a stale sidecar, an interrupted
        re-export, a model or data file replaced by hand). Each file is checked by its stat
        record when it has one, else (or with ``full``) hashed (:mod:`qkrope.file_record`);
        when the hash matched a file whose stat record did not (a copied folder), the records
        are refreshed in the sidecar (``read``: the JSON it was parsed from)."""
        full = full_by_default() if full is None else full
        side = sidecar_path(onnx_path)
        fix = f"re-export with `qkrope export --out {onnx_path}`"
        model = _check_file(onnx_path, side, self.model_sha256, self.model_file, ModelInfoError,
                            "the model", fix, full=full)
        if model is None:
            return
        verdicts = {None: model}
        for location, rec in self.external_data.items():
            data = Path(onnx_path).parent / location
            if not data.is_file():
                raise ModelInfoError(f"{onnx_path}'s external data file {data} is missing (its "
                                     f"sidecar {side} records it). Fix: copy it beside the "
                                     f"model, or {fix}")
            verdicts[location] = _check_file(data, side, rec.sha256, rec, ModelInfoError,
                                             "the model's external data file", fix,
                                             full=full)
        self.verified = "stat" if all(v.how == "stat" for v in verdicts.values()) else "sha256"
        self.digests = {"": self.model_sha256,
                        **{k: r.sha256 for k, r in self.external_data.items()}}
        fresh = {k: v.fresh for k, v in verdicts.items() if v.fresh is not None}
        if fresh and read is not None:
            def update(d: dict) -> None:
                for k, rec in fresh.items():
                    if k is None:
                        d["model_file"] = rec.to_dict()
                    else:
                        d.setdefault("external_data", {})[k] = rec.to_dict()
            if refresh_sidecar(side, read, update):
                self.model_file = fresh.get(None, self.model_file)
                self.external_data.update({k: r for k, r in fresh.items() if k is not None})

    def io_facts(self) -> dict[str, Any]:
        """The sidecar's facts about the graph's I/O and the export's sizes (inputs, outputs
        with roles, dynamic_axes, sample), as ``qkrope export`` also records them in the model's
        ``qkrope.io`` metadata (:meth:`check_agrees_with_model` compares the two)."""
        return json.loads(json.dumps({
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "dynamic_axes": self.dynamic_axes, "sample": self.sample}))

    def check_agrees_with_model(self, onnx_path: str | os.PathLike) -> None:
        """A :class:`ModelInfoError` when this sidecar states a fact its model does not: its
        ``model``, ``dtype``, any ``config`` value (axes_dims_rope, heads, head_dim, the
        diffusers config, the parameters, ...: what the runtime builds caches and inputs from),
        ``node_attributes``, ``inputs`` / ``outputs`` (names, dtypes, shapes with axis names,
        roles), ``dynamic_axes`` or ``sample`` differ from what the model file itself records in
        its ``metadata_props`` (``qkrope.model``, ``.dtype``, ``.config``, ``.node_attributes``,
        ``.io``, written by the export), or its ``opset`` / ``ir_version`` from the file's own
        header fields. The hash alone does not catch a sidecar edited beside an unchanged
        model. ``versions`` (what wrote it) is not checked: nothing is computed from it. A model
        without those entries (not written by qkrope export, or by an older one) is checked on
        what it records."""
        if not os.path.isfile(onnx_path):
            return
        props, ir_version, opsets = onnx_header(onnx_path)
        diffs = []
        exported = METADATA_PREFIX + "model" in props  # written by qkrope export
        # the header's own fields: the IR version and the default domain's opset
        if exported and ir_version is not None and ir_version != self.ir_version:
            diffs.append(f"ir_version: sidecar {self.ir_version}, model {ir_version}")
        if exported and "" in opsets and opsets[""] != self.opset:
            diffs.append(f"opset: sidecar {self.opset}, model {opsets['']}")
        io_text = props.get(METADATA_PREFIX + "io")
        if io_text is not None:
            try:
                theirs_io = json.loads(io_text)
            except ValueError:
                theirs_io = None
            mine_io = self.io_facts()
            if isinstance(theirs_io, dict):
                for key in mine_io:
                    a, b = mine_io[key], theirs_io.get(key, "<absent>")
                    if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
                        diffs.append(f"{key}: sidecar {_brief(a)}, model {_brief(b)}")
        recorded = {}
        try:
            for key in ("model", "dtype"):
                if METADATA_PREFIX + key in props:
                    recorded[key] = props[METADATA_PREFIX + key]
            if METADATA_PREFIX + "config" in props:
                recorded["config"] = json.loads(props[METADATA_PREFIX + "config"])
            if METADATA_PREFIX + "node_attributes" in props:
                recorded["node_attributes"] = json.loads(props[METADATA_PREFIX + "node_attributes"])
        except ValueError:
            recorded = {}  # not qkrope's metadata
        theirs_id = props.get(METADATA_PREFIX + "write_id")
        if self.write_id and theirs_id and theirs_id != self.write_id:
            raise _two_writers(sidecar_path(onnx_path), onnx_path, self.write_id, theirs_id,
                               "model's metadata_props", ModelInfoError,
                               f"re-export with `qkrope export --out {onnx_path}`, or restore "
                               f"its own sidecar")
        mine = {"model": self.model, "dtype": self.dtype,
                "config": json.loads(json.dumps(self.config.to_dict())),
                "node_attributes": (self.node_attributes.to_node()
                                    if self.node_attributes is not None else {})}
        for key, theirs in recorded.items():
            if key == "node_attributes":
                if mine[key] != theirs:
                    diffs.append(f"node_attributes: sidecar {_brief(mine[key])}, model "
                                 f"{_brief(theirs)}")
                continue
            if key != "config":
                if mine[key] != theirs:
                    diffs.append(f"{key}: sidecar {mine[key]!r}, model {theirs!r}")
                continue
            for name in sorted(set(theirs) | set(mine["config"])):
                a, b = mine["config"].get(name, "<absent>"), theirs.get(name, "<absent>")
                if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):  # NaN == NaN
                    diffs.append(f"config.{name}: sidecar {_brief(a)}, model {_brief(b)}")
        if diffs:
            raise ModelInfoError(
                f"the sidecar {sidecar_path(onnx_path)} disagrees with its model {onnx_path} "
                f"(whose metadata_props record what it was exported with) on "
                f"{'; '.join(diffs[:4])}{f' (+{len(diffs) - 4} more)' if len(diffs) > 4 else ''}"
                f". Fix: re-export with `qkrope export --out {onnx_path}`, or restore its "
                f"sidecar")

    def save(self, onnx_path: str | os.PathLike, *, external_data: Sequence[str] | None = None,
             digests: Mapping[str, str] | None = None) -> Path:
        """Write ``<onnx_path>.json`` atomically (temp file + os.replace). When ``onnx_path``
        exists, the sidecar records its sha256 (:attr:`model_sha256`) and stat record
        (:attr:`model_file`), and those of each external-data file (``external_data``: their
        locations; None: the ones the graph names). ``digests``: sha256 by location ("" the
        model file) that the writer computed while writing (not hashed again)."""
        path = sidecar_path(onnx_path)
        digests = dict(digests or {})
        if os.path.isfile(onnx_path):
            self.model_file = FileRecord.of(onnx_path, digests.get(""))
            self.model_sha256 = self.model_file.sha256
            if external_data is None:
                external_data = _external_locations(onnx_path)
            self.external_data = {
                loc: FileRecord.of(Path(onnx_path).parent / loc, digests.get(loc))
                for loc in sorted(set(external_data))
                if (Path(onnx_path).parent / loc).is_file()}
        write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def describe(cls, onnx_path: str | os.PathLike) -> "ModelInfo":
        """The model's description: its sidecar when there is one (axis names, config, export
        sample), else what the ONNX graph says (:meth:`from_onnx_graph`)."""
        if sidecar_path(onnx_path).exists():
            return cls.load(onnx_path)
        return cls.from_onnx_graph(onnx_path)

    @classmethod
    def from_onnx_graph(cls, onnx_path: str | os.PathLike, *, model=None) -> "ModelInfo":
        """Inputs/outputs of an ONNX file without a sidecar (dims: int, the ``dim_param`` name,
        or ``<input>.<i>`` for an unnamed dynamic dimension), and what the file's own
        ``metadata_props`` record (``qkrope export`` writes the model kind, dtype, config, its
        FP8 ``quantization`` and the node attributes there): a model without its sidecar is
        still built and run as what it is (an FP8 model is still refused ``--refit``). Without
        that metadata ``model`` and ``dtype`` are empty and the config unknown; the sample is
        always unknown. Weights are not loaded (``model``: the file's ModelProto, already
        read)."""
        import onnx

        if model is None:
            try:
                model = onnx.load(str(onnx_path), load_external_data=False)
            except Exception as exc:  # noqa: BLE001 - protobuf DecodeError, OSError, ...
                raise ModelInfoError(f"{onnx_path} is not a readable ONNX model (truncated, or "
                                     f"not ONNX: {type(exc).__name__}). Fix: re-export it with "
                                     f"`qkrope export --out {onnx_path}`") from None

        def io(values) -> list[TensorInfo]:
            out = []
            for vi in values:
                t = vi.type.tensor_type
                shape: list = []
                for i, d in enumerate(t.shape.dim):
                    if d.HasField("dim_value"):
                        shape.append(int(d.dim_value))
                    else:
                        shape.append(d.dim_param or f"{vi.name}.{i}")
                out.append(TensorInfo(vi.name, dtypes.canonical(int(t.elem_type), source="onnx"), shape))
            return out

        init_names = {i.name for i in model.graph.initializer}
        kind, dtype, config, attributes = _own_metadata(
            {p.key: p.value for p in model.metadata_props}, str(onnx_path))
        return cls(model=kind, opset=0, ir_version=int(model.ir_version), dtype=dtype,
                   inputs=io(v for v in model.graph.input if v.name not in init_names),
                   outputs=io(model.graph.output), dynamic_axes={}, node_attributes=attributes,
                   config=config, sample={}, source=str(onnx_path))

    # ---------------------------------------------------------------- shapes
    def roles(self) -> dict[str, str]:
        """role -> input name, as the sidecar records them (guessed for one that does not)."""
        return _roles(self.inputs)

    def role_of(self, name: str) -> str | None:
        return {v: k for k, v in self.roles().items()}.get(name)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def tensor(self, name: str) -> TensorInfo:
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        raise ModelInfoError(f"{name!r} is not an input or output of this model; it has inputs "
                             f"{self.input_names} and outputs {self.output_names}")

    def export_values(self) -> dict[str, int]:
        """Axis name -> the value it had at export (``dynamic_axes``, else the ``sample``)."""
        values = {axis: int(v["export_value"]) for axis, v in self.dynamic_axes.items()}
        sample = self.sample
        if model_io.BATCH not in values and sample.get("batch") is not None:
            values[model_io.BATCH] = int(sample["batch"])
        if model_io.IMG_TOKENS not in values and sample.get("img_shapes"):
            values[model_io.IMG_TOKENS] = sum(int(f) * int(h) * int(w)
                                              for f, h, w in sample["img_shapes"])
        if model_io.TXT_TOKENS not in values and sample.get("txt_len") is not None:
            values[model_io.TXT_TOKENS] = int(sample["txt_len"])
        return values

    def input_shape(self, name: str, *, batch: int, img_tokens: int, txt_tokens: int,
                    img_cache_rows: int | None = None,
                    txt_cache_rows: int | None = None) -> tuple[int, ...]:
        """The concrete shape of input (or output) ``name`` for these sizes; cache rows default
        to the token counts."""
        values = {model_io.BATCH: batch, model_io.IMG_TOKENS: img_tokens,
                  model_io.TXT_TOKENS: txt_tokens,
                  model_io.IMG_CACHE_ROWS: img_tokens if img_cache_rows is None else img_cache_rows,
                  model_io.TXT_CACHE_ROWS: txt_tokens if txt_cache_rows is None else txt_cache_rows}
        out = []
        for d in self.tensor(name).shape:
            if isinstance(d, str):
                if d not in values:
                    raise ModelInfoError(f"{name}: unknown axis name {d!r}")
                out.append(int(values[d]))
            else:
                out.append(int(d))
        return tuple(out)

    def axes_dims_rope(self) -> tuple[int, int, int]:
        if self.config.axes_dims_rope is None:
            raise ModelInfoError(f"{self.source or 'the sidecar'} records no config.axes_dims_rope"
                                 f". Fix: {_ONNX_FIX}")
        return tuple(int(v) for v in self.config.axes_dims_rope)  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# The engine sidecar
# --------------------------------------------------------------------------------------------

@dataclass
class EngineTensor:
    """One engine input or output as TensorRT's network reports it (-1 = dynamic), with the
    exporter's axis names where the model's sidecar had them."""

    name: str
    dtype: str
    shape: list[int]
    axes: list[str | None] | None = None
    role: str | None = None  # the model sidecar's role of this tensor (TensorInfo.role)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.axes is not None:
            d["axes"] = list(self.axes)
        if self.role is not None:
            d["role"] = self.role
        return d

    @classmethod
    def _read(cls, f: _Fields) -> "EngineTensor":
        axes = f.get("axes", list, optional=True)
        if axes is not None and any(a is not None and not isinstance(a, str) for a in axes):
            f.fail(f"field 'axes' must list axis names or null, got {axes!r}")
        t = cls(f.get("name", str), _dtype(f), _dims(f, f.get("shape", list), "shape", (int,)),
                axes, _role(f))
        if axes is not None and len(axes) != len(t.shape):
            f.fail(f"field 'axes' names {len(axes)} dimensions, its shape has {len(t.shape)}")
        _check_role(f, t.name, t.role, axes if axes is not None else t.shape)
        return t


@dataclass
class PluginRecord:
    """The plugin library an engine was built with."""

    path: str
    sha256: str | None = None
    serialized_in_engine: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "sha256": self.sha256,
                "serialized_in_engine": self.serialized_in_engine}


_ENGINE_FIX = "rebuild the engine with `qkrope build` (it writes the sidecar next to the engine)"


def _sample(f: _Fields) -> dict[str, Any]:
    """The export sample: ``img_shapes`` a list of positive (frames, height, width) triples,
    ``txt_len`` and ``batch`` positive ints (each optional; other keys kept as read)."""
    sample = f.obj("sample")
    shapes = sample.get("img_shapes")
    if shapes is not None and not (isinstance(shapes, list) and all(
            isinstance(s, list) and len(s) == 3 and all(_positive_int(v) for v in s)
            for s in shapes)):
        f.fail(f"field 'sample': 'img_shapes' must be a list of [frames, height, width] "
               f"positive ints, got {_brief(shapes)}")
    for key in ("txt_len", "batch"):
        if sample.get(key) is not None and not _positive_int(sample[key]):
            f.fail(f"field 'sample': {key!r} must be a positive int, got {_brief(sample[key])}")
    return sample


def _check_profile_entry(f: _Fields, name: str, levels: dict[str, list[int]],
                         shapes: Mapping[str, list[int]]) -> None:
    """One input of one optimisation profile: an input of the engine, min/opt/max of its rank,
    each dimension 0 <= min <= opt <= max and a static one equal to the engine's size."""
    if name not in shapes:
        f.fail(f"is not an input of the engine (its inputs: {', '.join(shapes)})")
    shape = shapes[name]
    for lv in LEVELS:
        if len(levels[lv]) != len(shape):
            f.fail(f"{lv} {levels[lv]} has {len(levels[lv])} dimensions, the input has "
                   f"{len(shape)} ({shape})")
    for d, (lo, opt, hi, size) in enumerate(zip(levels["min"], levels["opt"], levels["max"],
                                               shape)):
        if not 0 <= lo <= opt <= hi or (size >= 0 and not lo == hi == size):
            f.fail(f"dimension {d} is min {lo}, opt {opt}, max {hi}: it must be 0 <= min <= opt "
                   f"<= max" + (f", all {size} (a static dimension)" if size >= 0 else ""))


@dataclass
class EngineInfo:
    """One built engine's description (the module docstring has the JSON schema)."""

    tensorrt_version: str
    onnx: str
    inputs: list[EngineTensor]
    outputs: list[EngineTensor]
    profiles: list[dict[str, dict[str, list[int]]]]
    plugin: PluginRecord | None
    plugin_layers: int
    version_compatible: bool
    strongly_typed: bool
    builder_optimization_level: int | None = None
    parser_flags: list[str] = field(default_factory=list)
    config: ModelConfig = field(default_factory=lambda: ModelConfig())
    dynamic_axes: dict[str, Any] = field(default_factory=dict)
    sample: dict[str, Any] = field(default_factory=dict)
    gpu: dict[str, Any] | None = None
    build_seconds: float | None = None
    refittable: bool = False
    # "individual": only the exported parameters (BuilderFlag.REFIT_INDIVIDUAL); "all": every
    # weight (BuilderFlag.REFIT); None: not refittable
    refit_mode: str | None = None
    profile_labels: list[str] = field(default_factory=list)  # "1024x1024" per preset, or ""
    build_key: dict[str, Any] | None = None  # engine.build_key: what decides reuse
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                               time.gmtime()))
    engine_sha256: str | None = None
    engine_file: FileRecord | None = None  # its stat record (qkrope.file_record)
    write_id: str | None = None  # also in the engine's network name (engine_network_name)
    network_name: str | None = None  # the name the engine was built with (engine_network_name)
    source: str = field(default="", compare=False, repr=False)
    verified: str | None = field(default=None, compare=False, repr=False)  # as ModelInfo's
    # set by build_engine when it kept an up-to-date engine instead of building (not written)
    reused: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.config = ModelConfig.from_dict(self.config, source=self.source or "<config>",
                                            error=EngineInfoError)

    def tensor(self, name: str) -> EngineTensor:
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        raise EngineInfoError(f"{name!r} is not an input or output of this engine")

    def roles(self) -> dict[str, str]:
        """role -> input name, as the sidecar records them (guessed for one that does not)."""
        return _roles(self.inputs)

    def profile_ranges(self) -> dict[str, list[tuple[list[int], list[int]]]]:
        """input name -> [(min, max) per optimisation profile]."""
        out: dict[str, list[tuple[list[int], list[int]]]] = {}
        for prof in self.profiles:
            for name, levels in prof.items():
                out.setdefault(name, []).append((list(levels["min"]), list(levels["max"])))
        return out

    # ---------------------------------------------------------------- the one writer / reader
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": ENGINE_FORMAT, "format_version": FORMAT_VERSION,
            "tensorrt_version": self.tensorrt_version, "gpu": self.gpu, "onnx": self.onnx,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "profiles": [{n: {lv: list(v[lv]) for lv in LEVELS} for n, v in p.items()}
                         for p in self.profiles],
            "plugin": self.plugin.to_dict() if self.plugin is not None else None,
            "plugin_layers": self.plugin_layers, "version_compatible": self.version_compatible,
            "strongly_typed": self.strongly_typed,
            "builder_optimization_level": self.builder_optimization_level,
            "parser_flags": list(self.parser_flags), "config": self.config.to_dict(),
            "dynamic_axes": dict(self.dynamic_axes), "sample": dict(self.sample),
            "build_seconds": self.build_seconds, "created": self.created,
            "refittable": self.refittable, "refit_mode": self.refit_mode,
            "profile_labels": list(self.profile_labels), "engine_sha256": self.engine_sha256,
            "engine_file": self.engine_file.to_dict() if self.engine_file else None,
            "write_id": self.write_id, "network_name": self.network_name,
            "build_key": self.build_key,
        }

    @classmethod
    def from_dict(cls, d: Any, *, source: str = "<dict>") -> "EngineInfo":
        f = _Fields(d, source, EngineInfoError, _ENGINE_FIX)
        _check_format(f, ENGINE_FORMAT)
        tensors = {}
        for key in ("inputs", "outputs"):
            tensors[key] = [EngineTensor._read(f.sub(t, f"{key}[{i}]"))
                            for i, t in enumerate(f.get(key, list))]
            if not tensors[key]:
                f.fail(f"lists no {key}")
            _check_unique(f, key, tensors[key])
        profiles = []
        shapes = {t.name: t.shape for t in tensors["inputs"]}
        for i, p in enumerate(f.get("profiles", list)):
            pf = f.sub(p, f"profiles[{i}]")
            prof = {}
            for name, levels in pf.data.items():
                lf = pf.sub(levels, f"input {name!r}")
                prof[str(name)] = {lv: _dims(lf, lf.get(lv, list), lv, (int,)) for lv in LEVELS}
                _check_profile_entry(lf, str(name), prof[str(name)], shapes)
            profiles.append(prof)
        plugin = None
        raw = f.get("plugin", dict, optional=True)
        if raw is not None:
            pf = f.sub(raw, "plugin")
            plugin = PluginRecord(pf.get("path", str), pf.get("sha256", str, optional=True),
                                  bool(pf.get("serialized_in_engine", bool, optional=True,
                                              default=False)))
        gpu = f.get("gpu", dict, optional=True)
        return cls(
            tensorrt_version=f.get("tensorrt_version", str), onnx=f.get("onnx", str),
            inputs=tensors["inputs"], outputs=tensors["outputs"], profiles=profiles,
            plugin=plugin, plugin_layers=f.get("plugin_layers", int),
            version_compatible=f.get("version_compatible", bool),
            strongly_typed=f.get("strongly_typed", bool),
            builder_optimization_level=f.get("builder_optimization_level", int, optional=True),
            parser_flags=[str(x) for x in f.get("parser_flags", list)],
            config=ModelConfig.from_dict(f.obj("config"), source=source, error=EngineInfoError),
            dynamic_axes=f.obj("dynamic_axes"), sample=_sample(f),
            gpu=dict(gpu) if gpu is not None else None,
            build_seconds=f.get("build_seconds", (int, float), optional=True),
            refittable=f.get("refittable", bool, optional=True, default=False),
            refit_mode=f.get("refit_mode", str, optional=True),
            profile_labels=[str(x) for x in f.get("profile_labels", list, optional=True,
                                                   default=[])],
            created=f.get("created", str, optional=True, default=""),
            engine_sha256=_sha256_field(f, "engine_sha256"),
            engine_file=_record(f, "engine_file"), write_id=_write_id(f),
            network_name=f.get("network_name", str, optional=True),
            build_key=f.get("build_key", dict, optional=True), source=source)

    @classmethod
    def load(cls, engine_path: str | os.PathLike, *, full: bool | None = None) -> "EngineInfo":
        """Read ``<engine>.json``; a clear error when it is missing or invalid, or does not
        describe the engine beside it (its stat record, else or with ``full`` its sha256;
        None: ``QKROPE_VERIFY``; a copied engine that hashes right gets a fresh record)."""
        path = engine_sidecar_path(engine_path)
        data = _read_json(
            path, EngineInfoError,
            f"the engine's sidecar {path} is missing: it holds the I/O names, dtypes, dynamic "
            f"dims, profile and plugin library of {engine_path}. Fix: rebuild the engine with "
            f"`qkrope build` (which writes it next to the engine), or copy it alongside if you "
            f"moved the engine", _ENGINE_FIX)
        info = cls.from_dict(data, source=str(path))
        if info.network_name is not None:
            # the name the engine was built with, as this sidecar recorded it then: an edited
            # fact (axes_dims_rope, a role, a profile) no longer gives it, without reading the
            # engine
            info.check_engine_name(info.network_name, engine_path)
        if not os.path.isfile(engine_path):
            return info
        if info.engine_file is None or info.network_name is None:
            # no stat record or no recorded network name (an older build, a sidecar written by
            # hand): the engine is read once, for its sha256 and the tags its plan keeps
            try:
                digest, tags = engine_file_tags(engine_path)
            except OSError as exc:
                raise EngineInfoError(f"cannot read {engine_path} to check it against its "
                                      f"sidecar: {exc}") from None
            if info.engine_sha256 is not None and digest != info.engine_sha256:
                raise EngineInfoError(
                    f"the sidecar {path} does not describe this engine ({engine_path} has "
                    f"sha256 {digest[:12]}…, the sidecar describes {info.engine_sha256[:12]}…): "
                    f"the engine or its sidecar was replaced, or a write was interrupted. Fix: "
                    f"rebuild it with `qkrope build`, or put the engine's own sidecar beside it")
            info.check_engine_tags(tags, engine_path)
            info.verified = "sha256" if info.engine_sha256 is not None else None
            return info
        verdict = _check_file(engine_path, path, info.engine_sha256, info.engine_file,
                              EngineInfoError, "the engine",
                              "rebuild it with `qkrope build`, or put the engine's own sidecar "
                              "beside it", full=full_by_default() if full is None else full)
        if verdict is not None:
            info.verified = verdict.how
            fresh = verdict.fresh
            if fresh is not None and refresh_sidecar(
                    path, data, lambda d: d.__setitem__("engine_file", fresh.to_dict())):
                info.engine_file = fresh
        return info

    def check_engine_tags(self, tags: set[str], engine_path: str | os.PathLike) -> None:
        """The tags read off the engine file (:func:`engine_file_tags`) against this sidecar:
        an engine that carries a facts tag must carry this sidecar's (every fact it states,
        :func:`engine_facts`), one with only a config tag (an older qkrope's build) this
        config's. An engine without either (another builder's, or a plan that does not keep
        its name as text) is checked after deserialising (:meth:`check_engine_name`)."""
        facts = {t for t in tags if t.startswith(FACTS_TAG_PREFIX)}
        if facts:
            if facts_tag(self) not in facts:
                self._refuse(engine_path, "its facts (I/O and roles, profiles, config and RoPE "
                                          "axes, plugin, build options)", sorted(facts)[0],
                             facts_tag(self))
        elif tags and config_tag(self.config) not in tags:
            self._refuse(engine_path, "another config than the one", sorted(tags)[0],
                         config_tag(self.config))

    def _refuse(self, engine_path, what: str, recorded: str, mine: str) -> None:
        raise EngineInfoError(
            f"the sidecar {engine_sidecar_path(engine_path)} describes {what} {engine_path} "
            f"was built from (the engine records {recorded}, the sidecar gives {mine}): it was "
            f"edited or belongs to another build. Fix: rebuild with `qkrope build`, or put the "
            f"engine's own sidecar beside it")

    def check_engine_name(self, name: Any, engine_path: str | os.PathLike) -> None:
        """The engine keeps the tag of the sidecar it was built with as its network name
        (:func:`facts_tag`, set by ``qkrope build``; an older build's :func:`config_tag`;
        ``ICudaEngine.name`` after deserialising): an :class:`EngineInfoError` when this sidecar
        is not that one (its config, axes_dims_rope, I/O, roles, profiles, ...: what the
        runtime builds caches and checks calls from). An engine without a tag (another
        builder's) is not checked."""
        if not isinstance(name, str):
            return
        name, _, theirs_id = name.partition(WRITE_ID_SEPARATOR)
        if self.write_id and theirs_id and theirs_id != self.write_id:
            raise _two_writers(engine_sidecar_path(engine_path), engine_path, self.write_id,
                               theirs_id, "engine's name", EngineInfoError,
                               "rebuild with `qkrope build`, or put the engine's own sidecar "
                               "beside it")
        if name.startswith(FACTS_TAG_PREFIX):
            if name != facts_tag(self):
                self._refuse(engine_path, "other facts (I/O and roles, profiles, config and "
                                          "RoPE axes, plugin, build options) than the ones",
                             name, facts_tag(self))
        elif name.startswith(CONFIG_TAG_PREFIX) and name != config_tag(self.config):
            self._refuse(engine_path, "another config than the one", name,
                         config_tag(self.config))

    def save(self, engine_path: str | os.PathLike, *, sha256: str | None = None) -> Path:
        """Write ``<engine>.json`` atomically. When ``engine_path`` exists, the sidecar records
        its sha256 (:attr:`engine_sha256`; ``sha256``: the digest the writer already has) and its
        stat record (:attr:`engine_file`)."""
        path = engine_sidecar_path(engine_path)
        if os.path.isfile(engine_path):
            self.engine_file = FileRecord.of(engine_path, sha256)
            self.engine_sha256 = self.engine_file.sha256
        write_json_atomic(path, self.to_dict())
        return path


def engine_tensors(items: Sequence[EngineTensor], model: ModelInfo) -> list[EngineTensor]:
    """``items`` with the model's axis names (dynamic dims named by the exporter) and roles
    attached."""
    named = {t.name: t for t in model.inputs + model.outputs}
    out = []
    for t in items:
        desc = named.get(t.name)
        axes = ([d if isinstance(d, str) else None for d in desc.shape] if desc is not None
                else None)
        out.append(EngineTensor(t.name, t.dtype, list(t.shape), axes,
                                desc.role if desc is not None else None))
    return out


__all__ = ["FORMAT_VERSION", "ONNX_FORMAT", "ENGINE_FORMAT", "SidecarError", "ModelInfoError",
           "EngineInfoError", "ModelConfig", "TensorInfo", "ModelInfo", "EngineTensor", "PluginRecord",
           "EngineInfo", "engine_tensors", "sidecar_path", "engine_sidecar_path", "config_tag",
           "facts_tag", "engine_facts", "engine_file_tags"]
