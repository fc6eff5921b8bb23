"""``qkrope build``: ONNX model -> TensorRT engine with the QKNormRoPE plugin doing the fused work.

Steps (TensorRT 10.x / 11.x Python API; the TensorRT calls are kept thin, the logic around them is
in plain functions that run without TensorRT):

0. without TensorRT (:func:`plan_build`): the options, the paths, the ONNX file (readable, its
   QKNormRoPE nodes within the node contract, at least one of them), its description, the
   profile and an explicit plugin library; only then is TensorRT required;
1. load the plugin library (:func:`~qkrope.runtime.loader_tensorrt.load_plugin_library`, which
   the TensorRT runner's loader and refit share): ``ctypes.CDLL(lib, RTLD_GLOBAL)`` for the
   self-registering library, ``IPluginRegistry.load_library`` for the version-compatible (VC)
   one, then check the registry has the ``QKNormRoPE`` / ``1`` / ``qkrope`` creator;
2. parse the ONNX file into a strongly typed network (precision was fixed at export), with the
   parser flag ``ENABLE_PLUGIN_OVERRIDE`` where the TensorRT version has it;
3. **check the network holds one QKNormRoPE plugin layer per QKNormRoPE node** of the ONNX file,
   and fail if TensorRT fell back to the nodes' function bodies (standard layers);
4. the optimisation profiles (:mod:`qkrope.runtime.profiles`): one per resolution preset
   (``--resolutions``; a whole transformer defaults to the 1024x1024 preset) or the one of the
   given ranges, each an ``IOptimizationProfile`` added in order; with ``--refit`` the
   exported parameters refittable (:func:`set_refit`); optional timing cache, builder optimisation level, workspace limit, version
   compatibility (the VC plugin library serialised into the engine);
5. build with a progress display fed by ``trt.IProgressMonitor`` (:mod:`qkrope._progress`);
6. write the engine and its sidecar ``<engine>.json`` (TensorRT version, GPU, profile, I/O,
   plugin library path + sha256, the model config) as a pair (:func:`write_engine_pair`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence, TextIO

from qkrope.errors import InputFileNotFoundError, QkropeError
from qkrope._progress import BuildProgress, Steps, make_progress_monitor
from qkrope.file_record import new_write_id
from qkrope.sidecars import (EngineInfo, EngineTensor, ModelInfo, PluginRecord,
                             engine_network_name, engine_sidecar_path, engine_tensors,
                             sidecar_path)
from qkrope import contract, dtypes, model_io
from qkrope._fileio import (ENGINE_SIDECAR, MODEL_SIDECAR, TENSORRT_ENGINE, TIMING_CACHE,
                            OutputIsInputError,
                            check_output_folder, check_outputs, file_kind, output_error,
                            sha256_file, staged_outputs, write_atomic)

from . import fp8_engine
from . import profiles as prof
from . import onnx_file
from . import trt_utils as tu
from .loader_tensorrt import EngineBuildError, import_tensorrt, load_plugin_library, trt_major
from .plugin_build import resolve_plugin_library


class PluginFallbackError(EngineBuildError):
    """TensorRT parsed QKNormRoPE nodes into their function bodies instead of the plugin."""


# --------------------------------------------------------------------------------------------
# TensorRT network flags (thin; importing TensorRT and its plugin library: loader_tensorrt)
# --------------------------------------------------------------------------------------------

def network_creation_flags(trt) -> int:
    """``1 << STRONGLY_TYPED`` on TensorRT 10 (where the flag exists, value 1). TensorRT 11
    networks are always strongly typed and the flag is deprecated (value 0): nothing is passed."""
    if trt_major(trt) >= 11:
        return 0
    member = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(member) if member is not None else 0


def is_strongly_typed(trt, flags: int) -> bool:
    return trt_major(trt) >= 11 or bool(flags)


def set_parser_flags(parser, trt) -> list[str]:
    """Enable ENABLE_PLUGIN_OVERRIDE where the parser has it (10.15+): a registered plugin then
    replaces a same-named local function even when the node had no plugin_namespace."""
    enabled = []
    flag_enum = getattr(trt, "OnnxParserFlag", None)
    member = getattr(flag_enum, "ENABLE_PLUGIN_OVERRIDE", None) if flag_enum else None
    if member is not None:
        parser.set_flag(member)
        enabled.append("ENABLE_PLUGIN_OVERRIDE")
    return enabled


# --------------------------------------------------------------------------------------------
# Plugin-layer detection (works on any network-like object; tests use fakes)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PluginLayer:
    index: int
    layer_name: str
    plugin_name: str | None
    plugin_version: str | None
    plugin_namespace: str | None
    identified_by: str  # "plugin" (read from the plugin object) or "layer name"


def _plugin_identity(layer, trt) -> tuple[str, str, str] | None:
    """(name, version, namespace) of an IPluginV3 layer's plugin, or None if unreadable.

    ``network.get_layer`` returns the ``ILayer`` base class; like polygraphy, the layer is cast
    to its type's class (``layer.__class__ = trt.IPluginV3Layer``) before ``.plugin`` exists."""
    try:
        layer.__class__ = trt.IPluginV3Layer
        core = layer.plugin.get_capability_interface(trt.PluginCapabilityType.CORE)
        return (str(core.plugin_name), str(core.plugin_version), str(core.plugin_namespace))
    except Exception:
        return None


