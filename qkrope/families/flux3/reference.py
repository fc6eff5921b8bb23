"""FLUX.3's reference hook (runtime layer): the keyword arguments of diffusers'
``Flux3Transformer2DModel.forward`` for ``qkrope check``: the graph's activations and, in place
of the caches, the ids the FLUX.3 pipelines lay out (image h / w scaled by 0.5, the text's index
on the fourth axis), so the stock model builds its RoPE from them (float64) as a pipeline's call
would."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401

#: The images a sample takes: the one output image (the reference-image stream is refused).
IMAGES = 1


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``."""
    import torch

    from qkrope.families.flux3.dropin import pipeline_ids

    text = by_role["encoder_hidden_states"]
    txt_ids, img_ids = (torch.from_numpy(a) for a in pipeline_ids(img_shapes[0],
                                                                   int(text.shape[1])))
    kw = dict(hidden_states=by_role["hidden_states"], encoder_hidden_states=text,
              timestep=by_role["timestep"], img_ids=img_ids, txt_ids=txt_ids, return_dict=False)
    if "target_timestep" in by_role:  # a flow-map model's
        kw["target_timestep"] = by_role["target_timestep"]
    return kw
