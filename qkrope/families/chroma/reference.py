"""Chroma's reference hook (runtime layer): the keyword arguments of diffusers'
``ChromaTransformer2DModel.forward`` for ``qkrope check``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.runtime.dual_stream import forward_kwargs as _forward_kwargs

from . import DUAL_STREAM


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``: the shared dual-stream
    ones (:func:`qkrope.runtime.dual_stream.forward_kwargs`: the ids of Chroma's pipelines in
    place of the caches) and in place of the text mask the pipelines' ``attention_mask``: the
    text mask followed by ones for the image tokens."""
    import torch

    kw = _forward_kwargs(DUAL_STREAM.ids, info, by_role, img_shapes)
    mask = by_role.get("encoder_hidden_states_mask")
    if mask is not None:
        ones = torch.ones(mask.shape[0], by_role["hidden_states"].shape[1], dtype=mask.dtype,
                          device=mask.device)
        kw["attention_mask"] = torch.cat([mask, ones], dim=1)
    return kw
