"""Wan's part of the pipeline drop-in (runtime layer): ``WanPipeline``,
``WanImageToVideoPipeline`` (Wan 2.2 I2V-A14B: the image enters as latent channels) and
``WanVideoToVideoPipeline`` call ``pipe.transformer(hidden_states=latent [B, C, F, H, W],
timestep, encoder_hidden_states, attention_kwargs=..., return_dict=False)``; Wan 2.2's two
experts are two exports, ``pipe.transformer`` and ``pipe.transformer_2``, and the pipeline's
boundary switch (``boundary_ratio``) picks one per step as it does for the PyTorch models.

:class:`WanTransformer` packs the latent's patches as tokens (the graph's input), builds the
image cache of its (frames, height, width) patch grid with the "grid" scheme (float64 tables,
uncentred), runs the export and unpacks the prediction to diffusers' 5-D latent. Any grid,
frame count, batch and CFG setting the export's profile admits works (nothing is traced in).

Refused in one line, never ignored: ``encoder_hidden_states_image`` (Wan 2.1 I2V's CLIP branch
is not exported), per-token timesteps that differ within a sample (TI2V-5B's image-to-video
with ``expand_timesteps``; equal ones, TI2V's text-to-video, are taken as one per sample), a
LoRA scale other than 1 or any other ``attention_kwargs``, a latent that is not a whole number
of patches.
"""

from __future__ import annotations

import numbers

import torch

from qkrope.errors import InputError
from qkrope.runtime._dropin import (Call, Transformer, missing_arguments, refuse_kwargs, short_repr,
                                    tensor_arg)
from qkrope.runtime.latents import VIDEO_5D, Latent


def pack(latent: torch.Tensor, patch) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, f * h * w, C * pt * ph * pw]: each token one patch in (channel,
    t, h, w) order (the Conv3d weight's), tokens in (frame, row, column) order."""
    b, c, f, h, w = latent.shape
    pt, ph, pw = patch
    x = latent.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * pt * ph * pw)


def unpack(sample: torch.Tensor, grid, patch) -> torch.Tensor:
    """The graph's [B, N, pt * ph * pw * C] prediction as diffusers' [B, C, F, H, W]
    (``WanTransformer3DModel.forward``'s unpatchify)."""
    f, h, w = grid
    pt, ph, pw = patch
    b = sample.shape[0]
    x = sample.reshape(b, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the grid and the text length (its rows are identity: the text is not rotated)."""
    from qkrope.runtime.schemes import grid

    return grid.sample_request(img_shapes, txt_len)


def _timestep(value, batch: int) -> torch.Tensor:
    """diffusers' timestep as the graph's float32 [batch]: a number, [1] or [batch]; [batch,
    tokens] when every token of a sample has the same value (TI2V's expand_timesteps for
    text-to-video)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise InputError(f"timestep must be a tensor (one value per batch item); got "
                         f"{type(value).__name__} {short_repr(value, 60)}")
    if value.dim() == 2:
        if value.shape[0] != batch or not bool((value == value[:, :1]).all()):
            raise InputError(
                f"timestep {list(value.shape)} gives different timesteps to the tokens of a "
                f"sample (Wan 2.2 TI2V-5B's image-to-video, expand_timesteps); the export "
                f"takes one timestep per sample. Fix: run TI2V-5B's image-to-video in PyTorch")
        value = value[:, 0]
    if value.dim() == 0 or (value.dim() == 1 and value.shape[0] == 1 and batch > 1):
        value = value.reshape(1).expand(batch)
    if value.dim() != 1 or value.shape[0] != batch:
        raise InputError(f"timestep must be [batch] ({batch}); got shape {list(value.shape)}")
    return value.to(torch.float32).contiguous()


class WanTransformer(Transformer):
    """What diffusers' Wan pipelines call on ``pipe.transformer`` / ``pipe.transformer_2``
    (module docstring). Built by :func:`qkrope.runtime.load_transformer` for a Wan export."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "encoder_hidden_states_image", "return_dict", "attention_kwargs")
    PIPELINES = ("WanPipeline, WanImageToVideoPipeline (Wan 2.2), WanVideoToVideoPipeline; "
                 "Wan 2.2's transformer and transformer_2")

    def _video(self) -> Latent:
        return Latent(VIDEO_5D, tuple(int(p) for p in self.config["patch_size"]))

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_hidden_states_image=None, return_dict: bool = True,
                attention_kwargs=None) -> Call:
        if encoder_hidden_states_image is not None:
            raise InputError("encoder_hidden_states_image: Wan 2.1 I2V's CLIP image branch is "
                             "not in the export. Fix: run Wan 2.1 I2V in PyTorch (Wan 2.2 "
                             "I2V-A14B takes the image as latent channels and runs here)")
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        if hidden_states is None or timestep is None or encoder_hidden_states is None:
            missing = [n for n, v in (("hidden_states", hidden_states), ("timestep", timestep),
                                      ("encoder_hidden_states", encoder_hidden_states))
                       if v is None]
            raise missing_arguments("Wan", missing)
        channels = self.config.get("in_channels")
        tensor_arg(hidden_states, "hidden_states", 5, f"[batch, {channels}, frames, height, "
                   f"width] (the video latent)")
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   f"[batch, text_tokens, {self.config.get('text_dim')}]")
        video = self._video()
        grid = video.grid(tuple(hidden_states.shape))
        batch = int(hidden_states.shape[0])
        packed = pack(hidden_states.to(self.dtype), video.patch)
        return Call(packed, encoder_hidden_states.to(self.dtype),
                    {"img_shapes": [grid], "txt_seq_len": int(encoder_hidden_states.shape[1])},
                    timestep=_timestep(timestep, batch), return_dict=return_dict)

    def forward(self, *args, **kwargs):
        """diffusers' forward: ``Transformer2DModelOutput(sample=[B, C, F, H, W])`` or
        ``(sample,)`` with ``return_dict=False``."""
        bound = self._bind(args, kwargs)
        return_dict = bound.pop("return_dict", True)
        (packed,) = super().forward(**bound, return_dict=False)
        video = self._video()
        sample = unpack(packed, video.grid(tuple(bound["hidden_states"].shape)), video.patch)
        if not return_dict:
            return (sample,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=sample)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return WanTransformer


__all__ = ["WanTransformer", "dropin_class", "sample_request"]
