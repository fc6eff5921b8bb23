"""Cosmos-Predict2's part of the pipeline drop-in (runtime layer): ``Cosmos2TextToImagePipeline``
and ``Cosmos2VideoToWorldPipeline`` call ``pipe.transformer(hidden_states, timestep,
encoder_hidden_states, fps=..., condition_mask=..., padding_mask=...)``;
:class:`CosmosTransformer` maps that call onto the generic drop-in
(:mod:`qkrope.runtime._dropin`) and the "scaled_grid" position scheme (the latent's token grid
and the call's fps).

What diffusers' model does before its patch embedding is done here, without arithmetic: the
condition mask concatenated as a channel (Video2World), the padding mask resized to the
latent's size with nearest neighbours (torchvision's tensor path: ``F.interpolate(mode=
"nearest")``), a ``[batch]`` timestep repeated over the latent frames (diffusers' per-frame
form ``[batch, 1, frames, 1, 1]`` is taken as it is).

Refused in one line, never ignored: ControlNet residuals (``block_controlnet_hidden_states``),
a text ``attention_mask`` (the graph attends to every text token; the pipelines pass none), an
image context (Cosmos-Predict2.5's ``(text, image)`` tuple), a padding mask of more than one
item, a latent whose channels are not the model's.
"""

from __future__ import annotations

import torch

from qkrope.errors import InputError
from qkrope.runtime._dropin import (Call, Transformer, require_arguments, per_item, short_repr,
                                    tensor_arg)
from qkrope.runtime.schemes import scaled_grid


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample: the first grid (tokens), an image call (no fps)."""
    return scaled_grid.sample_request(img_shapes[0])


def frame_timesteps(timestep, batch: int, frames: int, dtype: torch.dtype) -> torch.Tensor:
    """The graph's ``[batch, frames]`` timesteps from what a Cosmos pipeline passes: a number
    or ``[batch]`` (Text2Image; the same value on every frame) or ``[batch, 1, frames, 1, 1]``
    (Video2World: the conditioning frames have their own)."""
    if isinstance(timestep, torch.Tensor) and timestep.dim() == 5:
        if tuple(timestep.shape) != (batch, 1, frames, 1, 1):
            raise InputError(f"timestep must be [batch] or [batch, 1, frames, 1, 1] = "
                             f"{[batch, 1, frames, 1, 1]}; got {list(timestep.shape)}. Fix: one "
                             f"value per batch item (and latent frame)")
        return timestep.reshape(batch, frames).to(dtype).contiguous()
    if isinstance(timestep, torch.Tensor) and timestep.dim() > 1:
        raise InputError(f"timestep must be [batch] or [batch, 1, frames, 1, 1]; got "
                         f"{list(timestep.shape)}")
    values = per_item(timestep, "timestep", batch, dtype)
    if values.shape != (batch,):
        raise InputError(f"timestep must hold {batch} values (one per batch item); got "
                         f"{short_repr(timestep, 60)}")
    return values.reshape(batch, 1).expand(batch, frames).contiguous()


class CosmosTransformer(Transformer):
    """What diffusers' Cosmos-Predict2 pipelines call on ``pipe.transformer`` (module
    docstring). Built by :func:`qkrope.runtime.load_transformer` for a Cosmos export."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "block_controlnet_hidden_states", "attention_mask", "fps", "condition_mask",
                    "padding_mask", "return_dict")
    PIPELINES = "Cosmos2TextToImagePipeline, Cosmos2VideoToWorldPipeline"

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                block_controlnet_hidden_states=None, attention_mask=None, fps=None,
                condition_mask=None, padding_mask=None, return_dict: bool = True) -> Call:
        if block_controlnet_hidden_states is not None:
            raise InputError("block_controlnet_hidden_states: the exported Cosmos transformer has "
                             "no ControlNet residual inputs. Fix: run Cosmos-Transfer pipelines "
                             "on the PyTorch model")
        if attention_mask is not None:
            raise InputError("attention_mask: the exported Cosmos transformer attends to every "
                             "text token (its pipelines pass no mask). Fix: drop attention_mask")
        if isinstance(encoder_hidden_states, tuple):
            raise InputError("encoder_hidden_states is a (text, image context) tuple (Cosmos-"
                             "Predict2.5); the exported Cosmos-Predict2 transformer takes the "
                             "text embeddings alone. Fix: pass the prompt embeddings tensor")
        require_arguments("Cosmos-Predict2", hidden_states=hidden_states, timestep=timestep,
                          encoder_hidden_states=encoder_hidden_states,
                          padding_mask=padding_mask)
        latent = tensor_arg(hidden_states, "hidden_states", 5,
                            "[batch, channels, frames, height, width] (the latent)")
        text = tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                          f"[batch, text_tokens, {self.config.get('text_embed_dim')}]")
        batch, _, frames, height, width = (int(v) for v in latent.shape)
        if condition_mask is not None:
            tensor_arg(condition_mask, "condition_mask", 5, "[batch, 1, frames, height, width]")
            latent = torch.cat([latent, condition_mask.to(latent.dtype)], dim=1)
        channels = int(self.config.get("in_channels"))
        if latent.shape[1] != channels:
            extra = "" if condition_mask is None else " with condition_mask"
            raise InputError(
                f"hidden_states{extra} has {latent.shape[1]} channels; this model takes "
                f"{channels} (in_channels: a Video2World model's include the condition mask, "
                f"passed as condition_mask). Fix: run this export with its own pipeline")
        if text.shape[0] == 1 < batch:
            text = text.expand(batch, -1, -1)
        mask = tensor_arg(padding_mask, "padding_mask", 4, "[1, 1, height, width]")
        if mask.shape[0] != 1 or mask.shape[1] != 1:
            raise InputError(f"padding_mask must be [1, 1, height, width] (one mask for the "
                             f"batch, as the pipelines pass it); got {list(mask.shape)}")
        mask = torch.nn.functional.interpolate(mask, size=[height, width], mode="nearest")
        conditioning = {"padding_mask": mask.to(self.dtype)}
        grid = self._latent.grid(tuple(latent.shape))
        timestep = frame_timesteps(timestep, batch, frames, self.dtype)
        return Call(latent.to(self.dtype), text.to(self.dtype),
                    {"grid": grid, "fps": fps}, timestep=timestep,
                    conditioning=conditioning, return_dict=return_dict)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return CosmosTransformer


__all__ = ["CosmosTransformer", "dropin_class", "frame_timesteps", "sample_request"]
