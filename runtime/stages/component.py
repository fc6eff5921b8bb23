"""Text and image encoders and VAEs on their exports, as diffusers pipeline components.

A stage folder (``OUT_DIR/text_encoder/``, ``OUT_DIR/vae/`` of ``qkrope export --model
pipeline``) holds the stage's ONNX graphs, the component's own ``config.json`` and
:data:`qkrope.stages.STAGE_FILE`, which names the graphs, their inputs and outputs, the export
dtype and each file's size and sha256. :func:`load_stage` (and ``from_pretrained``, which
diffusers' pipeline loader calls for ``["qkrope.runtime", "TextEncoderExport"]``) gives:

- :class:`TextEncoderExport`: called as the pipeline calls its encoder
  (``text_encoder(input_ids, attention_mask, output_hidden_states=True)``); returns
  transformers' ``BaseModelOutputWithPooling`` holding what the graph computes (the reads the
  family declared: ``last_hidden_state``, ``pooler_output``, ``hidden_states[k]``). A read the
  export does not hold (``hidden_states[3]`` of an export of ``hidden_states[-1]``), an input
  it does not take (``pixel_values``) or a mask it cannot honour (a graph without one, given
  one with zeros) is refused in one line.
- :class:`ImageEncoderExport`: the same of an image encoder called on its image processor's
  ``pixel_values`` (``image_encoder(pixel_values=..., output_hidden_states=True)``); images of
  another size than the exported one, or token ids, are refused in one line.
- :class:`VaeExport`: ``decode(z)`` and, where exported, ``encode(x)`` as diffusers'
  autoencoders do them: an image layout runs one graph; a causal video layout runs the first
  chunk's graph, then the next-chunk graph once per later chunk with the feature cache the call
  before returned (a fixed set of tensors, so memory does not grow with the number of frames).
  ``encode`` returns diffusers' ``DiagonalGaussianDistribution`` of the exported moments.
  ``enable_slicing`` is honoured (a batch is coded item by item); tiling, and ``encode`` of an
  export without an encoder graph, are refused in one line. The module tensors its family's
  pipeline reads off the VAE (``vae.bn.running_mean``: ``VaeStage.tensors``) are attributes
  under their state-dict path, read from :data:`qkrope.stages.TENSORS_FILE` (checked against
  the record's size and sha256).

Each runs its graphs in ONNX Runtime sessions, or with ``backend="tensorrt"`` on the engines
``qkrope build OUT_DIR`` wrote beside them (:mod:`qkrope.runtime.stages.engines`): the same
calls either way.

All are :class:`qkrope.runtime.component.DropinComponent` subclasses: no torch parameters,
``.to()`` honoured for the device ONNX Runtime runs on and refused for another dtype, saved with
the pipeline (the stage folder copied through a staging folder, its files confirmed unchanged
since load) and refused for LoRA, offloading and diffusers' model hooks, as the transformer
drop-in is.

Outputs in bfloat16 leave the graph as float32 (the export widens them, which is exact) because
ONNX Runtime's bfloat16 outputs cannot be read back through numpy; the drop-in returns them in
the export's dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from qkrope import dtypes
from qkrope._deps import require
from qkrope._fileio import link_or_copy, staged_outputs
from qkrope.errors import QkropeError
from qkrope.stages import STAGE_FILE, STAGE_FORMAT, STAGE_FORMAT_VERSION

from ..component import (ComponentError, ComponentLoadError, ComponentSaveError,
                         DropinComponent, _check_load_options, _single_device,
                         _stat, read_json_record)

#: files a stage folder holds besides its graphs (and their external data)
CONFIG_FILE = "config.json"
#: what runs a stage drop-in's graphs (StageComponent's ``backend``)
BACKENDS = ("onnxruntime", "tensorrt")


def _fix_reexport(folder: Path) -> str:
    return (f"Fix: export the pipeline again (qkrope export --model pipeline --diffusers "
            f"PIPELINE_DIR -o {folder.parent})")


def read_stage_record(folder: str | os.PathLike, *, check_files: bool = True) -> dict[str, Any]:
    """The stage record of ``folder`` (:data:`qkrope.stages.STAGE_FILE`), checked: format,
    version, and (``check_files``) every file it lists present with its recorded size; one
    line otherwise. ``check_files=False``: the record alone (a served stage, whose graphs are models of a
    Triton server)."""
    folder = Path(folder)
    path = folder / STAGE_FILE
    record = read_json_record(path, fix=_fix_reexport(folder), missing=(
        f"{folder} has no {STAGE_FILE}, so it is no qkrope stage export"))
    if not isinstance(record, Mapping) or record.get("format") != STAGE_FORMAT:
        raise ComponentLoadError(f"{path} is not a qkrope stage record (format "
                                 f"{STAGE_FORMAT!r}). {_fix_reexport(folder)}")
    if record.get("format_version") != STAGE_FORMAT_VERSION:
        raise ComponentLoadError(f"{path} has format_version {record.get('format_version')!r}; "
                                 f"this qkrope reads {STAGE_FORMAT_VERSION}. "
                                 f"{_fix_reexport(folder)}")
    files = record.get("files")
    if not isinstance(files, Mapping) or not files:
        raise ComponentLoadError(f"{path} lists no files. {_fix_reexport(folder)}")
    for name, facts in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise ComponentLoadError(f"{path} lists {name!r}, which is not a plain file name. "
                                     f"{_fix_reexport(folder)}")
        f = folder / name
        size = facts.get("size") if isinstance(facts, Mapping) else None
        if not check_files:
            continue
        if not f.is_file() or f.is_symlink():
            raise ComponentLoadError(f"{f} is missing (listed in {path}). "
                                     f"{_fix_reexport(folder)}")
        if f.stat().st_size != size:
            raise ComponentLoadError(f"{f} has {f.stat().st_size} bytes; {path} records "
                                     f"{size}: it was changed after the export. "
                                     f"{_fix_reexport(folder)}")
    graphs = record.get("graphs")
    if not isinstance(graphs, Mapping) or not graphs or any(
            not isinstance(g, Mapping) or g.get("file") not in files for g in graphs.values()):
        raise ComponentLoadError(f"{path} names graphs that are not among its files. "
                                 f"{_fix_reexport(folder)}")
    if record.get("dtype") not in dtypes.TORCH_BY_SHORT:
        raise ComponentLoadError(f"{path} has dtype {record.get('dtype')!r}, not one of "
                                 f"{sorted(dtypes.TORCH_BY_SHORT)}. {_fix_reexport(folder)}")
    return dict(record)


class StageGraphs:
    """The ONNX Runtime sessions of a stage folder's graphs, run with torch tensors."""

    backend = "onnxruntime"

    def __init__(self, folder: Path, record: Mapping[str, Any], *, providers=None,
                 provider_options=None, sess_options=None):
        from ..loader_onnxrt import _check_providers, default_providers, default_session_options

        ort = require("onnxruntime", "the exported pipeline stages")
        if isinstance(providers, str):
            providers = [providers]
        providers = list(providers) if providers else default_providers()
        _check_providers(ort, providers, provider_options)
        options = sess_options if sess_options is not None else default_session_options(ort)
        self.folder = folder
        self.graphs = dict(record["graphs"])
        self.path = folder / next(iter(self.graphs.values()))["file"]
        self.sessions = {}
        for name, graph in self.graphs.items():
            try:
                self.sessions[name] = ort.InferenceSession(
                    str(folder / graph["file"]), sess_options=options, providers=providers,
                    provider_options=None if provider_options is None
                    else [dict(o) for o in provider_options])
            except Exception as exc:  # noqa: BLE001 - ONNX Runtime's own exception classes
                first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
                raise ComponentLoadError(f"ONNX Runtime cannot load {folder / graph['file']}: "
                                         f"{first}. {_fix_reexport(folder)}") from None
        names = [p if isinstance(p, str) else p[0] for p in providers]
        self.device = torch.device("cuda" if names and names[0] == "CUDAExecutionProvider"
                                   else "cpu")
        self._cuda_ok = any("CUDAExecutionProvider" in s.get_providers()
                            for s in self.sessions.values())

    def _check_device(self, device: torch.device) -> None:
        from ..runner import RunnerInputError

        if device.type == "cuda" and not self._cuda_ok or device.type not in ("cpu", "cuda"):
            raise RunnerInputError(f"this ONNX Runtime session runs on {self.device}")

    def run(self, graph: str, feeds: Mapping[str, torch.Tensor],
            dtype: torch.dtype) -> list[torch.Tensor]:
        """Run ``graph`` on ``feeds`` (bound by pointer; contiguous copies where needed);
        floating outputs are returned in ``dtype``, on this runtime's device."""
        session = self.sessions[graph]
        device = self.device
        binding = session.io_binding()
        dev_id = (device.index or 0) if device.type == "cuda" else 0
        kept = []
        for name, t in feeds.items():
            t = t.to(device).contiguous()
            kept.append(t)
            binding.bind_input(name, device.type, dev_id,
                               dtypes.ONNX_BY_NAME[str(t.dtype).removeprefix("torch.")],
                               list(t.shape), t.data_ptr())
        for out in session.get_outputs():
            binding.bind_output(out.name, device.type, dev_id)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        session.run_with_iobinding(binding)
        outs = []
        for value in binding.get_outputs():
            t = torch.from_numpy(value.numpy())
            outs.append(t.to(device=device, dtype=dtype) if t.is_floating_point()
                        else t.to(device))
        return outs


