"""Chroma's reference hook (runtime layer): the keyword arguments of diffusers'
``ChromaTransformer2DModel.forward`` for ``qkrope check``."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (torch tensors by role, as
    :func:`qkrope.runtime.inputs.make_inputs` made them): the same activations and timestep, in
    place of the caches the position ids they were built from (the pipelines' layout:
    :func:`qkrope.families.chroma.dropin.sample_ids`), and in place of the text mask the
    pipelines' ``attention_mask``: the text mask followed by ones for the image tokens."""
    import torch

    from qkrope.families.chroma.dropin import sample_ids

    hidden = by_role["hidden_states"]
    text = by_role["encoder_hidden_states"]
    txt_ids, img_ids = (torch.from_numpy(a) for a in sample_ids(img_shapes,
                                                                 int(text.shape[1])))
    kw = dict(hidden_states=hidden, encoder_hidden_states=text, timestep=by_role["timestep"],
              txt_ids=txt_ids, img_ids=img_ids, return_dict=False)
    mask = by_role.get("encoder_hidden_states_mask")
    if mask is not None:
        ones = torch.ones(mask.shape[0], hidden.shape[1], dtype=mask.dtype, device=mask.device)
        kw["attention_mask"] = torch.cat([mask, ones], dim=1)
    return kw
