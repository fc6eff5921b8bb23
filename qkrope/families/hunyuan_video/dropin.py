"""HunyuanVideo-1.5's and HunyuanVideo's part of the pipeline drop-in (runtime layer).

``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline`` call ``pipe.transformer(
hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, encoder_hidden_states_2=,
encoder_attention_mask_2=, image_embeds=, attention_kwargs=, return_dict=)``;
``HunyuanVideoPipeline`` / ``HunyuanVideoImageToVideoPipeline`` call it with
``pooled_projections`` and ``guidance`` in place of the ByT5 and image inputs. :meth:`prepare`
maps a call onto the graph: the position request of the "grid" scheme is the latent's own token
grid (``img_shapes=[(F/pt, H/p, W/p)]``, uncentred) and the text length of the joined text
stream (HunyuanVideo-1.5: MLLM + ByT5 + image tokens; identity rows, the text is not rotated).

Refused in one line: ``timestep_r`` (MeanFlow models), a LoRA scale other than 1 or other
``attention_kwargs``, a ``guidance`` value for a model exported without guidance embeddings.

The masks go to the graph as int64 (1 = a real token; the export traces them so); the call
runs through the generic runner (the 5-D latent, the caches of the call's grid).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qkrope.errors import InputError
from qkrope.families.hunyuan_video import HUNYUAN_VIDEO15
from qkrope.runtime._dropin import (Call, Transformer, missing_arguments, per_item, refuse_kwargs,
                                    tensor_arg)
from qkrope.runtime.latents import latent_of


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample of these sizes: the grids themselves (the first is the
    latent's token grid) and the joined text length."""
    return {"img_shapes": [tuple(int(v) for v in s) for s in img_shapes],
            "txt_seq_len": int(txt_len)}


def request_for(record, config: Mapping, hidden_states: torch.Tensor, txt_tokens: int) -> dict:
    """The "grid" request of a call: the latent's token grid and the text stream's length."""
    grid = latent_of(record, config).grid(tuple(hidden_states.shape))
    return {"img_shapes": [grid], "txt_seq_len": int(txt_tokens)}


#: The masks' dtype in the graph (export.sample_args traces them as int64).
MASK_DTYPE = torch.int64


class _HunyuanBase(Transformer):
    PIPELINES = ("HunyuanVideo15Pipeline, HunyuanVideo15ImageToVideoPipeline, "
                 "HunyuanVideoPipeline, HunyuanVideoImageToVideoPipeline")

    def _common(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                attention_kwargs):
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        tensor_arg(hidden_states, "hidden_states", 5,
                   "[batch, channels, frames, height, width] (the video latent)")
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   "[batch, tokens, features] (the prompt embeddings)")
        batch = int(hidden_states.shape[0])
        mask = tensor_arg(encoder_attention_mask, "encoder_attention_mask", 2,
                          "[batch, tokens] (1 = a real token)")
        if tuple(mask.shape) != tuple(encoder_hidden_states.shape[:2]):
            raise InputError(f"encoder_attention_mask {list(mask.shape)} must be [batch, tokens]"
                             f" of encoder_hidden_states {list(encoder_hidden_states.shape)}")
        return batch, per_item(timestep, "timestep", batch, self.dtype), mask.to(MASK_DTYPE)

