"""A stage's graphs on the TensorRT engines ``qkrope build OUT_DIR`` wrote beside them.

:class:`EngineStageGraphs` stands where :class:`~qkrope.runtime.stages.component.StageGraphs`
(ONNX Runtime) stands in a stage drop-in (``load_stage(folder, backend="tensorrt")``): the same
``run(graph, feeds, dtype)``, so the drop-ins' calls (a text encoder's reads, a causal VAE's
chunks with their feature cache) are the same code on either backend.

Which engine runs which graph comes from the graph's own file name
(:func:`qkrope.stages.engine_name`: ``decode.onnx`` -> ``decode.engine`` in the same folder),
never from a path a JSON file holds. The stage's :data:`~qkrope.stages.ENGINES_FILE` says what
each engine was built from; an engine is refused in one line, before TensorRT loads anything,
when

- it is missing, or the record has no entry for its graph (``qkrope build OUT_DIR`` not run);
- it was built from other graph files than the stage's (the pipeline was exported again after
  the build: the record's ``build_key.onnx_sha256`` against the stage record's sha256s);
- its bytes are not those the build recorded (sha256, checked on the bytes TensorRT then
  deserialises).

Each engine runs through :class:`~qkrope.runtime.runner_tensorrt.TensorRTRunner` (per thread
one stream and one context per optimisation profile; the first profile whose bounds hold the
shapes), its inputs checked by :meth:`~qkrope.runtime.runner.Runner.run_feeds` first. Outputs
are copies (a causal VAE feeds one call's cache outputs to the next call as inputs, which must
not be the buffers that call writes). A stage engine has no QKNormRoPE layer: no plugin library
is loaded for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qkrope.stages import (ENGINES_FILE, ENGINES_FORMAT, engine_name, graph_files,
                           graph_files_digest, is_engines_record)

from ..component import ComponentLoadError, read_json_record
from ..loader_tensorrt import engine_from_path


def _fix_build(folder: Path) -> str:
    return f"Fix: qkrope build {folder.parent} (on the GPU the engines will run on)"


def read_engines_record(folder: Path) -> dict:
    """The stage folder's :data:`~qkrope.stages.ENGINES_FILE`, checked: one line where there is
    none or it is no engine record."""
    path = folder / ENGINES_FILE
    record = read_json_record(path, fix=_fix_build(folder), missing=(
        f"{folder} has no TensorRT engines ({ENGINES_FILE} is missing)"))
    if not is_engines_record(record):
        raise ComponentLoadError(f"{path} is no qkrope stage engine record (format "
                                 f"{ENGINES_FORMAT!r}). {_fix_build(folder)}")
    return record


def built_engines(folder: Path, record: Mapping[str, Any]) -> dict[str, tuple[Path, str]]:
    """graph -> (its engine, the sha256 its build recorded), for every graph of the stage
    record ``record``; one line for the first engine that is missing or stale (module
    docstring). Reads only the two records and the file system: no engine is opened."""
    built = read_engines_record(folder)["engines"]
    files = record["files"]
    found = {}
    for graph, spec in record["graphs"].items():
        path = folder / engine_name(spec["file"])
        entry = built.get(graph)
        if not isinstance(entry, Mapping) or path.is_symlink() or not path.is_file():
            raise ComponentLoadError(f"{path} (the engine of {spec['file']}) is missing. "
                                     f"{_fix_build(folder)}")
        recorded = {n: files[n].get("sha256") if isinstance(files[n], Mapping) else None
                    for n in graph_files(files, spec["file"])}
        key = entry.get("build_key")
        made_from = key.get("onnx_sha256") if isinstance(key, Mapping) else None
        if None in recorded.values() or made_from != graph_files_digest(recorded.items()):
            raise ComponentLoadError(f"{path} was built from other files than {spec['file']} "
                                     f"as exported now (the pipeline was exported again after "
                                     f"the build). {_fix_build(folder)}")
        sha256 = entry.get("sha256")
        if not isinstance(sha256, str):
            raise ComponentLoadError(f"{folder / ENGINES_FILE} records no sha256 of {path.name}"
                                     f". {_fix_build(folder)}")
        found[graph] = (path, sha256)
    return found


def _engine_device(device) -> torch.device:
    """The CUDA device the engines run on: ``device`` (a CUDA one), default the current one."""
    if device is None:
        if not torch.cuda.is_available():
            raise ComponentLoadError("TensorRT engines run on a CUDA GPU and none is available "
                                     "here. Fix: run on a GPU machine, or load the stage on "
                                     "ONNX Runtime (backend='onnxruntime')")
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ComponentLoadError(f"TensorRT engines run on a CUDA device, not {dev}. Fix: "
                                 f"device='cuda', or backend='onnxruntime' for {dev}")
    return dev


class EngineStageGraphs:
    """The TensorRT runners of a stage folder's graphs (module docstring)."""

    backend = "tensorrt"

    def __init__(self, folder: Path, record: Mapping[str, Any], *, device=None,
                 verbose: bool = False):
        from ..runner_tensorrt import TensorRTRunner

        engines = built_engines(folder, record)  # every engine checked before TensorRT
        self.device = _engine_device(device)
        self.folder = folder
        self.graphs = dict(record["graphs"])
        self.path = next(iter(engines.values()))[0]
        self.runners = {}
        for graph, (path, sha256) in engines.items():
            loaded = engine_from_path(path, verbose=verbose, plugin_layers=False, sha256=sha256)
            runner = TensorRTRunner(loaded, device=self.device, copy_outputs=True,
                                    transformer=False)
            expected = list(self.graphs[graph].get("inputs", []))
            if sorted(runner.input_names) != sorted(expected):
                raise ComponentLoadError(f"{path} takes {', '.join(runner.input_names)}, its "
                                         f"graph {', '.join(expected)}. {_fix_build(folder)}")
            self.runners[graph] = runner

    def _check_device(self, device: torch.device) -> None:
        from ..runner import RunnerInputError, _same_cuda

        if device.type != "cuda" or not _same_cuda(device, self.device):
            raise RunnerInputError(f"these TensorRT engines run on {self.device}, not {device}")

    def run(self, graph: str, feeds: Mapping[str, torch.Tensor],
            dtype: torch.dtype) -> list[torch.Tensor]:
        """Run ``graph``'s engine on ``feeds`` (moved to its device, contiguous); the outputs in
        the graph's recorded order, floating ones in ``dtype``."""
        runner = self.runners[graph]
        outs = runner.run_feeds({n: t.to(self.device).contiguous() for n, t in feeds.items()})
        named = dict(zip(runner.output_names, outs))
        order = self.graphs[graph].get("outputs") or runner.output_names
        return [named[n].to(dtype) if named[n].is_floating_point() else named[n] for n in order]


__all__ = ["EngineStageGraphs", "built_engines", "read_engines_record"]
