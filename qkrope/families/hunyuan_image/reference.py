"""HunyuanImage-2.1's reference hook (runtime layer): the keyword arguments of diffusers'
``HunyuanImageTransformer2DModel.forward`` for ``qkrope check`` (the graph's packed tokens as
the latent diffusers takes; the model computes its RoPE from the latent's shape), and
:func:`graph_output`, diffusers' sample in the graph's packed layout."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def _patch_grid(info, img_shapes):
    cfg = info.config.diffusers_config or {}
    patch = tuple(int(p) for p in cfg.get("patch_size", (1, 1)))
    grid = tuple(int(v) for v in img_shapes[0])
    return patch, (grid if len(patch) == 3 else grid[1:])


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``: the latent unpacked from
    the tokens (grid ``img_shapes[0]``), the text, its mask, the glyph text and its mask, the
    timestep and guidance."""
    from qkrope.runtime.latents import unpack_patches

    patch, grid = _patch_grid(info, img_shapes)
    kw = dict(hidden_states=unpack_patches(by_role["hidden_states"], grid, patch),
              timestep=by_role["timestep"],
              encoder_hidden_states=by_role["encoder_hidden_states"],
              encoder_attention_mask=by_role["encoder_hidden_states_mask"], return_dict=False)
    if "guidance" in by_role:
        kw["guidance"] = by_role["guidance"]
    if "encoder_hidden_states_2" in by_role:  # the byT5 glyph text (a model with its branch)
        kw["encoder_hidden_states_2"] = by_role["encoder_hidden_states_2"]
        kw["encoder_attention_mask_2"] = by_role["encoder_attention_mask_2"]
    return kw


def graph_output(info, sample, img_shapes: Sequence[Sequence[int]]):
    """diffusers' sample ``[B, C, *latent axes]`` as the graph's tokens ``[B, N, C x patch]``."""
    from qkrope.runtime.latents import pack_patches

    patch, _ = _patch_grid(info, img_shapes)
    return pack_patches(sample, patch)[0]
