"""``qkrope export --model pipeline``: a saved diffusers pipeline folder to a folder of the
same layout in which every model component is an export (:func:`export_pipeline`).

    qkrope export --model pipeline --diffusers Qwen-Image -o qwen-image-onnx
    python -c "import qkrope.runtime, diffusers; \\
        diffusers.DiffusionPipeline.from_pretrained('qwen-image-onnx')"

The output folder is diffusers-loadable: ``model_index.json`` keeps the pipeline class and
names each exported component as ``["qkrope.runtime", <class>]`` (the transformer as the
family's drop-in, saved as ``pipe.save_pretrained`` saves it; text encoders as
``TextEncoderExport``, image encoders as ``ImageEncoderExport``, the VAE as ``VaeExport``:
:data:`qkrope.stages.DROPIN_CLASSES`); the scheduler, tokenizers and processors are copied as
they are. What is exported of each encoder and the VAE is what the family declares its
pipeline reads (the record's ``stages``, qkrope.stages); a model component it does not declare
(an image encoder of a family that declares none) is refused in one line before anything is
written, and so is a pipeline class it does not declare (an edit pipeline whose encoder reads
images).

Trust: the folder's JSON names the classes; each is looked up by name in diffusers or
transformers (:data:`qkrope.stages.MODEL_LIBRARIES`), never imported from a module the folder
names, and only regular files are copied (a link in the folder is refused). The whole output is
written in a staging folder beside it and renamed into place: a failure leaves any previous
output as it was. An existing output folder is replaced only when it is empty or a previous
pipeline export (its :data:`qkrope.stages.PIPELINE_FILE`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkrope import families
from qkrope._fileio import staged_outputs, write_json_atomic
from qkrope.errors import InputError
from qkrope.stages import (MODEL_LIBRARIES, PIPELINE_FILE, PIPELINE_FORMAT, STAGE_FILE,
                           served_pipelines, stage_record, stages_for)


#: the first opset whose Conv takes bfloat16 (a bf16 VAE's graphs need it)
BF16_CONV_OPSET = 22


@dataclass(frozen=True)
class PipelineExport:
    """What :func:`export_pipeline` wrote: the folder, the dtype, and each component's kind
    (``transformer``, ``text_encoder``, ``vae`` or ``copied``)."""

    out: Path
    dtype: str
    components: dict


def _read_index(folder: Path) -> dict:
    path = folder / "model_index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"--diffusers {folder} has no model_index.json, so it is no saved "
                         f"diffusers pipeline. Fix: pass the folder pipe.save_pretrained(...) "
                         f"wrote (for one transformer: --model transformer)") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} cannot be read as JSON ({type(exc).__name__}). Fix: pass a "
                         f"saved diffusers pipeline folder") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise InputError(f"{path} names no pipeline class (_class_name). Fix: pass a saved "
                         f"diffusers pipeline folder")
    return index


def _components(index: dict) -> dict[str, tuple[str, str]]:
    """model_index.json's components: name -> (library, class), the unset ones left out."""
    return {k: (v[0], v[1]) for k, v in index.items() if not k.startswith("_")
            and isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
            and isinstance(v[1], str)}


def _model_class(library: str, name: str):
    """The class ``name`` of ``library`` where it is a model (diffusers' ModelMixin,
    transformers' PreTrainedModel), else None; only the two libraries are looked in."""
    if library not in MODEL_LIBRARIES or not name.isidentifier():
        return None
    import importlib

    module = importlib.import_module(library)
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        return None
    base = (importlib.import_module("diffusers").ModelMixin if library == "diffusers"
            else importlib.import_module("transformers").PreTrainedModel)
    return cls if issubclass(cls, base) else None