def find_plugin_layers(network, trt, *, node_names: Sequence[str] = ()) -> tuple[
        list[PluginLayer], list[PluginLayer]]:
    """(QKNormRoPE plugin layers, other plugin layers) of a parsed network.

    A layer counts when its type is ``LayerType.PLUGIN_V3`` and its plugin reports name
    QKNormRoPE and namespace qkrope; when the plugin object cannot be inspected, a layer whose
    name is one of the ONNX QKNormRoPE node names (the parser names layers after nodes) counts.
    """
    ours, others = [], []
    v3 = getattr(trt.LayerType, "PLUGIN_V3", None)
    plugin_types = {t for t in (getattr(trt.LayerType, "PLUGIN", None),
                                getattr(trt.LayerType, "PLUGIN_V2", None), v3) if t is not None}
    node_names = set(node_names)
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type not in plugin_types:
            continue
        ident = _plugin_identity(layer, trt) if layer.type == v3 else None
        if ident is not None:
            info = PluginLayer(i, layer.name, *ident, identified_by="plugin")
            match = (info.plugin_name == contract.PLUGIN_NAME
                     and info.plugin_namespace == contract.PLUGIN_NAMESPACE)
        else:
            info = PluginLayer(i, layer.name, None, None, None, identified_by="layer name")
            match = layer.type == v3 and (layer.name in node_names
                                          or any(n and n in layer.name for n in node_names))
        (ours if match else others).append(info)
    return ours, others


def check_plugin_layers(network, trt, expected: Sequence[str] | int, *,
                        trt_version: str = "?", plugin_registered: bool | None = None
                        ) -> list[PluginLayer]:
    """Fail loudly unless the network has exactly one QKNormRoPE plugin layer per ONNX node."""
    node_names = list(expected) if not isinstance(expected, int) else []
    n_expected = expected if isinstance(expected, int) else len(node_names)
    ours, others = find_plugin_layers(network, trt, node_names=node_names)
    if n_expected == 0:
        raise PluginFallbackError(
            "the ONNX model has no QKNormRoPE nodes (domain 'qkrope'), so the engine would not use "
            "the fused plugin. Fix: export with `qkrope export` (it writes the nodes), or build "
            "the decomposed model with trtexec/polygraphy if that is what you want")
    if len(ours) == n_expected:
        return ours
    where = (f"{len(ours)} of {n_expected} QKNormRoPE node(s) became plugin layers"
             + (f" (other plugin layers: {', '.join(o.layer_name for o in others)})"
                if others else ""))
    reasons = [f"TensorRT {trt_version} parsed the rest through the nodes' ONNX function body "
               f"(standard layers), which is correct but not fused"]
    if plugin_registered is False:
        reasons.append("the QKNormRoPE creator was not in the plugin registry at parse time")
    reasons.append("TensorRT 10.6 and older always use a node's local function; 10.7-10.14 "
                   "prefer a registered plugin; 10.15+/11 need the node's plugin_namespace "
                   "attribute or the parser flag ENABLE_PLUGIN_OVERRIDE")
    raise PluginFallbackError(
        f"{where}: {'; '.join(reasons)}. Fix: use TensorRT 10.7 or newer, load qkrope's plugin "
        f"library with --plugin, and export with `qkrope export` (it writes plugin_namespace)")


