"""``qkrope triton-repo``: a Triton Inference Server model repository for a built engine.

Layout written (one model directory, created atomically)::

    REPO/<name>/config.pbtxt             platform "tensorrt_plan", I/O from the engine's sidecar
    REPO/<name>/1/model.plan             the engine: an independent copy (a copy-on-write clone
                                         where the filesystem makes one, else a plain copy), so
                                         rewriting the source in place never changes what is
                                         served; a hard link only with ``link=True`` (``--link``:
                                         no bytes copied, but an in-place rewrite of the source
                                         changes the served model too); the result's
                                         ``transfer`` says which
    REPO/<name>/1/model.plan.json        a copy of the engine's sidecar: the record qkrope's
                                         loaders check the served file against
    REPO/<name>/libqkrope_plugin.so      copy of the plugin library (unless --no-copy-plugin);
                                         libqkrope_vc_plugin.so for a version-compatible engine,
                                         nothing for an engine built without the plugin

Only an engine with its engine sidecar (``M.engine.json``, :class:`EngineInfo`) is accepted: an
ONNX model (by suffix or content) is refused, and the plugin library must match the sha256 the
sidecar records (``--no-plugin-hash-check`` to skip). A version-compatible engine carries its VC
plugin; the printed command adds ``--backend-config=tensorrt,version-compatible=true``, so such a
repository is written only with the caller's ``--allow-host-code``. Every copy is hashed and
compared with the sidecar's sha256 (a source rewritten meanwhile is refused), and ``--force``
replaces a model directory only while it holds nothing but the files qkrope writes there.

The plugin library is a *file* in the model directory, not a ``REPO/plugins/`` folder: Triton
treats every sub-directory of a model repository as a model and, with the default
``--model-control-mode=none`` and ``--exit-on-error=true``, fails to start on a directory without
a model in it. Files next to ``config.pbtxt`` (like label files) are ignored by Triton's version
scan, so the model directory stays self-contained and moves with one rename.

The TensorRT backend ``dlopen``s the libraries named in ``--backend-config=tensorrt,plugins=...``
before it deserialises any plan, so the library must register its plugin creators when loaded
(the qkrope plugin library does, through its static registrar / ``getCreators`` export).

``max_batch_size`` is 0 by default: TensorRT 10 networks have explicit batch dimensions, and the
attention engine's RoPE cache inputs (``[rows, rotary_dim]``) have no batch axis at all, so
Triton's implicit leading batch dimension (``max_batch_size > 0``) cannot describe them. With
``max_batch_size: 0`` the batch is an ordinary dynamic dim (-1) of the activation inputs, and
clients send full shapes. ``--max-batch-size N > 0`` (with dynamic batching: preferred sizes and
queue delay) is accepted only for models whose every input and output has a dynamic leading
batch dimension. ``--instances`` / ``--gpus`` fill ``instance_group``.

Every config.pbtxt is a ``ModelConfig`` message (tritonclient's ``model_config_pb2``) printed by
``google.protobuf.text_format``; no text is assembled by hand.
The model step's config also carries the export's I/O record (the string parameter
``qkrope_model_io``, :mod:`qkrope.runtime.triton_io`) that qkrope's client
(:mod:`qkrope.runtime.runner_triton`) checks its calls with.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from qkrope import dtypes, model_io
from qkrope._fileio import (REPLACED, committing, folder_lock, link_or_copy, sha256_file,
                            staged_outputs, swap_dir)
from qkrope.errors import InputError, QkropeError
from qkrope.sidecars import EngineInfo, ModelConfig, engine_sidecar_path, sidecar_path

from . import onnx_file
from . import trt_utils as tu
from .plugin_build import LIBRARY_FILES, PluginNotBuiltError, resolve_plugin_library

PLUGIN_FILE_NAME = LIBRARY_FILES["plugin"][0]      # libqkrope_plugin.so
VC_PLUGIN_FILE_NAME = LIBRARY_FILES["vc"][0]       # libqkrope_vc_plugin.so

class TritonRepoError(QkropeError, RuntimeError):
    """Bad input for ``qkrope triton-repo`` (the message says what was found and the fix)."""


def triton_dtype(dtype: Any, source: str | None = None) -> str:
    """Triton's ``TYPE_*`` name of a dtype from ``source`` (:func:`qkrope.dtypes.canonical`; by
    default a sidecar's name such as ``"bfloat16"``, or a torch/numpy dtype)."""
    try:
        name = dtypes.canonical(dtype, source)
    except InputError:
        name = ""
    if name.startswith(("float8", "float4", "int4", "fp8", "fp4", "e4m3", "e5m2")):
        raise TritonRepoError(
            f"tensor dtype {dtype!r} has no Triton TYPE_* equivalent; Triton's TensorRT backend "
            "cannot serve engines with such I/O tensors (keep FP8/INT4 inside the network)")
    triton = dtypes.triton_type(name) if name else None
    if triton is None:
        raise TritonRepoError(f"unknown tensor dtype {dtype!r} in the engine sidecar; expected one "
                              f"of {sorted(dtypes.TRITON_BY_NAME)}")
    return triton


def default_model_name(engine: os.PathLike | str) -> str:
    """The engine file's stem (:attr:`pathlib.PurePath.stem`): the name without its last suffix,
    ``.engine`` / ``.plan`` (any case) or another (``attn.fp16.engine`` -> ``attn.fp16``,
    ``model.PLAN`` -> ``model``, ``attn`` -> ``attn``)."""
    return Path(engine).stem


def check_engine_file(engine: os.PathLike | str) -> None:
    """Refuse what is not a TensorRT engine: a missing or empty file, an ONNX model
    (:func:`qkrope.runtime.trt_utils.check_engine_file`; Triton's tensorrt_plan platform serves
    serialised engines)."""
    engine = Path(engine)
    if not engine.is_file():
        raise TritonRepoError(f"engine file not found: {engine}. Build one first: "
                              "qkrope build MODEL.onnx -o MODEL.engine --plugin LIB")
    tu.check_engine_file(engine)


def load_engine_sidecar(engine: os.PathLike | str) -> EngineInfo:
    """The engine's sidecar (:meth:`EngineInfo.load`: an engine sidecar, not a model's), after
    checking the engine file is one (:func:`check_engine_file`)."""
    check_engine_file(engine)
    return EngineInfo.load(engine)


def triton_dims(info: EngineInfo) -> dict[str, list[int]]:
    """Every engine tensor's dims as Triton sees them: an axis is -1 when the sidecar's shape
    says -1 or when an optimisation profile lets it vary (min != max)."""
    ranges = info.profile_ranges()
    input_names = {t.name for t in info.inputs}
    out: dict[str, list[int]] = {}
    for t in info.inputs + info.outputs:
        dims = [int(d) for d in t.shape]
        for lo, hi in ranges.get(t.name, []) if t.name in input_names else []:
            if len(lo) != len(dims):
                raise TritonRepoError(
                    f"input {t.name!r}: the sidecar's shape has rank {len(dims)} but a profile "
                    f"gives rank {len(lo)}; the sidecar is inconsistent, rebuild the engine")
            dims = [-1 if (a != b) else d for d, a, b in zip(dims, lo, hi)]
        out[t.name] = dims
    return out