def component_config(folder: Path) -> dict:
    """``folder/config.json`` as a dict ({} where unreadable or not an object)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def plan(pipeline_dir: str | os.PathLike) -> tuple[Any, dict[str, str], dict]:
    """Every check that needs no weights: the family (of the ``transformer`` component), each
    component's kind, and the model_index. One line for what cannot be exported."""
    src = Path(pipeline_dir)
    index = _read_index(src)
    pipeline = index["_class_name"]
    comps = _components(index)
    records = {k: families.by_class(component_config(src / k).get("_class_name")) for k in comps}
    transformers = [k for k, r in records.items() if r is not None]
    if "transformer" not in transformers:
        cls = component_config(src / "transformer").get("_class_name")
        if isinstance(cls, str):
            families.family_of({"_class_name": cls}, source=f"{src / 'transformer'}/config.json")
        raise InputError(f"{src} ({pipeline}) has no transformer component of a family qkrope "
                         f"exports. Fix: pass a pipeline folder of "
                         f"{', '.join(sorted({r.short for r in families.records()}))}")
    record = records["transformer"]
    stages = stages_for(record.stages, pipeline)
    declared = sorted(r.short for r in families.records() if r.stages is not None)
    if record.stages is None:
        raise InputError(f"{record.short}: qkrope does not export its pipeline's text encoders "
                         f"and VAE yet (it does for {', '.join(declared)}). Fix: export its "
                         f"transformer (--model transformer --diffusers {src / 'transformer'}) "
                         f"and run the rest in PyTorch (qkrope generate --transformer)")
    if stages is None:
        served = ", ".join(served_pipelines(record.stages))
        raise InputError(f"{src} is a {pipeline}; qkrope exports the stages of {served} for "
                         f"{record.short} (another pipeline calls its encoders otherwise). "
                         f"Fix: export its transformer "
                         f"(--model transformer) and run the rest in PyTorch")
    kinds: dict[str, str] = {}
    for name, (library, cls) in comps.items():
        if name in transformers:
            if records[name] is not record:
                raise InputError(f"{src / name} is a {records[name].short} transformer beside a "
                                 f"{record.short} one. Fix: pass a pipeline of one family")
            kinds[name] = "transformer"
        elif name in stages.text_encoders:
            kinds[name] = "text_encoder"
        elif name in stages.image_encoders:
            kinds[name] = "image_encoder"
        elif name == "vae" and stages.vae is not None:
            kinds[name] = "vae"
        elif _model_class(library, cls) is not None:
            raise InputError(f"{src / name} is a model ({cls}) that {record.short}'s pipeline "
                             f"stages do not declare, so it cannot be exported. Fix: save the "
                             f"pipeline without it ({name}=None), or export the transformer "
                             f"alone (--model transformer)")
        else:
            kinds[name] = "copied"
        if kinds[name] != "copied" and _model_class(library, cls) is None:
            raise InputError(f"{src}/model_index.json names {name} as {library}.{cls}, which is "
                             f"no model class of {' or '.join(MODEL_LIBRARIES)}. Fix: pass a "
                             f"pipeline folder saved by diffusers")
    missing = [c for c in stages.components() if c not in kinds]
    if missing:
        raise InputError(f"{src} lacks {', '.join(missing)}, which {pipeline} reads. Fix: "
                         f"pass the whole saved pipeline folder")
    return record, kinds, index


def check_out(src: Path, out: Path) -> None:
    """The output folder may be replaced: not the input nor inside it, and empty or a previous
    pipeline export."""
    try:
        s, o = src.resolve(), out.resolve()
    except (OSError, RuntimeError):
        s, o = src.absolute(), out.absolute()
    if o == s or s in o.parents or o in s.parents:
        raise InputError(f"--out {out} overlaps the input pipeline folder {src}. Fix: pass a "
                         f"new folder beside it")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise InputError(f"--out {out} exists and is not a folder. Fix: pass a new folder")
        if any(out.iterdir()) and not (out / PIPELINE_FILE).is_file():
            raise InputError(f"--out {out} holds files that no pipeline export wrote (no "
                             f"{PIPELINE_FILE}); the export replaces the folder whole, so it "
                             f"refuses to remove them. Fix: pass a new or empty folder")


def _copy_tree(src: Path, dst: Path) -> None:
    """A non-model component folder (scheduler, tokenizer), regular files only."""
    dst.mkdir()
    for p in sorted(src.iterdir()):
        if p.is_symlink():
            raise InputError(f"{p} is a symbolic link; the export copies only the files of the "
                             f"pipeline folder. Fix: replace it with the file it points to")
        if p.is_dir():
            _copy_tree(p, dst / p.name)
        elif p.is_file():
            shutil.copyfile(p, dst / p.name)


def _load(library: str, cls_name: str, folder: Path, dtype):
    """The component as from_pretrained(folder, dtype) builds it, streamed: its parameters
    placeholders and its weights read from the folder's safetensors one tensor at a time as
    each graph is written (:mod:`.streamed`; every key checked against the headers first), so
    a 7B text encoder exports in the memory of its largest tensor."""
    from .streamed import skeleton

    return skeleton(_model_class(library, cls_name), folder, dtype=dtype, library=library)