def set_refit(trt, config, network, parameters, say: Callable[[str], None]) -> str:
    """``--refit``: the model's parameters (the sidecar's ``config.parameters``, named as their
    initializers) become refittable. Where TensorRT can mark weights one by one
    (``BuilderFlag.REFIT_INDIVIDUAL`` + ``network.mark_weights_refittable``, TensorRT 10.0+)
    only they are, so the constants the export made stay free for constant folding; otherwise
    (an older sidecar without the list, a name the network does not know) every weight is
    (``BuilderFlag.REFIT``). Returns ``"individual"`` or ``"all"``."""
    individual = getattr(trt.BuilderFlag, "REFIT_INDIVIDUAL", None)
    if parameters and individual is not None and hasattr(network, "mark_weights_refittable"):
        unknown = [n for n in parameters if not network.mark_weights_refittable(n)]
        if not unknown:
            config.set_flag(individual)
            say(f"[build] refit: {len(parameters)} parameter(s) marked refittable")
            return "individual"
        shown = ", ".join(unknown[:4]) + (f" (+{len(unknown) - 4} more)" if len(unknown) > 4
                                          else "")
        say(f"[build] warning: TensorRT's network has no weights named {shown}; every "
            f"weight is made refittable instead (BuilderFlag.REFIT)")
    config.set_flag(trt.BuilderFlag.REFIT)
    return "all"


# --------------------------------------------------------------------------------------------
# Network I/O (for the engine sidecar)
# --------------------------------------------------------------------------------------------

def network_io(network) -> tuple[list[EngineTensor], list[EngineTensor]]:
    """The network's inputs and outputs (-1 = dynamic)."""
    def one(t):
        return EngineTensor(t.name, dtypes.canonical(t.dtype, source="tensorrt"), [int(d) for d in t.shape])

    return ([one(network.get_input(i)) for i in range(network.num_inputs)],
            [one(network.get_output(i)) for i in range(network.num_outputs)])


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------

@dataclass
class BuildOptions:
    plugin: str | None = None
    # False: the engine of the same ONNX file *without* the plugin (the parser inlines the
    # nodes' function body; for the benchmark). Needs a process where the plugin is not loaded.
    use_plugin: bool = True
    min_shapes: dict | None = None
    opt_shapes: dict | None = None
    max_shapes: dict | None = None
    max_batch: int | None = None
    max_img_tokens: int | None = None
    max_txt_tokens: int | None = None
    timing_cache: str | None = None
    version_compatible: bool = False
    builder_optimization_level: int | None = None
    workspace_mib: int | None = None
    progress: bool = True
    verbose: bool = False
    # resolution presets (width, height): one optimisation profile each
    resolutions: list | None = None
    txt_tokens: tuple[int, int] | None = None   # --txt-tokens MIN:MAX
    batch: tuple[int, int] | None = None        # --batch MIN:MAX
    refit: bool = False                         # set_refit: the parameters refittable
    force: bool = False                         # rebuild even when the engine is up to date
    # config.profiling_verbosity (PROFILING_VERBOSITIES; None: TensorRT's default): "detailed"
    # lets the engine inspector report layer types and tactics (qkrope bench reads them)
    profiling_verbosity: str | None = None


#: --workspace's upper bound in MiB: 1 TiB, above the memory of any GPU (the largest have 288 GiB)
MAX_WORKSPACE_MIB = 1 << 20

#: BuildOptions.profiling_verbosity values (trt.ProfilingVerbosity members, lower case)
PROFILING_VERBOSITIES = ("detailed", "layer_names_only", "none")


# the whole transformer's default when no preset, range or shape is given: a 1024x1024 image
DEFAULT_TRANSFORMER_RESOLUTIONS = [(1024, 1024)]


def _is_transformer(model: ModelInfo) -> bool:
    return any(spec.name == model_io.TIMESTEP.name for spec in model.inputs)