@dataclass(frozen=True)
class Serving:
    """How Triton runs a model: ``instances`` per device (``instance_group``), on ``gpus`` (all
    visible ones when empty), and batching: ``max_batch_size > 0`` turns on Triton's implicit
    batch axis and its dynamic batcher (``preferred_batch_sizes``, ``max_queue_delay_us``)."""

    instances: int = 1
    gpus: tuple[int, ...] = ()
    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0

    def __post_init__(self):
        # the config.pbtxt fields these fill are protobuf int32 (instance_group count and gpus,
        # max_batch_size, preferred_batch_size) and uint64 (max_queue_delay_microseconds): a
        # value outside them is this flag's error, not protobuf's ValueError
        _check_int("--instances", self.instances, 1, INT32_MAX)
        _check_int("--max-batch-size", self.max_batch_size, 0, INT32_MAX)
        gpus = tuple(self.gpus)
        if any(isinstance(g, bool) or not isinstance(g, int) or not 0 <= g <= INT32_MAX
               for g in gpus) or len(set(gpus)) != len(gpus):
            raise TritonRepoError(f"--gpus must list distinct GPU indices 0..{INT32_MAX} (e.g. "
                                  f"0,1); got {_brief_list(gpus)}")
        object.__setattr__(self, "gpus", gpus)
        sizes = tuple(self.preferred_batch_sizes)
        for b in sizes:
            _check_int("--preferred-batch-sizes", b, 1, INT32_MAX)
        if sizes and not self.max_batch_size:
            raise TritonRepoError("--preferred-batch-sizes needs --max-batch-size N > 0 (dynamic "
                                  "batching forms batches along Triton's batch axis)")
        bad = [b for b in sizes if not 1 <= b <= self.max_batch_size]
        if bad:
            raise TritonRepoError(f"--preferred-batch-sizes {_brief_list(sizes)}: each must be in "
                                  f"1..--max-batch-size {self.max_batch_size}; got "
                                  f"{_brief_list(bad)}")
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(sizes))))
        _check_int("--max-queue-delay-us", self.max_queue_delay_us, 0, UINT64_MAX)
        if self.max_queue_delay_us and not self.max_batch_size:
            raise TritonRepoError("--max-queue-delay-us needs --max-batch-size N > 0")


#: the ranges of the protobuf fields of Triton's ModelConfig that Serving fills
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1


def _brief_list(values) -> str:
    text = str(list(values))
    return text if len(text) <= 60 else text[:57] + "..."