class HunyuanVideo15Transformer(_HunyuanBase):
    """What HunyuanVideo-1.5's pipelines call on ``pipe.transformer``."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "encoder_attention_mask", "timestep_r", "encoder_hidden_states_2",
                    "encoder_attention_mask_2", "image_embeds", "attention_kwargs",
                    "return_dict")

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_attention_mask=None, timestep_r=None, encoder_hidden_states_2=None,
                encoder_attention_mask_2=None, image_embeds=None, attention_kwargs=None,
                return_dict: bool = True) -> Call:
        if timestep_r is not None:
            raise InputError("timestep_r (HunyuanVideo-1.5's MeanFlow super-resolution models) "
                             "is not in the exported graph. Fix: run MeanFlow models on the "
                             "PyTorch model")
        missing = [n for n, v in (("encoder_hidden_states_2", encoder_hidden_states_2),
                                  ("encoder_attention_mask_2", encoder_attention_mask_2),
                                  ("image_embeds", image_embeds)) if v is None]
        if missing:
            raise missing_arguments("HunyuanVideo-1.5", missing)  # zero image_embeds: T2V
        batch, timestep, mask = self._common(hidden_states, timestep, encoder_hidden_states,
                                       encoder_attention_mask, attention_kwargs)
        tensor_arg(encoder_hidden_states_2, "encoder_hidden_states_2", 3,
                   "[batch, tokens, features] (the ByT5 embeddings)")
        tensor_arg(image_embeds, "image_embeds", 3, "[batch, tokens, features]")
        mask_2 = tensor_arg(encoder_attention_mask_2, "encoder_attention_mask_2", 2,
                            "[batch, tokens] (1 = a real ByT5 token)")
        if tuple(mask_2.shape) != tuple(encoder_hidden_states_2.shape[:2]):
            raise InputError(f"encoder_attention_mask_2 {list(mask_2.shape)} must be [batch, "
                             f"tokens] of encoder_hidden_states_2 "
                             f"{list(encoder_hidden_states_2.shape)}")
        joined = sum(int(t.shape[1]) for t in (encoder_hidden_states, encoder_hidden_states_2,
                                                image_embeds))
        request = request_for(self.record, self.config, hidden_states, joined)
        extra = {"encoder_hidden_states_2": encoder_hidden_states_2.to(self.dtype),
                 "encoder_attention_mask_2": encoder_attention_mask_2.to(MASK_DTYPE),
                 "image_embeds": image_embeds.to(self.dtype)}
        return Call(hidden_states.to(self.dtype), encoder_hidden_states.to(self.dtype), request, timestep=timestep,
                    mask=mask, conditioning=extra, return_dict=return_dict)


class HunyuanVideoTransformer(_HunyuanBase):
    """What HunyuanVideo's pipelines call on ``pipe.transformer``."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "encoder_attention_mask", "pooled_projections", "guidance",
                    "attention_kwargs", "return_dict")

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_attention_mask=None, pooled_projections=None, guidance=None,
                attention_kwargs=None, return_dict: bool = True) -> Call:
        batch, timestep, mask = self._common(hidden_states, timestep, encoder_hidden_states,
                                       encoder_attention_mask, attention_kwargs)
        tensor_arg(pooled_projections, "pooled_projections", 2,
                   "[batch, pooled_projection_dim] (the pooled CLIP embedding)")
        conditioning = {"pooled_projections": pooled_projections.to(self.dtype)}
        guided = bool(self.config.get("guidance_embeds", False))
        if guided:
            if guidance is None:
                raise InputError("this HunyuanVideo transformer embeds a guidance scale "
                                 "(guidance_embeds=True) and needs guidance=[batch]; got None. "
                                 "Fix: pass the pipeline's guidance")
            conditioning["guidance"] = per_item(guidance, "guidance", batch, self.dtype)
        elif guidance is not None:
            raise InputError("guidance was given, but this HunyuanVideo transformer was exported "
                             "without guidance embeddings (guidance_embeds=False). Fix: drop "
                             "guidance")
        request = request_for(self.record, self.config, hidden_states,
                              int(encoder_hidden_states.shape[1]))
        return Call(hidden_states.to(self.dtype), encoder_hidden_states.to(self.dtype), request, timestep=timestep,
                    mask=mask, conditioning=conditioning,
                    return_dict=return_dict)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return HunyuanVideo15Transformer if record is HUNYUAN_VIDEO15 else HunyuanVideoTransformer


__all__ = ["HunyuanVideo15Transformer", "HunyuanVideoTransformer", "dropin_class",
           "request_for", "sample_request"]
