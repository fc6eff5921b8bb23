"""Kandinsky 5's reference hook (runtime layer): the keyword arguments of diffusers'
``Kandinsky5Transformer3DModel.forward`` for ``qkrope check``: the graph's channels-first latent
as the model's channels-last one, the positions the pipelines pass (each visual axis and the
text counted from 0) and the sample's angle divisors, in place of the caches."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401

from . import SAMPLE_SCALE

#: The images a sample takes: the one latent grid.
IMAGES = 1


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (the grid is the latent's
    own, ``img_shapes`` is not needed). ``return_dict`` stays True: with False diffusers returns
    the bare sample, and the check reads ``result[0]`` (the output's sample)."""
    import torch

    latent = by_role["hidden_states"]
    text = by_role["encoder_hidden_states"]
    patch = tuple(int(p) for p in info.config.diffusers_config["patch_size"])
    grid = [int(n) // p for n, p in zip(latent.shape[2:], patch)]
    return dict(hidden_states=latent.permute(0, 2, 3, 4, 1),
                encoder_hidden_states=text, timestep=by_role["timestep"],
                pooled_projections=by_role["pooled_projections"],
                visual_rope_pos=[torch.arange(n, device=latent.device) for n in grid],
                text_rope_pos=torch.arange(int(text.shape[1]), device=text.device),
                scale_factor=SAMPLE_SCALE, return_dict=True)


def graph_output(info, sample, img_shapes):
    """diffusers' channels-last output in the graph's channels-first layout."""
    return sample.permute(0, 4, 1, 2, 3)