def _check_int(flag: str, value, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        shown = repr(value) if not isinstance(value, int) or len(str(value)) <= 24 else \
            f"{str(value)[:20]}... ({len(str(value))} digits)"
        raise TritonRepoError(f"{flag} must be an integer in {lo}..{hi} (the range of its "
                              f"config.pbtxt field), got {shown}")


def _pb():
    from qkrope._deps import require

    return require("tritonclient.grpc.model_config_pb2", "writing a Triton model config")


def to_text(cfg) -> str:
    """config.pbtxt text of a ``ModelConfig`` message (protobuf text format; strings in UTF-8)."""
    from google.protobuf import text_format

    return text_format.MessageToString(cfg, as_utf8=True)


def parse_config(text: str):
    """Parse config.pbtxt text into ``tritonclient``'s ``ModelConfig`` protobuf (schema check)."""
    from qkrope._deps import require

    pb = _pb()
    text_format = require("google.protobuf.text_format", "checking a Triton model config")
    return text_format.Parse(text, pb.ModelConfig())


Specs = dict[str, list[tuple[str, str, list[int]]]]  # "input"/"output" -> (name, TYPE_*, dims)


def _config(name: str, tensors: Specs, serving: Serving | None, kind: str | None, **fields):
    """A ``ModelConfig`` with ``fields``, the I/O and (unless ``kind`` is None: an ensemble has
    no instances) the instance group and dynamic batching of ``serving``."""
    pb = _pb()
    cfg = pb.ModelConfig(name=name, **fields)
    for io_kind, specs in tensors.items():
        for t_name, t_dtype, t_dims in specs:
            getattr(cfg, io_kind).add(name=t_name, data_type=pb.DataType.Value(t_dtype),
                                      dims=[int(d) for d in t_dims])
    if kind is not None:
        serving = serving or Serving()
        group = cfg.instance_group.add(count=serving.instances,
                                       kind=pb.ModelInstanceGroup.Kind.Value(kind))
        if kind == "KIND_GPU":
            group.gpus.extend(serving.gpus)
        if serving.max_batch_size:
            cfg.max_batch_size = serving.max_batch_size
            cfg.dynamic_batching.preferred_batch_size.extend(serving.preferred_batch_sizes)
            cfg.dynamic_batching.max_queue_delay_microseconds = serving.max_queue_delay_us
    return cfg


def _batched(tensors: Specs, serving: Serving, not_batched: list[str],
             batch_max: int | None) -> Specs:
    """The I/O without the leading batch axis (Triton adds it) when ``serving`` batches."""
    if not serving.max_batch_size:
        return tensors
    if not_batched:
        raise TritonRepoError(
            f"--max-batch-size {serving.max_batch_size} needs a dynamic leading batch dim on "
            f"every input and output, but {not_batched} have none (the RoPE caches [rows, "
            "rotary_dim] are shared across the batch). Use --max-batch-size 0: the batch stays "
            "an explicit, dynamic dim of hidden_states / encoder_hidden_states")
    if batch_max is not None and serving.max_batch_size > batch_max:
        raise TritonRepoError(f"--max-batch-size {serving.max_batch_size} exceeds the engine "
                              f"profile's largest batch {batch_max}; rebuild the engine "
                              "with a larger --max-batch or lower --max-batch-size")
    return {k: [(n, dt, d[1:]) for n, dt, d in v] for k, v in tensors.items()}


def render_config(name: str, info: EngineInfo, serving: Serving | None = None) -> str:
    """config.pbtxt text for a ``tensorrt_plan`` model."""
    serving = serving or Serving()
    dims = triton_dims(info)
    tensors = {kind: [(t.name, triton_dtype(t.dtype), dims[t.name]) for t in items]
               for kind, items in (("input", info.inputs), ("output", info.outputs))}
    bad: list[str] = []
    batch_max = None
    if serving.max_batch_size > 0:
        bad = [t.name for t in info.inputs + info.outputs if not dims[t.name]
               or dims[t.name][0] != -1]
        # Named axes (qkrope build records the exporter's names under "axes") settle it.
        bad += [t.name for t in info.inputs + info.outputs
                if t.axes and t.axes[0] not in (None, "batch") and t.name not in bad]
        # Otherwise the leading axis is a batch axis only if every input's profile gives it the
        # same range (a cache's row count, [1, max_tokens], is not the batch range).
        lead = {}
        for t_name, ranges in info.profile_ranges().items():
            if ranges and ranges[0][0]:
                lead[t_name] = (ranges[0][0][0], ranges[0][1][0])
        if len(set(lead.values())) > 1:
            common = max(set(lead.values()), key=list(lead.values()).count)
            bad += [n for n, r in lead.items() if r != common and n not in bad]
        batch_max = min((hi for _, hi in lead.values()), default=None)
    tensors = _batched(tensors, serving, bad, batch_max)
    return to_text(_config(name, tensors, serving, "KIND_GPU", platform="tensorrt_plan",
                           default_model_filename="model.plan"))


@dataclass
class RepoResult:
    model_dir: Path
    config_path: Path
    plan_path: Path
    plugin_path: Path | None  # None: a function-body engine, no plugin
    command: str
    version_compatible: bool = False
    models: list[Path] | None = None  # every model directory written (main, rope, ensemble)
    # how the engine (or the ONNX model and its data) went in: "cloned" or "copied" (an
    # independent file), or "hard-linked" (``link=True`` only)
    transfer: str = "copied"
    # whether the caller asked for a hard link (``link=True``, ``--link``)
    link: bool = False
    # what the ensemble's clients send in place of the caches (the scheme's: img_shapes, or ids)
    rope_inputs: list[str] | None = None


def server_command(repo: Path, plugin_path: Path | None, *,
                   version_compatible: bool = False, plugin_in_engine: bool = False) -> str:
    """The tritonserver line: the plugin library for the TensorRT backend to dlopen (not for a
    version-compatible engine that carries its plugin, nor for an engine without one), and
    ``version-compatible=true`` for a version-compatible engine (TensorRT must be allowed to run
    the host code serialised in it)."""
    parts = [f"tritonserver --model-repository={repo.resolve()}"]
    if plugin_path is not None and not (version_compatible and plugin_in_engine):
        parts.append(f"--backend-config=tensorrt,plugins=\"{plugin_path.resolve()}\"")
    if version_compatible:
        parts.append("--backend-config=tensorrt,version-compatible=true")
    return " ".join(parts)


def resolve_engine_plugin(info: EngineInfo, plugin: os.PathLike | str | None, *,
                          check_plugin_hash: bool = True) -> Path | None:
    """The plugin library to serve ``info``'s engine with, checked against the engine sidecar's
    record (sha256) unless ``check_plugin_hash`` is False; None for an engine built without the
    plugin. A version-compatible engine takes the VC library."""
    if info.plugin is None:
        if info.plugin_layers:
            raise TritonRepoError(
                f"{info.source}: the engine has {info.plugin_layers} plugin layers but its "
                f"sidecar records no plugin library, so the library to serve it with cannot be "
                f"checked. Fix: rebuild the engine with `qkrope build`")
        if plugin is not None:
            raise TritonRepoError(f"the engine was built without the plugin ({info.source} "
                                  f"records none); drop --plugin")
        return None
    if check_plugin_hash and not info.plugin.sha256:
        raise TritonRepoError(
            f"{info.source} records no sha256 of the plugin library the engine was built with, "
            f"so the library to serve it with cannot be checked. Fix: rebuild the engine with "
            f"`qkrope build` (it records the hash), or pass --no-plugin-hash-check if you know "
            f"the library is the right one")
    kind = "vc" if info.version_compatible else "plugin"
    try:
        return resolve_plugin_library(None if plugin is None else str(plugin), info.plugin,
                                      kind=kind,
                                      check_hash="error" if check_plugin_hash else "off")
    except PluginNotBuiltError as exc:
        raise TritonRepoError(f"plugin library not found: {exc}") from None


ROPE_MODEL_TEMPLATE = Path(__file__).with_name("triton_rope_model.py")
#: The position schemes (numpy only), copied next to the rope model's model.py as ``schemes/``.
ROPE_SCHEMES_PACKAGE = Path(__file__).with_name("schemes")
CACHE_INPUTS = tuple(t.name for t in model_io.CACHE_INPUTS)
# the rope model reads the text length off this input's shape where the model has it (the
# prompt mask), else off the text itself ...
TXT_TENSOR = model_io.ENCODER_HIDDEN_STATES_MASK.name
LATENT_TENSOR = model_io.HIDDEN_STATES.name  # ... and the image token count off this one's
#: The stream of each cache input (the rope model's ``outputs`` parameter names streams).
STREAM_OF_CACHE = dict(zip(CACHE_INPUTS, ("img", "txt")))


def rope_scheme_files() -> list[Path]:
    """The files of :data:`ROPE_SCHEMES_PACKAGE` the rope model imports (its ``.py`` files)."""
    return sorted(p for p in ROPE_SCHEMES_PACKAGE.glob("*.py") if p.is_file())


def is_transformer(input_names: Iterable[str], config: ModelConfig | None,
                   model: str | None = None) -> bool:
    """A whole diffusers transformer (``qkrope export --model transformer``): an input of the
    timestep role (``timestep``; ``frame_timestep`` of a video model) and the image cache (the
    text cache too where the model has one: a model whose text is not rotated in a joint
    attention takes none); the attention block has no timestep."""
    names = set(input_names)
    if model is not None and model != "transformer":
        return False
    timestep = any(model_io.role_of(n) == model_io.TIMESTEP.role for n in names)
    return timestep and CACHE_INPUTS[0] in names and (
        model == "transformer" or (config is not None and config.diffusers_config is not None))


@dataclass(frozen=True)
class RopeRequest:
    """What the rope model of a transformer takes from the client instead of the caches."""

    inputs: list  # [(name, Triton type, dims)]: the scheme's (img_shapes, or txt_ids / img_ids)
    #: the inputs whose axis-1 lengths sum to the text length (the prompt mask or the text, then
    #: the condition inputs the model joins to its text, model_io.JOINED_TEXT_AXES)
    txt_tensors: tuple
    params: dict  # the rope model's scheme parameters (scheme, axes_dim, theta, ...)
    latent_tensor: str = LATENT_TENSOR  # the input of the image tokens (a 5-D latent's grid)
    outputs: tuple = CACHE_INPUTS  # the caches the model takes (image first)

    @property
    def shape_inputs(self) -> list[str]:
        """The inputs of which the rope model reads only the shapes."""
        return [self.latent_tensor, *self.txt_tensors]


def rope_request_for(config: ModelConfig, rotary_dim: int,
                     input_names: Iterable[str] | None = None) -> RopeRequest:
    """The rope model's request for a model with this sidecar ``config`` (its family record's
    scheme and the RoPE setting the sidecar records, :func:`qkrope.runtime.caches.model_setting`)
    whose caches are ``rotary_dim`` wide: the scheme's Triton inputs; the text length read off
    the prompt mask where the model has one (``input_names``; None: it has), else off the text
    itself, plus the condition inputs the model joins to its text; the image tokens read off the
    latent (the input of the ``hidden_states`` role: packed tokens, or a 5-D latent whose token
    grid the patch size of the family's latent layout gives); the caches the model takes."""
    from qkrope.errors import InputError

    from .caches import model_setting, record_of
    from . import schemes

    try:
        record = record_of(config, "the model's sidecar")
        setting = model_setting(config, record, "the model's sidecar")
    except InputError as exc:
        raise TritonRepoError(str(exc)) from None
    if setting.width != rotary_dim:
        raise TritonRepoError(f"the model's caches are {rotary_dim} wide but its axes_dims_rope "
                              f"{list(setting.axes_dim)} sum to {setting.width}; the sidecar is "
                              f"inconsistent")
    from .latents import VIDEO_5D, latent_of

    scheme = schemes.scheme(record.scheme)
    names = None if input_names is None else list(input_names)
    roles = {} if names is None else {model_io.role_of(n): n for n in names}
    history = sorted(n for r, n in roles.items() if r in model_io.HISTORY_ROLES)
    if history:
        raise TritonRepoError(
            f"the model joins history latents ({', '.join(history)}) before its latent, whose "
            f"tokens the rope model does not count (it reads the latent's alone), so qkrope "
            f"triton-repo does not serve it. Fix: run it with qkrope.runtime.load_transformer")
    mask = roles.get(model_io.ENCODER_HIDDEN_STATES_MASK.role)
    txt_tensor = TXT_TENSOR if names is None else mask or model_io.ENCODER_HIDDEN_STATES.name
    joined = [] if names is None else [  # the joined streams themselves, not their masks
        n for n in names if n in model_io.TENSORS and len(model_io.TENSORS[n].axes) == 3
        and model_io.TENSORS[n].axes[1] in model_io.JOINED_TEXT_AXES]
    latent_tensor = roles.get(model_io.HIDDEN_STATES.role, LATENT_TENSOR)
    outputs = CACHE_INPUTS if names is None else tuple(c for c in CACHE_INPUTS if c in names)
    params = {"scheme": scheme.NAME, "axes_dim": ",".join(str(a) for a in setting.axes_dim),
              "theta": repr(float(setting.theta)),
              "scale_rope": "true" if setting.scale_rope else "false"}
    if setting.max_positions is not None:
        params["max_positions"] = str(setting.max_positions)
    if tuple(setting.rotated) != schemes.STREAMS:  # a stream normalised but not rotated
        params["rotated"] = ",".join(setting.rotated)
    if setting.precision != "float32":  # the tables' precision (float64: diffusers' float64 RoPE)
        params["precision"] = setting.precision
    if setting.axis_thetas is not None:  # a base per axis (repr: the float64 values exactly)
        params["axis_thetas"] = ",".join(repr(float(t)) for t in setting.axis_thetas)
    if setting.base_fps is not None:  # frame positions scaled to this rate
        params["base_fps"] = repr(float(setting.base_fps))
    if setting.table_lengths is not None:  # the rows of each axis' table bound the positions
        params["table_lengths"] = ",".join(str(int(n)) for n in setting.table_lengths)
    latent = latent_of(record, config.diffusers_config)
    if latent.kind == VIDEO_5D:  # the rope model counts a 5-D latent's tokens by its patches
        params["latent_patch"] = ",".join(str(p) for p in latent.patch)
    if outputs != CACHE_INPUTS:
        params["outputs"] = ",".join(STREAM_OF_CACHE[c] for c in outputs)
    return RopeRequest(scheme.triton_inputs(setting), (txt_tensor, *joined), params,
                       latent_tensor, outputs)


ROPE_CACHE_BYTES = 64 * 2**20  # caches the rope model keeps for reuse, in all


@dataclass(frozen=True)
class RopeLimits:
    """The largest request the served model takes: image tokens (cache rows) and text tokens."""

    max_img_tokens: int
    max_txt_tokens: int
    source: str  # where the limits come from, for messages


def engine_rope_limits(info: EngineInfo) -> RopeLimits:
    """An engine's limits: its profiles' largest cache rows (and token counts)."""
    from .profiles import DEFAULT_MAX_IMG_TOKENS, DEFAULT_MAX_TXT_TOKENS

    ranges = info.profile_ranges()
    if not ranges:
        return RopeLimits(DEFAULT_MAX_IMG_TOKENS, DEFAULT_MAX_TXT_TOKENS,
                          "qkrope build's default profile (the engine sidecar records none)")

    def largest(name: str, axis: int) -> int | None:
        his = [hi[axis] for _, hi in ranges.get(name, []) if len(hi) > axis]
        return max(his) if his else None

    img = [v for v in (largest(CACHE_INPUTS[0], 0), largest(LATENT_TENSOR, 1)) if v]
    txt = [v for v in (largest(CACHE_INPUTS[1], 0), largest(TXT_TENSOR, 1)) if v]
    if img and not txt and CACHE_INPUTS[1] not in ranges:  # no text cache: the text's own range
        txt = [v for v in (largest(model_io.ENCODER_HIDDEN_STATES.name, 1),) if v] or [
            DEFAULT_MAX_TXT_TOKENS]
    if not img or not txt:
        raise TritonRepoError(f"the engine's profiles give no range for {CACHE_INPUTS}; the "
                              "sidecar is inconsistent, rebuild the engine")
    return RopeLimits(min(img), min(txt), "the engine's optimisation profiles")


def onnx_rope_limits(max_img_tokens: int | None, max_txt_tokens: int | None) -> RopeLimits:
    """An ONNX model has no profile: ``qkrope build``'s default limits unless given."""
    from .profiles import DEFAULT_MAX_IMG_TOKENS, DEFAULT_MAX_TXT_TOKENS

    return RopeLimits(max_img_tokens or DEFAULT_MAX_IMG_TOKENS,
                      max_txt_tokens or DEFAULT_MAX_TXT_TOKENS,
                      "--max-img-tokens / --max-txt-tokens" if max_img_tokens or max_txt_tokens
                      else "qkrope build's default profile")


def _check_limits_apply(whole: bool, max_img_tokens: int | None, max_txt_tokens: int | None,
                        model: Path) -> None:
    """--max-img-tokens / --max-txt-tokens bound what the ensemble's rope model accepts: for a
    model that gets none (an attention block, or ``ensemble=False``) they would be ignored, so
    they are refused; a value must be an integer >= 1."""
    given = [(flag, v) for flag, v in (("--max-img-tokens", max_img_tokens),
                                       ("--max-txt-tokens", max_txt_tokens)) if v is not None]
    for flag, value in given:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TritonRepoError(f"{flag} must be an integer >= 1, got {value!r}")
    if given and not whole:
        flags = " / ".join(flag for flag, _ in given)
        raise TritonRepoError(
            f"{flags} bound(s) what the transformer ensemble's rope model accepts, but {model} "
            f"gets no rope model (not a whole transformer: its clients pass the caches), so it "
            f"would be ignored. Fix: bound the sizes where they are decided (`qkrope build "
            f"{flags.replace(' / ', ' N ')} N` for an engine's profile), or leave it out")


def _limit_overrides(limits: RopeLimits, max_img_tokens: int | None,
                     max_txt_tokens: int | None) -> RopeLimits:
    for flag, value, cap in (("--max-img-tokens", max_img_tokens, limits.max_img_tokens),
                             ("--max-txt-tokens", max_txt_tokens, limits.max_txt_tokens)):
        if value is not None and not 1 <= value <= cap:
            raise TritonRepoError(f"{flag} {value}: must be in 1..{cap} ({limits.source} "
                                  f"accept no more)")
    return RopeLimits(max_img_tokens or limits.max_img_tokens,
                      max_txt_tokens or limits.max_txt_tokens, limits.source)


def render_rope_config(name: str, main: Specs, config: dict, limits: RopeLimits,
                       serving: Serving | None = None) -> str:
    """config.pbtxt of the Python-backend model that builds the caches
    (:mod:`qkrope.runtime.triton_rope_model`) for the main model whose I/O is ``main``."""
    by_name = {n: (dt, d) for n, dt, d in main["input"]}
    dims = [by_name[c][1] for c in CACHE_INPUTS if c in by_name]
    width = {d[-1] for d in dims}
    if CACHE_INPUTS[0] not in by_name or len(width) != 1 or -1 in width \
            or any(len(d) != 2 for d in dims):
        raise TritonRepoError(f"the cache inputs must be [rows, rotary_dim] with a fixed "
                              f"rotary_dim (the image cache at least); got {dims}")
    rotary = width.pop()
    request = rope_request_for(config, rotary, list(by_name))
    for needed in request.shape_inputs:
        if needed not in by_name:
            raise TritonRepoError(f"the model has no {needed} input (the rope model reads the "
                                  f"token counts off its shape)")
    tensors = {"input": request.inputs + [(n, *by_name[n]) for n in request.shape_inputs],
               "output": [(c, "TYPE_FP32", [-1, rotary]) for c in request.outputs]}
    serving = Serving(instances=(serving or Serving()).instances)  # CPU, unbatched
    cfg = _config(name, tensors, serving, "KIND_CPU", backend="python")
    params = {**request.params, "txt_tensor": ",".join(request.txt_tensors),
              "latent_tensor": request.latent_tensor,
              "img_output": CACHE_INPUTS[0], "txt_output": CACHE_INPUTS[1],
              "max_img_tokens": str(limits.max_img_tokens),
              "max_txt_tokens": str(limits.max_txt_tokens),
              "cache_bytes": str(ROPE_CACHE_BYTES)}
    for key, value in params.items():
        cfg.parameters[key].string_value = value
    return to_text(cfg)


def render_ensemble_config(name: str, main_name: str, rope_name: str, main: Specs,
                           request: RopeRequest | None = None) -> str:
    """The ensemble: client inputs (the main model's minus the caches, plus what the rope model
    takes: the scheme's ``img_shapes``, or ``txt_ids`` / ``img_ids``) -> the rope model -> the main
    model -> its outputs (``sample``)."""
    request = request or RopeRequest([("img_shapes", "TYPE_INT64", [-1, 3])], (TXT_TENSOR,), {})
    inputs = [t for t in main["input"] if t[0] not in CACHE_INPUTS]
    tensors = {"input": inputs + list(request.inputs), "output": list(main["output"])}
    cfg = _config(name, tensors, None, None, platform="ensemble")
    for model, ins, outs in (
            (rope_name, [t[0] for t in request.inputs] + request.shape_inputs,
             request.outputs),
            (main_name, [t[0] for t in main["input"]], [t[0] for t in main["output"]])):
        step = cfg.ensemble_scheduling.step.add(model_name=model, model_version=-1)
        for n in ins:
            step.input_map[n] = n
        for n in outs:
            step.output_map[n] = n
    return to_text(cfg)


def _engine_specs(info: EngineInfo) -> Specs:
    dims = triton_dims(info)
    return {kind: [(t.name, triton_dtype(t.dtype), dims[t.name]) for t in items]
            for kind, items in (("input", info.inputs), ("output", info.outputs))}


def onnx_specs(info) -> Specs:
    """Triton I/O of an exported ONNX model from its sidecar (:class:`ModelInfo`): a named
    (symbolic) axis is -1."""
    return {kind: [(t.name, triton_dtype(t.dtype), [d if isinstance(d, int) else -1
                                                     for d in t.shape]) for t in items]
            for kind, items in (("input", info.inputs), ("output", info.outputs))}


def render_onnx_config(name: str, specs: Specs, serving: Serving | None = None,
                       not_batched: list[str] | None = None, *, gpu: bool = False) -> str:
    """config.pbtxt of an ``onnxruntime``-backend model (``1/model.onnx``; ONNX Runtime runs
    the QKNormRoPE nodes' function bodies, so no plugin). ``KIND_GPU`` on ``serving.gpus``
    when given or with ``gpu`` (a bfloat16 model, which the CPU provider cannot run), else
    ``KIND_AUTO`` (a GPU where there is one)."""
    serving = serving or Serving()
    specs = _batched(specs, serving, list(not_batched or []), None)
    kind = "KIND_GPU" if serving.gpus or gpu else "KIND_AUTO"
    return to_text(_config(name, specs, serving, kind,
                           backend="onnxruntime", default_model_filename="model.onnx"))


def with_io_record(text: str, sidecar) -> str:
    """``text`` (a config.pbtxt) with the model's I/O record for qkrope's Triton client
    (:mod:`qkrope.runtime.triton_io`) as the string parameter ``qkrope_model_io``, and the
    export's identity (``qkrope_export_identity``: what the client compares with the export it
    was given, at connect)."""
    from .triton_io import IDENTITY_PARAMETER, IO_PARAMETER, export_identity, record_of

    cfg = parse_config(text)
    cfg.parameters[IO_PARAMETER].string_value = record_of(sidecar)
    identity = export_identity(sidecar)
    if identity is not None:
        cfg.parameters[IDENTITY_PARAMETER].string_value = identity
    return to_text(cfg)


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith("."):
        raise TritonRepoError(f"invalid model name {name!r}: Triton model names are directory "
                              "names; pass --name")


def _check_targets(repo: Path, models: dict[str, Any], force: bool,
                   inputs: Sequence[os.PathLike | str | None]) -> None:
    """What may be written at ``repo/<name>``: nothing there, or (``force``) a model directory
    that holds only files qkrope writes there (:func:`_check_only_ours`) and none of the
    ``inputs``."""
    if repo.exists() and not repo.is_dir():
        raise TritonRepoError(f"{repo} exists and is not a directory")
    for name in models:
        _check_name(name)
        target = repo / name
        if target.exists() and not force:
            raise TritonRepoError(f"{target} already exists; pass --force to replace it or "
                                  "--name to write another model")
        if target.exists() and (target.is_symlink() or not target.is_dir()):
            raise TritonRepoError(f"{target} exists and is not a model directory; remove it or "
                                  f"pass --name")
        for given in inputs:  # what the new model is made of must not go with the old one
            if given is not None and target.exists() and \
                    target.resolve() in Path(given).resolve().parents:
                raise TritonRepoError(f"{given} is inside {target}, which --force would "
                                      f"replace. Fix: copy it out of the repository first, or "
                                      f"write the model elsewhere (another repository or "
                                      f"--name)")
        if target.exists():
            _check_only_ours(target)


#: What qkrope writes in a model directory (any of its kinds: the engine's or the ONNX model's,
#: the rope model's, the ensemble's), by folder: the names, and the suffixes of whole kinds
#: (the rope model's ``schemes/*.py``; the ``__pycache__/*.pyc`` Triton's Python backend writes
#: when it imports them). An ONNX model's external data files in ``1/`` are the ones its served
#: record (``1/model.onnx.json``) lists.
#: the list of further files qkrope wrote under ``1/`` (paths relative to it), where a model
#: has more than the names below (a pipeline's stage graph's data, the pipeline model's copy of
#: the pipeline folder)
FILES_MANIFEST = "qkrope.files.json"
OWN_FILES = {"": {"config.pbtxt", PLUGIN_FILE_NAME, VC_PLUGIN_FILE_NAME},
             "1": {"model.plan", "model.plan.json", "model.onnx", "model.onnx.json",
                   "model.py", FILES_MANIFEST}}
OWN_FOLDERS = {"": {"1"}, "1": {"schemes", "__pycache__"}, "1/schemes": {"__pycache__"}}
OWN_SUFFIXES = {"1/schemes": ".py", "1/__pycache__": ".pyc", "1/schemes/__pycache__": ".pyc"}


def _served_data_names(version_dir: Path) -> set[str]:
    """The external data files the served record ``1/model.onnx.json`` lists (plain names in
    ``1/`` only; an unreadable record lists none). Only read, to know them as qkrope's."""
    record = version_dir / "model.onnx.json"
    try:
        if record.is_symlink() or not record.is_file():
            return set()
        import json

        data = json.loads(record.read_text(encoding="utf-8")).get("external_data") or {}
    except (OSError, ValueError, AttributeError):
        return set()
    return {k for k in data if isinstance(k, str) and k and "/" not in k and "\\" not in k
            and k not in (".", "..")} if isinstance(data, dict) else set()


def _manifest(version_dir: Path) -> set[str]:
    """The paths :data:`FILES_MANIFEST` lists (relative to ``version_dir``, none with ``..``);
    an unreadable manifest lists none. Only read, to know them as qkrope's."""
    import json

    path = version_dir / FILES_MANIFEST
    try:
        if path.is_symlink() or not path.is_file():
            return set()
        listed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    return {f"1/{p}" for p in listed if isinstance(p, str) and p and ".." not in
            Path(p).parts and not Path(p).is_absolute()} if isinstance(listed, list) else set()


def foreign_files(model_dir: Path) -> list[str]:
    """The entries of ``model_dir`` (relative paths) that qkrope did not write there
    (:data:`OWN_FILES`, :data:`OWN_FOLDERS`, :data:`OWN_SUFFIXES`, the files
    :data:`FILES_MANIFEST` lists): a user's notes, another model version (``2/``), a symlink;
    replacing the directory would delete them."""
    found: list[str] = []
    data = _served_data_names(model_dir / "1")
    listed = _manifest(model_dir / "1")
    listed_dirs = {str(parent) for p in listed for parent in Path(p).parents}

    def walk(rel: str) -> None:
        with os.scandir(model_dir / rel if rel else model_dir) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            path = f"{rel}/{e.name}" if rel else e.name
            if e.is_dir(follow_symlinks=False):
                if e.name in OWN_FOLDERS.get(rel, ()) or path in listed_dirs:
                    walk(path)
                else:
                    found.append(path + "/")
            elif e.is_file(follow_symlinks=False) and (
                    e.name in OWN_FILES.get(rel, ())
                    or (rel in OWN_SUFFIXES and e.name.endswith(OWN_SUFFIXES[rel]))
                    or (rel == "1" and e.name in data) or path in listed):
                continue
            else:
                found.append(path)

    walk("")
    return found


def _check_only_ours(target: Path) -> None:
    """``--force`` replaces the whole model directory ``target``: refused, in one line, while
    it holds a file qkrope did not write (:func:`foreign_files`). The user's own files are
    never removed."""
    try:
        foreign = foreign_files(target)
    except OSError as exc:
        raise TritonRepoError(f"cannot read {target} to check what --force would replace "
                              f"({exc.strerror or exc}); fix its permissions or write the model "
                              f"elsewhere (another repository or --name)") from None
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more"
                                          if len(foreign) > 5 else "")
        raise TritonRepoError(
            f"{target} holds files qkrope did not write ({shown}); --force replaces the whole "
            f"model directory and would delete them. Fix: move them out of {target}, or write "
            f"the model to a new repository (another --output) or under another --name")


