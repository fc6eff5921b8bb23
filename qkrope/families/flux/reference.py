"""FLUX.1's and FLUX.2's reference hook (runtime layer): the keyword arguments of diffusers'
``FluxTransformer2DModel`` / ``Flux2Transformer2DModel.forward`` for ``qkrope check``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.model_io import GUIDANCE, POOLED_PROJECTIONS


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (torch tensors by role, as
    :func:`qkrope.runtime.inputs.make_inputs` made them): the same activations,
    ``pooled_projections`` and ``guidance``, and in place of the caches the position ids they
    were built from (the pipelines' layout for these image shapes:
    :func:`qkrope.families.flux.dropin.flux_sample_ids`), so that the stock model computes its
    RoPE from them (float64) as a pipeline's call would."""
    import torch

    from qkrope.families.flux.dropin import flux_sample_ids

    txt_len = int(by_role["encoder_hidden_states"].shape[1])
    txt_ids, img_ids = (torch.from_numpy(a) for a in
                        flux_sample_ids(info.config.family, img_shapes, txt_len))
    kw = dict(hidden_states=by_role["hidden_states"],
              encoder_hidden_states=by_role["encoder_hidden_states"],
              timestep=by_role["timestep"], txt_ids=txt_ids, img_ids=img_ids, return_dict=False)
    for role in (POOLED_PROJECTIONS.role, GUIDANCE.role):
        if role in by_role:
            kw[role] = by_role[role]
    return kw
