"""Qwen-Image's reference hook (runtime layer): the keyword arguments of diffusers'
``QwenImageTransformer2DModel.forward`` for ``qkrope check`` (its complex RoPE from
``img_shapes``, the text mask as the graph takes it)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (torch tensors by role, as
    :func:`qkrope.runtime.inputs.make_inputs` made them): the same activations, mask and
    timestep, and in place of the caches the image shapes they were built from (the same for
    every batch item)."""
    batch = by_role["hidden_states"].shape[0]
    return dict(hidden_states=by_role["hidden_states"],
                encoder_hidden_states=by_role["encoder_hidden_states"],
                encoder_hidden_states_mask=by_role["encoder_hidden_states_mask"],
                timestep=by_role["timestep"],
                img_shapes=[[tuple(s) for s in img_shapes]] * batch, return_dict=False)
