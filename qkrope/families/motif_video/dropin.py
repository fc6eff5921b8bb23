"""Motif-Video's part of the pipeline drop-in (runtime layer).

``MotifVideoPipeline`` calls ``pipe.transformer(hidden_states=, timestep=, attention_kwargs=,
return_dict=False, encoder_hidden_states=, encoder_attention_mask=)`` (inside
``cache_context``, the drop-in's no-op). :meth:`MotifVideoTransformer.prepare` maps a call onto
the graph: the position request of the "grid" scheme is the latent's own token grid
(``img_shapes=[(F/pt, H/p, W/p)]``, uncentred) and the text length (identity rows: the text is
not rotated). A call without a mask attends every text token (a mask of ones: diffusers' None).

Refused in one line: ``image_embeds`` (``MotifVideoImage2VideoPipeline``'s SigLIP tokens: not
in the exported graph), a LoRA scale other than 1 or other ``attention_kwargs``.
"""

from __future__ import annotations

import torch

from qkrope.errors import InputError
from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime._dropin import Call, Transformer, per_item, refuse_kwargs, tensor_arg
from qkrope.runtime.latents import latent_of

#: The mask's dtype in the graph (export.sample_args traces it as int64).
MASK_DTYPE = torch.int64


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample of these sizes: the latent's token grid and the text
    length."""
    return {"img_shapes": [tuple(int(v) for v in s) for s in img_shapes],
            "txt_seq_len": int(txt_len)}


class MotifVideoTransformer(Transformer):
    """What Motif-Video's pipeline calls on ``pipe.transformer``."""

    PIPELINES = "MotifVideoPipeline"
    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "encoder_attention_mask", "image_embeds", "attention_kwargs", "return_dict")

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_attention_mask=None, image_embeds=None, attention_kwargs=None,
                return_dict: bool = True) -> Call:
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        if image_embeds is not None:
            raise InputError("image_embeds (MotifVideoImage2VideoPipeline's image tokens) are "
                             "not in the exported Motif-Video graph. Fix: run image-to-video on "
                             "the PyTorch model")
        tensor_arg(hidden_states, "hidden_states", 5,
                   "[batch, channels, frames, height, width] (the video latent)")
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   "[batch, tokens, features] (the prompt embeddings)")
        batch, tokens = (int(v) for v in encoder_hidden_states.shape[:2])
        if int(hidden_states.shape[0]) != batch:
            raise InputError(f"hidden_states has batch {int(hidden_states.shape[0])} but "
                             f"encoder_hidden_states {batch}. Fix: pass one prompt embedding "
                             f"per latent")
        if encoder_attention_mask is None:
            mask = torch.ones(batch, tokens, dtype=MASK_DTYPE)
        else:
            mask = tensor_arg(encoder_attention_mask, "encoder_attention_mask", 2,
                              "[batch, tokens] (1 = a real token)")
            if tuple(mask.shape) != (batch, tokens):
                raise InputError(f"encoder_attention_mask {list(mask.shape)} must be [batch, "
                                 f"tokens] of encoder_hidden_states "
                                 f"{list(encoder_hidden_states.shape)}")
            mask = mask.to(MASK_DTYPE)
        grid = latent_of(self.record, self.config).grid(tuple(hidden_states.shape))
        return Call(hidden_states.to(self.dtype), encoder_hidden_states.to(self.dtype),
                    {"img_shapes": [grid], "txt_seq_len": tokens},
                    timestep=per_item(timestep, "timestep", batch, self.dtype), mask=mask,
                    return_dict=return_dict)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return MotifVideoTransformer


__all__ = ["MotifVideoTransformer", "dropin_class", "sample_request"]
