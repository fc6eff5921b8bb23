"""Ideogram 4's reference hook (runtime layer): the keyword arguments of diffusers'
``Ideogram4Transformer2DModel.forward`` for ``qkrope check`` (the graph's two regions packed
back into the pipeline's ``[text region][image]`` sequence, with the position ids of the
sample's request, the segments and indicators of its text mask), and :func:`graph_output`,
diffusers' sample cut to the image rows the graph returns."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401

#: The images a sample takes: the one latent grid.
IMAGES = 1


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``: the sequence ``[text
    region; image]`` (zeros where the model masks), text token i at (i, i, i) as the sample
    request lays it out, padding (mask 0) in segment -1 with indicator 0."""
    import torch

    from qkrope.families.ideogram4.dropin import IMAGE, TEXT, layout_positions

    hs, ehs = by_role["hidden_states"], by_role["encoder_hidden_states"]
    mask = by_role["encoder_hidden_states_mask"] != 0
    batch, txt, img = int(hs.shape[0]), int(ehs.shape[1]), int(hs.shape[1])
    _, h, w = (int(v) for v in img_shapes[0])
    positions = layout_positions(h, w, txt).to(hs.device)
    ones = torch.ones(batch, img, dtype=torch.int64, device=hs.device)
    return dict(
        hidden_states=torch.cat([hs.new_zeros(batch, txt, hs.shape[2]), hs], dim=1),
        timestep=by_role["timestep"].to(hs.dtype),
        encoder_hidden_states=torch.cat([ehs, ehs.new_zeros(batch, img, ehs.shape[2])], dim=1),
        position_ids=positions.unsqueeze(0).expand(batch, -1, -1),
        segment_ids=torch.cat([torch.where(mask, 1, -1), ones], dim=1),
        indicator=torch.cat([torch.where(mask, TEXT, 0), ones * IMAGE], dim=1),
        return_dict=False)


def graph_output(info, sample, img_shapes: Sequence[Sequence[int]]):
    """diffusers' ``[B, text region + image, C]`` sample as the graph's image rows."""
    _, h, w = (int(v) for v in img_shapes[0])
    return sample[:, sample.shape[1] - h * w:]
