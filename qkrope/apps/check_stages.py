"""``qkrope check OUT_DIR --diffusers SRC``: every stage of a pipeline export (``qkrope export
--model pipeline``) against the PyTorch components of the pipeline folder it came from.

    qkrope check qwen-image-onnx --diffusers Qwen-Image            # every stage
    qkrope check qwen-image-onnx --diffusers Qwen-Image --stage vae

Stages (the components ``OUT_DIR/qkrope_pipeline.json`` records as exported):

- a transformer (``OUT_DIR/<name>/<name>.onnx``): ``qkrope check``'s own path
  (:func:`qkrope.apps.check.check_model`) with ``SRC/<name>`` as the reference folder; the
  transformer flags of ``qkrope check`` (``--img-shape``, ``--txt-len``, ``--batch``,
  ``--blocks``, ``--layers``) apply to it;
- a text encoder (``encoder.onnx``), run through its drop-in (:class:`qkrope.runtime.stages.
  TextEncoderExport`, called as the pipeline calls it) at :data:`TEXT_SAMPLES`: two token
  lengths, neither the export's, the last prompt of each padded (a masked tail where the graph
  takes an attention mask, the pad token where it does not); compared are the reads the
  family's pipeline takes (qkrope.stages.TextEncoderStage);
- an image encoder (``encoder.onnx``), through :class:`qkrope.runtime.stages.
  ImageEncoderExport` on random images at the exported side, batches :data:`IMAGE_SAMPLES`;
  compared are the reads its pipeline takes (qkrope.stages.ImageEncoderStage);
- the VAE's module tensors (``VaeStage.tensors``), where it saved any: bit for bit the PyTorch
  VAE's state dict;
- the VAE, run through :class:`qkrope.runtime.stages.VaeExport` ``decode`` at two latent sizes
  (:data:`VAE_SAMPLES`); the causal video layout over :data:`CAUSAL_FRAMES` latent frames, so
  that ``decode`` and ``decode_next`` both run, with the feature cache passed between them as
  the drop-in passes it; the reference is diffusers' own ``vae.decode(z).sample``.

The reference is the PyTorch component loaded from ``SRC/<name>`` in the export's dtype, its
class looked up by the name ``SRC/model_index.json`` gives in diffusers or transformers only
(qkrope.export.stages.pipeline's rule); nothing a folder names is imported otherwise, and no
path recorded in a JSON file is followed: the reference folder is the one the user names.
Before any work, ``SRC`` must be the pipeline ``OUT_DIR`` was exported from as far as files tell
(the same family and pipeline class, each stage's component class and ``config.json``), and
every file a stage record lists must be what it records (size and sha256).

The comparison is polygraphy's, as ``qkrope check``'s: ``Comparator.run`` over runners that call
the drop-ins (and, where TensorRT and a CUDA GPU are present and ``qkrope build OUT_DIR`` wrote
engines beside the graphs, the engines through polygraphy's ``TrtRunner``, run as the drop-in
runs its graphs), ``compare_accuracy`` against the PyTorch outputs, each runner against PyTorch
and TensorRT against ONNX Runtime. The inputs, reference and run results are saved in
polygraphy's JSON formats under ``--workdir`` (default ``OUT_DIR.check/``), one folder per
stage; a stage of one graph also gets ``polygraphy_cmd.sh`` to redo it by hand.

Bound. A text or image encoder or a VAE is a whole network of several layers, like the
transformer, so it is held to ``qkrope check``'s whole-transformer tolerance
(:data:`qkrope.apps.check.TOLERANCES` x :data:`~qkrope.apps.check.TRANSFORMER_FACTOR`, derived in that module's docstring: in fp32
ONNX Runtime and PyTorch sum in different orders, observed ~1.5e-5 x max|output| through a
2-block transformer, hence 1e-4 x max|reference|, the same number as
:data:`qkrope.apps.tiny_pipeline.TRANSFORMER_PARITY`; fp16 / bf16: 8 ulps of max|reference|),
taken as a bound on the largest absolute error over both sizes (max|reference| over both), with
no relative slack. The transformer keeps its check's own rule (an element fails when its error
exceeds both atol and rtol x |reference|; the bound printed is atol).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from qkrope.errors import InputError, InputFileNotFoundError
from qkrope.stages import DROPIN_CLASSES, PIPELINE_FILE, PIPELINE_FORMAT

#: text encoder samples: (batch, tokens, padding of the last prompt); neither length is the
#: export's traced one (7)
TEXT_SAMPLES = ((2, 5, 2), (2, 12, 5))
#: VAE samples: (batch, latent height, latent width); neither is the export's traced 6 x 10
VAE_SAMPLES = ((1, 4, 6), (2, 5, 3))
#: latent frames a causal video VAE decodes: ``decode`` once, ``decode_next`` twice
CAUSAL_FRAMES = 3
#: the kinds of stage a pipeline export records (qkrope_pipeline.json's components)
STAGE_KINDS = ("transformer", *DROPIN_CLASSES)
#: image encoder samples: batch sizes (the images at the exported side); neither the traced 2
IMAGE_SAMPLES = (1, 3)
#: --workdir's default: OUT_DIR with this suffix, beside it
WORKDIR_SUFFIX = ".check"
#: the runners' short names in the tables
SHORT = {"onnxrt-runner": "onnxrt", "trt-runner": "tensorrt", "pytorch": "pytorch"}


@dataclass
class StageResult:
    """One stage's outcome: its rows (runner, reference, output, max abs error, bound, pass)."""

    name: str
    kind: str
    graphs: str
    rows: list = field(default_factory=list)
    passed: bool = False
    error: str = ""
    row_graphs: list = field(default_factory=list)  # the graphs of each row (else ``graphs``)