def _write_models(repo: Path, models: dict[str, Any], *, force: bool,
                  inputs: Sequence[os.PathLike | str | None] = ()) -> None:
    """Write ``repo/<name>`` for each ``name -> fill(staged_dir)``. Every model directory is
    assembled in a staging folder next to ``repo`` (:func:`qkrope._fileio.staged_outputs`:
    removed on any failure or SIGTERM, and by the next run after a SIGKILL) and swapped in whole
    (:func:`qkrope._fileio.swap_dir`), in order (an ensemble last, after the models it calls),
    so a reader sees each model old or new, never a mix; existing model directories are
    replaced only with ``force``. The targets are checked before the work (to fail fast) and
    again under the repository's lock, right before the swap: a model another writer committed
    meanwhile is not replaced without ``force``. Write failures are one-line
    OutputWriteErrors."""
    _check_targets(repo, models, force, inputs)
    # Assembled in a staging folder next to the repository (not inside it: Triton takes every
    # sub-directory of a repository for a model), then swapped in whole.
    with staged_outputs(repo.parent, [], flag="--output") as st:
        staged = {}
        for name, fill in models.items():
            staged[name] = st.dir / name
            (staged[name] / "1").mkdir(parents=True)
            fill(staged[name])
        repo.mkdir(parents=True, exist_ok=True)
        # two writers of one repository: in turn, each deciding under the lock
        with committing(), folder_lock(repo, flag="--output"):
            _check_targets(repo, models, force, inputs)
            for name in models:
                swap_dir(staged[name], repo / name, st.dir / REPLACED)


