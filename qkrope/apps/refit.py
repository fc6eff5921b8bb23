"""``qkrope refit M.engine --diffusers DIR`` (or ``--state-dict FILE``): replace the weights of a
refittable engine (``qkrope build --refit``) by diffusers parameter name, e.g. after fusing a LoRA.

Every tensor must have the shape the export recorded (``config.parameter_shapes``; an older
sidecar without it: the element count only) and finite values, before and after the conversion
to the engine's dtype. A file that is not a state dict is one line saying what it is
(:mod:`qkrope.runtime.state_dict`).

Name map: TensorRT's refitter weight names == the ONNX initializer names == the diffusers
state-dict keys (``qkrope export`` keeps every state-dict entry the graph uses as its own
initializer named by its key, untransposed and never merged with an equal one, and lists them in
the sidecar's ``config.parameters``; ``qkrope build --refit`` marks exactly those refittable).
Every engine weight that is a parameter must be given by the state dict and every state-dict key
must be an engine weight, except the keys the export recorded as not in the graph
(``config.parameters_not_in_graph``: blocks past ``--layers``, the last block's text-output
path); ``--allow-missing`` / ``--allow-extra`` relax that to a report. Engine weights that are
no parameter (constants the export made) keep their values. Element counts must match; a
floating-point weight of another float dtype is converted to the engine's (one rounding, what
``qkrope export --dtype`` does to the same weights), anything else is refused. The refitted engine and its sidecar are written
as a pair (:func:`qkrope._fileio.staged_outputs`), in place or to ``-o``.

The code loaded to deserialise the engine is the caller's: the plugin library ``--plugin``
names (else ``QKROPE_PLUGIN_LIB``, else what ``qkrope build-plugin`` built), never the one the
engine sidecar records (that record only checks the library's sha256); the host code a
version-compatible engine carries runs only with ``--allow-host-code``.

TensorRT 10.x/11 API used: ``trt.Refitter(engine, logger)``, ``get_all_weights()``,
``get_weights_prototype(name)`` (a ``trt.Weights`` of the build's ``dtype`` and ``size``,
the count and type ``set_named_weights`` checks against), ``set_named_weights(name,
trt.Weights(dtype, ptr, count))``, ``get_missing_weights()``, ``refit_cuda_engine()``,
``engine.serialize()``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from qkrope import dtypes
from qkrope.errors import QkropeError
from qkrope.weight_values import cast_problem

from . import _args


class RefitError(QkropeError, RuntimeError):
    """The engine cannot be refitted with these weights; the message says why and the fix."""


@dataclass
class RefitReport:
    refitted: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)   # engine parameters the state dict lacks
    not_in_engine: list[str] = field(default_factory=list)  # state-dict keys the engine lacks
    not_in_graph: list[str] = field(default_factory=list)   # keys the export left out (expected)
    constants: list[str] = field(default_factory=list)      # engine weights that are no parameter
    cast: list[str] = field(default_factory=list)           # converted to the engine's float dtype


_FLOAT_NAMES = tuple(dtypes.SHORT_BY_NAME)  # the float precisions qkrope exports


def _short(names, n=8) -> str:
    names = sorted(names)
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def name_map(refitter_names, state_dict_keys, *, parameters=None, not_in_graph=()
             ) -> RefitReport:
    """Match the engine's refittable weights to a state dict; the map is the identity (refitter
    name == ONNX initializer name == state-dict key).

    ``parameters``: the state-dict keys the export kept as initializers (the model sidecar's
    ``config.parameters``). Engine weights outside it are constants the export made (folded
    shapes, the timestep frequencies) and keep their values; ``None`` (an older sidecar) counts
    every engine weight as a parameter. ``not_in_graph``: keys the export recorded as unused by
    the graph (blocks past ``--layers``, the last block's text-output path), ignored here."""
    engine, given, skip = set(refitter_names), set(state_dict_keys), set(not_in_graph)
    wanted = engine if parameters is None else engine & set(parameters)
    report = RefitReport(refitted=sorted(wanted & given), not_covered=sorted(wanted - given),
                         not_in_engine=sorted(given - engine - skip),
                         not_in_graph=sorted((given & skip) - engine),
                         constants=sorted(engine - wanted))
    return report


def refit_engine(trt, engine, logger, state_dict: Mapping[str, Any], *,
                 parameters=None, not_in_graph=(), allow_missing: bool = False,
                 allow_extra: bool = False, shapes: Mapping[str, Any] | None = None
                 ) -> RefitReport:
    """Set every mapped weight of ``engine`` from ``state_dict`` (torch tensors) and refit it
    (``parameters`` / ``not_in_graph``: see :func:`name_map`; ``shapes``: the export's
    ``config.parameter_shapes``, each tensor must have its shape; None, an older sidecar: the
    element count only).

    Raises RefitError for a non-refittable engine, uncovered names / unknown keys (unless
    allowed), a shape, count or dtype mismatch, non-finite values (NaN/inf as given, or values
    the conversion to the engine's dtype makes infinite: fp32 beyond fp16's range), or a refit
    TensorRT rejects."""
    import torch

    if getattr(engine, "refittable", True) is False:
        raise RefitError("the engine was not built refittable. Fix: rebuild it with "
                         "`qkrope build --refit`")
    from qkrope.runtime.state_dict import refuse_unusable_tensors

    refuse_unusable_tensors(state_dict, source="cannot refit", error=RefitError)
    refitter = trt.Refitter(engine, logger)
    report = name_map(list(refitter.get_all_weights()), state_dict, parameters=parameters,
                      not_in_graph=not_in_graph)
    problems = []
    if report.not_covered and not allow_missing:
        problems.append(f"{len(report.not_covered)} engine weight(s) have no state-dict entry: "
                        f"{_short(report.not_covered)}")
    if report.not_in_engine and not allow_extra:
        problems.append(f"{len(report.not_in_engine)} state-dict key(s) are not weights of the "
                        f"engine: {_short(report.not_in_engine)}")
    if not report.refitted:
        problems.append("no state-dict key names an engine weight (the map is by diffusers "
                        "parameter name: was the engine exported by `qkrope export`?)")
    keep, mismatched, nonfinite = [], [], []
    for name in report.refitted:
        current = refitter.get_weights_prototype(name)  # the build's dtype and count
        want_count = int(current.size)
        t = state_dict[name]
        if want_count < 0:  # TensorRT's prototype of a name it has no weight for: size -1
            mismatched.append(f"{name}: TensorRT has no weight of that name")
            continue
        want_dtype = dtypes.canonical(current.dtype, source="tensorrt")
        if not isinstance(t, torch.Tensor):
            mismatched.append(f"{name}: not a tensor ({type(t).__name__})")
            continue
        got_dtype = dtypes.canonical(t.dtype, source="torch")
        floats = t.is_floating_point() and want_dtype in _FLOAT_NAMES
        want_shape = None if shapes is None or name not in shapes else list(shapes[name])
        if (got_dtype != want_dtype and not floats) or t.numel() != want_count \
                or (want_shape is not None and list(t.shape) != want_shape):
            shape = f" {want_shape}" if want_shape is not None else ""
            mismatched.append(f"{name}: engine {want_dtype} x {want_count}{shape}, state dict "
                              f"{got_dtype} {list(t.shape)} ({t.numel()})")
            continue
        # what the export does to them: one rounding to the dtype (qkrope.weight_values: the
        # export's and quantize's check too)
        converted, problem = cast_problem(t, dtypes.torch_dtype(want_dtype))
        if problem is not None:
            nonfinite.append(f"{name}: {problem}" + (" in the engine" if "range" in problem
                                                     else ""))
            continue
        if got_dtype != want_dtype:
            t = converted
            report.cast.append(name)
        keep.append((name, t, current.dtype))
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) differ in shape or size or are not "
                        f"floating-point where the engine's are: " + "; ".join(mismatched[:8])
                        + (f" (+{len(mismatched) - 8} more)" if len(mismatched) > 8 else ""))
    if nonfinite:
        problems.append(f"{len(nonfinite)} weight(s) have values the engine cannot hold: "
                        + "; ".join(nonfinite[:8])
                        + (f" (+{len(nonfinite) - 8} more)" if len(nonfinite) > 8 else ""))
    if problems:
        raise RefitError("cannot refit: " + "; ".join(problems) + ". Fix: pass the state dict "
                         "of a model with the engine's config (its float weights may be of any "
                         "float dtype), or --allow-missing / --allow-extra to refit only the "
                         "names in both")
    alive = []  # the host copies stay referenced until refit_cuda_engine returns
    for name, t, trt_dtype in keep:
        host = t.detach().to("cpu").contiguous()
        alive.append(host)
        if not refitter.set_named_weights(name, trt.Weights(trt_dtype, host.data_ptr(),
                                                            host.numel())):
            raise RefitError(f"TensorRT refused the weight {name} (see its log above)")
    missing = list(refitter.get_missing_weights())
    if missing:
        raise RefitError(f"TensorRT still needs {len(missing)} weight(s) before it can refit: "
                         f"{_short(missing)}. Fix: give them in the state dict")
    if not refitter.refit_cuda_engine():
        raise RefitError("TensorRT's refit_cuda_engine failed (see its log above)")
    del alive
    return report


