"""``qkrope build OUT_DIR``: a TensorRT engine for every graph of a pipeline export (``qkrope
export --model pipeline -o OUT_DIR``), each written beside its ONNX graph:

    OUT_DIR/transformer/transformer.engine   (+ .engine.json: qkrope build MODEL.onnx's own)
    OUT_DIR/text_encoder/encoder.engine      (and image_encoder/encoder.engine)
    OUT_DIR/vae/decode.engine, OUT_DIR/vae/decode_next.engine   (the causal video layout)
    OUT_DIR/<stage>/qkrope_engines.json      (what each stage engine was built from)

The transformer is built as ``qkrope build OUT_DIR/transformer/transformer.onnx`` builds it
(:func:`qkrope.runtime.engine.build_engine`: the QKNormRoPE plugin, ``--plugin``, its profiles
from ``--resolutions`` / ``--txt-tokens`` / ``--batch`` / ``--max-*``, ``--refit``,
``--version-compatible``). The text and image encoders and the VAE have no plugin node: each graph is
parsed and built as it is, with optimisation profiles over its dynamic axes, named here:

=================  ===================================  ========================================
axis               graphs                               min / opt / max by default
=================  ===================================  ========================================
``batch``          every stage graph (an image          1 / 2 / 2 (``--batch MIN:MAX``,
                   encoder's only axis: its images      ``--max-batch N``: opt = max)
                   have the exported side)
``txt_tokens``     text encoders (ids and mask)         1 / T / T, T the pipeline's padded text
                                                        length (the family record's ``stages``), at
                                                        most the encoder's
                                                        ``max_position_embeddings``
                                                        (``--txt-tokens``, ``--max-txt-tokens``)
``latent_height``  VAE graphs (a causal VAE's cache     1 / H / H, H the pipeline's default
``latent_width``   inputs follow from them)             height (width) over the VAE's pixels per
                                                        latent; one profile per
                                                        ``--resolutions`` preset
=================  ===================================  ========================================

``--min/--opt/--max [STAGE.]AXIS:N`` set one level of an axis in every profile (of that stage
only with ``STAGE.``, e.g. ``--max text_encoder_2.txt_tokens:512``). Which graph input dimension
is which axis comes from the graph itself: the first input's batch and spatial (or token)
dimensions, and every other input dimension as the expression of them that the export recorded
(a causal VAE's cache ``cache_10`` of ``[B, 48, 2, 2*s1, 2*s0]``); the VAE's pixels per latent
are read the same way from its ``decode`` graph's output.

Each stage's engines and its ``qkrope_engines.json`` are written through a staging folder and
renamed into place (:func:`qkrope._fileio.staged_outputs`): a failure leaves the previous ones.
An engine whose record says it was built from the same graph files, profiles, options, TensorRT
version and GPU, and that is still the file built, is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping, Sequence

from qkrope.errors import InputError, QkropeError
from qkrope.sidecars import LEVELS
from qkrope.stages import (ENGINES_FILE, ENGINES_FORMAT, ENGINES_FORMAT_VERSION, PIPELINE_FILE,
                           engine_name, graph_files, graph_files_digest, is_engines_record)
#: the named axes of the stage graphs (module docstring)
AXES = ("batch", "txt_tokens", "latent_height", "latent_width")
#: diffusers' image pipelines' default size when ``height`` / ``width`` are None:
#: default_sample_size 128 x vae_scale_factor 8
DEFAULT_PIXELS = 1024
#: diffusers' ``max_sequence_length`` default of the pipelines with stages
DEFAULT_TEXT_TOKENS = 512
#: diffusers' vae_scale_factor where a VAE graph does not tell its own
DEFAULT_VAE_FACTOR = 8


class StageBuildError(QkropeError, ValueError):
    """A stage graph or a build flag that cannot give a profile, in one line."""


@dataclass
class StageOptions:
    """The stage engines' options (module docstring); the rest are BuildOptions'."""

    batch: tuple[int, int] | None = None
    txt_tokens: tuple[int, int] | None = None
    resolutions: list | None = None
    levels: dict = field(default_factory=dict)  # (stage or None, axis) -> {level: value}
    timing_cache: str | None = None
    builder_optimization_level: int | None = None
    workspace_mib: int | None = None
    force: bool = False
    progress: bool = True
    verbose: bool = False


@dataclass
class GraphBuild:
    """One stage graph's engine: where it goes and its profiles ``[(label, profile)]``."""

    stage: str
    graph: str
    onnx: Path
    engine: Path
    files: list          # the graph's files (the ONNX file and its external data)
    profiles: list


