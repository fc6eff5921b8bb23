"""Chroma's part of the pipeline drop-in (runtime layer): ``ChromaPipeline``,
``ChromaImg2ImgPipeline`` and ``ChromaInpaintPipeline`` call ``pipe.transformer(hidden_states,
timestep, encoder_hidden_states, txt_ids, img_ids, attention_mask, joint_attention_kwargs,
return_dict=False)``; :class:`ChromaTransformer` maps that call onto the generic drop-in
(:mod:`qkrope.runtime._dropin`) and the "ids" position scheme.

The mask: the pipelines pass ``attention_mask`` = [text mask; ones for the image tokens] in the
prompt embeddings' float dtype, and diffusers' SDPA adds a float mask to the scores (it does not
drop keys: diffusers issues 12116, 13619). The graph takes the text part
(``encoder_hidden_states_mask``, in the model's dtype) and adds the same pairwise products, so
the drop-in reproduces the stock pipelines. Refused in one line: a bool mask (diffusers drops
keys for it; the graph adds a float one), a mask whose image part is not all ones, ControlNet
residuals, IP-Adapter image embeddings, a LoRA scale other than 1 (or other
``joint_attention_kwargs``). ``attention_mask=None`` (no pipeline passes it) runs with the text
mask all ones: a uniform +1 on every score, which softmax cancels up to rounding. The drop-in's
config has ``guidance_embeds=False``, which ``ChromaInpaintPipeline`` reads and diffusers' own
Chroma config lacks (with the stock transformer that pipeline stops with an AttributeError).

The rest is the shared dual-stream drop-in
(:class:`qkrope.runtime.dual_stream.DualStreamTransformer`: ids, timestep, refusals) with
Chroma's :data:`qkrope.families.chroma.DUAL_STREAM`; also the family's cache builder
:func:`caches_from_ids`, the ids its pipelines lay out for given sizes (:func:`sample_ids`,
:func:`sample_request`: what ``make_inputs`` and the exporter's sample need).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from qkrope.errors import InputError
from qkrope.runtime import dual_stream
from qkrope.runtime._dropin import Call, tensor_arg
from qkrope.runtime.dual_stream import DualStreamTransformer, IPAdapterUnsupportedError

from . import DUAL_STREAM

#: Chroma's RoPE caches from its position ids (``[tokens, 3]``), as diffusers'
#: ``FluxPosEmbed`` computes them, as wide as the model's heads
#: (:func:`qkrope.runtime.dual_stream.caches_from_ids`)
caches_from_ids = functools.partial(dual_stream.caches_from_ids, "chroma")


def sample_ids(img_shapes, txt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(txt_ids, img_ids), float32 ``[tokens, 3]``, as the Chroma pipelines make them: text ids
    all 0, the image's patch at (0, row, column) (FLUX.1's layout; a further image of
    ``img_shapes`` at first axis k, as FLUX.1 Kontext lays out a condition image)."""
    return dual_stream.sample_ids(DUAL_STREAM.ids, img_shapes, txt_len)


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the ids the pipelines pass."""
    return dual_stream.ids_request(DUAL_STREAM.ids, img_shapes, txt_len)


class ChromaTransformer(DualStreamTransformer):
    """What diffusers' Chroma pipelines call on ``pipe.transformer`` (module docstring). Built
    by :func:`qkrope.runtime.load_transformer` for a Chroma export."""

    SPEC = DUAL_STREAM

    def __init__(self, runner, record, *, device=None):
        from qkrope.runtime._dropin import frozen_config

        super().__init__(runner, record, device=device)
        # ChromaInpaintPipeline (diffusers 0.42.1) reads transformer.config.guidance_embeds,
        # which ChromaTransformer2DModel's config lacks (the stock model fails there with an
        # AttributeError); Chroma embeds no guidance, so the drop-in's config says False (the
        # pipeline then passes none, as to every Chroma transformer)
        if "guidance_embeds" not in self.config:
            self.config = frozen_config({**self.config, "guidance_embeds": False})

    def prepare(self, **call) -> Call:
        prepared = super().prepare(**call)
        prepared.mask = self._text_mask(call.get("attention_mask"),
                                        int(prepared.hidden_states.shape[0]),
                                        int(prepared.encoder_hidden_states.shape[1]),
                                        int(prepared.hidden_states.shape[1]))
        return prepared

    def _text_mask(self, attention_mask, batch: int, s_txt: int, s_img: int):
        """The graph's text mask from the pipelines' ``attention_mask`` ([batch, text + image]
        tokens, float), or None (the runner's all-ones mask)."""
        if attention_mask is None:
            return None
        layout = f"[batch, txt_tokens + img_tokens] = [{batch}, {s_txt + s_img}]"
        tensor_arg(attention_mask, "attention_mask", 2, layout,
                   "pass the mask the Chroma pipeline prepares (the prompt mask, then ones for "
                   "the image tokens)")
        if tuple(attention_mask.shape) != (batch, s_txt + s_img):
            raise InputError(f"attention_mask must be {layout}; got "
                             f"{tuple(attention_mask.shape)}. Fix: pass the prompt mask "
                             f"followed by ones for the image tokens, one row per batch item")
        if attention_mask.dtype == torch.bool or not attention_mask.is_floating_point():
            raise InputError(
                f"attention_mask is {attention_mask.dtype}; diffusers' SDPA drops keys for a bool "
                f"mask, while this export adds the float 0/1 mask the Chroma pipelines pass "
                f"(prompt_attention_mask in the prompt embeddings' dtype). Fix: pass the mask "
                f"as a float tensor (attention_mask.to(prompt_embeds.dtype)), or run the "
                f"PyTorch model for a dropping mask")
        if not bool((attention_mask[:, s_txt:] == 1).all()):
            raise InputError("attention_mask's image part (after the text tokens) is not all "
                             "ones; the graph takes a text mask and joins ones for the image, "
                             "as the Chroma pipelines do. Fix: mask only text tokens")
        return attention_mask[:, :s_txt].to(self.dtype)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return ChromaTransformer


__all__ = ["ChromaTransformer", "IPAdapterUnsupportedError", "caches_from_ids", "dropin_class",
           "sample_ids", "sample_request"]
