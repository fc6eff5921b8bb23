"""The engine sidecar ``M.engine.json``: :class:`EngineInfo` (one writer, one reader, the
checked load against the engine file and the tag it keeps), its tensors
(:class:`EngineTensor`), the plugin it was built with (:class:`PluginRecord`) and its
optimisation profiles (the JSON schema: :mod:`qkrope.sidecars`)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from qkrope._fileio import write_json_atomic
from qkrope.file_record import FileRecord, full_by_default, refresh_sidecar

from .config import ModelConfig
from .fields import _check_format, _dims, _Fields, _read_json
from .files import _check_file, _record, _sha256_field, _two_writers, _write_id
from .formats import (ENGINE_FORMAT, FORMAT_VERSION, LEVELS, EngineInfoError, _ENGINE_FIX,
                      engine_sidecar_path)
from .model import ModelInfo, _check_role, _check_unique, _dtype, _role, _roles, _sample
from .tags import (CONFIG_TAG_PREFIX, FACTS_TAG_PREFIX, WRITE_ID_SEPARATOR, config_tag,
                   engine_file_tags, facts_tag)

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
    """One built engine's description (the JSON schema: :mod:`qkrope.sidecars`)."""

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
