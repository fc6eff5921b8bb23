"""A text encoder component to ONNX: one graph from the token ids (and the attention mask,
where the pipeline passes one) to exactly what the family's pipeline reads of the call
(qkrope.stages.TextEncoderStage: ``last_hidden_state``, ``pooler_output``, or one layer of
``output_hidden_states``). The pipeline's prompt template, the prefix it drops and its padding
stay in the pipeline's Python, which runs unchanged around the drop-in.

An image encoder (qkrope.stages.ImageEncoderStage) the same way, from ``pixel_values``
``[B, C, S, S]`` (S the config's ``image_size``, fixed: the position embeddings are learnt for
it; the batch dynamic); its image processor stays in the pipeline's Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from qkrope.errors import InputError
from qkrope.stages import (DROPIN_CLASSES, ImageEncoderStage, TextEncoderStage, hidden_index,
                           output_name)

from ._onnx import file_facts, trace

#: the traced sample: batch and tokens (distinct sizes above 1, so that torch.export keeps both
#: axes dynamic), the last prompt padded by this many tokens
SAMPLE_BATCH, SAMPLE_TOKENS, SAMPLE_PAD = 2, 7, 2


class _Reads(nn.Module):
    """The encoder's call as the pipeline makes it, returning the declared reads in order."""

    def __init__(self, encoder: nn.Module, stage: TextEncoderStage | ImageEncoderStage,
                 dtype: torch.dtype):
        super().__init__()
        self.encoder, self.stage, self.dtype = encoder, stage, dtype
        self.hidden = any(hidden_index(r) is not None for r in stage.reads)

    def call(self, **kwargs):
        out = self.encoder(**kwargs, output_hidden_states=self.hidden, return_dict=True)
        reads = []
        for read in self.stage.reads:
            k = hidden_index(read)
            reads.append(out.hidden_states[k] if k is not None else getattr(out, read))
        return widened(tuple(reads), self.dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        kwargs: dict[str, Any] = {"input_ids": input_ids}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return self.call(**kwargs)


class _ImageReads(_Reads):
    def forward(self, pixel_values: torch.Tensor):
        return self.call(pixel_values=pixel_values)


def widened(values: tuple, dtype: torch.dtype) -> tuple:
    """``values`` with bfloat16 ones as float32 (exact): ONNX Runtime's bfloat16 outputs cannot
    be read back through numpy, so a stage graph's floating outputs leave it as float32."""
    return tuple(v.float() if dtype == torch.bfloat16 and v.is_floating_point() else v
                 for v in values)


def sample_inputs(encoder: nn.Module, stage: TextEncoderStage) -> tuple[torch.Tensor, ...]:
    """The traced token ids (below the vocabulary size) and mask (the last prompt padded)."""
    config = encoder.config  # a multimodal config keeps its vocabulary in its text config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or getattr(config, "vocab_size", 0) or 0) or 1000
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(vocab, 1000), (SAMPLE_BATCH, SAMPLE_TOKENS), generator=g)
    if "attention_mask" not in stage.inputs:
        return (ids,)
    mask = torch.ones_like(ids)
    mask[-1, SAMPLE_TOKENS - SAMPLE_PAD:] = 0
    return ids, mask


def hidden_states_count(encoder: nn.Module, args: tuple) -> int:
    """How many entries the encoder's ``hidden_states`` has (embeddings + one per layer)."""
    if args[0].is_floating_point():  # an image encoder's pixel_values
        kwargs = {"pixel_values": args[0][:1]}
    else:
        kwargs = {"input_ids": args[0][:1, :2]}
    if len(args) > 1:
        kwargs["attention_mask"] = args[1][:1, :2]
    with torch.no_grad():
        out = encoder(**kwargs, output_hidden_states=True, return_dict=True)
    return len(out.hidden_states)


def export_text_encoder(encoder: nn.Module, stage: TextEncoderStage, folder: Path, *,
                        opset: int, dtype: torch.dtype) -> dict[str, Any]:
    """Export ``encoder`` (in ``dtype``, eval mode) into ``folder`` as ``encoder.onnx``; returns
    the stage record's fields."""
    encoder = encoder.eval()
    args = sample_inputs(encoder, stage)
    names = list(stage.inputs)
    outputs = [output_name(r) for r in stage.reads]
    auto = torch.export.Dim.AUTO
    dynamic = {n: {0: auto, 1: auto} for n in names}
    files = trace(_Reads(encoder, stage, dtype), args, input_names=names,
                  output_names=outputs, dynamic=dynamic, opset=opset,
                  out=folder / "encoder.onnx")
    return {"class": DROPIN_CLASSES["text_encoder"], "reads": list(stage.reads),
            "inputs": names, "hidden_states": hidden_states_count(encoder, args),
            "graphs": {"encode": {"file": files[0].name, "inputs": names, "outputs": outputs}},
            "files": file_facts(files)}


#: the traced image batch (above 1: a dynamic axis)
IMAGE_BATCH = 2


def image_size(encoder: nn.Module) -> tuple[int, int]:
    """(channels, side) of the images ``encoder`` takes: its (vision) config's
    ``num_channels`` and ``image_size``; one line where the config has no side."""
    config = encoder.config
    vision = getattr(config, "vision_config", None) or config
    side = getattr(vision, "image_size", None)
    if isinstance(side, (list, tuple)) and len(set(side)) == 1:
        side = side[0]
    if not isinstance(side, int) or side <= 0:
        raise InputError(f"{type(encoder).__name__}'s config gives no square image_size "
                         f"({side!r}), so the image encoder's input cannot be sized. Fix: "
                         f"export the transformer alone (--model transformer) and run this "
                         f"encoder in PyTorch")
    return int(getattr(vision, "num_channels", 3) or 3), side


def export_image_encoder(encoder: nn.Module, stage: ImageEncoderStage, folder: Path, *,
                         opset: int, dtype: torch.dtype) -> dict[str, Any]:
    """Export the image ``encoder`` (in ``dtype``, eval mode) into ``folder`` as
    ``encoder.onnx`` (module docstring); returns the stage record's fields."""
    encoder = encoder.eval()
    channels, side = image_size(encoder)
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(IMAGE_BATCH, channels, side, side, generator=g).to(dtype),)
    outputs = [output_name(r) for r in stage.reads]
    files = trace(_ImageReads(encoder, stage, dtype), args, input_names=["pixel_values"],
                  output_names=outputs, dynamic={"pixel_values": {0: torch.export.Dim.AUTO}},
                  opset=opset, out=folder / "encoder.onnx")
    return {"class": DROPIN_CLASSES["image_encoder"], "reads": list(stage.reads),
            "inputs": ["pixel_values"], "image_size": [channels, side, side],
            "hidden_states": hidden_states_count(encoder, args),
            "graphs": {"encode": {"file": files[0].name, "inputs": ["pixel_values"],
                                  "outputs": outputs}},
            "files": file_facts(files)}
