"""Z-Image's part of the pipeline drop-in (runtime layer): ``ZImagePipeline``,
``ZImageImg2ImgPipeline`` and ``ZImageInpaintPipeline`` call
``pipe.transformer(x, t, cap_feats, return_dict=False)`` with LISTS: one latent
``[C, 1, H, W]`` and one caption ``[L_i, cap_feat_dim]`` per sample; CFG's negative captions
usually have other lengths. diffusers pads each caption to a multiple of 32 (``Lc_i``) and puts
sample i's image at frame position ``Lc_i + 1``, so positions differ between samples whose
padded captions differ (docs/spec.md section 6c). :class:`ZImageTransformer` groups the samples
by (latent shape, ``Lc_i``) and runs one call of the exported graph per group, with the 2-D
caches of that group (the "table" position scheme), then returns the list diffusers returns.

Refused in one line, never ignored: ControlNet residuals (``controlnet_block_samples``), the
Omni model's nested lists, SigLIP features and noise masks, a patch size other than the
exported one, a LoRA scale other than 1 (or other ``joint_attention_kwargs``), positions past
the model's RoPE tables (``axes_lens``).

Also the layout of the pipelines' position ids (:func:`sample_ids`, :func:`sample_request`:
what ``make_inputs`` and the exporter's sample need) and :func:`caches_for_sizes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from qkrope.errors import InputError
from qkrope.families.z_image import SEQ_MULTIPLE, Z_IMAGE
from qkrope.runtime._dropin import (Call, Split, Transformer, require_arguments, per_item,
                                    refuse_kwargs, short_repr)
from qkrope.runtime.caches import RopeCaches, build_rope_caches, checked_setting
from qkrope.runtime.schemes import table


def padded(length: int) -> int:
    """A caption (or image) of ``length`` tokens as diffusers pads it: to a multiple of 32."""
    return int(length) + (-int(length)) % SEQ_MULTIPLE


def sample_ids(img_shapes: Sequence[Sequence[int]], txt_len: int) -> tuple:
    """(txt_ids, img_ids), int64 ``[tokens, 3]``, as diffusers' ``patchify_and_embed`` lays them
    out for a sample whose caption holds ``txt_len`` tokens after padding and whose image is the
    one ``(frames, h, w)`` token grid of ``img_shapes``: caption token j at (1 + j, 0, 0), image
    token (f, y, x) at (txt_len + 1 + f, y, x). (The image's pad tokens, at (0, 0, 0), get their
    identity rows in the graph.)"""
    shapes = [tuple(int(v) for v in s) for s in img_shapes]
    if len(shapes) != 1:
        raise InputError(f"a Z-Image sample has one image; got img_shapes {shapes}")
    f, h, w = shapes[0]
    txt = np.zeros((int(txt_len), 3), np.int64)
    txt[:, 0] = np.arange(1, int(txt_len) + 1)
    frame, y, x = np.meshgrid(np.arange(f), np.arange(h), np.arange(w), indexing="ij")
    img = np.stack([frame.ravel() + int(txt_len) + 1, y.ravel(), x.ravel()], axis=1)
    return txt, img.astype(np.int64)


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the ids the pipelines lay out."""
    txt, img = sample_ids(img_shapes, txt_len)
    return {"txt_ids": txt, "img_ids": img}


def caches_for_sizes(img_shapes: Sequence[Sequence[int]], txt_len: int, *,
                     axes: Sequence[int] = Z_IMAGE.axes, theta: float = Z_IMAGE.theta,
                     device: torch.device | str | None = None) -> RopeCaches:
    """Z-Image's RoPE caches for samples of one image grid (``img_shapes``, ``[(1, h, w)]`` in
    latent patches) and ``txt_len`` caption tokens after padding, as diffusers'
    ``RopeEmbedder`` tabulates them (:mod:`qkrope.runtime.schemes.table` says the bits):
    ``RopeCaches(img [f*h*w, sum(axes)], txt [txt_len, sum(axes)])``, memoised."""
    setting = checked_setting(Z_IMAGE.scheme, axes, theta, what="axes_dims")
    return build_rope_caches(Z_IMAGE.scheme, sample_request(Z_IMAGE, img_shapes, txt_len),
                             setting, device=device)