def _rope_models(repo_name: str, main_name: str, main: Specs, config: ModelConfig,
                 limits: RopeLimits, serving: Serving, models: dict) -> list[str]:
    """Add the rope model and the ensemble (named ``repo_name``) after the main model; returns
    what the ensemble's clients send in place of the caches (the rope request's inputs)."""
    if not repo_name.isascii():
        # Seen with Triton 2.51: the Python backend's stub cannot import from a non-ASCII model
        # directory (UnicodeEncodeError at load, whatever the locale).
        raise TritonRepoError(f"model name {repo_name!r}: the ensemble's {repo_name}_rope model "
                              f"runs in Triton's Python backend, which cannot load from a "
                              f"non-ASCII directory name; pass an ASCII --name")
    rope_name = f"{repo_name}_rope"
    rope_text = render_rope_config(rope_name, main, config, limits, serving)
    rotary = next(d[-1] for n, _, d in main["input"] if n == CACHE_INPUTS[0])
    request = rope_request_for(config, rotary, [n for n, _, _ in main["input"]])
    ens_text = render_ensemble_config(repo_name, main_name, rope_name, main, request)

    def fill_rope(d: Path) -> None:
        (d / "config.pbtxt").write_text(rope_text, encoding="utf-8")
        shutil.copyfile(ROPE_MODEL_TEMPLATE, d / "1" / "model.py")
        (d / "1" / "schemes").mkdir()
        for f in rope_scheme_files():
            shutil.copyfile(f, d / "1" / "schemes" / f.name)

    def fill_ensemble(d: Path) -> None:
        (d / "config.pbtxt").write_text(ens_text, encoding="utf-8")

    models[rope_name] = fill_rope
    models[repo_name] = fill_ensemble
    return [n for n, _, _ in request.inputs]


