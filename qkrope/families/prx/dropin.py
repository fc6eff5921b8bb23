"""PRX's part of the pipeline drop-in (runtime layer). ``PRXPipeline`` (and
``PRXPixelPipeline``) call ``pipe.transformer(hidden_states=[B, C, H, W], timestep=,
encoder_hidden_states=, attention_mask=, return_dict=False)``. :class:`PRXTransformer` packs
the latent into the patches the graph takes (:func:`qkrope.runtime.latents.pack_patches`),
asks the "ids" scheme for the cache of its (row, column) grid, and unpacks the sample as
diffusers' ``seq2img`` does. A call without a mask attends every text token (a mask of ones:
diffusers' None). Refused in one line: ``attention_kwargs`` other than a LoRA scale of 1 (what
was fixed at export), and a mask or text of another batch or length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qkrope.errors import InputError
from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime._dropin import (Call, Transformer, require_arguments, per_item, refuse_kwargs,
                                    tensor_arg)
from qkrope.runtime.latents import pack_patches, unpack_patches


def grid_request(h: int, w: int, txt_len: int) -> dict:
    """The "ids" request of an ``h x w`` patch grid as diffusers' ``get_image_ids`` lays it out
    ((row, column) in row-major order) and ``txt_len`` text tokens at 0 (not rotated)."""
    rows, cols = torch.meshgrid(torch.arange(int(h)), torch.arange(int(w)), indexing="ij")
    img = torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1).float()
    return {"txt_ids": torch.zeros(max(int(txt_len), 1), 2), "img_ids": img}


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes: the first grid ``(1, h, w)``."""
    _, h, w = (int(v) for v in img_shapes[0])
    return grid_request(h, w, txt_len)


class PRXTransformer(Transformer):
    """What PRX's pipelines call on ``pipe.transformer`` (module docstring)."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states", "attention_mask",
                    "attention_kwargs", "return_dict")
    PIPELINES = "PRXPipeline, PRXPixelPipeline"

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                attention_mask=None, attention_kwargs=None, return_dict: bool = True) -> Call:
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        require_arguments(self.record.short, hidden_states=hidden_states, timestep=timestep,
                          encoder_hidden_states=encoder_hidden_states)
        p = int(self.config.get("patch_size", 2))
        tensor_arg(hidden_states, "hidden_states", 4, "[batch, channels, height, width]")
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   f"[batch, text_tokens, {self.config.get('context_in_dim')}]")
        tokens, grid = pack_patches(hidden_states, (p, p))
        batch, txt = int(tokens.shape[0]), int(encoder_hidden_states.shape[1])
        if int(encoder_hidden_states.shape[0]) != batch:
            raise InputError(f"hidden_states has batch {batch} but encoder_hidden_states "
                             f"{int(encoder_hidden_states.shape[0])}. Fix: pass one prompt "
                             f"embedding per latent")
        if attention_mask is None:
            mask = torch.ones(batch, txt, dtype=torch.int64)
        else:
            mask = tensor_arg(attention_mask, "attention_mask", 2,
                              f"[batch, {txt}] (1 / True = a real text token)")
            if tuple(mask.shape) != (batch, txt):
                raise InputError(f"attention_mask {list(mask.shape)} must be [batch={batch}, "
                                 f"text tokens={txt}] of encoder_hidden_states. Fix: pass the "
                                 f"pipeline's prompt mask")
            mask = mask.to(torch.int64)
        return Call(tokens.to(self.dtype), encoder_hidden_states.to(self.dtype),
                    grid_request(grid[0], grid[1], txt),
                    timestep=per_item(timestep, "timestep", batch, torch.float32), mask=mask,
                    return_dict=return_dict,
                    unpack=lambda sample: unpack_patches(sample, grid, (p, p)).contiguous())


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return PRXTransformer


__all__ = ["PRXTransformer", "dropin_class", "grid_request", "sample_request"]
