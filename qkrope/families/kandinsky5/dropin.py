"""Kandinsky 5's part of the pipeline drop-in (runtime layer).

``Kandinsky5T2VPipeline``, ``Kandinsky5I2VPipeline``, ``Kandinsky5T2IPipeline`` and
``Kandinsky5I2IPipeline`` call ``pipe.transformer(hidden_states=, encoder_hidden_states=,
pooled_projections=, timestep=, visual_rope_pos=, text_rope_pos=, scale_factor=,
sparse_params=, return_dict=True)``. :meth:`Kandinsky5Transformer.prepare` maps a call onto the
graph: the channels-last latent ``[B, F, H, W, C]`` permuted to the graph's channels-first one
(and the sample back, ``Call.unpack``), the position request of the "divided_grid" scheme (the
latent's token grid, the call's ``scale_factor``, the text length). The positions must be what
the pipelines pass: each visual axis ``0..n-1`` over the latent's grid, the text ``0..L-1``
over its tokens. With ``return_dict=False`` the sample comes back bare, as diffusers' forward
returns it.

Refused in one line: ``sparse_params`` (nabla sparse attention), positions that are not those
ranges, a latent whose channels are not the model's.
"""

from __future__ import annotations

import torch

from qkrope.errors import InputError
from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime._dropin import Call, Transformer, require_arguments, per_item, tensor_arg
from qkrope.runtime.latents import latent_of
from qkrope.runtime.schemes import divided_grid

from . import SAMPLE_SCALE


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample: the first grid (tokens), the sample's divisors and
    the text length."""
    return divided_grid.sample_request(img_shapes[0], txt_len, SAMPLE_SCALE)


def _is_range(value, n: int) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != n:
        return False
    return bool((value.detach().cpu().to(torch.int64) == torch.arange(n)).all())


def _channels_first(sample: torch.Tensor) -> torch.Tensor:
    return sample.permute(0, 4, 1, 2, 3)


def _channels_last(sample: torch.Tensor) -> torch.Tensor:
    return sample.permute(0, 2, 3, 4, 1)


class Kandinsky5Transformer(Transformer):
    """What Kandinsky 5's pipelines call on ``pipe.transformer`` (module docstring)."""

    PIPELINES = ("Kandinsky5T2VPipeline, Kandinsky5I2VPipeline, Kandinsky5T2IPipeline, "
                 "Kandinsky5I2IPipeline")
    FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "timestep", "pooled_projections",
                    "visual_rope_pos", "text_rope_pos", "scale_factor", "sparse_params",
                    "return_dict")

    @property
    def visual_cond(self) -> bool:
        """Whether the latent carries the condition channels (the pipelines read
        ``pipe.transformer.visual_cond`` to build the latent)."""
        return bool(self.config.get("visual_cond", False))

    def prepare(self, hidden_states=None, encoder_hidden_states=None, timestep=None,
                pooled_projections=None, visual_rope_pos=None, text_rope_pos=None,
                scale_factor=(1.0, 1.0, 1.0), sparse_params=None,
                return_dict: bool = True) -> Call:
        if sparse_params is not None:
            raise InputError("sparse_params (nabla sparse attention) is not in the exported "
                             "Kandinsky 5 graph. Fix: run a model with attention_type "
                             "'regular' (sparse_params None)")
        require_arguments("Kandinsky 5", hidden_states=hidden_states,
                          encoder_hidden_states=encoder_hidden_states,
                          timestep=timestep, pooled_projections=pooled_projections,
                          visual_rope_pos=visual_rope_pos,
                          text_rope_pos=text_rope_pos)
        latent = tensor_arg(hidden_states, "hidden_states", 5,
                            "[batch, frames, height, width, channels] (the channels-last latent)")
        text = tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                          "[batch, tokens, features] (the Qwen prompt embeddings)")
        pooled = tensor_arg(pooled_projections, "pooled_projections", 2,
                            "[batch, features] (the pooled CLIP embedding)")
        batch, tokens = int(latent.shape[0]), int(text.shape[1])
        if int(text.shape[0]) != batch or int(pooled.shape[0]) != batch:
            raise InputError(f"hidden_states has batch {batch} but encoder_hidden_states "
                             f"{int(text.shape[0])} and pooled_projections "
                             f"{int(pooled.shape[0])}. Fix: one prompt embedding per latent")
        channels = self.config.get("in_visual_dim")
        want = 2 * int(channels) + 1 if self.config.get("visual_cond") else int(channels)
        if int(latent.shape[-1]) != want:
            raise InputError(f"hidden_states has {int(latent.shape[-1])} channels (last axis); "
                             f"this model takes {want} (channels last). Fix: run this export "
                             f"with its own pipeline")
        latent = _channels_first(latent)
        grid = latent_of(self.record, self.config).grid(tuple(latent.shape))
        if not isinstance(visual_rope_pos, (list, tuple)) or len(visual_rope_pos) != 3 or not all(
                _is_range(p, n) for p, n in zip(visual_rope_pos, grid)):
            raise InputError(f"visual_rope_pos must be the three ranges the pipelines pass, "
                             f"arange(n) over the latent's token grid {list(grid)}; got "
                             f"{visual_rope_pos!r:.80}. Fix: pass [torch.arange(n) for n in "
                             f"{list(grid)}]")
        if not _is_range(text_rope_pos, tokens):
            raise InputError(f"text_rope_pos must be arange({tokens}) over the "
                             f"{tokens} text tokens; got {text_rope_pos!r:.80}. Fix: pass "
                             f"torch.arange(encoder_hidden_states.shape[1])")
        request = {"grid": grid, "scale": tuple(scale_factor) if isinstance(
            scale_factor, (list, tuple)) else scale_factor, "txt_seq_len": tokens}
        return Call(latent.to(self.dtype), text.to(self.dtype), request,
                    timestep=per_item(timestep, "timestep", batch, self.dtype),
                    conditioning={"pooled_projections": pooled.to(self.dtype)},
                    return_dict=return_dict, unpack=_channels_last)


    def output(self, sample, return_dict: bool):
        """diffusers' return: ``Transformer2DModelOutput(sample=...)``, or the bare sample with
        ``return_dict=False`` (Kandinsky 5's forward returns no tuple)."""
        return super().output(sample, True) if return_dict else sample


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return Kandinsky5Transformer


__all__ = ["Kandinsky5Transformer", "dropin_class", "sample_request"]