_REFIT_QUANT_FIX = ("refit replaces float weights and would drop the quantisation; export the "
                    "quantised folder with `qkrope export --model transformer --diffusers QDIR "
                    "--quant fp8` and build a new engine (`qkrope build`)")


def load_state_dict(diffusers: str | None = None, state_dict: str | None = None, *,
                    variant: str | None = None) -> dict:
    """The weights by diffusers parameter name: a diffusers model folder (its ``transformer``
    subfolder when given a pipeline folder; one file or the shards its index names, of
    ``variant``: :mod:`qkrope.diffusers_weights`) or one file (``.safetensors``, or a torch
    ``.pt``/``.bin``, loaded with ``weights_only=True``), each file read by
    :func:`qkrope.runtime.state_dict.read_state_dict_file`. Weights carrying ModelOpt quantizer
    state are refused (QuantizedModelError)."""
    weights = _load_state_dict(diffusers, state_dict, variant)
    from qkrope.quantization import refuse_quantized_state_dict

    refuse_quantized_state_dict(weights, source=str(diffusers or state_dict),
                                fix=_REFIT_QUANT_FIX)
    return weights


def _load_state_dict(diffusers: str | None, state_dict: str | None, variant: str | None) -> dict:
    if (diffusers is None) == (state_dict is None):
        raise RefitError("give exactly one of --diffusers DIR and --state-dict FILE")
    from qkrope.runtime.state_dict import read_state_dict_file

    if state_dict is not None:
        return read_state_dict_file(state_dict, what="--state-dict", error=RefitError)
    from qkrope import diffusers_weights

    # each shard through the one reader: a corrupt shard is one line naming it
    return diffusers_weights.load_state_dict(
        diffusers, variant=variant, other_source="pass --state-dict FILE",
        reader=lambda f: read_state_dict_file(f, what="--diffusers shard", error=RefitError))


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "refit",
        description="Update the weights of an engine built with `qkrope build --refit` from a "
                    "diffusers model folder or a state-dict file (e.g. after fusing a LoRA); "
                    "weights are matched by state-dict key (= ONNX initializer name = TensorRT "
                    "weight name). The engine and its sidecar are replaced as a pair.")
    p.add_argument("engine", metavar="MODEL.engine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--diffusers", metavar="DIR", help="diffusers transformer (or pipeline) "
                     "folder: its safetensors weights, shards read through their index")
    src.add_argument("--state-dict", metavar="FILE", help=".safetensors (or torch .pt) state "
                     "dict keyed by diffusers parameter name; each tensor of the exported "
                     "shape, finite in the engine's dtype")
    p.add_argument("--variant", metavar="NAME",
                   help="with --diffusers: the weights variant it was saved with (diffusers' "
                        "variant=, e.g. fp16: diffusion_pytorch_model.fp16.safetensors or its "
                        "indexed shards)")
    p.add_argument("-o", "--output", metavar="OUT.engine",
                   help="write the refitted engine here (default: replace MODEL.engine)")
    from qkrope.runtime.plugin_build import DEFAULT_PLUGIN_HELP

    _args.add_plugin(p, DEFAULT_PLUGIN_HELP)
    _args.add_allow_host_code(p)
    p.add_argument("--allow-missing", action="store_true",
                   help="engine weights the state dict lacks keep their values")
    p.add_argument("--allow-extra", action="store_true",
                   help="state-dict keys the engine does not have are ignored")
    p.add_argument("--verbose", action="store_true", help="TensorRT's verbose log")
    p.set_defaults(func=run)
    return p