def plan_profiles(model: ModelInfo, opts: BuildOptions) -> list[tuple[str, prof.Profile]]:
    """Derive and validate the profiles, ``[(label, profile)]`` (no TensorRT needed): one per
    resolution preset, or the one of the ranges/shapes given. A whole transformer with no
    preset, range or shape flag gets the 1024x1024 preset (opt 4096 image tokens, text
    1..512, batch 1..2), not its tiny export sample as opt."""
    resolutions = opts.resolutions
    no_flags = not (opts.min_shapes or opts.opt_shapes or opts.max_shapes or opts.max_batch
                    or opts.max_img_tokens or opts.max_txt_tokens)
    if not resolutions and no_flags and _is_transformer(model):
        resolutions = DEFAULT_TRANSFORMER_RESOLUTIONS
    if resolutions:
        if opts.max_batch or opts.max_img_tokens or opts.max_txt_tokens:
            raise prof.ProfileError("--resolutions sets the image tokens of each profile; give "
                                    "the text and batch ranges with --txt-tokens MIN:MAX and "
                                    "--batch MIN:MAX instead of --max-*")
        return prof.derive_preset_profiles(
            model, list(resolutions), txt_tokens=opts.txt_tokens, batch=opts.batch,
            min_shapes=opts.min_shapes, opt_shapes=opts.opt_shapes, max_shapes=opts.max_shapes)
    txt_max = opts.txt_tokens[1] if opts.txt_tokens else opts.max_txt_tokens
    if txt_max and _is_transformer(model):  # a scheme with position tables bounds the text
        prof.check_rope_positions([], txt_max, family=model.config.family)
    if opts.txt_tokens or opts.batch:
        levels = {}
        if opts.txt_tokens:
            levels[model_io.TXT_TOKENS] = (opts.txt_tokens[0], opts.txt_tokens[1],
                                           opts.txt_tokens[1])
        if opts.batch:
            levels[model_io.BATCH] = (opts.batch[0], opts.batch[1], opts.batch[1])
    else:
        levels = None
    profile = prof.derive_profile(
        model, min_shapes=opts.min_shapes, opt_shapes=opts.opt_shapes,
        max_shapes=opts.max_shapes, max_batch=opts.max_batch,
        max_img_tokens=opts.max_img_tokens, max_txt_tokens=opts.max_txt_tokens,
        axis_levels=levels)
    prof.validate_profile(profile, model.inputs)
    _check_max_flags_hold(model, opts, profile)
    return [("", profile)]


def _check_max_flags_hold(model: ModelInfo, opts: BuildOptions, profile: prof.Profile) -> None:
    """--max-batch / --max-img-tokens / --max-txt-tokens are the profile's max of their axis on
    every input that has it; a range flag of the same axis (--batch, --txt-tokens) or an
    explicit --max shape that says otherwise would win silently, so the pair is refused."""
    for flag, value, axis, other in (
            ("--max-batch", opts.max_batch, model_io.BATCH, ("--batch", opts.batch)),
            ("--max-img-tokens", opts.max_img_tokens, model_io.IMG_TOKENS, (None, None)),
            ("--max-txt-tokens", opts.max_txt_tokens, model_io.TXT_TOKENS,
             ("--txt-tokens", opts.txt_tokens))):
        if value is None:
            continue
        if other[1]:
            raise prof.ProfileError(f"{flag} {value} and {other[0]} "
                                    f"{other[1][0]}:{other[1][1]} both set the {axis} range; "
                                    f"give one of them")
        for spec in model.inputs:
            for i, d in enumerate(spec.shape):
                got = profile[spec.name]["max"][i] if spec.name in profile else value
                if d == axis and got != value:
                    raise prof.ProfileError(
                        f"{flag} {value} conflicts with the --max shape(s) given "
                        f"({', '.join(opts.max_shapes or ())}), which make the max of "
                        f"{spec.name} {'x'.join(map(str, profile[spec.name]['max']))} (its "
                        f"{axis} {got}); give the {axis} once, with either flag")


def plan_profile(model: ModelInfo, opts: BuildOptions) -> prof.Profile:
    """The first profile of :func:`plan_profiles`."""
    return plan_profiles(model, opts)[0][1]