class StageComponent(DropinComponent):
    """Base of the stage drop-ins (module docstring). ``KIND`` names it in messages."""

    KIND = "stage"

    def __init__(self, folder: str | os.PathLike, *, providers=None, provider_options=None,
                 sess_options=None, graphs=None, backend: str = "onnxruntime", device=None):
        """``backend``: ``"onnxruntime"`` (the folder's graphs in ONNX Runtime sessions: the
        ``providers``, ``provider_options`` and ``sess_options`` options) or ``"tensorrt"``
        (the engines ``qkrope build OUT_DIR`` wrote beside them, on ``device``, default the
        current CUDA device: :class:`qkrope.runtime.stages.engines.EngineStageGraphs`).
        ``graphs``: what runs the stage's graphs in place of either (an object with
        :class:`StageGraphs`' ``run``, ``device`` and ``backend``:
        :class:`qkrope.runtime.stages.served.ServedStageGraphs`); the folder then needs only
        its record and config."""
        folder = Path(folder)
        if backend not in BACKENDS:
            raise ComponentLoadError(f"backend={backend!r} is none of {', '.join(BACKENDS)}. "
                                     f"Fix: backend='onnxruntime' or 'tensorrt'")
        ort_options = [n for n, v in (("providers", providers), ("provider_options",
                                      provider_options), ("sess_options", sess_options))
                       if v is not None]
        if backend == "tensorrt" and ort_options:
            raise ComponentLoadError(f"{', '.join(ort_options)} are ONNX Runtime options; "
                                     f"backend='tensorrt' runs the stage's engines. Fix: drop "
                                     f"them, or backend='onnxruntime'")
        if backend == "onnxruntime" and device is not None and graphs is None:
            raise ComponentLoadError("device= chooses the GPU of backend='tensorrt'; ONNX "
                                     "Runtime runs where its providers say. Fix: providers="
                                     "['CUDAExecutionProvider'] (or .to('cuda') after loading)")
        record = read_stage_record(folder, check_files=graphs is None)
        if record.get("class") != type(self).__name__:
            raise ComponentLoadError(f"{folder / STAGE_FILE} records a {record.get('class')}, "
                                     f"not a {type(self).__name__}. {_fix_reexport(folder)}")
        self.__dict__["_folder"] = folder
        self.__dict__["_record"] = record
        self.__dict__["_stats"] = (None if graphs is not None else
                                   {n: _stat(folder / n) for n in _stage_files(record)})
        if graphs is None and backend == "tensorrt":
            from .engines import EngineStageGraphs

            graphs = EngineStageGraphs(folder, record, device=device)
        self._runner = graphs if graphs is not None else StageGraphs(
            folder, record, providers=providers, provider_options=provider_options,
            sess_options=sess_options)
        self.dtype = dtypes.TORCH_BY_SHORT[record["dtype"]]
        self.device = self._runner.device
        from diffusers.configuration_utils import FrozenDict

        config = {}
        try:
            config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
        self.config = FrozenDict(config if isinstance(config, dict) else {})

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            config = self.__dict__.get("config")
            if config is not None and not name.startswith("_") and name in config:
                return config[name]  # as diffusers' models offer their config's keys
            raise

    def _what(self) -> str:
        folder = self.__dict__.get("_folder")
        runner = self.__dict__.get("_runner")
        backend = getattr(runner, "backend", "onnxruntime")
        return (f"the exported {self.KIND} ({folder.name}/, {backend})" if folder is not None
                else f"the exported {self.KIND}")

    # --- saved with the pipeline -----------------------------------------------------------
    def _confirmed_files(self):
        folder, record = self._folder, self._record
        if self._stats is None:
            raise ComponentSaveError(f"{self._what()} runs on a server and holds no graph "
                                     f"files, so the pipeline cannot save it. Fix: save the "
                                     f"pipeline export it was served from")
        for name, stat in self._stats.items():
            f = folder / name
            try:
                now = _stat(f)
            except OSError:
                now = None
            if now != stat:
                raise ComponentSaveError(
                    f"{f} was {'removed' if now is None else 'changed'} since this "
                    f"{self.KIND} was loaded, so the pipeline cannot save what it ran. Fix: "
                    f"load the pipeline again from {folder.parent}, or export it again")
        return folder, record

    def _check_target(self, target: Path) -> None:
        if not target.exists():
            return
        if not target.is_dir() or target.is_symlink():
            raise ComponentSaveError(f"{target} is not a folder, so the {self.KIND} cannot be "
                                     f"saved there. Fix: save the pipeline to another folder")
        own = set(_stage_files(self._record))
        try:
            previous = read_stage_record(target)
            own |= set(_stage_files(previous))
        except QkropeError:
            pass
        others = sorted(p.name for p in target.iterdir() if p.name not in own)
        if others:
            raise ComponentSaveError(
                f"{target} holds {others[0]!r}, which a qkrope stage save did not write; the "
                f"save replaces the folder whole, so it refuses to remove it. Fix: save the "
                f"pipeline to an empty folder, or move {others[0]!r} away")

    def save_pretrained(self, save_directory: str | os.PathLike, **options) -> None:
        """``DIR/<component>/``: the stage folder's files as loaded, copied (never linked)
        through a staging folder renamed into place."""
        self._check_save_options(**options)
        target = Path(save_directory)
        folder, record = self._confirmed_files()
        self._check_target(target)
        if target.resolve() == folder.resolve():
            return  # saved back into its own folder: the files are already there
        with staged_outputs(target.parent, [target.name], flag="save_directory") as stage:
            out = stage.path(target.name)
            out.mkdir()
            for name in _stage_files(record):
                link_or_copy(folder / name, out / name)
            self._confirmed_files()  # again after the copy
            stage.commit([target.name])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *,
                        torch_dtype: torch.dtype | None = None, dtype: torch.dtype | None = None,
                        device_map=None, quantization_config=None, device=None, providers=None,
                        provider_options=None, sess_options=None, backend: str = "onnxruntime",
                        **diffusers_options):
        """The stage saved in a component folder (called by ``DiffusionPipeline.
        from_pretrained``): ``torch_dtype`` must be the export's or None; ``backend`` as the
        constructor takes it (``"tensorrt"``: its engines, on ``device``); diffusers' other
        options as the transformer drop-in takes them."""
        folder = Path(pretrained_model_name_or_path)
        _check_load_options(folder, diffusers_options)
        if quantization_config is not None:
            raise ComponentLoadError(f"{folder}: quantization_config cannot apply to an "
                                     f"exported {cls.KIND} (its weights are fixed at export). "
                                     f"Fix: drop it for this component")
        if device is None and device_map is not None:
            device = _single_device(device_map, folder)
        engines = backend == "tensorrt"
        stage = cls(folder, providers=providers, provider_options=provider_options,
                    sess_options=sess_options, backend=backend,
                    device=device if engines else None)
        if engines:
            device = None  # the engines are on it
        torch_dtype = torch_dtype if torch_dtype is not None else dtype
        if torch_dtype is not None and torch_dtype != stage.dtype:
            raise ComponentLoadError(
                f"{folder} holds a {cls.KIND} exported in {stage.dtype}, which cannot load as "
                f"{torch_dtype}. Fix: from_pretrained(..., torch_dtype={stage.dtype}), or "
                f"export the pipeline in {str(torch_dtype).removeprefix('torch.')}")
        return stage.to(device) if device is not None else stage