# --------------------------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------------------------

def axis_levels(min_shapes: Sequence[str], opt_shapes: Sequence[str],
                max_shapes: Sequence[str], stages: Sequence[str]) -> dict:
    """``--min/--opt/--max [STAGE.]AXIS:N`` -> {(stage or None, axis): {level: N}}; one line
    for a name that is no axis (an input shape of the transformer among them) or no stage."""
    from qkrope.runtime.profiles import parse_shape_specs

    out: dict = {}
    for level, items in zip(LEVELS, (min_shapes, opt_shapes, max_shapes)):
        for name, shape in parse_shape_specs(items).items():
            stage, _, axis = name.rpartition(".")
            if axis not in AXES or (stage and stage not in stages):
                where = (f"a stage of this export ({', '.join(stages)})" if stage
                         and axis in AXES else f"one of {', '.join(AXES)}")
                raise StageBuildError(
                    f"--{level} {name}:...: with a pipeline folder --min/--opt/--max set a "
                    f"stage axis, [STAGE.]AXIS:N, AXIS {where}. Fix: e.g. --{level} "
                    f"txt_tokens:256; for the transformer's own input shapes build it alone "
                    f"(qkrope build OUT_DIR/transformer/transformer.onnx --{level} ...)")
            if len(shape) != 1:
                raise StageBuildError(f"--{level} {name}:{'x'.join(map(str, shape))}: a stage "
                                      f"axis takes one number, {name}:N")
            out.setdefault((stage or None, axis), {})[level] = int(shape[0])
    return out