def export_pipeline(pipeline_dir: str | os.PathLike, out: str | os.PathLike, *,
                    dtype: str | None = None, opset: int | None = None,
                    progress: bool = True) -> PipelineExport:
    """Export the saved pipeline in ``pipeline_dir`` to the folder ``out`` (module docstring).
    ``dtype``: of every stage (default: the transformer's checkpoint dtype, as
    ``--model transformer`` chooses it); ``opset``: the transformer's (its default), the
    stages' graphs use the same."""
    import torch

    from qkrope import contract, dtypes
    from qkrope._progress import Steps
    from qkrope.runtime.component import (COMPONENT_FILE, COMPONENT_FORMAT,
                                          COMPONENT_FORMAT_VERSION, LIBRARY)

    from .. import api
    from .text_encoder import export_image_encoder, export_text_encoder
    from .vae import export_vae

    src, out = Path(pipeline_dir), Path(out)
    record, kinds, index = plan(src)
    check_out(src, out)
    if dtype == "bf16" and opset is not None and opset < BF16_CONV_OPSET \
            and stages_for(record.stages, index["_class_name"]).vae is not None:
        raise InputError(f"--opset {opset} with --dtype bf16: ONNX's Conv takes bfloat16 from "
                         f"opset {BF16_CONV_OPSET}, so the VAE cannot be exported. Fix: --opset "
                         f"{BF16_CONV_OPSET}, or leave --opset out")
    comps = _components(index)
    stages = stages_for(record.stages, index["_class_name"])
    dropin = families.hooks(record, "dropin").dropin_class(record).__name__
    steps = Steps("qkrope export --model pipeline", len(kinds), enabled=progress)
    written: dict[str, str] = {}
    with staged_outputs(out.parent, [out.name], flag="--out", inputs=[src]) as staging:
        root = staging.path(out.name)
        root.mkdir()
        new_index = dict(index)
        # the transformers first: their dtype (the checkpoint's by default) is every stage's
        for name in [k for k, v in kinds.items() if v == "transformer"]:
            folder = root / name
            folder.mkdir()
            result = api.export_transformer(src / name, folder / f"{name}.onnx", dtype=dtype,
                                            opset=opset, progress=progress)
            dtype = result.dtype
            files = [Path(p).name for p in result.paths]
            write_json_atomic(folder / COMPONENT_FILE, {
                "format": COMPONENT_FORMAT, "format_version": COMPONENT_FORMAT_VERSION,
                "class": dropin, "model": Path(result.out).name, "files": files,
                "backend": "onnxruntime",
                "dtype": str(dtypes.TORCH_BY_SHORT[dtype]).removeprefix("torch."),
                "cuda_graph": False})
            new_index[name] = [LIBRARY, dropin]
            written[name] = "transformer"
        tdtype = dtypes.TORCH_BY_SHORT[dtype]
        # the stages' graphs: the given opset, else the default; a bf16 graph needs 22, where
        # ONNX's Conv (a VAE's) first takes bfloat16
        graph_opset = opset if opset is not None else (
            max(contract.DEFAULT_OPSET, BF16_CONV_OPSET) if dtype == "bf16"
            else contract.DEFAULT_OPSET)
        if dtype == "bf16" and graph_opset < BF16_CONV_OPSET and stages.vae is not None:
            raise InputError(f"--opset {graph_opset} with --dtype bf16: ONNX's Conv takes "
                             f"bfloat16 from opset {BF16_CONV_OPSET}, so the VAE cannot be "
                             f"exported. Fix: --opset {BF16_CONV_OPSET}, or leave --opset out")
        for name, kind in kinds.items():
            if kind == "transformer":
                continue
            with steps.step(f"{name}: {kind.replace('_', ' ')}"):
                if kind == "copied":
                    if (src / name).is_dir():
                        _copy_tree(src / name, root / name)
                    written[name] = kind
                    continue
                folder = root / name
                folder.mkdir()
                library, cls_name = comps[name]
                model = _load(library, cls_name, src / name, tdtype)
                with torch.no_grad():
                    if kind == "text_encoder":
                        fields = export_text_encoder(model, stages.text_encoders[name], folder,
                                                     opset=graph_opset, dtype=tdtype)
                    elif kind == "image_encoder":
                        fields = export_image_encoder(model, stages.image_encoders[name],
                                                      folder, opset=graph_opset, dtype=tdtype)
                    else:
                        fields = export_vae(model, stages.vae, folder, opset=graph_opset,
                                            dtype=tdtype,
                                            encode=index["_class_name"] in stages.vae.encode)
                del model
                shutil.copyfile(src / name / "config.json", folder / "config.json")
                write_json_atomic(folder / STAGE_FILE, stage_record(
                    dtype=dtype, source={"library": library, "class": cls_name}, **fields))
                new_index[name] = [LIBRARY, fields["class"]]
                written[name] = kind
        write_json_atomic(root / "model_index.json", new_index)
        write_json_atomic(root / PIPELINE_FILE, {
            "format": PIPELINE_FORMAT, "family": record.name, "pipeline": index["_class_name"],
            "dtype": dtype, "components": written})
        staging.commit([out.name])
    return PipelineExport(out, dtype, written)


__all__ = ["PipelineExport", "export_pipeline", "plan", "check_out"]