# --------------------------------------------------------------------------------------------
# The folder and its record (no torch)
# --------------------------------------------------------------------------------------------

def is_pipeline_export(path: str | os.PathLike) -> bool:
    """``path`` is a folder holding a pipeline export's record."""
    p = Path(path)
    return p.is_dir() and (p / PIPELINE_FILE).is_file()


def _fix_folder(command: str) -> str:
    return (f"Fix: pass the folder `qkrope export --model pipeline` wrote (it holds "
            f"{PIPELINE_FILE}), or one MODEL.onnx to qkrope {command}")


def read_pipeline_record(out_dir: str | os.PathLike, *, command: str = "check") -> dict:
    """The record of a pipeline export folder, checked: one line for a folder that is none."""
    folder = Path(out_dir)
    if not folder.is_dir():
        raise InputFileNotFoundError(f"{folder} is no folder. {_fix_folder(command)}")
    path = folder / PIPELINE_FILE
    if not path.is_file():
        raise InputError(f"{folder} is a folder but no pipeline export (it has no "
                         f"{PIPELINE_FILE}). {_fix_folder(command)}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} cannot be read as JSON ({type(exc).__name__}). Fix: export "
                         f"the pipeline again (qkrope export --model pipeline -o "
                         f"{folder})") from None
    comps = record.get("components") if isinstance(record, dict) else None
    if (not isinstance(record, dict) or record.get("format") != PIPELINE_FORMAT
            or not isinstance(comps, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in comps.items())
            or not isinstance(record.get("family"), str)
            or not isinstance(record.get("pipeline"), str)):
        raise InputError(f"{path} is not a qkrope pipeline record (format "
                         f"{PIPELINE_FORMAT!r} with family, pipeline and components). Fix: "
                         f"export the pipeline again (qkrope export --model pipeline -o "
                         f"{folder})")
    return record


def stages_of(record: Mapping[str, Any]) -> dict[str, str]:
    """The exported stages of a pipeline record: component name -> kind, in its order."""
    return {k: v for k, v in record["components"].items() if v in STAGE_KINDS}


def select_stage(stages: Mapping[str, str], stage: str | None, out_dir: Path) -> dict[str, str]:
    """All stages, or the one ``--stage`` names (one line for a name that is no stage)."""
    if stage is None:
        return dict(stages)
    if stage not in stages:
        raise InputError(f"--stage {stage}: {out_dir} has no such stage; its stages are "
                         f"{', '.join(stages)}. Fix: --stage one of them, or leave --stage out "
                         f"to check every stage")
    return {stage: stages[stage]}


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------

#: qkrope check's flags that mean nothing for a pipeline folder, and why
_NOT_FOR_FOLDERS = {
    "engine": ("--engine", "the engines of a pipeline export are found beside each stage's "
                          "graphs (qkrope build OUT_DIR writes them)"),
    "no_onnxrt": ("--no-onnxrt", "the stages are compared on ONNX Runtime (and TensorRT where "
                                 "engines and TensorRT are present)"),
}


def run(args: argparse.Namespace) -> int:
    """``qkrope check OUT_DIR``: the arguments first (one line each), then every stage."""
    from qkrope import _preflight as pre

    from . import _args

    out_dir = Path(args.onnx)
    read_pipeline_record(out_dir)
    if getattr(args, "engine", None):
        flag, why = _NOT_FOR_FOLDERS["engine"]
        raise InputError(f"{flag} {args.engine} with a pipeline folder: {why}. Fix: drop "
                         f"{flag}")
    if not getattr(args, "onnxrt", True):
        flag, why = _NOT_FOR_FOLDERS["no_onnxrt"]
        raise InputError(f"{flag} with a pipeline folder: {why}. Fix: drop {flag}")
    if not args.diffusers:
        raise InputError(f"qkrope check {out_dir} needs --diffusers SRC, the saved diffusers "
                         f"pipeline folder it was exported from (each stage's PyTorch "
                         f"reference is loaded from SRC/<component>). Fix: qkrope check "
                         f"{out_dir} --diffusers SRC")
    pre.input_dir(args.diffusers, flag="--diffusers",
                  fix=f"pass the saved diffusers pipeline folder {out_dir} was exported from")
    _args.check_plugin(args)
    transformer = {"img_shapes": args.img_shape, "txt_len": args.txt_len,
                   "batch": args.batch, "blocks": args.blocks, "layers": args.layers}
    passed, _ = check_pipeline(out_dir, args.diffusers, stage=getattr(args, "stage", None),
                               providers=args.providers, seed=args.seed, workdir=args.workdir,
                               plugin=args.plugin, allow_host_code=args.allow_host_code,
                               transformer=transformer, verbose=args.verbose)
    return 0 if passed else 1


@dataclass
class _Plan:
    """What the check decided before any work."""

    out_dir: Path
    src: Path
    record: dict
    family: Any          # the family record (qkrope.families)
    stages: dict         # name -> kind, the selected ones
    sources: dict        # name -> (library, class) of SRC/model_index.json
    stage_records: dict  # name -> the stage record (text encoders, VAE)
    dtype: str
    workdir: Path


