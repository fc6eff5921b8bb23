"""The pipeline's other model stages (text encoders, VAE) as facts: what a family's pipeline
reads of each, declared in its record (``FamilyRecord.stages``), and the record a stage export
leaves in its component folder. No torch; the export is qkrope.export.stages, the drop-ins
qkrope.runtime.stages.

A family's pipeline keeps its own Python (prompt templates, the dropped prefix, the scheduler,
latent packing): only its model calls run on exports. So what the family declares is what each
call reads back:

- a text encoder: the outputs the pipeline takes from its call (``last_hidden_state``,
  ``pooler_output``, ``hidden_states[-k]``: one layer of ``output_hidden_states``), and the
  inputs it passes (``input_ids``, ``attention_mask``);
- an image encoder (a CLIP vision tower): the same reads, of its call on the
  ``pixel_values`` its image processor makes (a fixed square side, the config's
  ``image_size``); optional: a pipeline saved without one exports without it;
- the VAE: its layout (``image``: a 2-D autoencoder, one graph per call; ``causal-video``: a
  causal video autoencoder whose decoder runs latent frame by latent frame with its feature
  cache, exported as two graphs, the first chunk and each next one, the cache as their inputs
  and outputs), which of its pipelines encode images (image to image, image to video), and the
  module tensors the pipeline reads off the VAE itself (a latent normalisation's statistics),
  saved beside the graphs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

#: a stage component folder's record (beside its ONNX graphs and the component's config.json)
STAGE_FILE = "qkrope_stage.json"
STAGE_FORMAT = "qkrope-stage"
STAGE_FORMAT_VERSION = 1
#: a pipeline export folder's record (beside model_index.json): what wrote it, so that a later
#: export may replace the folder whole; any other folder is refused
PIPELINE_FILE = "qkrope_pipeline.json"
PIPELINE_FORMAT = "qkrope-pipeline"
#: a VAE stage folder's file of the module tensors its pipelines read off the VAE
#: (``VaeStage.tensors``), beside its graphs
TENSORS_FILE = "tensors.safetensors"
#: a stage folder's record of the TensorRT engines ``qkrope build OUT_DIR`` wrote beside its
#: graphs (each named after its graph: :func:`engine_name`), with what each was built from
ENGINES_FILE = "qkrope_engines.json"
ENGINES_FORMAT = "qkrope-stage-engines"
ENGINES_FORMAT_VERSION = 1

#: the drop-in class (qkrope.runtime) a stage export of each kind records and model_index.json
#: names
DROPIN_CLASSES = {"text_encoder": "TextEncoderExport", "image_encoder": "ImageEncoderExport",
                  "vae": "VaeExport"}
#: the text encoder inputs a graph may take
TEXT_INPUTS = ("input_ids", "attention_mask")
#: the VAE layouts (module docstring)
VAE_LAYOUTS = ("image", "causal-video")
#: the libraries a pipeline folder's model_index.json may name for a model component that is
#: exported (the class is looked up in that library by name; nothing else is imported)
MODEL_LIBRARIES = ("diffusers", "transformers")

_HIDDEN = re.compile(r"hidden_states\[(-?\d+)\]")


def hidden_index(read: str) -> int | None:
    """``k`` of a ``hidden_states[k]`` read, None for a named output."""
    m = _HIDDEN.fullmatch(read)
    return int(m.group(1)) if m else None


def output_name(read: str) -> str:
    """The graph output name of a read: ``hidden_states[-1]`` -> ``hidden_states_m1``."""
    k = hidden_index(read)
    if k is None:
        return read
    return f"hidden_states_{'m' if k < 0 else ''}{abs(k)}"


@dataclass(frozen=True)
class TextEncoderStage:
    """What the family's pipeline reads of one text encoder component (module docstring)."""

    reads: tuple[str, ...]
    inputs: tuple[str, ...] = TEXT_INPUTS
    #: the token length the pipeline pads its prompts to by default (its max_sequence_length,
    #: plus a template prefix it drops after the call): the engine profile's text length
    tokens: int = 512

    def __post_init__(self):
        named = ("last_hidden_state", "pooler_output")
        bad = [r for r in self.reads if r not in named and hidden_index(r) is None]
        if not self.reads or bad:
            raise ValueError(f"TextEncoderStage reads {self.reads!r}: each one of {named} or "
                             f"'hidden_states[k]'")
        if "input_ids" not in self.inputs or not set(self.inputs) <= set(TEXT_INPUTS):
            raise ValueError(f"TextEncoderStage inputs {self.inputs!r}: input_ids and "
                             f"optionally attention_mask")


@dataclass(frozen=True)
class ImageEncoderStage:
    """What the family's pipeline reads of one image encoder component, called as
    ``image_encoder(pixel_values=..., output_hidden_states=True)`` (module docstring)."""

    reads: tuple[str, ...]

    def __post_init__(self):
        TextEncoderStage(reads=self.reads)  # the same reads, checked there


@dataclass(frozen=True)
class VaeStage:
    """The family's VAE: its layout (:data:`VAE_LAYOUTS`), the pipeline classes that encode
    with it (image to image, edit, image to video: the encoder is exported for those), and
    ``tensors``: the state-dict keys of the tensors its pipelines read off the module (as
    ``vae.bn.running_mean``), saved in :data:`TENSORS_FILE` and offered by the drop-in under
    the same attribute path."""

    layout: str
    encode: tuple[str, ...] = ()
    tensors: tuple[str, ...] = ()

    def __post_init__(self):
        if self.layout not in VAE_LAYOUTS:
            raise ValueError(f"VaeStage layout {self.layout!r}: one of {VAE_LAYOUTS}")
        bad = [k for k in self.tensors if not is_tensor_key(k)]
        if bad:
            raise ValueError(f"VaeStage tensors {bad!r}: each a dotted state-dict key "
                             f"(module.buffer)")


