"""HunyuanVideo-1.5's and HunyuanVideo's part of the pipeline drop-in (runtime layer).

``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline`` call ``pipe.transformer(
hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, encoder_hidden_states_2=,
encoder_attention_mask_2=, image_embeds=, attention_kwargs=, return_dict=)``;
``HunyuanVideoPipeline`` / ``HunyuanVideoImageToVideoPipeline`` call it with
``pooled_projections`` and ``guidance`` in place of the ByT5 and image inputs. :meth:`prepare`
maps a call onto the graph: the position request of the "grid" scheme is the latent's own token
grid (``img_shapes=[(F/pt, H/p, W/p)]``, uncentred) and the text length of the joined text
stream (HunyuanVideo-1.5: MLLM + ByT5 + image tokens; identity rows, the text is not rotated).

``HunyuanVideoFramepackPipeline`` calls it with HunyuanVideo's arguments plus ``image_embeds``
and the history: ``latents_clean``, ``latents_history_2x``, ``latents_history_4x`` and the
frame indices of each part and of the latent (``indices_*``, 1-D, shared by the batch). Its
position request is the "ids" scheme's: one (frame index, row, column) row per full-resolution
token of each part in sequence order (:func:`framepack_ids`), the text rows those of the image
and text tokens (identity: not rotated).

Refused in one line: ``timestep_r`` (MeanFlow models), a LoRA scale other than 1 or other
``attention_kwargs``, a ``guidance`` value for a model exported without guidance embeddings.

The masks go to the graph as int64 (1 = a real token; the export traces them so); the call
runs through the generic runner (the 5-D latent, the caches of the call's grid).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from qkrope.errors import InputError
from qkrope.families.hunyuan_video import HUNYUAN_VIDEO15, HUNYUAN_VIDEO_FRAMEPACK
from qkrope.runtime._dropin import (Call, Transformer, require_arguments, per_item, refuse_kwargs,
                                    tensor_arg)
from qkrope.runtime.latents import latent_of


#: The history frames (clean, 2x, 4x) of an exported FramePack's sample, the traced one and a
#: check's (a check's inputs keep the export's values of model_io.HISTORY_AXES): counts that
#: need padding to whole 2x and 4x patches, so the padding is in the graph.
FRAMEPACK_SAMPLE_HISTORY = (2, 3, 5)


def framepack_sample_indices(frames: int, history=FRAMEPACK_SAMPLE_HISTORY) -> list:
    """Frame indices of a FramePack sample of ``frames`` latent frames behind ``history``
    (clean, 2x, 4x frames), in sequence order (4x, 2x, clean, latent), laid out as the
    pipeline's inverted anti-drifting sampling lays them out: the latent after the first
    frame, the clean part the first frame and the newest history frames, then the 2x and 4x
    history further on."""
    clean, h2, h4 = (int(n) for n in history)
    start = 1 + int(frames)
    latent = torch.arange(1, start)
    clean_idx = torch.cat([torch.zeros(1, dtype=torch.int64),
                           torch.arange(start, start + clean - 1)])
    idx_2x = torch.arange(start + clean - 1, start + clean - 1 + h2)
    idx_4x = torch.arange(start + clean - 1 + h2, start + clean - 1 + h2 + h4)
    return [idx_4x, idx_2x, clean_idx, latent]


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample of these sizes: the grids themselves (the first is the
    latent's token grid) and the joined text length; FramePack's the "ids" request of its
    latent grid behind :data:`FRAMEPACK_SAMPLE_HISTORY` (:func:`framepack_sample_indices`),
    the text rows identity."""
    if record is HUNYUAN_VIDEO_FRAMEPACK:
        f, h, w = (int(v) for v in img_shapes[0])
        return {"img_ids": framepack_ids(h, w, framepack_sample_indices(f)),
                "txt_ids": torch.zeros(int(txt_len), 3)}
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
        require_arguments("HunyuanVideo-1.5", encoder_hidden_states_2=encoder_hidden_states_2,
                          encoder_attention_mask_2=encoder_attention_mask_2,
                          image_embeds=image_embeds)  # zero image_embeds: T2V
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


def framepack_ids(height: int, width: int, frames) -> torch.Tensor:
    """The "ids" request's image positions of a FramePack call: ``frames`` the frame indices of
    each part in sequence order (4x history, 2x history, clean, latent), ``height`` x ``width``
    the latent's token grid (patch 2); float32 ``[rows, 3]``, one (frame, row, column) row per
    full-resolution token of each part (the export pools the 2x and 4x parts' rows, as
    diffusers pools its tables)."""
    rows = []
    for index in frames:
        f, y, x = torch.meshgrid(torch.as_tensor(index).to(torch.float32),
                                 torch.arange(int(height), dtype=torch.float32),
                                 torch.arange(int(width), dtype=torch.float32), indexing="ij")
        rows.append(torch.stack([f.reshape(-1), y.reshape(-1), x.reshape(-1)], dim=1))
    return torch.cat(rows, dim=0)