def plan_check(out_dir: str | os.PathLike, src: str | os.PathLike, *, stage: str | None = None,
               providers: Sequence[str] = ("cpu",),
               workdir: str | os.PathLike | None = None) -> _Plan:
    """Every check that needs no weights and runs nothing, in one line each (module
    docstring): the export's record, ``--stage``, SRC against the export, each stage's files,
    the providers for the dtype and the workdir."""
    from qkrope._fileio import check_not_inputs
    from qkrope.export.stages.pipeline import _components, plan
    from qkrope.runtime.stages.component import read_stage_record

    out_dir, src = Path(out_dir), Path(src)
    record = read_pipeline_record(out_dir)
    stages = select_stage(stages_of(record), stage, out_dir)
    family, kinds, index = plan(src)
    if family.name != record["family"] or index["_class_name"] != record["pipeline"]:
        raise InputError(f"--diffusers {src} is a {index['_class_name']} ({family.short}), but "
                         f"{out_dir} is an export of a {record['pipeline']} "
                         f"({record['family']}). Fix: pass the pipeline folder {out_dir} was "
                         f"exported from")
    sources = _components(index)
    stage_records: dict[str, dict] = {}
    for name, kind in stages.items():
        folder = out_dir / name
        if kinds.get(name) != kind:
            raise InputError(f"--diffusers {src} has no {kind.replace('_', ' ')} component "
                             f"{name!r} (model_index.json), which {out_dir} exported. Fix: "
                             f"pass the pipeline folder {out_dir} was exported from")
        if kind == "transformer":
            onnx = folder / f"{name}.onnx"
            if not onnx.is_file():
                raise InputFileNotFoundError(
                    f"{onnx} is missing: {out_dir} records {name} as exported. Fix: export the "
                    f"pipeline again (qkrope export --model pipeline --diffusers {src} -o "
                    f"{out_dir})")
            continue
        stage_record = read_stage_record(folder)
        expected = DROPIN_CLASSES[kind]
        if stage_record.get("class") != expected:
            raise InputError(f"{folder} holds a {stage_record.get('class')} stage, but "
                             f"{out_dir}/{PIPELINE_FILE} records {name} as a "
                             f"{kind.replace('_', ' ')}. Fix: export the pipeline again")
        _check_source(name, stage_record, sources[name], folder, src / name)
        _verify_files(folder, stage_record)
        stage_records[name] = stage_record
    dtype = str(record.get("dtype") or "")
    from qkrope import dtypes

    if dtype not in dtypes.TORCH_BY_SHORT:
        raise InputError(f"{out_dir}/{PIPELINE_FILE} records dtype {dtype!r}, not one of "
                         f"{sorted(dtypes.TORCH_BY_SHORT)}. Fix: export the pipeline again")
    if dtype == "bf16" and [str(p).lower() for p in providers] == ["cpu"]:
        raise InputError(f"{out_dir} is a bf16 export, and ONNX Runtime's CPU provider (the only "
                         f"one asked for) has no bfloat16 MatMul kernel, so nothing was run. "
                         f"Fix: --providers cuda (onnxruntime-gpu), or check an fp32 export of "
                         f"the same pipeline (qkrope export --model pipeline --dtype fp32)")
    work = Path(workdir) if workdir else Path(str(out_dir).rstrip("/\\") + WORKDIR_SUFFIX)
    reads = [p for name in stages for d in (out_dir / name, src / name) if d.is_dir()
             for p in sorted(d.iterdir()) if p.is_file()]
    from .check import WORKDIR_FILES

    check_not_inputs([work / name / sub / f for name in stages for sub in ("", "decode", "encode")
                      for f in WORKDIR_FILES], reads,
                     flag="--workdir")
    return _Plan(out_dir, src, record, family, stages, sources, stage_records, dtype, work)