def check_options(opts: BuildOptions) -> None:
    """The options' own values (no file, no TensorRT): sizes, levels, limits."""
    for name, value in (("--max-batch", opts.max_batch), ("--max-img-tokens", opts.max_img_tokens),
                        ("--max-txt-tokens", opts.max_txt_tokens),
                        ("--workspace", opts.workspace_mib)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise prof.ProfileError(f"{name} must be >= 1; got {value!r}")
    if opts.workspace_mib is not None and opts.workspace_mib > MAX_WORKSPACE_MIB:
        raise EngineBuildError(
            f"--workspace {opts.workspace_mib} MiB is more than {MAX_WORKSPACE_MIB} MiB (1 TiB), "
            f"more memory than any GPU has (TensorRT takes it as the workspace pool's limit). "
            f"Fix: give at most the GPU's memory in MiB, or leave it to TensorRT")
    level = opts.builder_optimization_level
    if level is not None and (isinstance(level, bool) or not isinstance(level, int)
                              or not 0 <= level <= 5):
        raise EngineBuildError(f"--builder-optimization-level must be 0..5; got {level!r}")
    if opts.profiling_verbosity is not None and \
            opts.profiling_verbosity not in PROFILING_VERBOSITIES:
        raise EngineBuildError(f"profiling_verbosity must be one of "
                               f"{', '.join(PROFILING_VERBOSITIES)}; got "
                               f"{opts.profiling_verbosity!r}")
    if not opts.use_plugin and opts.version_compatible:
        raise EngineBuildError("a version-compatible engine serialises the plugin library; "
                               "it cannot be built without the plugin (use_plugin=False)")


@dataclass
class BuildPlan:
    """Everything ``qkrope build`` decides before TensorRT is imported."""

    onnx_path: Path
    engine_path: Path
    model: ModelInfo
    profile: prof.Profile
    node_names: list[str]
    plugin_path: str | None
    profiles: list = None  # [(label, profile)]; profile is the first


def _check_build_outputs(onnx_path: Path, engine_path: Path, opts: BuildOptions,
                         data_files: Sequence[Path]) -> None:
    """Nothing the build reads is written over (the model, its sidecar and external data, the
    plugin library), the engine does not land on the timing cache, and neither output replaces a
    file of another kind (:func:`qkrope._fileio.check_outputs`). A timing cache must not be a
    model, an engine, a sidecar or a text file: TensorRT ignores a cache it cannot read and the
    build would then write a fresh one over that file."""
    inputs = [onnx_path, sidecar_path(onnx_path), *data_files, opts.plugin]
    check_outputs([(engine_path, TENSORRT_ENGINE),
                   (engine_sidecar_path(engine_path), ENGINE_SIDECAR)],
                  inputs + [opts.timing_cache], flag="-o")
    if opts.timing_cache:
        cache = Path(opts.timing_cache)
        check_outputs([(cache, TIMING_CACHE)],
                      inputs + [engine_path, engine_sidecar_path(engine_path)],
                      flag="--timing-cache")
        if file_kind(str(cache) + ".json") in (MODEL_SIDECAR, ENGINE_SIDECAR):
            raise OutputIsInputError(
                f"--timing-cache {cache} has the sidecar {cache}.json of a qkrope "
                f"{'model' if file_kind(str(cache) + '.json') == MODEL_SIDECAR else 'engine'}: "
                f"it is not a timing cache and is not replaced. Fix: choose another "
                f"--timing-cache, e.g. {cache.with_suffix('.timing-cache')}")


def plan_build(onnx_path: str | os.PathLike, engine_path: str | os.PathLike,
               opts: BuildOptions) -> BuildPlan:
    """Check the arguments and the model without TensorRT, in this order: the options, the
    paths, the ONNX file (readable, its QKNormRoPE nodes within the node contract, at least one
    when the plugin is used), its description and the profile, an explicit plugin library."""
    check_options(opts)
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    if not onnx_path.is_file():
        raise InputFileNotFoundError(f"{onnx_path} does not exist. Fix: export it with "
                                     f"`qkrope export`")
    if engine_path.is_dir():
        raise EngineBuildError(f"the engine path {engine_path} is a directory. Fix: pass -o "
                               f"{engine_path / onnx_path.with_suffix('.engine').name}")
    check_output_folder(engine_path.parent, flag="-o")  # fail before the build, not after it
    onnx_model = onnx_file.checked_onnx_model(onnx_path, require_nodes=opts.use_plugin)
    _check_build_outputs(onnx_path, engine_path, opts,
                         onnx_file.external_data_files(onnx_model, onnx_path))
    model = ModelInfo.describe(onnx_path)
    profiles = plan_profiles(model, opts)
    profile = profiles[0][1]
    plugin_path = None
    if opts.use_plugin and opts.plugin:
        plugin_path = str(resolve_plugin_library(
            opts.plugin, None, kind="vc" if opts.version_compatible else "plugin"))
    return BuildPlan(onnx_path, engine_path, model, profile, onnx_file.plugin_node_names(onnx_model),
                     plugin_path, profiles)


# BuildOptions fields that do not change what is built (how it is shown, where the plugin was
# found: its hash counts instead, the timing cache: a speed-up of the build only)
_NOT_IN_BUILD_KEY = ("plugin", "progress", "verbose", "timing_cache", "force")


def model_sha256(onnx_path: str | os.PathLike, info: ModelInfo | None = None) -> str:
    """One sha256 over the ONNX file and every external-data file it names (a weight changed
    in ``M.onnx.data`` changes it too). With ``info``, a sidecar that :meth:`ModelInfo.load`
    verified with the file records (the model and each data file: their stat records, or their
    hash), the recorded sha256s are combined instead of reading the weights again."""
    onnx_path = Path(onnx_path)
    model = onnx_file.read_onnx_model(onnx_path)
    locations = sorted({e.value for t in model.graph.initializer for e in t.external_data
                        if e.key == "location"})
    known = dict(info.digests or {}) if info is not None else {}
    if not known.get("") or any(loc not in known for loc in locations
                                if (onnx_path.parent / loc).is_file()):
        known = {}  # an older sidecar (no records): hash the files
    digest = hashlib.sha256((known.get("") or sha256_file(onnx_path)).encode())
    for location in locations:
        target = onnx_path.parent / location
        sha = (known.get(location) or sha256_file(target)) if target.is_file() else "-"
        digest.update(f"{location}\0{sha}".encode())
    return digest.hexdigest()


def build_key(onnx_path, opts: BuildOptions, trt_version: str, gpu: dict | None,
              plugin_path: str | None, model: ModelInfo | None = None) -> dict:
    """What an engine is built from: the model (:func:`model_sha256`), the build options that
    change the engine, the TensorRT version, the GPU (name and compute capability) and the
    plugin library's sha256. Recorded as the engine sidecar's ``build_key``, with the built
    engine's ``engine_sha256``."""
    import dataclasses
    import json

    options = {k: v for k, v in dataclasses.asdict(opts).items() if k not in _NOT_IN_BUILD_KEY}
    key = {"model_sha256": model_sha256(onnx_path, model), "options": options,
           "tensorrt_version": str(trt_version),
           "gpu": ({"name": gpu.get("name"), "compute_capability": gpu.get("compute_capability")}
                   if gpu else None),
           "plugin_sha256": sha256_file(plugin_path) if plugin_path else None}
    return json.loads(json.dumps(key, sort_keys=True, default=str))  # tuples -> lists


def reusable_engine(engine_path: str | os.PathLike, key: dict) -> tuple[EngineInfo | None, str]:
    """``(its sidecar, "")`` when ``engine_path`` is an engine built from ``key`` (same model,
    options, TensorRT, GPU and plugin) and still the file its sidecar describes, else
    ``(None, why it is rebuilt)``."""
    engine_path = Path(engine_path)
    if not engine_path.is_file() or not engine_sidecar_path(engine_path).is_file():
        return None, "no engine there yet"
    try:
        # checks the engine against the sidecar's engine_sha256 (hashed once, here)
        info = EngineInfo.load(engine_path)
    except QkropeError as exc:
        return None, f"the engine or its sidecar is not what the build wrote ({exc})"
    old = info.build_key
    if not old:
        return None, "its sidecar records no build key (an older qkrope built it)"
    changed = [name for name in ("model_sha256", "options", "tensorrt_version", "gpu",
                                 "plugin_sha256") if old.get(name) != key.get(name)]
    if changed:
        return None, f"changed since it was built: {', '.join(changed)}"
    if info.engine_sha256 is None:  # a sidecar without engine_sha256: the build key's record
        recorded = old.get("engine_sha256")
        if not recorded or sha256_file(engine_path) != recorded:
            return None, "the engine file is not the one its sidecar describes"
    return info, ""


def build_engine(onnx_path: str | os.PathLike, engine_path: str | os.PathLike,
                 opts: BuildOptions | None = None, *, log: TextIO | None = None) -> EngineInfo:
    """Build ``engine_path`` from ``onnx_path``; returns its sidecar (also written next to it).

    The arguments and the model are checked first (:func:`plan_build`), TensorRT is required
    after that. With ``opts.use_plugin`` (default) the QKNormRoPE nodes must become plugin
    layers; without it they must not (the function-body engine the benchmark compares
    against). An existing engine built from the same :func:`build_key` (model, options,
    TensorRT version, GPU, plugin) is kept and its sidecar returned with ``reused=True``,
    unless ``opts.force``."""
    opts = opts or BuildOptions()
    log = log if log is not None else sys.stderr
    with Steps("qkrope build", 3, enabled=opts.progress, stream=log) as steps:
        return _build_engine(onnx_path, engine_path, opts, log, steps)


def _build_engine(onnx_path, engine_path, opts: BuildOptions, log: TextIO,
                  steps: Steps) -> EngineInfo:
    plan = plan_build(onnx_path, engine_path, opts)
    onnx_path, engine_path = plan.onnx_path, plan.engine_path
    model, profile, node_names = plan.model, plan.profile, plan.node_names
    fp8 = fp8_engine.quantization_of(model)  # an FP8 export: see qkrope.runtime.fp8_engine
    if fp8:
        fp8_engine.check_options(opts)
        fp8_engine.check_gpu(tu.gpu_info(), onnx_path)
    trt = import_tensorrt()
    plugin_path = plan.plugin_path
    if opts.use_plugin and plugin_path is None:
        plugin_path = str(resolve_plugin_library(
            None, None, kind="vc" if opts.version_compatible else "plugin"))
        _check_build_outputs(onnx_path, engine_path, replace(opts, plugin=plugin_path), [])

    key = build_key(onnx_path, opts, trt.__version__, tu.gpu_info(), plugin_path, model)
    kept, why = reusable_engine(engine_path, key)
    if kept is not None and not opts.force:
        steps.write(f"[build] {engine_path} is up to date (same model, build options, TensorRT "
                    f"{trt.__version__}, GPU and plugin): kept; --force rebuilds it")
        kept.reused = True
        return kept
    steps.write(f"[build] building {engine_path}: "
                + ("--force" if kept is not None else why))

    logger = trt.Logger(trt.Logger.VERBOSE if opts.verbose else trt.Logger.WARNING)
    if plugin_path is not None:
        if hasattr(trt, "init_libnvinfer_plugins"):
            trt.init_libnvinfer_plugins(logger, "")
        load_plugin_library(trt, plugin_path, version_compatible=opts.version_compatible)
    elif trt.get_plugin_registry().get_creator(contract.PLUGIN_NAME, contract.PLUGIN_VERSION,
                                               contract.PLUGIN_NAMESPACE) is not None:
        raise EngineBuildError(
            "the QKNormRoPE plugin is already registered in this process, so the parser would "
            "use it; build the function-body engine first or in a fresh process")

    builder = trt.Builder(logger)
    flags = network_creation_flags(trt)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    parser_flags = set_parser_flags(parser, trt) if plugin_path is not None else []
    with steps.step(f"parsing {onnx_path} (TensorRT {trt.__version__})"):
        parsed = parser.parse_from_file(str(onnx_path))
    if not opts.progress:
        steps.write(f"[build] parsed {onnx_path} (TensorRT {trt.__version__})")
    if not parsed:
        errors = [" ".join(str(parser.get_error(i)).split()) for i in range(parser.num_errors)]
        raise EngineBuildError(
            f"TensorRT {trt.__version__}'s ONNX parser rejected {onnx_path} ({len(errors)} "
            f"error(s)): {'; '.join(errors[:4]) or 'no error reported'}"
            f"{f' (+{len(errors) - 4} more)' if len(errors) > 4 else ''}. Fix: check the model "
            f"with `qkrope check {onnx_path}`; an op TensorRT {trt.__version__} does not support "
            f"needs another export (e.g. --attention primitive) or a newer TensorRT")
    if plugin_path is not None:
        layers = check_plugin_layers(network, trt, node_names, trt_version=trt.__version__,
                                     plugin_registered=True)
        steps.write(f"[build] {len(layers)} QKNormRoPE plugin layer(s), one per ONNX node")
    else:
        layers, _ = find_plugin_layers(network, trt)
        if layers:
            raise EngineBuildError(f"the no-plugin network still has {len(layers)} QKNormRoPE "
                                   f"plugin layer(s); it would not measure the function body")
        steps.write(f"[build] no plugin: {len(node_names)} QKNormRoPE node(s) through their "
                    f"function body")

    inputs, outputs = network_io(network)
    net_names = [i.name for i in inputs]
    if sorted(net_names) != sorted(profile):
        raise EngineBuildError(
            f"the network's inputs ({', '.join(net_names)}) differ from the model description's "
            f"({', '.join(profile)}; from {model.source}). Fix: re-export so the sidecar "
            f"matches the ONNX file")

    config = builder.create_builder_config()
    for _label, one in plan.profiles:  # one IOptimizationProfile per preset, in order
        trt_profile = builder.create_optimization_profile()
        for name, levels in one.items():
            trt_profile.set_shape(name, levels["min"], levels["opt"], levels["max"])
        if config.add_optimization_profile(trt_profile) < 0:
            raise EngineBuildError(f"TensorRT refused the optimisation profile {_label or 0}")
    refit_mode = (set_refit(trt, config, network, model.config.parameters, steps.write)
                  if opts.refit else None)
    if opts.workspace_mib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opts.workspace_mib) << 20)
    if opts.builder_optimization_level is not None:
        config.builder_optimization_level = int(opts.builder_optimization_level)
    if opts.profiling_verbosity is not None:
        config.profiling_verbosity = getattr(trt.ProfilingVerbosity,
                                             opts.profiling_verbosity.upper())
    if fp8:
        fp8_engine.configure(trt, config)
    if opts.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        config.plugins_to_serialize = [plugin_path]
    cache = None
    if opts.timing_cache:
        data = Path(opts.timing_cache).read_bytes() if Path(opts.timing_cache).exists() else b""
        cache = config.create_timing_cache(data)
        config.set_timing_cache(cache, ignore_mismatch=True)
    progress = BuildProgress(log) if opts.progress else None
    monitor = None  # kept referenced until the build returns (TensorRT holds a raw pointer)
    if progress is not None and hasattr(trt, "IProgressMonitor"):
        monitor = make_progress_monitor(trt, progress)
        config.progress_monitor = monitor

    # The sidecar, but for what only the build tells (its time, the engine's hash, an FP8
    # engine's layer summary): the network is named after its facts, so the engine keeps the
    # tag that every later load checks the sidecar against (sidecars.facts_tag), and the write
    # id that pairs it with its sidecar; the sidecar records the name too (network_name).
    info = EngineInfo(
        tensorrt_version=trt.__version__, onnx=str(onnx_path.resolve()),
        inputs=engine_tensors(inputs, model), outputs=engine_tensors(outputs, model),
        profiles=[prof.profile_to_json(one) for _label, one in plan.profiles],
        profile_labels=[label for label, _one in plan.profiles], refittable=bool(opts.refit),
        refit_mode=refit_mode,
        plugin=(PluginRecord(plugin_path, sha256_file(plugin_path),
                             bool(opts.version_compatible)) if plugin_path else None),
        plugin_layers=len(layers), version_compatible=bool(opts.version_compatible),
        strongly_typed=is_strongly_typed(trt, flags),
        builder_optimization_level=opts.builder_optimization_level,
        parser_flags=list(parser_flags), config=dataclasses.replace(model.config),
        dynamic_axes=dict(model.dynamic_axes), sample=dict(model.sample), gpu=tu.gpu_info(),
        build_key=dict(key), write_id=new_write_id())
    network.name = info.network_name = engine_network_name(info)

    for k, (label, one) in enumerate(plan.profiles):
        steps.write(f"[build] profile {k}{' (' + label + ')' if label else ''}:\n"
                    + prof.format_profile(one))
    t0 = time.monotonic()
    try:
        with steps.step("building (TensorRT: tactic selection and kernel compilation)"):
            serialized = builder.build_serialized_network(network, config)
    finally:  # stops a build TensorRT is still running (Ctrl-C) and closes the phase bars
        if progress is not None:
            progress.cancel()
    seconds = time.monotonic() - t0
    del monitor
    if serialized is None:
        raise EngineBuildError("TensorRT failed to build the engine (see its log above); no "
                               f"file was written to {engine_path}")

    if fp8:
        summary = fp8_engine.inspect_engine(trt, logger, serialized, node_names)
        steps.write(f"[build] FP8 engine: {summary['fp8_layers']} of {summary['layers']} "
                    f"layers in FP8, {summary['plugin_layers']} plugin layer(s)")
        info.config.quantization = {**fp8, "engine": summary}  # not in the facts tag
    if opts.timing_cache:  # a cache, not an output: written before the engine pair
        try:
            write_atomic(opts.timing_cache, config.get_timing_cache().serialize())
        except OSError as exc:
            raise output_error(exc, opts.timing_cache, flag="--timing-cache") from None
    info.build_seconds = round(seconds, 3)
    # + the engine's own hash: a kept engine must still be the file that was built
    info.build_key = {**key, "engine_sha256": hashlib.sha256(memoryview(serialized)).hexdigest()}
    with steps.step(f"writing {engine_path} ({serialized.nbytes / 2**20:.1f} MiB) and its "
                    f"sidecar"):
        write_engine_pair(engine_path, serialized, info, sha256=info.build_key["engine_sha256"])
    return info


def write_engine_pair(engine_path: Path, serialized, info: EngineInfo, *,
                      sha256: str | None = None) -> None:
    """Replace the engine and its sidecar as a pair or not at all
    (:func:`qkrope._fileio.staged_outputs`): both are written into a staging folder next to
    them, then moved in, sidecar first and engine last; any failure puts the old pair back, and
    a staging folder left by a killed build is removed by the next one."""
    side_name = engine_sidecar_path(engine_path).name
    with staged_outputs(engine_path.parent, [engine_path.name, side_name], flag="-o",
                        kinds={engine_path.name: TENSORRT_ENGINE,
                               side_name: ENGINE_SIDECAR}) as st:
        write_atomic(st.path(engine_path.name), serialized)
        if sha256 is None:  # hashed from memory: the file is not read back
            sha256 = hashlib.sha256(memoryview(serialized)).hexdigest()
        info.save(st.path(engine_path.name), sha256=sha256)
        st.commit([side_name, engine_path.name])