class _HiddenStates(tuple):
    """``output_hidden_states``' tuple with only the layers the export holds; indexing any
    other is refused in one line."""

    def __new__(cls, count: int, present: Mapping[int, torch.Tensor], what: str):
        self = super().__new__(cls, [present.get(i) for i in range(count)])
        self._present, self._what = dict(present), what
        return self

    def __getitem__(self, key):
        if isinstance(key, int) and -len(self) <= key < len(self):
            i = key % len(self)
            if i not in self._present:
                held = ", ".join(f"hidden_states[{j - len(self)}]" for j in sorted(self._present))
                raise ComponentError(
                    f"hidden_states[{key}] of {self._what}: the export holds only {held} (what "
                    f"its family's pipeline reads). Fix: declare the read in the family's "
                    f"record (stages) and export the pipeline again")
        return super().__getitem__(key)


class TextEncoderExport(StageComponent):
    """A text encoder component on its export (module docstring)."""

    KIND = "text encoder"

    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *args,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs):
        record = self._record
        inputs, reads = record["inputs"], record["reads"]
        extra = [f"positional argument {i + 3}" for i, a in enumerate(args) if a is not None]
        extra += [k for k, v in kwargs.items() if v is not None
                  and k not in ("output_attentions", "use_cache")]
        if extra or input_ids is None:
            got = ", ".join(extra) if extra else "no input_ids"
            raise ComponentError(f"{self._what()} takes {' and '.join(inputs)}; got {got}. Fix: "
                                 f"call it as its pipeline does (the export computes "
                                 f"{', '.join(reads)} from the token ids)")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ComponentError(f"{self._what()}: input_ids must be a [batch, tokens] tensor; "
                                 f"got {getattr(input_ids, 'shape', type(input_ids).__name__)}")
        feeds = {"input_ids": input_ids.to(torch.int64)}
        if "attention_mask" in inputs:
            feeds["attention_mask"] = (torch.ones_like(feeds["input_ids"])
                                       if attention_mask is None
                                       else attention_mask.to(torch.int64))
        elif attention_mask is not None and not bool((attention_mask != 0).all()):
            raise ComponentError(f"{self._what()} was exported without an attention mask (its "
                                 f"pipeline passes none) and was given one with padding. Fix: "
                                 f"call it without attention_mask")
        return self._encoded(feeds, return_dict)

    def _encoded(self, feeds: Mapping[str, torch.Tensor], return_dict: bool | None):
        """The ``encode`` graph on ``feeds`` as transformers' output of the call."""
        record = self._record
        reads = record["reads"]
        outs = self._runner.run("encode", feeds, self.dtype)
        by_read = dict(zip(reads, outs))
        count = int(record.get("hidden_states", 0))
        layers = {k % count: by_read[r] for r in reads
                  if (k := _hidden_index(r)) is not None}
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        out = BaseModelOutputWithPooling(
            last_hidden_state=by_read.get("last_hidden_state"),
            pooler_output=by_read.get("pooler_output"),
            hidden_states=_HiddenStates(count, layers, self._what()) if layers else None)
        return out if return_dict is not False else out.to_tuple()


    def generate(self, *args, **kwargs):
        raise ComponentError(f"{self._what()} computes the hidden states its pipeline reads, "
                             f"not text generation (a pipeline that rewrites or expands its "
                             f"prompt with the encoder's generate()). Fix: turn the pipeline's "
                             f"prompt rewriting off, or run the PyTorch text encoder")


