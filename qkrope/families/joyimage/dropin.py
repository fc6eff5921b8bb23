"""JoyImage Edit's part of the pipeline drop-in (runtime layer).

``JoyImageEditPipeline`` calls ``pipe.transformer(hidden_states=, timestep=,
encoder_hidden_states=, return_dict=False)`` with the 6-D latent ``[batch, items, channels,
frames, height, width]`` (the reference images' latents first, the target last), and a plain
call may pass the 5-D ``[batch, channels, frames, height, width]``. :meth:`prepare` does what
diffusers' forward does before patchifying: with several items the target moves first, and the
items lie along the frames (``[batch, channels, items x frames, height, width]``); the call's
``unpack`` undoes both on the sample. The position request of the "grid" scheme is that latent's
token grid (uncentred) and the text length (identity rows: the text is not rotated).
"""

from __future__ import annotations

import torch

from qkrope.errors import InputError
from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime._dropin import Call, Transformer, per_item, tensor_arg
from qkrope.runtime.latents import latent_of


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample of these sizes: the grids (the first is the latent's
    token grid) and the text length."""
    return {"img_shapes": [tuple(int(v) for v in s) for s in img_shapes],
            "txt_seq_len": int(txt_len)}


def items_to_frames(hidden_states: torch.Tensor) -> torch.Tensor:
    """The edit pipeline's ``[B, N, C, T, H, W]`` as diffusers' forward lays it out: the last
    item (the target) first when N > 1, then ``[B, C, N * T, H, W]``."""
    n = int(hidden_states.shape[1])
    if n > 1:
        hidden_states = torch.cat([hidden_states[:, -1:], hidden_states[:, :-1]], dim=1)
    b, n, c, t, h, w = hidden_states.shape
    return hidden_states.permute(0, 2, 1, 3, 4, 5).reshape(b, c, n * t, h, w)


def frames_to_items(sample: torch.Tensor, items: int) -> torch.Tensor:
    """The inverse of :func:`items_to_frames` on the model's output ``[B, C, N * T, H, W]``."""
    b, c, nt, h, w = sample.shape
    out = sample.reshape(b, c, items, nt // items, h, w).permute(0, 2, 1, 3, 4, 5)
    return torch.cat([out[:, 1:], out[:, :1]], dim=1) if items > 1 else out


class JoyImageEditTransformer(Transformer):
    """What ``JoyImageEditPipeline`` calls on ``pipe.transformer``."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states", "return_dict")
    PIPELINES = "JoyImageEditPipeline"

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                return_dict: bool = True) -> Call:
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() not in (5, 6):
            got = (list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor)
                   else type(hidden_states).__name__)
            raise InputError(f"hidden_states must be [batch, items, channels, frames, height, "
                             f"width] or [batch, channels, frames, height, width]; got {got}. "
                             f"Fix: pass the pipeline's latent (the edit pipeline's 6-D one, or "
                             f"a 5-D video latent)")
        unpack = None
        if hidden_states.dim() == 6:
            items = int(hidden_states.shape[1])
            if items > 1 and int(self.config.get("patch_size", (1,))[0]) != 1:
                raise InputError(f"{items} items need a temporal patch of 1 (diffusers' rule); "
                                 f"this model's patch_size is {list(self.config['patch_size'])}. "
                                 f"Fix: pass one item, or export a model whose patch_size starts "
                                 f"with 1")
            hidden_states = items_to_frames(hidden_states)
            unpack = lambda sample, n=items: frames_to_items(sample, n)  # noqa: E731
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   "[batch, tokens, features] (the prompt embeddings)")
        batch = int(hidden_states.shape[0])
        grid = latent_of(self.record, self.config).grid(tuple(hidden_states.shape))
        request = {"img_shapes": [grid], "txt_seq_len": int(encoder_hidden_states.shape[1])}
        return Call(hidden_states.to(self.dtype), encoder_hidden_states.to(self.dtype), request,
                    timestep=per_item(timestep, "timestep", batch, self.dtype),
                    return_dict=return_dict, unpack=unpack)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return JoyImageEditTransformer


__all__ = ["JoyImageEditTransformer", "dropin_class", "frames_to_items", "items_to_frames",
           "sample_request"]