class HunyuanVideoFramepackTransformer(_HunyuanBase):
    """What HunyuanVideoFramepackPipeline calls on ``pipe.transformer``."""

    PIPELINES = "HunyuanVideoFramepackPipeline"
    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "encoder_attention_mask", "pooled_projections", "image_embeds",
                    "indices_latents", "guidance", "latents_clean", "indices_latents_clean",
                    "latents_history_2x", "indices_latents_history_2x", "latents_history_4x",
                    "indices_latents_history_4x", "attention_kwargs", "return_dict")
    #: The history parts in sequence order: (latent argument, its frame indices' argument).
    HISTORY = (("latents_history_4x", "indices_latents_history_4x"),
               ("latents_history_2x", "indices_latents_history_2x"),
               ("latents_clean", "indices_latents_clean"))

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_attention_mask=None, pooled_projections=None, image_embeds=None,
                indices_latents=None, guidance=None, latents_clean=None,
                indices_latents_clean=None, latents_history_2x=None,
                indices_latents_history_2x=None, latents_history_4x=None,
                indices_latents_history_4x=None, attention_kwargs=None,
                return_dict: bool = True) -> Call:
        given = dict(pooled_projections=pooled_projections, image_embeds=image_embeds,
                     indices_latents=indices_latents, latents_clean=latents_clean,
                     indices_latents_clean=indices_latents_clean,
                     latents_history_2x=latents_history_2x,
                     indices_latents_history_2x=indices_latents_history_2x,
                     latents_history_4x=latents_history_4x,
                     indices_latents_history_4x=indices_latents_history_4x)
        # diffusers' FramePack forward needs every part of the history
        require_arguments("HunyuanVideo FramePack", **given)
        batch, timestep, mask = self._common(hidden_states, timestep, encoder_hidden_states,
                                             encoder_attention_mask, attention_kwargs)
        tensor_arg(pooled_projections, "pooled_projections", 2,
                   "[batch, pooled_projection_dim] (the pooled CLIP embedding)")
        tensor_arg(image_embeds, "image_embeds", 3, "[batch, tokens, features] (SigLIP)")
        _, _, frames, height, width = (int(v) for v in hidden_states.shape)
        parts = [(latent, index) for latent, index in self.HISTORY]
        parts.append(("hidden_states", "indices_latents"))
        given["hidden_states"] = hidden_states
        indices = []
        for latent, index in parts:
            value = tensor_arg(given[latent], latent, 5,
                               "[batch, channels, frames, height, width]")
            if (value.shape[0], value.shape[3], value.shape[4]) != (batch, height, width):
                raise InputError(f"{latent} {list(value.shape)} must have the batch, height "
                                 f"and width of hidden_states {list(hidden_states.shape)}. Fix: "
                                 f"pass the pipeline's history latents of this latent")
            idx = tensor_arg(given[index], index, 1, "[frames] (one frame index per frame)")
            if idx.shape[0] != value.shape[2]:
                raise InputError(f"{index} has {idx.shape[0]} frame indices but {latent} has "
                                 f"{value.shape[2]} frames. Fix: pass one index per frame, as "
                                 f"the pipeline's {index} does")
            indices.append(idx)
        p = int(self.config["patch_size"])
        img_ids = framepack_ids(height // p, width // p, indices)
        txt_rows = int(image_embeds.shape[1]) + int(encoder_hidden_states.shape[1])
        request = {"img_ids": img_ids, "txt_ids": torch.zeros(txt_rows, 3)}
        conditioning = {"pooled_projections": pooled_projections.to(self.dtype),
                        "image_embeds": image_embeds.to(self.dtype)}
        conditioning.update({latent: given[latent].to(self.dtype)
                             for latent, _ in self.HISTORY})
        guided = bool(self.config.get("guidance_embeds", False))
        if guided and guidance is None:
            raise InputError("this FramePack transformer embeds a guidance scale "
                             "(guidance_embeds=True) and needs guidance=[batch]; got None. Fix: "
                             "pass the pipeline's guidance")
        if not guided and guidance is not None:
            raise InputError("guidance was given, but this FramePack transformer was exported "
                             "without guidance embeddings (guidance_embeds=False). Fix: drop "
                             "guidance")
        if guided:
            conditioning["guidance"] = per_item(guidance, "guidance", batch, self.dtype)
        return Call(hidden_states.to(self.dtype), encoder_hidden_states.to(self.dtype), request,
                    timestep=timestep, mask=mask, conditioning=conditioning,
                    return_dict=return_dict)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    if record is HUNYUAN_VIDEO_FRAMEPACK:
        return HunyuanVideoFramepackTransformer
    return HunyuanVideo15Transformer if record is HUNYUAN_VIDEO15 else HunyuanVideoTransformer


__all__ = ["HunyuanVideo15Transformer", "HunyuanVideoFramepackTransformer",
           "HunyuanVideoTransformer", "FRAMEPACK_SAMPLE_HISTORY", "dropin_class", "framepack_ids",
           "framepack_sample_indices", "request_for",
           "sample_request"]