class ImageEncoderExport(TextEncoderExport):
    """An image encoder component on its export (a CLIP vision tower), called as
    its pipeline calls it: ``image_encoder(pixel_values=..., output_hidden_states=True)`` with
    the images its image processor made, ``[B, C, S, S]`` at the exported side; the reads as
    :class:`TextEncoderExport`'s."""

    KIND = "image encoder"

    def __init__(self, folder: str | os.PathLike, **options):
        super().__init__(folder, **options)
        size = self._record.get("image_size")
        if not isinstance(size, list) or len(size) != 3 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in size):
            raise ComponentLoadError(f"{Path(folder) / STAGE_FILE} gives image_size {size!r}, "
                                     f"not [channels, side, side]. "
                                     f"{_fix_reexport(Path(folder))}")

    def generate(self, *args, **kwargs):
        raise ComponentError(f"{self._what()} computes the hidden states its pipeline reads "
                             f"of an image, not generation. Fix: call it as its pipeline "
                             f"does (image_encoder(pixel_values=..., "
                             f"output_hidden_states=True))")

    def forward(self, pixel_values: torch.Tensor | None = None, *args,
                output_hidden_states: bool | None = None, return_dict: bool | None = None,
                **kwargs):
        extra = [f"positional argument {i + 2}" for i, a in enumerate(args) if a is not None]
        extra += [k for k, v in kwargs.items() if v is not None
                  and k not in ("output_attentions", "interpolate_pos_encoding")]
        if kwargs.get("interpolate_pos_encoding"):
            extra.append("interpolate_pos_encoding=True")
        if extra or pixel_values is None:
            got = ", ".join(extra) if extra else "no pixel_values"
            raise ComponentError(f"{self._what()} takes pixel_values; got {got}. Fix: call it "
                                 f"as its pipeline does, with its image processor's output")
        size = [int(d) for d in self._record["image_size"]]  # checked at load
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.dim() != 4 or \
                list(pixel_values.shape[1:]) != size:
            got = (list(pixel_values.shape) if isinstance(pixel_values, torch.Tensor)
                   else type(pixel_values).__name__)
            raise ComponentError(f"{self._what()}: pixel_values must be [batch, {size[0]}, "
                                 f"{size[1]}, {size[2]}] (the exported image size); got {got}. "
                                 f"Fix: make them with the pipeline's image processor")
        return self._encoded({"pixel_values": pixel_values.to(self.dtype)}, return_dict)


