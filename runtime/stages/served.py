"""A pipeline served by Triton from prompt to pixels: the model components of the top model
that ``qkrope triton-repo --pipeline`` writes (:mod:`qkrope.apps.triton_pipeline`, whose
:class:`~qkrope.apps.triton_pipeline.TritonPythonModel` its ``1/model.py`` imports), and the
stage graphs they call.

The top model runs the pipeline itself, the class its ``model_index.json`` names, with its own
tokenizers and scheduler, through :func:`qkrope.apps.generate.generate`, so a served prompt
takes exactly the path ``qkrope generate OUT_DIR`` takes. Only its model components differ:
each is the same drop-in whose graphs are models of the same server, called by business-logic
scripting (BLS, :class:`qkrope.runtime.runner_triton._Bls`):

- each text or image encoder and the VAE: a stage drop-in (:class:`~.component.
  StageComponent`) over :class:`ServedStageGraphs`, one served model per graph
  (``<name>_<component>_<graph>``: the causal video VAE's first-chunk and next-chunk graphs
  are two, the feature cache passed between them by the drop-in as in the local run; a VAE's
  module tensors read from the pipeline copy's tensors.safetensors, checked against its
  record);
- each transformer: the family drop-in over a :class:`~qkrope.runtime.runner_triton.
  TritonRunner` of the transformer's ensemble (``<name>_<component>``), which checks every call
  against the served I/O record as the gRPC client does.

The request's optional inputs are the ``qkrope generate`` options the pipeline's call takes
(:data:`REQUEST_OPTIONS`); the output is :data:`PIXELS`.

The server's Python must import qkrope with torch, diffusers and transformers (the pipeline's
own code) and, for Triton servers up to 2.52, numpy < 2 (:data:`qkrope.runtime.triton.
PIPELINE_ENV_NOTE`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..runner import RunnerError
from ..runner_triton import _ServerError, from_wire, one_line, to_wire
from .component import CLASSES, ComponentError

#: the config parameter holding what the top model serves (:func:`served_plan`)
PLAN_PARAMETER = "qkrope_pipeline"
#: the pipeline folder's copy under the top model's version folder (index, scheduler,
#: tokenizers, processors and each stage's record; no graph)
PIPELINE_FOLDER = "pipeline"
#: the request's optional inputs: name -> (Triton type, the generate() keyword it is, the
#: pipeline call's parameter that must exist for it to be offered; None: always)
REQUEST_OPTIONS = {
    "negative_prompt": ("TYPE_STRING", "negative_prompt", "negative_prompt"),
    "seed": ("TYPE_INT64", "seed", None),
    "steps": ("TYPE_INT32", "steps", "num_inference_steps"),
    "height": ("TYPE_INT32", "height", "height"),
    "width": ("TYPE_INT32", "width", "width"),
    "guidance": ("TYPE_FP32", "guidance_scale", "guidance_scale"),
    "true_cfg_scale": ("TYPE_FP32", "true_cfg_scale", "true_cfg_scale"),
    "frames": ("TYPE_INT32", "num_frames", "num_frames"),
}
PROMPT, PIXELS = "prompt", "pixels"


class ServedStageGraphs:
    """A stage's graphs as models of a Triton server (``models``: graph name -> served model),
    called through a transport of :mod:`qkrope.runtime.runner_triton` (BLS in the server):
    :class:`~.component.StageGraphs`' ``run``, whose outputs are checked (present, finite)
    before the pipeline sees them."""

    backend = "triton"

    def __init__(self, transport, models: Mapping[str, str], record: Mapping[str, Any]):
        self.transport, self.models = transport, dict(models)
        self.graphs = dict(record["graphs"])
        missing = sorted(set(self.graphs) - set(self.models))
        if missing:
            raise ComponentError(f"the served stage has no model for its graphs {missing}. "
                                 f"Fix: write the repository again (qkrope triton-repo "
                                 f"--pipeline OUT_DIR)")
        self.device = torch.device("cpu")
        self.path = None

    def _check_device(self, device: torch.device) -> None:
        from ..runner import RunnerInputError

        if device.type != "cpu":
            raise RunnerInputError("a served stage takes and returns host tensors")

    def run(self, graph: str, feeds: Mapping[str, torch.Tensor],
            dtype: torch.dtype) -> list[torch.Tensor]:
        model, names = self.models[graph], list(self.graphs[graph]["outputs"])
        inputs = [(name, *to_wire(t)) for name, t in feeds.items()]
        try:
            got = self.transport.infer(model, "", inputs, names)
        except _ServerError as exc:
            raise ComponentError(f"the served model {model!r}: {one_line(exc.message)}. Fix: "
                                 f"see the server's log") from None
        outs = []
        for name in names:
            if name not in got:
                raise ComponentError(f"the served model {model!r} returned no {name!r} (it "
                                     f"returned {sorted(got)}). Fix: write the repository "
                                     f"again (qkrope triton-repo --pipeline OUT_DIR)")
            datatype, shape, data = got[name]
            try:
                t = from_wire(data, datatype, shape, name=name, device=torch.device("cpu"))
            except RunnerError as exc:
                raise ComponentError(f"the served model {model!r}: {exc}") from None
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
                raise ComponentError(f"the served model {model!r} returned {name} with NaN or "
                                     f"infinite values. Fix: see the server's log")
            outs.append(t.to(dtype) if t.is_floating_point() else t)
        return outs


def served_plan(components: Mapping[str, Any]) -> str:
    """The top model's :data:`PLAN_PARAMETER` as JSON: ``{"components": {component: entry}}``,
    each entry ``{"class": the stage class, "models": {graph: served model}}`` for a text
    encoder or VAE, ``{"model": the ensemble}`` for a transformer."""
    return json.dumps({"components": dict(components)}, sort_keys=True)


def served_components(folder: Path, plan: Mapping[str, Any], transport, runner_of) -> dict:
    """The pipeline's model components over the server's models (module docstring):
    ``runner_of(model)`` gives a transformer's runner."""
    from ..transformer import transformer_for_runner

    out = {}
    for component, entry in plan["components"].items():
        if Path(component).name != component or component in ("", ".", ".."):
            raise ComponentError(f"the served plan names the component {component!r}, which "
                                 f"is not a folder name of the pipeline. Fix: write the "
                                 f"repository again (qkrope triton-repo --pipeline OUT_DIR)")
        if "model" in entry:  # a transformer: the family drop-in over its ensemble
            out[component] = transformer_for_runner(runner_of(entry["model"]),
                                                    device=torch.device("cpu"))
            continue
        cls = CLASSES[entry["class"]]
        from .component import read_stage_record

        record = read_stage_record(folder / component, check_files=False)
        out[component] = cls(folder / component,
                             graphs=ServedStageGraphs(transport, entry["models"], record))
    return out


__all__ = ["PIPELINE_FOLDER", "PLAN_PARAMETER", "REQUEST_OPTIONS", "PROMPT", "PIXELS",
           "ServedStageGraphs", "served_components", "served_plan"]