#: Public names this family adds to qkrope.runtime (and qkrope.runtime.caches).
PUBLIC: dict = {"build_z_image_rope_caches": caches_for_sizes}


def _items(value: Any, name: str, rank: int, layout: str) -> list:
    """A list (or tuple) of ``rank``-D tensors, or one tensor whose first axis is the batch."""
    if isinstance(value, torch.Tensor) and value.dim() == rank + 1:
        return list(value.unbind(0))
    if isinstance(value, (list, tuple)) and value and any(isinstance(v, (list, tuple))
                                                          for v in value):
        raise InputError(f"{name} is a nested list (Z-Image-Omni's form: several images or "
                         f"captions per sample), which this export does not take. Fix: run the "
                         f"Omni pipeline on the PyTorch model")
    if not isinstance(value, (list, tuple)) or not value or not all(
            isinstance(v, torch.Tensor) and v.dim() == rank for v in value):
        got = (f"a {type(value).__name__} of "
               f"{[tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value][:4]}"
               if isinstance(value, (list, tuple)) else short_repr(value, 60))
        raise InputError(f"{name} must be a list of {rank}-D tensors {layout}, one per sample; "
                         f"got {got}. Fix: pass what the Z-Image pipeline passes")
    return list(value)


class ZImageTransformer(Transformer):
    """What diffusers' Z-Image pipelines call on ``pipe.transformer`` (module docstring). Built
    by :func:`qkrope.runtime.load_transformer` for a Z-Image export."""

    FORWARD_ARGS = ("x", "t", "cap_feats", "return_dict", "controlnet_block_samples",
                    "siglip_feats", "image_noise_mask", "patch_size", "f_patch_size",
                    "joint_attention_kwargs")
    PIPELINES = "ZImagePipeline, ZImageImg2ImgPipeline, ZImageInpaintPipeline"

    def __init__(self, runner, record, *, device=None):
        super().__init__(runner, record, device=device)
        cfg = self.config
        self._patch = (int(cfg.get("all_patch_size", (2,))[0]),
                       int(cfg.get("all_f_patch_size", (1,))[0]))
        self._lens = tuple(int(v) for v in cfg.get("axes_lens", (1024, 512, 512)))
        self._channels = int(cfg.get("in_channels", 16))

    @property
    def in_channels(self) -> int:
        """The latent channels (the pipelines read ``transformer.in_channels``)."""
        return self._channels

    def prepare(self, x=None, t=None, cap_feats=None, return_dict: bool = True,
                controlnet_block_samples=None, siglip_feats=None, image_noise_mask=None,
                patch_size=2, f_patch_size=1, joint_attention_kwargs=None) -> Split:
        """diffusers' Z-Image call as one graph call per (latent shape, padded caption length)
        group; the generic forward returns the list of ``[C, F, H, W]`` samples diffusers
        returns."""
        self._refuse_unsupported(controlnet_block_samples, siglip_feats, image_noise_mask,
                                 patch_size, f_patch_size, joint_attention_kwargs)
        require_arguments("Z-Image", x=x, t=t, cap_feats=cap_feats)
        images = _items(x, "x", 4, "[channels, frames, height, width]")
        captions = _items(cap_feats, "cap_feats", 2, "[caption_tokens, cap_feat_dim]")
        if len(images) != len(captions):
            raise InputError(f"x has {len(images)} samples but cap_feats has {len(captions)}; "
                             f"give one caption per latent")
        batch = len(images)
        timestep = per_item(t, "t", batch, torch.float32)
        if timestep.shape != (batch,):
            raise InputError(f"t must hold {batch} timesteps (one per sample); got shape "
                             f"{tuple(timestep.shape)}")
        groups: dict[tuple, list[int]] = {}
        for i, (image, caption) in enumerate(zip(images, captions)):
            self._check_sample(i, image, caption)
            groups.setdefault((tuple(image.shape), padded(caption.shape[0])), []).append(i)
        return Split([self._group(shape, txt_len, index, images, captions, timestep)
                      for (shape, txt_len), index in groups.items()], batch,
                     return_dict=return_dict)

    # ----------------------------------------------------------------------------------------
    def _check_sample(self, i: int, image: torch.Tensor, caption: torch.Tensor) -> None:
        c, f, h, w = image.shape
        pf, p = self._patch[1], self._patch[0]
        if c != self._channels or f % pf or h % p or w % p or min(f, h, w) < 1:
            raise InputError(f"x[{i}] has shape {list(image.shape)}; the model takes "
                             f"[{self._channels}, frames, height, width] with frames a multiple "
                             f"of {pf} and height, width multiples of {p}. Fix: pass the "
                             f"pipeline's latents (latents.unsqueeze(2))")
        if caption.shape[0] < 1:
            raise InputError(f"cap_feats[{i}] has no tokens; every sample needs a caption")
        # the positions the sample's ids reach, within the tables: the table scheme's one check
        # (the Triton rope model runs the same on the ids a client sends)
        txt_ids, img_ids = sample_ids([(f // pf, h // p, w // p)], padded(caption.shape[0]))
        try:
            table.check_lengths(table.Positions(txt_ids, img_ids), self._lens)
        except table.PositionOverflow as exc:
            raise InputError(f"sample {i} (caption of {caption.shape[0]} tokens, latent "
                             f"{list(image.shape)}): {exc}") from None

    def _group(self, shape: tuple, txt_len: int, index: list, images: list, captions: list,
               timestep: torch.Tensor) -> Call:
        """The graph call of the samples ``index`` (one latent shape, one padded caption
        length): their latents packed as tokens, captions padded with a mask, the group's ids;
        its unpack gives the ``[n, C, F, H, W]`` latents back."""
        c, f, h, w = shape
        p, pf = self._patch
        ft, ht, wt = f // pf, h // p, w // p
        hs = torch.stack([images[i] for i in index]).view(len(index), c, ft, pf, ht, p, wt, p)
        hs = hs.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(len(index), ft * ht * wt, pf * p * p * c)
        first = captions[index[0]]
        ehs = first.new_zeros((len(index), txt_len, first.shape[1]))
        mask = torch.zeros((len(index), txt_len), dtype=torch.bool, device=first.device)
        for row, i in enumerate(index):
            n = captions[i].shape[0]
            ehs[row, :n] = captions[i]
            mask[row, :n] = True
        txt_ids, img_ids = sample_ids([(ft, ht, wt)], txt_len)

        def unpack(sample: torch.Tensor) -> torch.Tensor:
            out = sample.view(len(index), ft, ht, wt, pf, p, p, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
            return out.reshape(len(index), -1, f, h, w)

        return Call(hs.contiguous(), ehs, {"txt_ids": txt_ids, "img_ids": img_ids},
                    timestep=timestep[index].to(hs.device).contiguous(), mask=mask,
                    unpack=unpack, items=tuple(index))

    def _refuse_unsupported(self, controlnet_block_samples, siglip_feats, image_noise_mask,
                            p, pf, joint_attention_kwargs) -> None:
        if controlnet_block_samples is not None:
            raise InputError("controlnet_block_samples: the exported Z-Image transformer has no "
                             "ControlNet residual inputs. Fix: run ZImageControlNetPipeline on "
                             "the PyTorch model")
        if siglip_feats is not None or image_noise_mask is not None:
            raise InputError("siglip_feats / image_noise_mask belong to Z-Image-Omni, which "
                             "this export does not take. Fix: run the Omni pipeline on the "
                             "PyTorch model")
        if (p, pf) != self._patch:
            raise InputError(f"patch_size={p!r}, f_patch_size={pf!r}: the export runs the "
                             f"model's patch size {self._patch[0]} (frames "
                             f"{self._patch[1]}) only. Fix: call with the exported patch size")
        refuse_kwargs(joint_attention_kwargs, "joint_attention_kwargs")


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return ZImageTransformer



__all__ = ["ZImageTransformer", "caches_for_sizes", "dropin_class", "padded", "sample_ids",
           "sample_request"]
