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
- the VAE: its layout (``image``: a 2-D autoencoder, one graph per call; ``causal-video``: a
  causal video autoencoder whose decoder runs latent frame by latent frame with its feature
  cache, exported as two graphs, the first chunk and each next one, the cache as their inputs
  and outputs), and which of its pipelines encode images (image to image, image to video).
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
class VaeStage:
    """The family's VAE: its layout (:data:`VAE_LAYOUTS`) and the pipeline classes that encode
    with it (image to image, edit, image to video: the encoder is exported for those)."""

    layout: str
    encode: tuple[str, ...] = ()

    def __post_init__(self):
        if self.layout not in VAE_LAYOUTS:
            raise ValueError(f"VaeStage layout {self.layout!r}: one of {VAE_LAYOUTS}")


@dataclass(frozen=True)
class PipelineStages:
    """A family's pipeline stages besides the transformer, for the diffusers pipeline classes
    ``pipelines`` and ``vae.encode`` (another pipeline of the same transformer may call its
    encoders otherwise: an edit pipeline's text encoder reads images): its text encoder
    components by name, and its VAE (component ``vae``)."""

    pipelines: tuple[str, ...]
    text_encoders: Mapping[str, TextEncoderStage] = field(default_factory=dict)
    vae: VaeStage | None = None
    #: (height, width) in pixels its pipelines make by default: the VAE engines' profile
    size: tuple[int, int] = (1024, 1024)

    def all_pipelines(self) -> tuple[str, ...]:
        """Every pipeline class the stages serve: ``pipelines`` and those that encode."""
        encoding = self.vae.encode if self.vae is not None else ()
        return tuple(dict.fromkeys(self.pipelines + encoding))

    def components(self) -> tuple[str, ...]:
        return tuple(self.text_encoders) + (("vae",) if self.vae is not None else ())


def stage_record(**fields) -> dict:
    """A stage folder's record (:data:`STAGE_FILE`) of ``fields``: ``class`` (the drop-in class
    qkrope.runtime offers), ``dtype``, ``graphs`` (graph name -> its file, inputs and outputs),
    ``files`` (name -> size and sha256), and the stage's own (a text encoder's ``reads``,
    ``inputs`` and ``hidden_states`` count; a VAE's ``layout``)."""
    return {"format": STAGE_FORMAT, "format_version": STAGE_FORMAT_VERSION, **fields}


__all__ = ["stage_record", "STAGE_FILE", "STAGE_FORMAT", "STAGE_FORMAT_VERSION", "PIPELINE_FILE",
           "PIPELINE_FORMAT", "TEXT_INPUTS", "VAE_LAYOUTS", "MODEL_LIBRARIES", "hidden_index",
           "output_name", "TextEncoderStage", "VaeStage", "PipelineStages"]