PYTHON_ENV_NOTE = ("the *_rope model (Python backend) needs numpy in the server's Python, and "
                   "numpy < 2 for Triton servers up to 2.52, whose Python backend corrupts "
                   "outputs under numpy 2")


PIPELINE_ENV_NOTE = ("the pipeline model (Python backend) imports qkrope with torch, diffusers "
                     "and transformers: install them in the server's Python (pip install "
                     "'qkrope[diffusers,triton]' transformers), with numpy < 2 for Triton "
                     "servers up to 2.52")


#: What the command says of a hard-linked model (its output and the README say the same).
HARD_LINK_NOTE = ("--link: a hard link shares the file with its source: rewriting the source in "
                  "place (onnx.save or a copy over it, not a rename) changes the served model "
                  "too, and qkrope then refuses the served file (its record beside it no longer "
                  "matches); leave out --link to copy instead")


def _transfer(results: Sequence[str]) -> str:
    """One word for how a model's files went in (:func:`qkrope._fileio.link_or_copy`'s
    answers): "hard-linked" when any file is shared with its source (the warning must be said),
    "cloned" when every file is a clone, else "copied"."""
    if "hard-linked" in results:
        return "hard-linked"
    return "cloned" if results and all(r == "cloned" for r in results) else "copied"


def copy_checked(src: Path, dst: Path, sha256: str, *, link: bool = False) -> str:
    """``dst`` becomes ``src`` (:func:`qkrope._fileio.link_or_copy`), then is hashed: a copy
    whose sha256 is not ``sha256`` (what was checked: the sidecar's record) is refused in one
    line, so a source rewritten between the check and the copy is never served. Raised inside
    the staging folder: nothing is committed. Returns how the file went in."""
    how = link_or_copy(src, dst, link=link)
    got = sha256_file(dst)
    if got != sha256:
        raise TritonRepoError(
            f"{src} changed while it was copied into the repository (the copy has sha256 "
            f"{got[:12]}…, what was checked has {sha256[:12]}…); nothing was written. Fix: let "
            f"whatever rewrites {src} finish (or rebuild/re-export it), then run triton-repo "
            f"again")
    return how