def _check_source(name: str, stage_record: Mapping, source: tuple[str, str], folder: Path,
                  ref_folder: Path) -> None:
    """SRC's component is the one the stage was exported from, as far as files tell: the class
    model_index.json names and the config.json the export copied (compared, never followed)."""
    recorded = stage_record.get("source") if isinstance(stage_record.get("source"), dict) else {}
    if recorded and (recorded.get("library"), recorded.get("class")) != tuple(source):
        raise InputError(f"{folder} was exported from a {recorded.get('library')}."
                         f"{recorded.get('class')}, but --diffusers names {name} as a "
                         f"{source[0]}.{source[1]}. Fix: pass the pipeline folder it was "
                         f"exported from")
    try:
        ours = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        theirs = json.loads((ref_folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{name}: config.json of {folder} or {ref_folder} cannot be read "
                         f"({type(exc).__name__}). Fix: pass the pipeline folder the export "
                         f"was made from, and export it again if its config.json is gone") from None
    if ours != theirs:
        keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        raise InputError(f"{ref_folder}/config.json differs from the one {folder} was exported "
                         f"with ({', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}), so it "
                         f"is not that model. Fix: pass the pipeline folder {folder.parent} was "
                         f"exported from")


def _verify_files(folder: Path, stage_record: Mapping) -> None:
    """Every file the stage record lists hashes to its recorded sha256."""
    from qkrope._fileio import sha256_file

    for name, facts in stage_record["files"].items():
        want = facts.get("sha256") if isinstance(facts, Mapping) else None
        if want and sha256_file(folder / name) != want:
            raise InputError(f"{folder / name} is not the file the export wrote (its sha256 "
                             f"differs from {folder.name}/qkrope_stage.json's): it was changed "
                             f"after the export. Fix: export the pipeline again (qkrope export "
                             f"--model pipeline -o {folder.parent})")


def check_pipeline(out_dir: str | os.PathLike, diffusers_dir: str | os.PathLike, *,
                   stage: str | None = None, providers: Sequence[str] = ("cpu",),
                   seed: int = 0, workdir: str | os.PathLike | None = None,
                   plugin: str | None = None, allow_host_code: bool = False,
                   transformer: Mapping[str, Any] | None = None, out=None,
                   verbose: bool = False) -> tuple[bool, list[StageResult]]:
    """Check every stage (or ``stage``) of the pipeline export ``out_dir`` against the PyTorch
    components of ``diffusers_dir`` (module docstring). Prints each stage's comparison and a
    summary to ``out``; returns (all passed, the stage results)."""
    from polygraphy.logger import G_LOGGER

    out = out if out is not None else sys.stdout
    plan = plan_check(out_dir, diffusers_dir, stage=stage, providers=providers,
                      workdir=workdir)
    trt_ok, trt_why = _tensorrt_ready()
    print(f"qkrope check: {plan.out_dir} ({plan.record['pipeline']}, {plan.dtype}), "
          f"{len(plan.stages)} stage(s) against the PyTorch components of {plan.src}; ONNX "
          f"Runtime {'/'.join(providers)}"
          + ("" if trt_ok else f"; TensorRT not compared ({trt_why})"), file=out)
    results = []
    with G_LOGGER.verbosity(G_LOGGER.INFO if verbose else G_LOGGER.ERROR):
        for name, kind in plan.stages.items():
            print(f"\n== {name} ({kind.replace('_', ' ')}) ==", file=out)
            if kind == "transformer":
                results.append(_check_transformer(plan, name, providers=providers, seed=seed,
                                                  plugin=plugin, trt_ok=trt_ok,
                                                  allow_host_code=allow_host_code,
                                                  options=transformer or {}, out=out,
                                                  verbose=verbose))
            else:
                results.append(_check_stage(plan, name, kind, providers=providers, seed=seed,
                                            trt_ok=trt_ok, out=out))
    passed = all(r.passed for r in results)
    print(f"\n{format_summary(results, plan.dtype)}", file=out)
    failed = [r.name for r in results if not r.passed]
    print(f"qkrope check: {'PASSED' if passed else 'FAILED: ' + ', '.join(failed)} "
          f"({len(results)} stage(s); polygraphy inputs/outputs in {plan.workdir}/)", file=out)
    return passed, results


def format_summary(results: Sequence[StageResult], dtype: str) -> str:
    """One line per stage and compared output: max abs error, its bound, PASS / FAIL."""
    table = []  # (stage, graphs, compared, max abs err, bound, result)
    for r in results:
        if r.error or not r.rows:
            table.append((r.name, r.graphs, "(not run: see above)" if r.error
                          else "(nothing compared)", "-", "-",
                          "PASS" if r.passed and not r.error else "FAIL"))
            continue
        for k, row in enumerate(r.rows):
            graphs = r.row_graphs[k] if k < len(r.row_graphs) else r.graphs
            table.append((r.name, graphs, f"{row.output} {row.runner} vs {row.against}",
                          f"{row.max_abs:.3g}", f"{row.atol:.3g}",
                          "PASS" if row.passed else "FAIL"))
    head = ("stage", "graph(s)", "compared", "max abs err", "bound", "result")
    width = [max(len(line[i]) for line in [head, *table]) for i in range(len(head))]
    lines = []
    for line in [head, *table]:
        lines.append(f"{line[0]:<{width[0]}}  {line[1]:<{width[1]}}  {line[2]:<{width[2]}}  "
                     f"{line[3]:>{width[3]}}  {line[4]:>{width[4]}}  {line[5]}")
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"bound: {dtype} encoders and VAEs: qkrope check's whole-network "
                 f"tolerance on the largest absolute error (qkrope.apps.check_stages); the "
                 f"transformer: its check's elementwise rule, the bound shown being atol")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The transformer: qkrope check's own path
# --------------------------------------------------------------------------------------------

def _check_transformer(plan: _Plan, name: str, *, providers, seed, plugin, trt_ok,
                       allow_host_code, options, out, verbose) -> StageResult:
    from .check import check_model

    onnx = plan.out_dir / name / f"{name}.onnx"
    engine = onnx.with_suffix(".engine")
    use_engine = None
    if engine.is_file() and trt_ok:
        if plugin:
            use_engine = str(engine)
        else:
            print(f"{engine} not compared: its QKNormRoPE layers need --plugin LIB", file=out)
    passed, rows = check_model(onnx, diffusers_dir=str(plan.src / name), engine=use_engine,
                               plugin=plugin, providers=providers, seed=seed,
                               workdir=plan.workdir / name, out=out, verbose=verbose,
                               allow_host_code=allow_host_code,
                               **{k: v for k, v in options.items() if v})
    return StageResult(name, "transformer", onnx.name, list(rows), bool(passed))


# --------------------------------------------------------------------------------------------
# Text encoders and VAEs
# --------------------------------------------------------------------------------------------

