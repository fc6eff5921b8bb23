"""``qkrope triton-repo --pipeline OUT_DIR``: one Triton repository serving a pipeline export
(``qkrope export --model pipeline -o OUT_DIR``) from prompt to pixels, and its top model
(:class:`TritonPythonModel`), which runs the pipeline inside the server.

The top model runs the pipeline itself, the class its ``model_index.json`` names, with its own
tokenizers and scheduler, through :func:`qkrope.apps.generate.generate`, so a served prompt
takes exactly the path ``qkrope generate OUT_DIR`` takes; its model components are the same
drop-ins over the server's models (:mod:`qkrope.runtime.stages.served`). The output ``pixels``
is UINT8, ``[batch, H, W, 3]`` (images) or ``[batch, frames, H, W, 3]`` (video): the
pipeline's ``output_type="np"`` values rounded as diffusers rounds them to PIL
(``round(x * 255)``), so they equal the files ``generate`` saves. A request whose values the
pipeline or an export refuses gets that one-line message (its flags named as the request's
inputs) as an ``INVALID_ARG`` error; the model stays loaded.

Layout written (``NAME``: ``--name``, by default OUT_DIR's folder name)::

    REPO/NAME/                          the top model (Python backend): the prompt in, UINT8
      config.pbtxt                      pixels out; the request's options the pipeline's call
                                        takes (:data:`~.served.REQUEST_OPTIONS`), each optional
      1/model.py                        imports qkrope.apps.triton_pipeline.TritonPythonModel
      1/pipeline/                       OUT_DIR less its graphs: model_index.json, scheduler,
                                        tokenizers, processors, each stage's record and config
                                        (and a VAE's module tensors, tensors.safetensors)
      1/qkrope.files.json               what 1/pipeline/ holds (what --force may replace)
    REPO/NAME_<component>_<graph>/      one model per stage graph: the text and image
                                        encoders' encode, the VAE's decode (encode where
                                        exported; a causal video
                                        VAE's decode_next too), on Triton's onnxruntime backend
                                        (1/model.onnx with its data) or, --backend tensorrt, as
                                        the engines `qkrope build OUT_DIR` wrote (1/model.plan)
    REPO/NAME_<transformer component>/  the transformer's ensemble, as `qkrope triton-repo`
                                        writes it for one export (its _rope, _onnx or _trt
                                        steps beside it)

Every graph, engine and module-tensor file is copied and then hashed against the record it
was checked with (the stage record's sha256, the export's sidecar), so a source rewritten
meanwhile is never served. All
model directories are assembled in one staging folder and swapped in together, the top model
last (:func:`qkrope.runtime.triton._write_models`); ``force`` replaces only model directories
that hold nothing but what qkrope writes.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkrope.errors import QkropeError
from qkrope.stages import PIPELINE_FILE, STAGE_FILE, TENSORS_FILE

from qkrope.runtime import triton as tr
from qkrope.runtime.component import COMPONENT_FILE
from qkrope.runtime.runner_triton import one_line
from qkrope.runtime.stages.component import CLASSES, CONFIG_FILE, ComponentError, \
    read_stage_record
from qkrope.runtime.stages.served import PIPELINE_FOLDER, PIXELS, PLAN_PARAMETER, PROMPT, \
    REQUEST_OPTIONS, served_components, served_plan

#: the module a model_index.json entry names for qkrope's components
RUNTIME_MODULE = "qkrope.runtime"
#: the top model's 1/model.py: the whole of it
MODEL_PY = ('"""The pipeline model of `qkrope triton-repo --pipeline` (its code is qkrope\'s: '
            'qkrope.apps.triton_pipeline)."""\n\n'
            'from qkrope.apps.triton_pipeline import TritonPythonModel  # noqa: F401\n')
BACKENDS = ("onnxruntime", "tensorrt")


@dataclass
class PipelineRepo:
    model_dir: Path            # the top model
    models: list[Path]         # every model directory written
    command: str               # the tritonserver command
    inputs: list[str]          # the top model's inputs (prompt first)


