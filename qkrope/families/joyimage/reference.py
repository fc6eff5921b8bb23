"""JoyImage Edit's reference hook (runtime layer): the keyword arguments of diffusers'
``JoyImageEditTransformer3DModel.forward`` for ``qkrope check``: the 5-D latent, the timestep
and the text (diffusers builds its RoPE from the latent's own shape, so no caches)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401

#: A sample is the one latent grid.
IMAGES = 1

_KEYWORDS = {"hidden_states": "hidden_states", "timestep": "timestep",
             "encoder_hidden_states": "encoder_hidden_states"}


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (the latent's shape is its
    grid: ``img_shapes`` is not needed)."""
    kw = {_KEYWORDS[role]: value for role, value in by_role.items() if role in _KEYWORDS}
    kw["return_dict"] = False
    return kw