# --------------------------------------------------------------------------------------------
# Graph dimensions: the symbols and expressions the export recorded
# --------------------------------------------------------------------------------------------

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv}
_FUNCS = {"floor": lambda x: Fraction(x.numerator // x.denominator),
          "ceiling": lambda x: Fraction(-(-x.numerator // x.denominator)),
          "Max": max, "Min": min}


def eval_dim(expr: str, env: Mapping[str, int]) -> int:
    """The value of a dimension expression (``"2*s1"``, ``"((s0 - 1)//2) + 1"``,
    ``"floor(s0/2)"``) at the symbol values ``env``; KeyError naming an unknown symbol,
    ValueError for what is no such expression."""
    def value(node) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.Name):
            return Fraction(env[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = value(node.left), value(node.right)
            if isinstance(node.op, ast.FloorDiv):
                return Fraction((a / b).numerator // (a / b).denominator)
            return Fraction(_OPS[type(node.op)](a, b))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in _FUNCS and not node.keywords):
            return Fraction(_FUNCS[node.func.id](*(value(a) for a in node.args)))
        raise ValueError(expr)

    got = value(ast.parse(expr.strip(), mode="eval"))
    if got.denominator != 1:
        raise ValueError(expr)
    return int(got)


def graph_io(path: Path) -> tuple[list, list]:
    """The graph's inputs and outputs: ``[(name, dims)]``, a dim an int or its expression."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def dims(v):
        return [d.dim_param if d.dim_param else int(d.dim_value)
                for d in v.type.tensor_type.shape.dim]

    inits = {t.name for t in model.graph.initializer}
    return ([(v.name, dims(v)) for v in model.graph.input if v.name not in inits],
            [(v.name, dims(v)) for v in model.graph.output])


def _anchors(kind: str, graph: str, inputs: list, onnx: Path) -> dict[str, tuple[str, bool]]:
    """symbol -> (axis, in pixels) of the inputs that define the axes: every text input
    (batch, tokens); an image encoder's images (batch); a VAE graph's first input (batch, then
    height and width: latents, or pixels for an encoder graph)."""
    out: dict[str, tuple[str, bool]] = {}

    def bind(name, dims, index, axis, pixels=False):
        d = dims[index]
        if isinstance(d, str):
            if not d.isidentifier():
                raise StageBuildError(f"{onnx} input {name} dimension {index} is {d!r}, no size "
                                      f"of its own. Fix: export the pipeline again")
            out[d] = (axis, pixels)

    if kind == "text_encoder":
        for name, dims in inputs:
            if len(dims) != 2:
                raise StageBuildError(f"{onnx} input {name} has {len(dims)} dimensions, not "
                                      f"[batch, tokens]. Fix: export the pipeline again")
            bind(name, dims, 0, "batch")
            bind(name, dims, 1, "txt_tokens")
        return out
    name, dims = inputs[0]
    if kind == "image_encoder":  # images at the exported side: the batch alone varies
        bind(name, dims, 0, "batch")
        return out
    bind(name, dims, 0, "batch")
    pixels = graph.startswith("encode")  # an encoder graph takes the images
    bind(name, dims, -2, "latent_height", pixels)
    bind(name, dims, -1, "latent_width", pixels)
    return out


def vae_factor(decode_onnx: Path) -> int | None:
    """Pixels per latent of a VAE's ``decode`` graph (its output's width over its input's), or
    None where the graph does not record it."""
    inputs, outputs = graph_io(decode_onnx)
    try:
        sym, out = inputs[0][1][-1], outputs[0][1][-1]
        if not isinstance(sym, str) or not isinstance(out, str):
            return None
        one, two = eval_dim(out, {sym: 1}), eval_dim(out, {sym: 2})
    except (KeyError, ValueError, IndexError, ZeroDivisionError):
        return None
    return one if one >= 1 and two == 2 * one else None


def _levels_env(anchors: Mapping[str, tuple[str, bool]], levels: Mapping[str, tuple], k: int,
                factor: int) -> dict[str, int]:
    return {sym: levels[axis][k] * (factor if pixels else 1)
            for sym, (axis, pixels) in anchors.items()}


def graph_profile(kind: str, graph: str, onnx: Path, levels: Mapping[str, tuple],
                  factor: int, first: tuple[str, Path] | None = None) -> dict:
    """The profile of one graph: every input's min/opt/max shape from the axis ``levels``
    (axis -> (min, opt, max)); ``factor``: pixels per latent, for an encoder graph's pixels.
    ``first``: a next-chunk graph's first-chunk graph (name, file), whose cache outputs
    (``<input>_out``) give the shape of a cache input the next graph does not relate to its
    own first input (torch.export leaves those sizes free)."""
    inputs, _ = graph_io(onnx)
    anchors = _anchors(kind, graph, inputs, onnx)
    first_anchors: dict = {}
    first_outputs: dict = {}
    if first is not None:
        f_inputs, f_outputs = graph_io(first[1])
        first_anchors = _anchors(kind, first[0], f_inputs, first[1])
        first_outputs = dict(f_outputs)
    profile: dict = {}
    for k, level in enumerate(LEVELS):
        env = _levels_env(anchors, levels, k, factor)
        first_env = _levels_env(first_anchors, levels, k, factor)
        for name, dims in inputs:
            shape = []
            for i, d in enumerate(dims):
                if isinstance(d, int):
                    if d < 1:
                        raise StageBuildError(f"{onnx} input {name} dimension {i} has no size "
                                              f"(neither a number nor a symbol). Fix: export "
                                              f"the pipeline again")
                    shape.append(d)
                    continue
                try:
                    try:
                        shape.append(eval_dim(d, env))
                    except KeyError:
                        twin = first_outputs.get(f"{name}_out")
                        if twin is None or len(twin) != len(dims):
                            raise
                        t = twin[i]
                        shape.append(t if isinstance(t, int) else eval_dim(t, first_env))
                except KeyError as exc:
                    raise StageBuildError(
                        f"{onnx} input {name} dimension {i} is {d!r}, which no batch, token or "
                        f"latent size of the graph determines ({exc.args[0]} is its own "
                        f"size). Fix: export the pipeline again") from None
                except (ValueError, ZeroDivisionError, SyntaxError):
                    raise StageBuildError(f"{onnx} input {name} dimension {i} is {d!r}, no "
                                          f"expression qkrope reads. Fix: export the pipeline "
                                          f"again") from None
            if min(shape, default=1) < 1:
                raise StageBuildError(f"{onnx} input {name} would be {'x'.join(map(str, shape))} "
                                      f"at the profile's {level}: a dimension below 1. Fix: "
                                      f"raise the {level} of its axes (--{level} AXIS:N)")
            profile.setdefault(name, {})[level] = tuple(shape)
    for name, levels_of in profile.items():
        if any(not a <= b <= c for a, b, c in zip(*(levels_of[lv] for lv in LEVELS))):
            raise StageBuildError(f"{onnx} input {name}: min {levels_of['min']}, opt "
                                  f"{levels_of['opt']}, max {levels_of['max']} are not in order. "
                                  f"Fix: adjust --min/--opt/--max")
    return profile


# --------------------------------------------------------------------------------------------
# The plan (no TensorRT)
# --------------------------------------------------------------------------------------------

def _range(levels: Mapping, stage: str, axis: str, default: tuple[int, int, int]) -> tuple:
    """(min, opt, max) of ``axis`` for ``stage``: the default, then the unqualified
    --min/--opt/--max, then the stage's own; checked 1 <= min <= opt <= max."""
    got = list(default)
    for key in ((None, axis), (stage, axis)):
        for k, level in enumerate(LEVELS):
            if level in levels.get(key, {}):
                got[k] = levels[key][level]
    if not 1 <= got[0] <= got[1] <= got[2]:
        raise StageBuildError(f"{stage} {axis}: min {got[0]}, opt {got[1]}, max {got[2]}; need "
                              f"1 <= min <= opt <= max. Fix: adjust --min/--opt/--max "
                              f"[{stage}.]{axis}:N")
    return tuple(got)


def stage_sizes(family: str, pipeline: str) -> tuple[int, int, dict[str, int]]:
    """(height, width, text tokens per encoder) the family's pipeline class ``pipeline`` calls
    its stages with by default: its record's stages for that class (qkrope.stages: ``size``,
    each encoder's ``tokens``)."""
    from qkrope import families
    from qkrope.stages import stages_for

    stages = stages_for(families.by_name(family, source=PIPELINE_FILE).stages, pipeline)
    if stages is None:
        return DEFAULT_PIXELS, DEFAULT_PIXELS, {}
    return (*stages.size, {k: v.tokens for k, v in stages.text_encoders.items()})


def plan_stage_builds(out_dir: Path, record: Mapping, stages: Mapping[str, str],
                      opts: StageOptions) -> tuple[list[GraphBuild], list[str]]:
    """Every stage graph's engine and profiles, checked without TensorRT; and notes (how a
    default was chosen)."""
    from qkrope.runtime.profiles import DEFAULT_MAX_BATCH
    from qkrope.runtime.stages.component import read_stage_record

    height, width, texts = stage_sizes(record["family"], record["pipeline"])
    notes: list[str] = []
    builds: list[GraphBuild] = []
    for name, kind in stages.items():
        folder = out_dir / name
        stage_record = read_stage_record(folder)
        if opts.batch:
            batch = (opts.batch[0], opts.batch[1], opts.batch[1])
        else:
            batch = (1, DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH)
        levels = {"batch": _range(opts.levels, name, "batch", batch)}
        presets: list[tuple[str, dict]] = []
        factor = 1
        if kind == "text_encoder":
            from qkrope.export.stages.pipeline import component_config

            positions = component_config(folder).get("max_position_embeddings")
            tokens = texts.get(name, DEFAULT_TEXT_TOKENS)
            if isinstance(positions, int) and 0 < positions < tokens:
                tokens = positions
            txt = ((opts.txt_tokens[0], opts.txt_tokens[1], opts.txt_tokens[1])
                   if opts.txt_tokens else (1, tokens, tokens))
            levels["txt_tokens"] = _range(opts.levels, name, "txt_tokens", txt)
            if isinstance(positions, int) and levels["txt_tokens"][2] > positions:
                raise StageBuildError(f"{name}: a max of {levels['txt_tokens'][2]} text tokens "
                                      f"is more than its {positions} positions (config.json "
                                      f"max_position_embeddings). Fix: --max "
                                      f"{name}.txt_tokens:{positions} (or --txt-tokens)")
            presets.append(("", dict(levels)))
        elif kind == "image_encoder":
            presets.append(("", dict(levels)))
        else:
            decode = folder / stage_record["graphs"]["decode"]["file"]
            factor = vae_factor(decode) or 0
            if not factor:
                factor = DEFAULT_VAE_FACTOR
                notes.append(f"{decode} does not record its pixels per latent: "
                             f"{DEFAULT_VAE_FACTOR} assumed (diffusers' default)")
            sizes = ([(r[0], r[1]) for r in opts.resolutions] if opts.resolutions
                     else [(width, height)])
            for w, h in sizes:
                if w % factor or h % factor:
                    raise StageBuildError(f"--resolutions {w}x{h}: {name} decodes {factor} px "
                                          f"per latent; give sides that are multiples of "
                                          f"{factor}")
                one = dict(levels)
                one["latent_height"] = _range(opts.levels, name, "latent_height",
                                              (1, h // factor, h // factor))
                one["latent_width"] = _range(opts.levels, name, "latent_width",
                                             (1, w // factor, w // factor))
                presets.append((f"{w}x{h}" if len(sizes) > 1 else "", one))
        for graph, spec in stage_record["graphs"].items():
            onnx = folder / spec["file"]
            files = [folder / f for f in graph_files(stage_record["files"], spec["file"])]
            base = graph[:-len("_next")] if graph.endswith("_next") else None
            first = ((base, folder / stage_record["graphs"][base]["file"])
                     if base in stage_record["graphs"] else None)
            profiles = [(label, graph_profile(kind, graph, onnx, one, factor, first))
                        for label, one in presets]
            builds.append(GraphBuild(name, graph, onnx, folder / engine_name(spec["file"]), files,
                                     profiles))
    return builds, notes


def _read_engines_record(folder: Path) -> dict:
    """A stage folder's previous engine record ({} where none); one line for a file of that
    name that is none (it is not replaced)."""
    path = folder / ENGINES_FILE
    if not path.exists():
        return {}
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    if not is_engines_record(record):
        raise StageBuildError(f"{path} exists and is no qkrope stage engine record (format "
                              f"{ENGINES_FORMAT!r}); it is not replaced. Fix: move it away")
    return record


def check_stage_outputs(builds: Sequence[GraphBuild], opts: StageOptions,
                        inputs: Sequence[Any] = ()) -> None:
    """Nothing the build reads is written over and no file of another kind is replaced
    (:func:`qkrope._fileio.check_outputs`), before any work."""
    from qkrope._fileio import TENSORRT_ENGINE, check_outputs

    reads = [*inputs, opts.timing_cache, *(f for b in builds for f in b.files)]
    check_outputs([(b.engine, TENSORRT_ENGINE) for b in builds], reads, flag="OUT_DIR")
    for folder in {b.engine.parent for b in builds}:
        _read_engines_record(folder)


# --------------------------------------------------------------------------------------------
# The build (TensorRT)
# --------------------------------------------------------------------------------------------

def _files_sha256(files: Sequence[Path]) -> str:
    from qkrope._fileio import sha256_file

    return graph_files_digest((f.name, sha256_file(f)) for f in files)


def build_key(b: GraphBuild, opts: StageOptions, trt_version: str, gpu) -> dict:
    """What a stage engine is built from (its record's ``build_key``)."""
    from qkrope.runtime.profiles import profile_to_json

    key = {"onnx_sha256": _files_sha256(b.files),
           "profiles": [profile_to_json(p) for _, p in b.profiles],
           "options": {"builder_optimization_level": opts.builder_optimization_level,
                       "workspace_mib": opts.workspace_mib},
           "tensorrt_version": str(trt_version),
           "gpu": ({"name": gpu.get("name"), "compute_capability": gpu.get("compute_capability")}
                   if gpu else None)}
    return json.loads(json.dumps(key, sort_keys=True))


def build_graph(trt, b: GraphBuild, opts: StageOptions, say) -> bytes:
    """One stage graph to a serialised engine: parsed as it is (strongly typed: the export
    fixed its precision), its profiles added in order."""
    from qkrope.runtime.engine import network_creation_flags
    from qkrope.runtime.loader_tensorrt import EngineBuildError

    logger = trt.Logger(trt.Logger.VERBOSE if opts.verbose else trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_creation_flags(trt))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(b.onnx)):
        errors = [" ".join(str(parser.get_error(i)).split()) for i in range(parser.num_errors)]
        raise EngineBuildError(
            f"TensorRT {trt.__version__}'s ONNX parser rejected {b.onnx} ({len(errors)} "
            f"error(s)): {'; '.join(errors[:4]) or 'no error reported'}. Fix: check the export "
            f"with qkrope check {b.onnx.parent.parent} --stage {b.stage}; an op TensorRT "
            f"{trt.__version__} does not support needs a newer TensorRT")
    names = sorted(network.get_input(i).name for i in range(network.num_inputs))
    want = sorted(b.profiles[0][1])
    if names != want:
        raise EngineBuildError(f"TensorRT's network of {b.onnx} has the inputs "
                               f"{', '.join(names)}, the graph {', '.join(want)}. Fix: export "
                               f"the pipeline again")
    config = builder.create_builder_config()
    for label, profile in b.profiles:
        one = builder.create_optimization_profile()
        for name, levels in profile.items():
            one.set_shape(name, levels["min"], levels["opt"], levels["max"])
        if config.add_optimization_profile(one) < 0:
            raise EngineBuildError(f"TensorRT refused the optimisation profile "
                                   f"{label or 0} of {b.onnx}")
    if opts.workspace_mib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opts.workspace_mib) << 20)
    if opts.builder_optimization_level is not None:
        config.builder_optimization_level = int(opts.builder_optimization_level)
    if opts.timing_cache:
        cache_path = Path(opts.timing_cache)
        data = cache_path.read_bytes() if cache_path.exists() else b""
        config.set_timing_cache(config.create_timing_cache(data), ignore_mismatch=True)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT failed to build the engine of {b.onnx} (see its log "
                               f"above); nothing was written to {b.engine}")
    if opts.timing_cache:
        from qkrope._fileio import output_error, write_atomic

        try:
            write_atomic(opts.timing_cache, config.get_timing_cache().serialize())
        except OSError as exc:
            raise output_error(exc, opts.timing_cache, flag="--timing-cache") from None
    return serialized


def build_stage_engines(trt, builds: Sequence[GraphBuild], opts: StageOptions, steps,
                        out=None) -> list[tuple[GraphBuild, str]]:
    """Build (or keep) every stage engine; per stage folder one staged commit of its new
    engines and its record. Returns (build, "wrote" or "kept") per graph."""
    import hashlib
    import time

    from qkrope._fileio import TENSORRT_ENGINE, sha256_file, staged_outputs, write_atomic
    from qkrope.runtime import trt_utils
    from qkrope.runtime.profiles import format_profile, profile_to_json

    out = out if out is not None else sys.stdout
    gpu = trt_utils.gpu_info()
    done: list[tuple[GraphBuild, str]] = []
    folders: dict[Path, list[GraphBuild]] = {}
    for b in builds:
        folders.setdefault(b.engine.parent, []).append(b)
    for folder, group in folders.items():
        previous = _read_engines_record(folder).get("engines", {})
        entries = dict(previous)
        new: dict[str, bytes] = {}
        for b in group:
            key = build_key(b, opts, trt.__version__, gpu)
            old = previous.get(b.graph)
            if (not opts.force and isinstance(old, dict) and old.get("build_key") == key
                    and b.engine.is_file() and sha256_file(b.engine) == old.get("sha256")):
                done.append((b, "kept"))
                continue
            for k, (label, profile) in enumerate(b.profiles):
                steps.write(f"[build] {b.stage}/{b.engine.name} profile {k}"
                            f"{' (' + label + ')' if label else ''}:\n{format_profile(profile)}")
            t0 = time.monotonic()
            with steps.step(f"building {b.engine} (TensorRT {trt.__version__})"):
                serialized = build_graph(trt, b, opts, steps.write)
            new[b.engine.name] = serialized
            entries[b.graph] = {
                "file": b.engine.name, "onnx": b.onnx.name,
                "sha256": hashlib.sha256(memoryview(serialized)).hexdigest(),
                "build_key": key, "profiles": [profile_to_json(p) for _, p in b.profiles],
                "profile_labels": [label for label, _ in b.profiles],
                "tensorrt_version": str(trt.__version__), "gpu": gpu,
                "build_seconds": round(time.monotonic() - t0, 3)}
            done.append((b, "wrote"))
        if not new:
            continue
        kinds = {n: TENSORRT_ENGINE for n in new}
        with staged_outputs(folder, [ENGINES_FILE, *new], flag="OUT_DIR", kinds=kinds,
                            inputs=[opts.timing_cache, *(f for b in group for f in b.files)]
                            ) as staging:
            for name, data in new.items():
                write_atomic(staging.path(name), data)
            record = {"format": ENGINES_FORMAT, "format_version": ENGINES_FORMAT_VERSION,
                      "engines": entries}
            staging.path(ENGINES_FILE).write_text(json.dumps(record, indent=2) + "\n",
                                                  encoding="utf-8")
            _read_engines_record(folder)  # under the same rule just before the commit
            staging.commit([ENGINES_FILE, *new])  # the record first, the engines last
    for b, what in done:
        labels = [label for label, _ in b.profiles if label]
        print(f"{what} {b.engine} ({len(b.profiles)} profile(s)"
              f"{': ' + ', '.join(labels) if labels else ''}"
              f"{'' if what == 'wrote' else '; up to date, --force rebuilds it'})", file=out)
    return done


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    """``qkrope build OUT_DIR``: the transformer(s) as ``qkrope build MODEL.onnx`` builds them,
    then every stage graph; every check first, TensorRT required only after them."""
    from qkrope import _preflight as pre
    from qkrope.runtime import profiles
    from qkrope.runtime.engine import BuildOptions, check_options, plan_build

    from . import _args
    from .check_stages import read_pipeline_record, stages_of

    out_dir = Path(args.onnx)
    record = read_pipeline_record(out_dir, command="build")
    if args.output:
        raise InputError(f"-o {args.output} with a pipeline folder: each engine is written "
                         f"beside its graph in {out_dir}. Fix: drop -o (or build one graph: "
                         f"qkrope build OUT_DIR/transformer/transformer.onnx -o ...)")
    _args.check_plugin(args)
    pre.file_to_write(args.timing_cache, flag="--timing-cache", example="timing.cache")
    all_stages = stages_of(record)
    transformers = [k for k, v in all_stages.items() if v == "transformer"]
    stages = {k: v for k, v in all_stages.items() if v != "transformer"}
    resolutions = (profiles.parse_resolutions(args.resolutions)
                   if args.resolutions is not None else None)
    txt_tokens = profiles.parse_range(args.txt_tokens, "--txt-tokens")
    batch = profiles.parse_range(args.batch, "--batch")
    topts = BuildOptions(
        plugin=args.plugin, max_batch=args.max_batch, max_img_tokens=args.max_img_tokens,
        max_txt_tokens=args.max_txt_tokens, timing_cache=args.timing_cache,
        version_compatible=args.version_compatible,
        builder_optimization_level=args.builder_optimization_level,
        workspace_mib=args.workspace, progress=not args.no_progress, verbose=args.verbose,
        resolutions=resolutions, txt_tokens=txt_tokens, batch=batch, refit=args.refit,
        force=args.force)
    check_options(topts)
    sopts = StageOptions(
        batch=batch or ((1, args.max_batch) if args.max_batch else None),
        txt_tokens=txt_tokens or ((1, args.max_txt_tokens) if args.max_txt_tokens else None),
        resolutions=resolutions,
        levels=axis_levels(args.min_shapes, args.opt_shapes, args.max_shapes, list(stages)),
        timing_cache=args.timing_cache,
        builder_optimization_level=args.builder_optimization_level,
        workspace_mib=args.workspace, force=args.force, progress=not args.no_progress,
        verbose=args.verbose)
    onnx_of = {name: out_dir / name / f"{name}.onnx" for name in transformers}
    for name, onnx in onnx_of.items():
        pre.onnx_model(onnx, command="build")
        plan_build(onnx, onnx.with_suffix(".engine"), topts)  # its checks, without TensorRT
    builds, notes = plan_stage_builds(out_dir, record, stages, sopts)
    check_stage_outputs(builds, sopts, [args.plugin, *onnx_of.values()])

    from qkrope._progress import Steps
    from qkrope.runtime.engine import build_engine
    from qkrope.runtime.loader_tensorrt import import_tensorrt
    from qkrope.sidecars import engine_sidecar_path

    trt = import_tensorrt()
    for name, onnx in onnx_of.items():
        engine = onnx.with_suffix(".engine")
        info = build_engine(onnx, engine, topts)
        what = "kept" if getattr(info, "reused", False) else "wrote"
        print(f"{what} {engine} and {engine_sidecar_path(engine).name} (the transformer: "
              f"{len(getattr(info, 'profiles', None) or [0])} profile(s), "
              f"{info.plugin_layers} plugin layers)")
    with Steps("qkrope build", len(builds), enabled=sopts.progress) as steps:
        for note in notes:
            steps.write(f"[build] {note}")
        build_stage_engines(trt, builds, sopts, steps)
    return 0


__all__ = ["run", "plan_stage_builds", "build_stage_engines", "build_graph", "graph_profile",
           "graph_io", "eval_dim", "vae_factor", "axis_levels", "stage_sizes", "StageOptions",
           "GraphBuild", "StageBuildError", "AXES", "ENGINES_FILE",
           "ENGINES_FORMAT"]
