"""PRX's reference hook (runtime layer): the keyword arguments of diffusers'
``PRXTransformer2DModel.forward`` for ``qkrope check`` (the graph's packed patches as the 4-D
latent diffusers takes; the model computes its RoPE from the latent's shape), and
:func:`graph_output`, diffusers' sample in the graph's packed layout."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401

#: The images a sample takes: the one latent grid.
IMAGES = 1


def _patch_grid(info, img_shapes):
    p = int((info.config.diffusers_config or {}).get("patch_size", 2))
    return (p, p), tuple(int(v) for v in img_shapes[0])[1:]


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``: the latent unpacked from
    the patches (grid ``img_shapes[0]``), the text, its mask and the timestep."""
    from qkrope.runtime.latents import unpack_patches

    patch, grid = _patch_grid(info, img_shapes)
    return dict(hidden_states=unpack_patches(by_role["hidden_states"], grid, patch),
                timestep=by_role["timestep"],
                encoder_hidden_states=by_role["encoder_hidden_states"],
                attention_mask=by_role["encoder_hidden_states_mask"], return_dict=False)


def graph_output(info, sample, img_shapes: Sequence[Sequence[int]]):
    """diffusers' sample ``[B, C, H, W]`` as the graph's patches ``[B, N, C x p x p]``."""
    from qkrope.runtime.latents import pack_patches

    patch, _ = _patch_grid(info, img_shapes)
    return pack_patches(sample, patch)[0]