def _source_sha256(path: Path, recorded: str | None) -> str:
    """What a copy of ``path`` must hash to: its sidecar's record, else ``path``'s hash now."""
    return recorded if recorded is not None else sha256_file(path)


def _check_record(record: Path, key: str, sha256: str | None) -> None:
    """The served record (the sidecar's copy) describes the file that was checked: its ``key``
    is ``sha256``, else the sidecar was rewritten meanwhile (one line, nothing committed)."""
    import json

    try:
        got = json.loads(record.read_text(encoding="utf-8")).get(key)
    except (OSError, ValueError, AttributeError):
        got = "unreadable"
    if got != sha256:
        raise TritonRepoError(
            f"the sidecar copied to {record} was rewritten while the repository was written (it "
            f"records {key} {str(got)[:12]}…, the one checked {str(sha256)[:12]}…); nothing was "
            f"written. Fix: let whatever rewrites it finish, then run triton-repo again")


def served_record(sidecar: Path, served: Path) -> None:
    """Beside a served file, a copy of its sidecar (``1/model.plan.json`` /
    ``1/model.onnx.json``): the record (sha256, size, mtime_ns, inode, write id) qkrope's own
    loaders check the served file against (:meth:`EngineInfo.load` / :meth:`ModelInfo.load`;
    ``qkrope check`` on the repository), so a served file that no longer matches it (its hard
    linked source rewritten in place, ``--link``) is refused. Triton reads only the model
    file."""
    shutil.copyfile(sidecar, Path(str(served) + ".json"))


def write_repository(engine: os.PathLike | str, repo: os.PathLike | str, *,
                     plugin: os.PathLike | str | None = None, name: str | None = None,
                     serving: Serving | None = None, force: bool = False,
                     copy_plugin: bool = True, check_plugin_hash: bool = True,
                     ensemble: bool | None = None, max_img_tokens: int | None = None,
                     max_txt_tokens: int | None = None, link: bool = False,
                     allow_host_code: bool = False) -> RepoResult:
    """Write ``repo/<name>`` for ``engine`` (:func:`_write_models`): the engine goes in as an
    independent copy (a copy-on-write clone where the filesystem has one), or with ``link`` as
    a hard link (the caller's explicit choice: an in-place rewrite of the source then changes
    the served engine too). For a whole transformer
    (:func:`is_transformer`; ``ensemble=None``: whenever it is one) three models:
    ``<name>_trt`` (the engine), ``<name>_rope`` (Python backend, the caches) and ``<name>``
    (the ensemble clients call); else the one model ``<name>``. The rope model accepts what the
    engine's profiles do (``max_img_tokens`` / ``max_txt_tokens`` may lower that). A
    version-compatible engine carries its plugin library as host code that the server runs
    (the printed command allows it): refused, before anything is written, unless the caller
    passes ``allow_host_code`` (``--allow-host-code``;
    :func:`qkrope.runtime.loader_tensorrt.check_host_code`)."""
    parts = engine_models(engine, plugin=plugin, name=name, serving=serving,
                          copy_plugin=copy_plugin, check_plugin_hash=check_plugin_hash,
                          ensemble=ensemble, max_img_tokens=max_img_tokens,
                          max_txt_tokens=max_txt_tokens, link=link,
                          allow_host_code=allow_host_code)
    _write_models(Path(repo), parts.models, force=force, inputs=parts.inputs)
    return parts.result(Path(repo))


@dataclass
class ModelParts:
    """What one served export adds to a repository, before anything is written: its model
    directories (``name -> fill(staged_dir)``, in the order they are swapped in), the files
    they are made of (which ``--force`` must not remove) and the result once written."""

    models: dict[str, Any]
    inputs: list
    result: Any  # repo -> RepoResult


def engine_models(engine: os.PathLike | str, *, plugin: os.PathLike | str | None = None,
                  name: str | None = None, serving: Serving | None = None,
                  copy_plugin: bool = True, check_plugin_hash: bool = True,
                  ensemble: bool | None = None, max_img_tokens: int | None = None,
                  max_txt_tokens: int | None = None, link: bool = False,
                  allow_host_code: bool = False) -> ModelParts:
    """:func:`write_repository`'s models, checked, not written."""
    from .loader_tensorrt import check_host_code

    serving = serving or Serving()
    engine = Path(engine)
    info = load_engine_sidecar(engine)
    check_host_code(info, engine, allow_host_code)  # before anything is written
    name = name or default_model_name(engine)
    _check_name(name)
    plugin_src = resolve_engine_plugin(info, plugin, check_plugin_hash=check_plugin_hash)
    vc = bool(info.version_compatible)
    plugin_name = VC_PLUGIN_FILE_NAME if vc else PLUGIN_FILE_NAME
    copy_plugin = copy_plugin and plugin_src is not None
    whole = is_transformer([t.name for t in info.inputs], info.config)
    if ensemble and not whole:
        raise TritonRepoError(f"{engine} is not a whole transformer (no timestep input), so it "
                              "gets no ensemble")
    whole = whole if ensemble is None else bool(ensemble)
    if whole and serving.max_batch_size:
        raise TritonRepoError("the transformer ensemble needs --max-batch-size 0 (the RoPE "
                              "caches have no batch axis)")
    _check_limits_apply(whole, max_img_tokens, max_txt_tokens, engine)
    main_name = f"{name}_trt" if whole else name
    text = with_io_record(render_config(main_name, info, serving), info)

    transfer: list[str] = []
    # what the copies must hash to: what was checked (the sidecar's records)
    engine_sha = _source_sha256(engine, info.engine_sha256)
    plugin_sha = None
    if copy_plugin:
        plugin_sha = _source_sha256(plugin_src, info.plugin.sha256 if check_plugin_hash
                                    and info.plugin is not None else None)

    def fill_main(d: Path) -> None:
        transfer.append(copy_checked(engine, d / "1" / "model.plan", engine_sha, link=link))
        served_record(engine_sidecar_path(engine), d / "1" / "model.plan")
        _check_record(d / "1" / "model.plan.json", "engine_sha256", info.engine_sha256)
        (d / "config.pbtxt").write_text(text, encoding="utf-8")
        if copy_plugin:
            copy_checked(plugin_src, d / plugin_name, plugin_sha)
            shutil.copystat(plugin_src, d / plugin_name)

    models: dict[str, Any] = {main_name: fill_main}
    rope_inputs = None
    if whole:
        limits = _limit_overrides(engine_rope_limits(info), max_img_tokens, max_txt_tokens)
        rope_inputs = _rope_models(name, main_name, _engine_specs(info), info.config, limits,
                                   serving, models)
    def result(repo: Path) -> RepoResult:
        target = repo / name
        main_dir = repo / main_name
        plugin_final = (main_dir / plugin_name) if copy_plugin else plugin_src
        in_engine = bool(info.plugin and info.plugin.serialized_in_engine)
        return RepoResult(target, target / "config.pbtxt", main_dir / "1" / "model.plan",
                          plugin_final.resolve() if plugin_final is not None else None,
                          server_command(repo, plugin_final, version_compatible=vc,
                                         plugin_in_engine=in_engine), version_compatible=vc,
                          models=[repo / m for m in models], transfer=_transfer(transfer),
                          rope_inputs=rope_inputs, link=link)

    return ModelParts(models, [engine, engine_sidecar_path(engine), plugin_src], result)