def _tensorrt_ready() -> tuple[bool, str]:
    """TensorRT's bindings and a CUDA GPU, both present (else why not)."""
    import importlib.util

    try:
        present = (sys.modules["tensorrt"] is not None if "tensorrt" in sys.modules
                   else importlib.util.find_spec("tensorrt") is not None)
    except (ImportError, ValueError):
        present = False
    if not present:
        return False, "no TensorRT Python bindings"
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA GPU"
    except Exception:  # noqa: BLE001 - no usable torch CUDA: no TensorRT comparison
        return False, "no CUDA GPU"
    return True, ""


@dataclass
class _Side:
    """How one stage is compared: its graphs, the runner inputs' metadata, the sample feeds,
    the reference and the drop-in (and TensorRT) calls."""

    graphs: str
    inputs: list                     # (name, dtype name, shape with -1)
    feeds: list                      # one feed dict (numpy) per size
    sizes: str                       # the sizes, in words
    reference: Callable[[Mapping[str, Any]], dict]
    dropin: Callable[[Mapping[str, Any]], dict]
    tensorrt: Callable[[Mapping[str, Any]], dict] | None = None
    single_graph: str | None = None  # the graph file polygraphy run can redo alone
    label: str = ""                  # the VAE's "decode" / "encode" (its own workdir folder)
    tensorrt_note: str = ""


def _check_stage(plan: _Plan, name: str, kind: str, *, providers, seed, trt_ok,
                 out) -> StageResult:
    """A text encoder or the VAE: its drop-in on ONNX Runtime (and its engines on TensorRT)
    against the PyTorch component, with polygraphy (module docstring)."""
    from qkrope import dtypes
    from qkrope.runtime.stages.component import load_stage

    from .check import _ort_provider

    folder = plan.out_dir / name
    record = plan.stage_records[name]
    tdtype = dtypes.TORCH_BY_SHORT[plan.dtype]
    library, cls_name = plan.sources[name]
    graphs = "+".join(g["file"] for g in record["graphs"].values())
    model = reference_model(library, cls_name, plan.src / name, tdtype)
    print(f"{graphs} on its drop-in ({record['class']}, ONNX Runtime) against "
          f"{library}.{cls_name} from {plan.src / name} ({plan.dtype})", file=out)
    try:
        dropin = load_stage(folder, providers=[_ort_provider(p) for p in providers])
        if record.get("tensors"):
            _check_module_tensors(record["tensors"], model, dropin, out)
        sides = ([_text_side(plan, name, record, model, dropin, seed=seed, trt_ok=trt_ok)]
                 if kind == "text_encoder" else
                 [_image_side(plan, name, record, model, dropin, seed=seed, trt_ok=trt_ok)]
                 if kind == "image_encoder" else
                 _vae_sides(plan, name, record, model, dropin, seed=seed, trt_ok=trt_ok))
        result = StageResult(name, kind, graphs, [], True)
        for side in sides:
            side.graphs = "+".join(record["graphs"][g]["file"] for g in record["graphs"]
                                   if not side.label or g in (side.label, f"{side.label}_next"))
            print(f"{side.label + ' ' if side.label else ''}inputs: {side.sizes}", file=out)
            if side.tensorrt_note:
                print(side.tensorrt_note, file=out)
            part = _compare(plan, name, kind, side, out=out)
            result.rows += part.rows
            result.row_graphs += [side.graphs] * len(part.rows)
            result.passed = result.passed and part.passed
        return result
    except Exception as exc:  # noqa: BLE001 - a graph that does not load or run fails its stage
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
        print(f"{name}: FAILED: its graphs do not run as the drop-in runs them "
              f"({type(exc).__name__}: {first})", file=out)
        return StageResult(name, kind, graphs, [], False, error=first)


def _check_module_tensors(keys, model, dropin, out) -> None:
    """The module tensors a VAE export saved (its pipeline reads them off the VAE) against the
    PyTorch component's state dict, bit for bit (they are copies, not computed)."""
    import operator

    import torch

    state = model.state_dict()
    for key in keys:
        got = operator.attrgetter(key)(dropin)
        ref = state.get(key)
        if ref is None or got.dtype != ref.dtype or not torch.equal(got, ref.to(got.device)):
            raise InputError(f"the saved module tensor {key} differs from the PyTorch VAE's "
                             f"(exported from another checkpoint?). Fix: pass --diffusers the "
                             f"pipeline folder the export was made from, or export it again")
    print(f"module tensors: {', '.join(keys)} equal the PyTorch VAE's, bit for bit", file=out)


def reference_model(library: str, cls_name: str, folder: Path, dtype):
    """The PyTorch component of ``folder`` in ``dtype``, eval mode: the class model_index.json
    names, looked up by name in diffusers or transformers only
    (qkrope.export.stages.pipeline._model_class), loaded whole by its ``from_pretrained`` from
    local files."""
    from qkrope.export.stages.pipeline import _model_class

    cls = _model_class(library, cls_name)
    if cls is None:
        raise InputError(f"{folder.parent}/model_index.json names {folder.name} as "
                         f"{library}.{cls_name}, which is no model class of diffusers or "
                         f"transformers. Fix: pass the pipeline folder the export was made from")
    if library == "transformers":
        model = cls.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    else:
        model = cls.from_pretrained(str(folder), torch_dtype=dtype, local_files_only=True)
    return model.eval()