@dataclass(frozen=True)
class PipelineStages:
    """A family's pipeline stages besides the transformer, for the diffusers pipeline classes
    ``pipelines`` and ``vae.encode`` (another pipeline of the same transformer may call its
    encoders otherwise: an edit pipeline's text encoder reads images): its text encoder
    components by name, and its VAE (component ``vae``)."""

    pipelines: tuple[str, ...]
    text_encoders: Mapping[str, TextEncoderStage] = field(default_factory=dict)
    vae: VaeStage | None = None
    #: image encoder components by name, each optional (exported where the folder has it)
    image_encoders: Mapping[str, ImageEncoderStage] = field(default_factory=dict)
    #: (height, width) in pixels its pipelines make by default: the VAE engines' profile
    size: tuple[int, int] = (1024, 1024)

    def all_pipelines(self) -> tuple[str, ...]:
        """Every pipeline class the stages serve: ``pipelines`` and those that encode."""
        encoding = self.vae.encode if self.vae is not None else ()
        return tuple(dict.fromkeys(self.pipelines + encoding))

    def components(self) -> tuple[str, ...]:
        """The components every pipeline of these stages has (the image encoders are
        optional)."""
        return tuple(self.text_encoders) + (("vae",) if self.vae is not None else ())


def declared_stages(declared) -> tuple[PipelineStages, ...]:
    """A family record's ``stages`` as a tuple: none (None), its one :class:`PipelineStages`,
    or the several it declares, one per set of pipeline classes that read the same components
    alike (FLUX.2: klein's Qwen3 hidden states 9/18/27, [dev]'s Mistral3 10/20/30)."""
    if declared is None:
        return ()
    return tuple(declared) if isinstance(declared, tuple) else (declared,)


def stages_for(declared, pipeline: str) -> PipelineStages | None:
    """The :class:`PipelineStages` of a record's ``stages`` that serve the diffusers pipeline
    class ``pipeline`` (None: none does)."""
    return next((s for s in declared_stages(declared) if pipeline in s.all_pipelines()), None)


def served_pipelines(declared) -> tuple[str, ...]:
    """Every pipeline class a record's ``stages`` serve, in declaration order."""
    return tuple(dict.fromkeys(p for s in declared_stages(declared) for p in s.all_pipelines()))


def is_tensor_key(key: object) -> bool:
    """``key`` is a dotted state-dict key of public attribute names (``bn.running_mean``)."""
    return isinstance(key, str) and all(p.isidentifier() and not p.startswith("_")
                                        for p in key.split("."))


def engine_name(graph_file: str) -> str:
    """The file name of a stage graph's engine, beside it: ``decode.onnx`` -> ``decode.engine``.
    Where an engine is comes from the graph's name, never from a path a JSON file holds."""
    stem, dot, _ = graph_file.rpartition(".")
    return f"{stem if dot else graph_file}.engine"


def graph_files(files: Mapping[str, object], graph_file: str) -> list[str]:
    """The files of one graph among a stage record's ``files`` (in their order): the graph and
    its external data (``decode.onnx.data``)."""
    return [f for f in files if f == graph_file or f.startswith(graph_file + ".")]


def graph_files_digest(named_sha256) -> str:
    """One sha256 over a graph's files, ``(name, sha256)`` pairs in order: what a stage engine
    records as built from (its ``build_key.onnx_sha256``)."""
    import hashlib

    digest = hashlib.sha256()
    for name, sha in named_sha256:
        digest.update(f"{name}\0{sha}\n".encode())
    return digest.hexdigest()


def is_engines_record(record: object) -> bool:
    """``record`` (read from :data:`ENGINES_FILE`) has its format and an ``engines`` mapping."""
    return (isinstance(record, dict) and record.get("format") == ENGINES_FORMAT
            and isinstance(record.get("engines"), dict))


def stage_record(**fields) -> dict:
    """A stage folder's record (:data:`STAGE_FILE`) of ``fields``: ``class`` (the drop-in class
    qkrope.runtime offers), ``dtype``, ``graphs`` (graph name -> its file, inputs and outputs),
    ``files`` (name -> size and sha256), and the stage's own (a text encoder's ``reads``,
    ``inputs`` and ``hidden_states`` count; a VAE's ``layout``)."""
    return {"format": STAGE_FORMAT, "format_version": STAGE_FORMAT_VERSION, **fields}


__all__ = ["stage_record", "is_tensor_key", "declared_stages", "stages_for", "served_pipelines", "engine_name", "graph_files", "graph_files_digest",
           "is_engines_record", "ENGINES_FILE", "ENGINES_FORMAT", "ENGINES_FORMAT_VERSION",
           "DROPIN_CLASSES", "STAGE_FILE", "STAGE_FORMAT", "STAGE_FORMAT_VERSION", "PIPELINE_FILE",
           "PIPELINE_FORMAT", "TENSORS_FILE", "TEXT_INPUTS", "VAE_LAYOUTS", "MODEL_LIBRARIES",
           "hidden_index", "output_name", "TextEncoderStage", "ImageEncoderStage", "VaeStage",
           "PipelineStages"]