class VaeExport(StageComponent):
    """A VAE component on its export (module docstring)."""

    KIND = "VAE"
    use_slicing = False
    use_tiling = False

    def __init__(self, folder: str | os.PathLike, **options):
        super().__init__(folder, **options)
        self.__dict__["_tensors"] = _module_tensors(Path(folder), self._record,
                                                    served=self._stats is None)

    def __getattr__(self, name: str) -> Any:
        tensors = self.__dict__.get("_tensors")
        if tensors is not None and name in tensors:
            return tensors[name]
        return super().__getattr__(name)

    def forward(self, *args, **kwargs):
        raise ComponentError(f"{self._what()} runs decode() (and encode() where exported), not "
                             f"a whole forward. Fix: call vae.decode(latents)")

    def enable_slicing(self) -> None:
        self.use_slicing = True

    def disable_slicing(self) -> None:
        self.use_slicing = False

    def enable_tiling(self, *args, **kwargs) -> None:
        raise ComponentError(f"{self._what()} decodes whole frames (a causal video VAE frame by "
                             f"latent frame with its feature cache); tiles are not exported. "
                             f"Fix: decode without tiling, or run the PyTorch VAE")

    def disable_tiling(self) -> None:
        pass

    def clear_cache(self) -> None:
        pass  # the feature cache lives in each decode call

    def encode(self, x: torch.Tensor, return_dict: bool = True):
        """diffusers' ``encode``: the latent distribution of ``x`` (images ``[B, 3, H, W]``,
        or a video ``[B, 3, T, H, W]`` for a causal video VAE, chunked as diffusers chunks
        it: the first frame, then four frames a chunk)."""
        if "encode" not in self._record["graphs"]:
            raise ComponentError(f"{self._what()} holds no encoder graph (its family's "
                                 f"pipeline does not encode images). Fix: run the PyTorch "
                                 f"VAE's encode")
        x = self._checked(x, "images or video frames")
        moments = (torch.cat([self._code("encode", part) for part in x.split(1)])
                   if self.use_slicing and x.shape[0] > 1 else self._code("encode", x))
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.models.modeling_outputs import AutoencoderKLOutput

        posterior = DiagonalGaussianDistribution(moments)
        return AutoencoderKLOutput(latent_dist=posterior) if return_dict else (posterior,)

    def decode(self, z: torch.Tensor, return_dict: bool = True, generator=None):
        z = self._checked(z, "latents")
        sample = (torch.cat([self._code("decode", part) for part in z.split(1)])
                  if self.use_slicing and z.shape[0] > 1 else self._code("decode", z))
        from diffusers.models.autoencoders.vae import DecoderOutput

        return DecoderOutput(sample=sample) if return_dict else (sample,)

    def _checked(self, x, what: str) -> torch.Tensor:
        layout = self._record["layout"]
        want = 5 if layout == "causal-video" else 4
        if not isinstance(x, torch.Tensor) or x.dim() != want:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ComponentError(f"{self._what()} takes {want}-D {what} ({layout}); got "
                                 f"{shape}. Fix: pass them as the pipeline makes them")
        return x.to(self.dtype)

    def _code(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``name`` ("decode" or "encode") of ``x``: one graph call (image layout), or the
        first chunk's graph then the next chunk's once per chunk, the feature cache passed
        from each call to the next (causal video layout)."""
        graphs = self._record["graphs"]
        first = graphs[name]
        if self._record["layout"] != "causal-video":
            return self._runner.run(name, {first["inputs"][0]: x}, self.dtype)[0]
        out, *cache = self._runner.run(name, {first["inputs"][0]: x[:, :, :1]}, self.dtype)
        parts = [out]
        step = graphs[f"{name}_next"]
        size = int(step.get("frames", 1))
        # diffusers' chunks: 1 + (T - 1) // size of them; a last partial chunk is not coded
        for start in range(1, 1 + (x.shape[2] - 1) // size * size, size):
            feeds = {step["inputs"][0]: x[:, :, start:start + size]}
            feeds.update(zip(step["inputs"][1:], cache))
            out, *cache = self._runner.run(f"{name}_next", feeds, self.dtype)
            parts.append(out)
        return torch.cat(parts, 2) if len(parts) > 1 else parts[0]


def _module_tensors(folder: Path, record: Mapping[str, Any], served: bool) -> dict[str, Any]:
    """The module tensors a VAE record lists (``tensors``, saved in
    :data:`qkrope.stages.TENSORS_FILE`, checked against the record's size and sha256 even where
    the graphs are served) as the attribute tree the pipeline reads (``bn.running_mean`` ->
    ``{"bn": namespace(running_mean=tensor)}``); {} for none. ``served``: the folder is a
    Triton repository's copy (the fix is to write the repository again)."""
    from types import SimpleNamespace

    from qkrope._fileio import sha256_file
    from qkrope.stages import TENSORS_FILE, is_tensor_key

    keys = record.get("tensors")
    if not keys:
        return {}
    path = folder / TENSORS_FILE
    fix = ("Fix: write the repository again (qkrope triton-repo --pipeline OUT_DIR)" if served
           else _fix_reexport(folder))
    facts = record["files"].get(TENSORS_FILE)
    paths = [k.split(".") for k in keys] if isinstance(keys, list) else []
    if not paths or not all(is_tensor_key(k) for k in keys) or any(
            a != b and b[:len(a)] == a for a in paths for b in paths):
        raise ComponentLoadError(f"{folder / STAGE_FILE} lists tensors {keys!r}, which are not "
                                 f"distinct dotted state-dict keys of a module. {fix}")
    if not isinstance(facts, Mapping) or not path.is_file() or path.is_symlink():
        raise ComponentLoadError(f"{folder / STAGE_FILE} lists tensors {keys!r}, but "
                                 f"{TENSORS_FILE} is not a file of its record and folder. {fix}")
    if path.stat().st_size != facts.get("size") or sha256_file(path) != facts.get("sha256"):
        raise ComponentLoadError(f"{path} is not the file {folder / STAGE_FILE} records (size "
                                 f"and sha256): it was changed after the export. {fix}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        values = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ComponentLoadError(f"{path} cannot be read ({type(exc).__name__}). "
                                 f"{fix}") from None
    tree: dict[str, Any] = {}
    for key, parts in zip(keys, paths):
        if key not in values:
            raise ComponentLoadError(f"{path} lacks {key!r}, which {folder / STAGE_FILE} "
                                     f"lists. {fix}")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = values[key]

    def build(node):
        return SimpleNamespace(**{k: build(v) if isinstance(v, dict) else v
                                  for k, v in node.items()})
    return {k: build(v) if isinstance(v, dict) else v for k, v in tree.items()}


#: the stage classes by the name a stage record and model_index.json give
CLASSES = {c.__name__: c for c in (TextEncoderExport, ImageEncoderExport, VaeExport)}


def load_stage(folder: str | os.PathLike, **options) -> StageComponent:
    """The stage drop-in of a stage folder (its record names the class)."""
    record = read_stage_record(folder)
    cls = CLASSES.get(record.get("class"))
    if cls is None:
        raise ComponentLoadError(f"{Path(folder) / STAGE_FILE} records class "
                                 f"{record.get('class')!r}, not one of {sorted(CLASSES)}. "
                                 f"{_fix_reexport(Path(folder))}")
    return cls.from_pretrained(folder, **options)


def _hidden_index(read: str) -> int | None:
    from qkrope.stages import hidden_index

    return hidden_index(read)


def _stage_files(record: Mapping[str, Any]) -> list[str]:
    return [*record["files"], CONFIG_FILE, STAGE_FILE]


__all__ = ["StageComponent", "TextEncoderExport", "ImageEncoderExport", "VaeExport",
           "StageGraphs", "load_stage",
           "read_stage_record", "CLASSES"]
