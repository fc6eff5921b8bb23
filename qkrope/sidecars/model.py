"""The ONNX sidecar ``M.onnx.json``: :class:`ModelInfo` (one writer, one reader, the checked
load) and its tensors (:class:`TensorInfo`), each with its role checked against its name and
axes (the JSON schema: :mod:`qkrope.sidecars`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from qkrope import dtypes, model_io
from qkrope._fileio import write_json_atomic
from qkrope.contract import NodeAttributes
from qkrope.file_record import FileRecord, full_by_default, refresh_sidecar

from .config import ModelConfig, _node_attributes, _own_metadata
from .fields import _brief, _check_format, _dims, _Fields, _positive_int, _read_json
from .files import (_check_file, _external_locations, _record, _records, _sha256_field,
                    _two_writers, _write_id, onnx_header)
from .formats import (DTYPES, METADATA_PREFIX, MODELS, ONNX_FORMAT, FORMAT_VERSION,
                      ModelInfoError, _ONNX_FIX, sidecar_path)

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
    # a role may have forms of one rank with other axes (a [batch] timestep, a packed
    # sequence's [noise_levels] one): the form whose named axes the shape has
    same_rank = [w for w in forms if len(w) == len(axes)]
    want = next((w for w in same_rank if all(
        not isinstance(got, str) or e is None or got == e for got, e in zip(axes, w))),
        same_rank[0] if same_rank else forms[0])
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


@dataclass
class ModelInfo:
    """One exported model's description (the JSON schema: :mod:`qkrope.sidecars`).
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
