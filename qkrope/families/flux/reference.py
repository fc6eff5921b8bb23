"""FLUX.1's and FLUX.2's reference hook (runtime layer): the keyword arguments of diffusers'
``FluxTransformer2DModel`` / ``Flux2Transformer2DModel.forward`` for ``qkrope check``
(:func:`qkrope.runtime.dual_stream.forward_kwargs` with the record's id layout)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.runtime.dual_stream import forward_kwargs as _forward_kwargs

from . import DUAL_STREAM


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments: the graph's activations, pooled projections and guidance,
    and the ids the FLUX pipelines lay out in place of the caches."""
    return _forward_kwargs(DUAL_STREAM[info.config.family].ids, info, by_role, img_shapes)