def _fix_export(folder: Path) -> str:
    return (f"Fix: pass the folder `qkrope export --model pipeline --diffusers PIPELINE_DIR -o "
            f"{folder}` wrote")


def graph_specs(onnx_path: Path) -> tr.Specs:
    """Triton I/O of an ONNX graph from the graph itself (no data read): names, dtypes, and
    each dimension that is not a fixed size as -1."""
    import onnx

    from qkrope import dtypes

    model = onnx.load(str(onnx_path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}

    def one(v) -> tuple[str, str, list[int]]:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        return v.name, tr.triton_dtype(dtypes.NAME_BY_ONNX[t.elem_type]), dims

    return {"input": [one(v) for v in model.graph.input if v.name not in inits],
            "output": [one(v) for v in model.graph.output]}


def _stage_config(name: str, specs: tr.Specs, backend: str, serving: tr.Serving) -> str:
    if backend == "onnxruntime":
        bf16 = any(dt == "TYPE_BF16" for io in specs.values() for _, dt, _ in io)
        return tr.render_onnx_config(name, specs, serving, gpu=bf16)
    return tr.to_text(tr._config(name, specs, serving, "KIND_GPU", platform="tensorrt_plan",
                                 default_model_filename="model.plan"))


def _stage_models(folder: Path, component: str, record: dict, prefix: str, backend: str,
                  serving: tr.Serving, link: bool, models: dict, inputs: list) -> dict:
    """Add one model per graph of a stage; returns graph -> served model name."""
    files = record["files"]
    engines = {}
    if backend == "tensorrt":
        from qkrope.runtime.stages.engines import built_engines

        try:  # each graph's engine, named after it, built from it as exported now
            engines = built_engines(folder, record)
        except QkropeError as exc:
            raise tr.TritonRepoError(f"--backend tensorrt: {exc}") from None
    served = {}
    for graph, entry in record["graphs"].items():
        model = f"{prefix}_{component}_{graph}"
        onnx_path = folder / entry["file"]
        specs = graph_specs(onnx_path)
        text = _stage_config(model, specs, backend, serving)
        if backend == "onnxruntime":
            data = tr._onnx_files(onnx_path)
            sources = [(onnx_path, "model.onnx")] + [(f, f.name) for f in data]
            sha256 = {src: (files.get(src.name) or {}).get("sha256") for src, _ in sources}
        else:
            engine, digest = engines[graph]
            sources = [(engine, "model.plan")]
            sha256 = {engine: digest}
        for src, _ in sources:
            if not sha256.get(src):
                raise tr.TritonRepoError(f"{src} has no sha256 in its record, so its copy "
                                         f"cannot be checked. {_fix_export(folder.parent)}")

        def fill(d: Path, sources=sources, sha256=sha256, text=text) -> None:
            for src, dst in sources:
                tr.copy_checked(src, d / "1" / dst, sha256[src], link=link)
            extra = [dst for _, dst in sources if dst not in ("model.onnx", "model.plan")]
            if extra:  # the graph's data files: named so --force knows them as qkrope's
                (d / "1" / tr.FILES_MANIFEST).write_text(json.dumps(extra) + "\n",
                                                         encoding="utf-8")
            (d / "config.pbtxt").write_text(text, encoding="utf-8")

        models[model] = fill
        inputs.extend(src for src, _ in sources)
        served[graph] = model
    return served


def _pipeline_files(pipeline_dir: Path, components: dict[str, str]) -> list[str]:
    """What the top model's 1/pipeline/ copies (paths relative to ``pipeline_dir``): every
    regular file but the model components'; of a stage component only its record, config and
    module tensors (:data:`qkrope.stages.TENSORS_FILE`, which the drop-in offers itself).
    A link is refused (nothing outside the export is followed)."""
    out = []
    for root, dirs, names in os.walk(pipeline_dir):
        rel = Path(root).relative_to(pipeline_dir)
        top = rel.parts[0] if rel.parts else None
        for n in sorted(dirs + names):
            if (Path(root) / n).is_symlink():
                raise tr.TritonRepoError(f"{Path(root) / n} is a link; the pipeline export "
                                         f"holds plain files only. {_fix_export(pipeline_dir)}")
        dirs.sort()
        if top in components:
            if components[top] in CLASSES and len(rel.parts) == 1:
                out += [f"{top}/{n}" for n in (CONFIG_FILE, STAGE_FILE, TENSORS_FILE)
                        if n in names]
            dirs[:] = []
            continue
        out += [str(rel / n) if rel.parts else n for n in sorted(names)]
    return out


def _top_config(name: str, plan, serving: tr.Serving, components: dict) -> tuple[str, list]:
    pb = tr._pb()
    cfg = pb.ModelConfig(name=name, backend="python", max_batch_size=0)
    offered = [PROMPT] + [k for k, (_, _, param) in REQUEST_OPTIONS.items()
                          if param is None or param in plan.params]
    for key in offered:
        dtype = "TYPE_STRING" if key == PROMPT else REQUEST_OPTIONS[key][0]
        cfg.input.add(name=key, data_type=pb.DataType.Value(dtype), dims=[1],
                      optional=key != PROMPT)
    rank = 5 if plan.video else 4
    cfg.output.add(name=PIXELS, data_type=pb.DataType.Value("TYPE_UINT8"),
                   dims=[-1] * (rank - 1) + [3])
    cfg.instance_group.add(count=serving.instances, kind=pb.ModelInstanceGroup.Kind.KIND_CPU)
    cfg.parameters[PLAN_PARAMETER].string_value = served_plan(components)
    return tr.to_text(cfg), offered


def write_pipeline_repository(pipeline_dir: os.PathLike | str, repo: os.PathLike | str, *,
                              name: str | None = None, backend: str = "onnxruntime",
                              plugin: os.PathLike | str | None = None,
                              serving: tr.Serving | None = None, force: bool = False,
                              link: bool = False, check_plugin_hash: bool = True,
                              allow_host_code: bool = False) -> PipelineRepo:
    """Write the repository of the module docstring; everything is checked before the first
    file is written."""
    from .generate import read_pipeline

    pipeline_dir, repo = Path(pipeline_dir), Path(repo)
    serving = serving or tr.Serving()
    if backend not in BACKENDS:
        raise tr.TritonRepoError(f"--backend {backend!r}: a pipeline is served with one of "
                                 f"{list(BACKENDS)}")
    if not (pipeline_dir / PIPELINE_FILE).is_file():
        raise tr.TritonRepoError(f"{pipeline_dir} has no {PIPELINE_FILE}, so it is no pipeline "
                                 f"export. {_fix_export(pipeline_dir)}")
    if serving.max_batch_size:
        raise tr.TritonRepoError("--max-batch-size: a pipeline's models take the batch as a "
                                 "dimension of their inputs (the top model sends whole "
                                 "requests). Fix: leave --max-batch-size out")
    name = name or pipeline_dir.resolve().name
    tr._check_name(name)
    if not name.isascii():
        raise tr.TritonRepoError(f"model name {name!r}: the pipeline model runs in Triton's "
                                 f"Python backend, which cannot load from a non-ASCII folder "
                                 f"name. Fix: pass an ASCII --name")
    try:
        index = json.loads((pipeline_dir / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise tr.TritonRepoError(f"{pipeline_dir}/model_index.json cannot be read. "
                                 f"{_fix_export(pipeline_dir)}") from None
    components = {k: v[1] for k, v in index.items() if isinstance(v, list) and len(v) == 2
                  and v[0] == RUNTIME_MODULE and isinstance(v[1], str)}
    plan = read_pipeline(pipeline_dir)
    models: dict[str, Any] = {}
    inputs: list = []
    entries: dict[str, Any] = {}
    checked: dict[str, str] = {}  # a copied file -> the sha256 its stage record gives
    for component, cls in components.items():
        folder = pipeline_dir / component
        if cls in CLASSES:
            try:
                record = read_stage_record(folder)
            except Exception as exc:  # noqa: BLE001 - the record's one-line refusal
                raise tr.TritonRepoError(str(exc)) from None
            entries[component] = {"class": cls, "models": _stage_models(
                folder, component, record, name, backend, serving, link, models, inputs)}
            facts = record["files"].get(TENSORS_FILE)
            if isinstance(facts, dict):  # copied for the top model's drop-in, checked
                if not facts.get("sha256"):
                    raise tr.TritonRepoError(f"{folder / TENSORS_FILE} has no sha256 in its "
                                             f"record, so its copy cannot be checked. "
                                             f"{_fix_export(pipeline_dir)}")
                checked[f"{component}/{TENSORS_FILE}"] = str(facts["sha256"])
                inputs.append(folder / TENSORS_FILE)
            continue
        try:
            model = json.loads((folder / COMPONENT_FILE).read_text(encoding="utf-8"))["model"]
        except (OSError, ValueError, KeyError, TypeError):
            raise tr.TritonRepoError(f"{folder} has no {COMPONENT_FILE} naming its export. "
                                     f"{_fix_export(pipeline_dir)}") from None
        onnx_path = folder / Path(str(model)).name
        served = f"{name}_{component}"
        if backend == "onnxruntime":
            parts = tr.onnx_models(onnx_path, name=served, serving=serving, link=link)
        else:
            engine = onnx_path.with_suffix(".engine")
            if not engine.is_file():
                raise tr.TritonRepoError(f"{engine} is missing, which --backend tensorrt "
                                         f"serves. Fix: qkrope build {pipeline_dir}")
            parts = tr.engine_models(engine, plugin=plugin, name=served, serving=serving,
                                     check_plugin_hash=check_plugin_hash, link=link,
                                     allow_host_code=allow_host_code)
        models.update(parts.models)
        inputs.extend(parts.inputs)
        entries[component] = {"model": served}
    if not any("model" in e for e in entries.values()):
        raise tr.TritonRepoError(f"{pipeline_dir} names no exported transformer in its "
                                 f"model_index.json. {_fix_export(pipeline_dir)}")
    files = _pipeline_files(pipeline_dir, components)
    text, offered = _top_config(name, plan, serving, entries)

    def fill_top(d: Path) -> None:
        (d / "config.pbtxt").write_text(text, encoding="utf-8")
        (d / "1" / "model.py").write_text(MODEL_PY, encoding="utf-8")
        for rel in files:
            dst = d / "1" / PIPELINE_FOLDER / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if rel in checked:
                tr.copy_checked(pipeline_dir / rel, dst, checked[rel])
            else:
                shutil.copyfile(pipeline_dir / rel, dst)
        listed = [f"{PIPELINE_FOLDER}/{rel}" for rel in files]
        (d / "1" / tr.FILES_MANIFEST).write_text(json.dumps(listed, indent=1) + "\n",
                                                 encoding="utf-8")

    models[name] = fill_top  # last: swapped in after every model it calls
    oversized = [m for m in models if len(m.encode()) > 255]
    if oversized:
        raise tr.TritonRepoError(f"the model name {oversized[0][:40]!r}... is "
                                 f"{len(oversized[0].encode())} bytes; a Triton model name is a "
                                 f"folder name, at most 255. Fix: pass a shorter --name")
    tr._write_models(repo, models, force=force, inputs=[pipeline_dir, *inputs])
    return PipelineRepo(repo / name, [repo / m for m in models],
                        f"tritonserver --model-repository={repo.resolve()}", offered)



# --------------------------------------------------------------------------------------------
# The top model (its 1/model.py imports it; it runs inside the server)
# --------------------------------------------------------------------------------------------

def pixels(output) -> Any:
    """``[batch, (frames,) H, W, 3]`` uint8 of a pipeline's ``output_type="np"`` output (its
    ``images`` or ``frames``), rounded as diffusers' ``numpy_to_pil`` rounds."""
    import numpy as np

    values = getattr(output, "frames", None)
    if values is None:
        values = output.images
    values = np.asarray(values)
    return (values * 255).round().astype(np.uint8)


def in_request_terms(message: str) -> str:
    """``message`` (a refusal of :func:`qkrope.apps.generate.generate`, which names its command
    line flags) with each flag named as the request input it is (``--steps`` -> ``steps``)."""
    from .generate import _options

    by_param = {param: name for name, (_, _, param) in REQUEST_OPTIONS.items() if param}
    words = {flag: by_param[param] for flag, param in _options(*[None] * 7)
             if param in by_param}
    words.update({"--seed": "seed", "--prompt": PROMPT})
    for flag in sorted(words, key=len, reverse=True):
        message = message.replace(flag, words[flag])
    return message


class TritonPythonModel:
    """The top model of a pipeline repository (module docstring)."""

    def initialize(self, args: Mapping[str, str]) -> None:
        import triton_python_backend_utils as pb_utils

        from qkrope.runtime.runner_triton import DEFAULT_TIMEOUT_S, IN_SERVER, TritonRunner, _Bls

        from .generate import load_pipeline

        self.pb = pb_utils
        config = json.loads(args["model_config"])
        here = Path(args["model_repository"])
        self.folder = here / str(args["model_version"]) / PIPELINE_FOLDER
        plan = json.loads(config["parameters"][PLAN_PARAMETER]["string_value"])
        repository = str(here.parent)
        transport = _Bls(repository, DEFAULT_TIMEOUT_S, {})

        def runner_of(model: str):
            return TritonRunner(repository, model, protocol=IN_SERVER)

        self.served = served_components(self.folder, plan, transport, runner_of)
        self.inputs = [t["name"] for t in config["input"]]
        self.pipe = load_pipeline(self.folder, self.served, device="cpu")

    def _request_options(self, request) -> dict:
        from qkrope.errors import InputError

        text = self.pb.get_input_tensor_by_name(request, PROMPT)
        options: dict[str, Any] = {}
        for name in self.inputs:
            t = self.pb.get_input_tensor_by_name(request, name)
            if t is None:
                continue
            values = t.as_numpy().reshape(-1)
            if values.size != 1:
                raise InputError(f"input {name} holds {values.size} values; send one")
            value = values[0]
            if name == PROMPT or REQUEST_OPTIONS.get(name, ("",))[0] == "TYPE_STRING":
                value = value.decode("utf-8") if isinstance(value, bytes) else str(value)
            elif REQUEST_OPTIONS[name][0] == "TYPE_FP32":
                value = float(value)
            else:
                value = int(value)
            options[PROMPT if name == PROMPT else REQUEST_OPTIONS[name][1]] = value
        if text is None:
            raise InputError("the request has no prompt; send the BYTES input 'prompt'")
        return options

    def execute(self, requests):
        from .generate import generate

        responses = []
        for request in requests:
            try:
                options = self._request_options(request)
                output, _times, _pipe = generate(
                    self.folder, None, options.pop(PROMPT), served=self.served, pipe=self.pipe,
                    device="cpu", output_type="np", log=lambda *_: None, **options)
                responses.append(self.pb.InferenceResponse(
                    output_tensors=[self.pb.Tensor(PIXELS, pixels(output))]))
            except (QkropeError, ComponentError, ValueError) as exc:
                # qkrope's refusals, and the pipeline's own check of its inputs (ValueError:
                # a height its VAE cannot take): the request's fault, said in one line
                responses.append(self._error(in_request_terms(str(exc)), "INVALID_ARG"))
            except Exception as exc:  # noqa: BLE001 - one request fails; the model serves on
                responses.append(self._error(f"{type(exc).__name__}: {exc}", "INTERNAL"))
        return responses

    def _error(self, message: str, code: str):
        return self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(
            one_line(message, 1000), getattr(self.pb.TritonError, code)))


__all__ = ["BACKENDS", "PipelineRepo", "TritonPythonModel", "graph_specs", "in_request_terms",
           "pixels", "write_pipeline_repository"]
