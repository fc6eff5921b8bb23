"""Motif-Video's reference hook (runtime layer): the keyword arguments of diffusers'
``MotifVideoTransformer3DModel.forward`` for ``qkrope check``: the graph inputs by role, and no
caches (diffusers builds its RoPE from the latent's own shape)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401

#: The images a sample takes: the one video grid the latent is.
IMAGES = 1

#: diffusers' keyword of each graph input role (the text mask's role is the generic one).
_KEYWORDS = {"hidden_states": "hidden_states", "timestep": "timestep",
             "encoder_hidden_states": "encoder_hidden_states",
             "encoder_hidden_states_mask": "encoder_attention_mask"}


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (``img_shapes`` is not
    needed: the latent's shape is its grid)."""
    kw = {_KEYWORDS[role]: value for role, value in by_role.items() if role in _KEYWORDS}
    kw["return_dict"] = False
    return kw
