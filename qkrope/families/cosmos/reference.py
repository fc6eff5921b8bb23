"""Cosmos-Predict2's reference hook (runtime layer): the keyword arguments of diffusers'
``CosmosTransformer3DModel.forward`` for ``qkrope check``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``: the latent as it is (its
    condition-mask channel, where the model has one, is already concatenated, as diffusers
    concatenates ``condition_mask``), the per-frame timesteps in diffusers' ``[B, 1, T, 1, 1]``
    form, the padding mask (already at the latent's size: diffusers' nearest resize keeps it),
    no fps (the sample's caches are an image call's). In place of the cache, the model computes
    its RoPE from the latent's shape."""
    latent = by_role["hidden_states"]
    timestep = by_role["timestep"]
    b, f = timestep.shape
    return dict(hidden_states=latent, timestep=timestep.reshape(b, 1, f, 1, 1),
                encoder_hidden_states=by_role["encoder_hidden_states"],
                padding_mask=by_role["padding_mask"], fps=None, return_dict=False)
