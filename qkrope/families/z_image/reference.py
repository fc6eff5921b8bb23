"""Z-Image's reference hook (runtime layer): the keyword arguments of diffusers'
``ZImageTransformer2DModel.forward`` for ``qkrope check``, and its output (a list of latents)
in the graph's layout (:func:`graph_output`)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

#: ``qkrope check``'s default sizes for a Z-Image export: one image (the family's calls hold
#: one; 6 x 5 patches, padded to 32 tokens in the graph as by diffusers) and a caption length
#: diffusers does not pad further (a multiple of 32; the second sample's mask then leaves 24
#: real tokens, which diffusers pads back to 32).
CHECK_SAMPLE = dict(img_shapes=[(1, 6, 5)], txt_len=32)


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (torch tensors by role):
    the latent patches unpatchified into one ``[C, F, H, W]`` latent per sample, each sample's
    real caption tokens (the mask's True rows, which must come first) as its caption, the
    timestep; diffusers then pads each caption to a multiple of 32 and builds the positions
    itself. That is the graph's call only when every caption pads to the graph's caption
    length (a multiple of 32): refused in one line otherwise."""
    from qkrope.errors import InputError
    from qkrope.families.z_image.dropin import padded

    cfg = info.config.diffusers_config or {}
    p = int(cfg.get("all_patch_size", (2,))[0])
    pf = int(cfg.get("all_f_patch_size", (1,))[0])
    hs, ehs = by_role["hidden_states"], by_role["encoder_hidden_states"]
    mask = by_role.get("encoder_hidden_states_mask")
    b, s = int(ehs.shape[0]), int(ehs.shape[1])
    lengths = [s] * b if mask is None else [int(v) for v in mask.to(bool).sum(1).tolist()]
    if mask is not None and any(not bool(mask[i, :n].all()) for i, n in enumerate(lengths)):
        raise InputError("the caption mask must mark each sample's real tokens first (its pad "
                         "tokens last), as the Z-Image pipelines pad captions")
    if any(padded(n) != s for n in lengths):
        raise InputError(f"diffusers pads each Z-Image caption to a multiple of 32, so its "
                         f"forward reproduces a graph call of {s} caption tokens only when every "
                         f"caption ({lengths} real tokens) pads to {s}. Fix: check with a text "
                         f"length that is a multiple of 32 (e.g. --txt-len 32)")
    (f, h, w), = [tuple(int(v) for v in sh) for sh in img_shapes]
    c = int(hs.shape[-1]) // (pf * p * p)
    latents = hs.view(b, f, h, w, pf, p, p, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
    latents = latents.reshape(b, c, f * pf, h * p, w * p)
    return dict(x=list(latents.unbind(0)), t=by_role["timestep"],
                cap_feats=[ehs[i, :n] for i, n in enumerate(lengths)], return_dict=False)


def graph_output(info, sample, img_shapes: Sequence[Sequence[int]]):
    """diffusers' output (one ``[C, F, H, W]`` latent per sample) as the graph's ``sample``
    ``[B, N, pf*p*p*C]``: patchified as diffusers' ``_patchify_image`` does."""
    import torch

    cfg = info.config.diffusers_config or {}
    p = int(cfg.get("all_patch_size", (2,))[0])
    pf = int(cfg.get("all_f_patch_size", (1,))[0])
    x = torch.stack(list(sample))
    b, c, f, h, w = x.shape
    x = x.view(b, c, f // pf, pf, h // p, p, w // p, p).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, (f // pf) * (h // p) * (w // p), pf * p * p * c)