def _onnx_files(onnx_path: Path) -> list[Path]:
    """The ONNX file's external data files, each checked to lie inside the model's folder
    (:func:`qkrope.runtime.onnx_file.external_data_files`: no absolute or ``..`` location, no
    symlink out of the folder), so nothing from elsewhere is copied into the repository."""
    import onnx

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - not a protobuf: not an ONNX model
        raise TritonRepoError(f"{onnx_path} is not an ONNX model ({type(exc).__name__}); "
                              "--backend onnxruntime serves the .onnx from `qkrope export`, "
                              "not a TensorRT engine") from None
    return onnx_file.external_data_files(model, onnx_path)  # each inside the model's folder


def write_onnx_repository(onnx_path: os.PathLike | str, repo: os.PathLike | str, *,
                          name: str | None = None, serving: Serving | None = None,
                          force: bool = False, max_img_tokens: int | None = None,
                          max_txt_tokens: int | None = None, link: bool = False) -> RepoResult:
    """``--backend onnxruntime``: serve ``qkrope export``'s .onnx (and its external data file)
    with Triton's onnxruntime backend, no TensorRT or plugin; the files go in as independent
    copies (clones where the filesystem has them), or hard-linked with ``link``. A transformer gets the ensemble
    (``<name>_onnx``, ``<name>_rope``, ``<name>``), an attention block one model ``<name>``.
    The rope model accepts ``max_img_tokens`` / ``max_txt_tokens`` (default: ``qkrope
    build``'s default profile)."""
    parts = onnx_models(onnx_path, name=name, serving=serving, max_img_tokens=max_img_tokens,
                        max_txt_tokens=max_txt_tokens, link=link)
    _write_models(Path(repo), parts.models, force=force, inputs=parts.inputs)
    return parts.result(Path(repo))


def onnx_models(onnx_path: os.PathLike | str, *, name: str | None = None,
                serving: Serving | None = None, max_img_tokens: int | None = None,
                max_txt_tokens: int | None = None, link: bool = False) -> ModelParts:
    """:func:`write_onnx_repository`'s models, checked, not written."""
    from qkrope.sidecars import ModelInfo

    serving = serving or Serving()
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise TritonRepoError(f"ONNX model not found: {onnx_path}. Export one first: "
                              "qkrope export --out MODEL.onnx")
    if onnx_path.suffix.lower() in (".engine", ".plan"):
        raise TritonRepoError(f"{onnx_path} is a TensorRT engine; --backend onnxruntime serves "
                              "the .onnx model (use --backend tensorrt --engine for an engine)")
    data = _onnx_files(onnx_path)
    for f in data:
        if not f.is_file() or f.parent.resolve() != onnx_path.parent.resolve():
            raise TritonRepoError(f"{onnx_path}'s external data file {f} is missing (or not "
                                  "next to it); re-export the model")
    info = ModelInfo.load(onnx_path)
    name = name or default_model_name(onnx_path)
    _check_name(name)
    whole = is_transformer([t.name for t in info.inputs], info.config, info.model)
    _check_limits_apply(whole, max_img_tokens, max_txt_tokens, onnx_path)
    main_name = f"{name}_onnx" if whole else name
    specs = onnx_specs(info)
    if whole and serving.max_batch_size:
        raise TritonRepoError("the transformer ensemble needs --max-batch-size 0 (the RoPE "
                              "caches have no batch axis)")
    not_batched = [t.name for t in info.inputs + info.outputs
                   if not t.shape or t.shape[0] != "batch"]
    # ONNX Runtime's CPU provider has no bfloat16 kernels for most ops: a bf16 model is put on
    # a GPU (KIND_GPU), never on KIND_AUTO's CPU fall-back where Triton has no GPU
    bf16 = any(t.dtype == "bfloat16" for t in info.inputs + info.outputs)
    text = with_io_record(render_onnx_config(main_name, specs, serving, not_batched, gpu=bf16),
                          info)

    transfer: list[str] = []
    # what the copies must hash to: what was checked (the sidecar's records)
    records = {f: r.sha256 for f in data for loc, r in info.external_data.items()
               if (onnx_path.parent / loc).resolve() == f.resolve()}
    want = {f: _source_sha256(f, records.get(f)) for f in data}
    model_sha = _source_sha256(onnx_path, info.model_sha256)

    def fill_main(d: Path) -> None:
        transfer.append(copy_checked(onnx_path, d / "1" / "model.onnx", model_sha, link=link))
        for f in data:  # keeps the name the model's tensors refer to
            transfer.append(copy_checked(f, d / "1" / f.name, want[f], link=link))
        served_record(sidecar_path(onnx_path), d / "1" / "model.onnx")
        _check_record(d / "1" / "model.onnx.json", "model_sha256", info.model_sha256)
        (d / "config.pbtxt").write_text(text, encoding="utf-8")

    models: dict[str, Any] = {main_name: fill_main}
    rope_inputs = None
    if whole:
        for value, flag in ((max_img_tokens, "--max-img-tokens"),
                            (max_txt_tokens, "--max-txt-tokens")):
            if value is not None and value < 1:
                raise TritonRepoError(f"{flag} must be >= 1, got {value}")
        rope_inputs = _rope_models(name, main_name, specs, info.config,
                                   onnx_rope_limits(max_img_tokens, max_txt_tokens), serving,
                                   models)
    def result(repo: Path) -> RepoResult:
        target = repo / name
        return RepoResult(target, target / "config.pbtxt",
                          repo / main_name / "1" / "model.onnx", None,
                          f"tritonserver --model-repository={repo.resolve()}",
                          models=[repo / m for m in models], rope_inputs=rope_inputs,
                          transfer=_transfer(transfer), link=link)

    return ModelParts(models, [onnx_path, sidecar_path(onnx_path), *data], result)