def _check_refit_outputs(args: argparse.Namespace, engine_path: Path, out: Path,
                         sidecar_plugin: str | None) -> None:
    """-o (and its sidecar) is none of the files refit reads (the weights, the plugin library
    given or recorded; the engine itself only when -o names it: in place) and replaces no file
    of another kind."""
    from qkrope._fileio import ENGINE_SIDECAR, TENSORRT_ENGINE, check_outputs, same_file
    from qkrope.sidecars import engine_sidecar_path

    from qkrope.runtime.state_dict import model_folder_files

    inputs = [args.state_dict, args.plugin, sidecar_plugin]
    if args.diffusers:  # its weights and configs (an engine pair kept there is not one)
        inputs += [p for p in model_folder_files(args.diffusers)
                   if not same_file(p, engine_sidecar_path(engine_path))]
    if not same_file(out, engine_path):
        inputs += [engine_path, engine_sidecar_path(engine_path)]
    check_outputs([(out, TENSORRT_ENGINE), (engine_sidecar_path(out), ENGINE_SIDECAR)],
                  inputs, flag="-o")


def run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre  # checked before TensorRT and torch are imported

    engine_path = pre.engine(args.engine, command="refit", refit=True)
    pre.input_dir(args.diffusers, flag="--diffusers",
                  fix="pass the folder of a saved diffusers transformer (config.json + weights)")
    pre.input_file(args.state_dict, flag="--state-dict",
                   fix="pass a .safetensors (or torch .pt) file keyed by diffusers parameter name")
    _args.check_plugin(args)
    pre.file_to_write(args.output, flag="-o", example=engine_path.name)

    import dataclasses

    from qkrope.runtime.engine import write_engine_pair
    from qkrope.runtime.loader_tensorrt import (check_host_code, import_tensorrt,
                                                load_plugin_library)
    from qkrope.runtime.plugin_build import resolve_plugin_library
    from qkrope.sidecars import EngineInfo
    info = EngineInfo.load(engine_path)
    if not info.refittable:
        raise RefitError(f"{engine_path} was not built refittable (its sidecar says "
                         f"refittable: false). Fix: rebuild it with `qkrope build --refit`")
    if args.variant and not args.diffusers:
        raise RefitError("--variant names a diffusers weights variant: it goes with --diffusers "
                         "DIR")
    out = Path(args.output) if args.output else engine_path
    _check_refit_outputs(args, engine_path, out, info.plugin.path if info.plugin else None)
    # the code that runs is the caller's: the engine's own host code only with
    # --allow-host-code, a plugin library only the one --plugin / QKROPE_PLUGIN_LIB /
    # build/plugins gives (never the sidecar's record, which only checks it)
    host_code = check_host_code(info, engine_path, args.allow_host_code)
    lib = None if info.version_compatible else resolve_plugin_library(
        args.plugin, info.plugin, kind="plugin", check_hash="warn", source=engine_path)
    weights = load_state_dict(args.diffusers, args.state_dict, variant=args.variant)
    trt = import_tensorrt("qkrope refit (TensorRT engine refitting)")
    logger = trt.Logger(trt.Logger.VERBOSE if args.verbose else trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    if host_code:
        runtime.engine_host_code_allowed = True
    if lib is not None:
        load_plugin_library(trt, lib)
    engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
    if engine is None:
        raise RefitError(f"TensorRT could not deserialise {engine_path} (see its log above)")
    info.check_engine_name(getattr(engine, "name", None), engine_path)
    report = refit_engine(trt, engine, logger, weights,
                          parameters=info.config.parameters,
                          not_in_graph=info.config.parameters_not_in_graph or (),
                          allow_missing=args.allow_missing, allow_extra=args.allow_extra,
                          shapes=info.config.parameter_shapes)
    write_engine_pair(out, engine.serialize(), dataclasses.replace(info))
    print(f"refitted {len(report.refitted)} weight(s) of {engine_path}; wrote {out}"
          + (f"; kept {len(report.not_covered)} engine weight(s) the state dict lacks"
             if report.not_covered else "")
          + (f"; ignored {len(report.not_in_engine)} unknown key(s)"
             if report.not_in_engine else "")
          + (f"; converted {len(report.cast)} to the engine's dtype" if report.cast else "")
          + (f"; skipped {len(report.not_in_graph)} key(s) the export left out of the graph"
             if report.not_in_graph else ""))
    return 0


__all__ = ["RefitError", "RefitReport", "name_map", "refit_engine", "load_state_dict"]