def _reads(stage_record: Mapping, family, name: str, pipeline: str) -> tuple[str, ...]:
    """The reads the family's pipeline class ``pipeline`` takes of text or image encoder
    ``name`` (its declaration), the record's where the family declares none."""
    from qkrope.stages import stages_for

    stages = stages_for(family.stages, pipeline)
    declared = (stages.text_encoders.get(name) or stages.image_encoders.get(name)
                if stages else None)
    return tuple(declared.reads) if declared is not None else tuple(stage_record["reads"])


def _text_side(plan: _Plan, name: str, record: Mapping, model, dropin, *, seed: int,
               trt_ok: bool) -> _Side:
    import torch

    from qkrope.runtime.inputs import from_torch

    inputs = list(record["inputs"])
    # a vision-language encoder's text settings are in its text config (transformers'
    # get_text_config: Mistral3's text_config), a text model's are its own
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    vocab = int(getattr(config, "vocab_size", 0) or 0) or 1000
    pad = getattr(config, "pad_token_id", None)
    pad = int(pad) if isinstance(pad, int) and 0 <= pad < vocab else 0
    g = torch.Generator().manual_seed(seed)
    feeds, sizes = [], []
    for batch, tokens, padding in TEXT_SAMPLES:
        ids = torch.randint(0, min(vocab, 1000), (batch, tokens), generator=g)
        feed = {}
        if "attention_mask" in inputs:
            mask = torch.ones_like(ids)
            mask[-1, tokens - padding:] = 0
            feed["attention_mask"] = mask
        else:  # no mask: the pipeline pads with the pad token
            ids[-1, tokens - padding:] = pad
        feed["input_ids"] = ids
        feeds.append({k: from_torch(feed[k]) for k in inputs})
        sizes.append(f"batch {batch} x {tokens} tokens (the last prompt {padding} padding)")
    return _encoder_side(plan, name, record, model, dropin, feeds, " and ".join(sizes),
                         [(n, "int64", [-1, -1]) for n in inputs], trt_ok=trt_ok)


def _image_side(plan: _Plan, name: str, record: Mapping, model, dropin, *, seed: int,
                trt_ok: bool) -> _Side:
    """An image encoder on random images in [-1, 2] (about a normalised image's range) at the
    exported side, batches :data:`IMAGE_SAMPLES`."""
    import torch

    from qkrope import dtypes
    from qkrope.runtime.inputs import from_torch

    tdtype = dtypes.TORCH_BY_SHORT[plan.dtype]
    channels, height, width = (int(d) for d in record["image_size"])
    g = torch.Generator().manual_seed(seed)
    feeds = [{"pixel_values": from_torch((torch.rand(b, channels, height, width, generator=g)
                                          * 3 - 1).to(tdtype))} for b in IMAGE_SAMPLES]
    sizes = " and ".join(f"batch {b} x {channels}x{height}x{width} pixels" for b in IMAGE_SAMPLES)
    dt = dtypes.canonical(str(tdtype).removeprefix("torch."))
    return _encoder_side(plan, name, record, model, dropin, feeds, sizes,
                         [("pixel_values", dt, [-1, channels, height, width])], trt_ok=trt_ok)


def _encoder_side(plan: _Plan, name: str, record: Mapping, model, dropin, feeds, sizes: str,
                  io, *, trt_ok: bool) -> _Side:
    """A text or image encoder's side: each feed through the PyTorch component and the drop-in
    (and the engine where built), the declared reads compared."""
    import torch

    from qkrope.runtime.inputs import from_torch, to_torch
    from qkrope.stages import hidden_index, output_name

    reads = _reads(record, plan.family, name, plan.record["pipeline"])
    inputs = list(record["inputs"])
    outputs = [output_name(r) for r in reads]
    hidden = any(hidden_index(r) is not None for r in reads)

    def pick(result) -> dict:
        got = {}
        for read, out in zip(reads, outputs):
            k = hidden_index(read)
            t = result.hidden_states[k] if k is not None else getattr(result, read)
            got[out] = from_torch(t).astype("float32")
        return got

    def call(module, feed):
        kwargs = {k: to_torch(feed[k]) for k in inputs}
        with torch.no_grad():
            return pick(module(**kwargs, output_hidden_states=hidden, return_dict=True))

    side = _Side("", io, feeds, sizes,
                 reference=lambda feed: call(model, feed), dropin=lambda feed: call(dropin, feed),
                 single_graph=record["graphs"]["encode"]["file"])
    engines = _engines(plan.out_dir / name, record)
    if engines and trt_ok:
        run_graph = _trt_graphs(engines)
        side.tensorrt = lambda feed: {
            o: from_torch(v).astype("float32") for o, v in zip(
                outputs, run_graph("encode", {k: to_torch(feed[k]) for k in inputs}, record))}
    elif engines:
        side.tensorrt_note = (f"{', '.join(p.name for p in engines.values())} not compared: "
                              f"{_tensorrt_ready()[1]}")
    return side


def _vae_sides(plan: _Plan, name: str, record: Mapping, model, dropin, *, seed: int,
               trt_ok: bool) -> list[_Side]:
    """The VAE's decode, and its encode where the export holds an encoder graph."""
    sides = [_vae_side(plan, name, record, model, dropin, "decode", seed=seed, trt_ok=trt_ok)]
    if "encode" in record["graphs"]:
        sides.append(_vae_side(plan, name, record, model, dropin, "encode", seed=seed,
                               trt_ok=trt_ok))
    return sides


def _spatial_factor(model, channels: int, causal: bool, dtype) -> int:
    """Pixels per latent along a side: the reference's own decode of a 2 x 2 latent."""
    import torch

    z = torch.zeros((1, channels, 1, 2, 2) if causal else (1, channels, 2, 2), dtype=dtype)
    with torch.no_grad():
        return int(model.decode(z).sample.shape[-1]) // 2


def _vae_side(plan: _Plan, name: str, record: Mapping, model, dropin, coder: str, *,
              seed: int, trt_ok: bool) -> _Side:
    """``coder`` "decode": latents at :data:`VAE_SAMPLES` (x :data:`CAUSAL_FRAMES` latent
    frames); "encode": images of those latent sizes times the VAE's pixels per latent (a causal
    VAE: the first frame and two chunks of the next-chunk graph's frames)."""
    import torch

    from qkrope import dtypes
    from qkrope.runtime.inputs import from_torch, to_torch

    tdtype = dtypes.TORCH_BY_SHORT[plan.dtype]
    graphs = record["graphs"]
    causal = record["layout"] == "causal-video"
    config = model.config
    latent_channels = int(config.z_dim if causal else config.latent_channels)
    decoder = coder == "decode"
    first, step = graphs[coder], graphs.get(f"{coder}_next")
    x_name, y_name = first["inputs"][0], first["outputs"][0]
    if decoder:
        channels, scale, frames = latent_channels, 1, CAUSAL_FRAMES
    else:
        channels = int(config.get("in_channels") or config.get("input_channels") or 3)
        scale = _spatial_factor(model, latent_channels, causal, tdtype)
        frames = 1 + 2 * int(step.get("frames", 1)) if causal else 1
    g = torch.Generator().manual_seed(seed + (0 if decoder else 1))
    feeds, sizes = [], []
    for batch, height, width in VAE_SAMPLES:
        hw = (height * scale, width * scale)
        shape = (batch, channels, frames, *hw) if causal else (batch, channels, *hw)
        feeds.append({x_name: from_torch(torch.randn(*shape, generator=g).to(tdtype))})
        sizes.append(f"batch {batch} x {hw[0]}x{hw[1]} {'latents' if decoder else 'pixels'}"
                     + (f" x {frames} {'latent ' if decoder else ''}frames" if causal else ""))

    def result(out):
        if decoder:
            return out.sample
        return out.latent_dist.parameters

    def reference(feed):
        with torch.no_grad():
            got = result(getattr(model, coder)(to_torch(feed[x_name]), return_dict=True))
        return {y_name: from_torch(got).astype("float32")}

    def run_dropin(feed):
        got = result(getattr(dropin, coder)(to_torch(feed[x_name])))
        return {y_name: from_torch(got).astype("float32")}

    dt = dtypes.canonical(str(tdtype).removeprefix("torch."))
    loop = (f" ({coder} on the first {'latent frame' if decoder else 'frame'}, {coder}_next "
            f"on each next {'one' if decoder else 'chunk'}, the feature cache passed between "
            f"them as the drop-in passes it)") if causal else ""
    side = _Side("", [(x_name, dt, [-1, channels, -1, -1, -1] if causal
                       else [-1, channels, -1, -1])], feeds, " and ".join(sizes) + loop,
                 reference=reference, dropin=run_dropin,
                 single_graph=None if causal else first["file"], label=coder)
    engines = _engines(plan.out_dir / name, record, [coder, f"{coder}_next"])
    if engines and trt_ok:
        run_graph = _trt_graphs(engines)

        def run_trt(feed):
            x = to_torch(feed[x_name]).to(tdtype)
            if not causal:
                return {y_name: from_torch(run_graph(coder, {x_name: x}, record)[0])
                        .astype("float32")}
            out, *cache = run_graph(coder, {x_name: x[:, :, :1]}, record)
            parts, size = [out], int(step.get("frames", 1))
            for start in range(1, 1 + (x.shape[2] - 1) // size * size, size):
                feeds_i = {step["inputs"][0]: x[:, :, start:start + size]}
                feeds_i.update(zip(step["inputs"][1:], (c.to(tdtype) for c in cache)))
                out, *cache = run_graph(f"{coder}_next", feeds_i, record)
                parts.append(out)
            return {y_name: from_torch(torch.cat(parts, 2)).astype("float32")}
        side.tensorrt = run_trt
    elif engines:
        side.tensorrt_note = (f"{', '.join(p.name for p in engines.values())} not compared: "
                              f"{_tensorrt_ready()[1]}")
    return side


def _engines(folder: Path, record: Mapping,
             graphs: Sequence[str] | None = None) -> dict[str, Path]:
    """The engines ``qkrope build OUT_DIR`` wrote beside a stage's graphs (graph -> path; those
    of ``graphs`` the record holds), when every one has one; named after the graph files, never
    read from a JSON file."""
    from qkrope.stages import engine_name

    found = {g: folder / engine_name(spec["file"])
             for g, spec in record["graphs"].items() if graphs is None or g in graphs}
    return found if all(p.is_file() for p in found.values()) else {}


def _trt_graphs(engines: Mapping[str, Path]):
    """``run(graph, feeds, record) -> outputs in the graph's order``: each engine through
    polygraphy's TrtRunner (torch tensors on the GPU in and out), activated on first use."""
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    from polygraphy.backend.common import BytesFromPath

    runners: dict[str, Any] = {}

    def run(graph: str, feeds: Mapping[str, Any], record: Mapping) -> list:
        if graph not in runners:
            runner = TrtRunner(EngineFromBytes(BytesFromPath(str(engines[graph]))))
            runner.activate()
            runners[graph] = runner
        outs = runners[graph].infer({k: v.cuda().contiguous() for k, v in feeds.items()})
        return [outs[o].float().cpu() for o in record["graphs"][graph]["outputs"]]

    return run


def _compare(plan: _Plan, name: str, kind: str, side: _Side, *, out) -> StageResult:
    """polygraphy's Comparator over the drop-in (and TensorRT) runners and the PyTorch
    reference; the stage's rows and its files in the workdir."""
    import numpy as np
    from polygraphy.comparator import Comparator

    try:  # as qkrope check imports it (CompareFunc.simple before polygraphy 0.53)
        from polygraphy.comparator.compare import SimpleCompareFunc
    except ImportError:  # pragma: no cover - older polygraphy
        from polygraphy.comparator import CompareFunc

        SimpleCompareFunc = CompareFunc.simple
    from polygraphy.comparator.struct import IterationResult, RunResults
    from polygraphy.json import save_json

    from ._polygraphy import comparator_runner
    from .check import _json_feed, compare_arrays, tolerances
    from .measure import format_check_table

    runners = [comparator_runner("onnxrt-runner", "qkrope-stage-dropin", side.inputs,
                                 side.dropin)]
    if side.tensorrt is not None:
        runners.append(comparator_runner("trt-runner", "qkrope-stage-tensorrt", side.inputs,
                                         side.tensorrt))
    results = Comparator.run(runners, data_loader=side.feeds)
    references = [side.reference(feed) for feed in side.feeds]
    outputs = list(references[0])
    scale = {o: np.array([max(float(np.max(np.abs(r[o]))) if r[o].size else 0.0
                              for r in references)], dtype=np.float32) for o in outputs}
    bounds = {o: atol for o, (atol, _rtol) in
              tolerances(plan.dtype, scale, model="transformer").items()}
    converted = RunResults()
    for runner_name, iterations in results:
        converted.append((runner_name, [IterationResult(
            {k: np.asarray(v, dtype=np.float32) for k, v in it.items()},
            runner_name=runner_name) for it in iterations]))
    ref_results = RunResults()
    ref_results.append(("pytorch", [IterationResult(r, runner_name="pytorch")
                                    for r in references]))
    converted.append(("pytorch", ref_results["pytorch"]))
    compare = SimpleCompareFunc(atol=bounds, rtol={o: 0.0 for o in outputs},
                                check_error_stat="max")
    ref_index = len(converted) - 1
    pairs = [(i, ref_index) for i in range(ref_index)]
    if side.tensorrt is not None:
        pairs.append((1, 0))  # TensorRT vs ONNX Runtime
    accuracy = Comparator.compare_accuracy(converted, compare_func=compare, comparisons=pairs)
    rows = []
    for a, b in pairs:
        name_a, name_b = converted[a][0], converted[b][0]
        for output in outputs:
            per = [compare_arrays(output, got[output], ref[output], bounds[output], 0.0,
                                  SHORT.get(name_a, name_a), SHORT.get(name_b, name_b))
                   for got, ref in zip(converted[a][1], converted[b][1])]
            worst = max(per, key=lambda r: r.max_abs)
            worst.passed = all(r.passed for r in per)
            rows.append(worst)
    passed = bool(accuracy) and all(r.passed for r in rows)
    print(format_check_table(rows), file=out)

    work = plan.workdir / name / side.label if side.label else plan.workdir / name
    work.mkdir(parents=True, exist_ok=True)
    save_json([_json_feed(f) for f in side.feeds], str(work / "inputs.json"))
    ref_results.save(str(work / "reference_outputs.json"))
    converted.save(str(work / "run_results.json"))
    script = work / "polygraphy_cmd.sh"
    if side.single_graph is not None:
        import shlex

        atol = " ".join(f"{o}:{bounds[o]:.6g}" for o in outputs)
        rtol = " ".join(f"{o}:0" for o in outputs)
        cmd = shlex.join(["polygraphy", "run", str(plan.out_dir / name / side.single_graph),
                          "--onnxrt", "--load-inputs", str(work / "inputs.json"),
                          "--load-outputs", str(work / "reference_outputs.json")])
        script.write_text(f"#!/bin/sh\n{cmd} --atol {atol} --rtol {rtol} "
                          f"--check-error-stat max\n")
        print(f"polygraphy inputs/outputs: {work}/; rerun by hand: sh {script}", file=out)
    else:
        script.unlink(missing_ok=True)
        print(f"polygraphy inputs/outputs: {work}/ ({side.label} and {side.label}_next run "
              f"in a loop with the feature cache: no single polygraphy run redoes it)", file=out)
    print(f"{name}{' ' + side.label if side.label else ''}: "
          f"{'PASSED' if passed else 'FAILED'} (max abs error "
          f"{max((r.max_abs for r in rows), default=0.0):.3g}, bound "
          f"{min(bounds.values(), default=0.0):.3g})", file=out)
    return StageResult(name, kind, side.graphs, rows, passed)


__all__ = ["check_pipeline", "plan_check", "read_pipeline_record", "stages_of", "select_stage",
           "is_pipeline_export", "format_summary", "run", "StageResult", "TEXT_SAMPLES",
           "VAE_SAMPLES", "CAUSAL_FRAMES"]
