"""Qwen-Image's part of the pipeline drop-in (runtime layer): ``QwenImagePipeline`` /
``QwenImageEditPipeline`` call ``pipe.transformer(hidden_states, encoder_hidden_states,
encoder_hidden_states_mask, timestep, img_shapes, ...)``; :class:`QwenImageTransformer` maps
that call onto the generic drop-in (:mod:`qkrope.runtime._dropin`) and the "grid" position
scheme (``img_shapes`` and the text length).

What diffusers' own model takes is taken here too, with its meaning: ``img_shapes`` in
diffusers' per-batch forms, read as diffusers reads them (:func:`diffusers_img_shapes`; every
item the same, since the caches have no batch axis), ``txt_seq_lens`` where an installed
diffusers still passes it (checked, not used), a 0-dim ``timestep`` (one per batch item), a 1/0
integer mask. Refused in one line, never ignored: ControlNet residuals, additional timestep
conditioning, a LoRA scale other than 1 or any other ``attention_kwargs``, a ``guidance`` value.

Also the family's public cache builder :func:`build_qwen_rope_caches` (``PUBLIC``: reachable as
``qkrope.runtime.build_qwen_rope_caches``) and what ``make_inputs`` needs
(:func:`sample_request`).
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch

from qkrope.errors import InputError
from qkrope.families.qwen_image import QWEN_IMAGE_RECORD as RECORD
from qkrope.runtime._dropin import (Call, Transformer, require_arguments, refuse_kwargs, short_repr,
                                    tensor_arg)
from qkrope.runtime.caches import RopeCaches, build_rope_caches, checked_setting
from qkrope.runtime.schemes import grid


def build_qwen_rope_caches(img_shapes: Sequence[Sequence[int]], txt_seq_len: int, *,
                           theta: float = RECORD.theta,
                           axes_dim: Sequence[int] = RECORD.axes,
                           scale_rope: bool = True,
                           device: torch.device | str | None = None) -> RopeCaches:
    """Qwen-Image's RoPE caches for one sample, as diffusers' ``QwenEmbedRope`` computes them
    (the "grid" scheme, :mod:`qkrope.runtime.schemes.grid`).

    Args:
        img_shapes: ``[(frames, height, width), ...]`` in latent patches (a 1024x1024 image is
            ``(1, 64, 64)``). Entry k > 0 is edit/condition image k (frame offset k).
        txt_seq_len: text tokens.
        device: where the caches are put.

    Returns:
        ``RopeCaches(img [sum f*h*w, sum(axes_dim)], txt [txt_seq_len, sum(axes_dim)])``, fp32.
        Results are memoised per (shapes, length, setting, device), up to
        ``qkrope.runtime.caches.MEMO_BYTES`` in all: treat them as read-only.

    Raises:
        RopeCacheOverflowError: the positions run past diffusers' 4096-entry tables.
    """
    setting = checked_setting(RECORD.scheme, axes_dim, theta, max_positions=RECORD.max_positions,
                              scale_rope=scale_rope)
    return build_rope_caches(RECORD.scheme, {"img_shapes": img_shapes, "txt_seq_len": txt_seq_len},
                             setting, device=device)


#: Public names this family adds to qkrope.runtime (and qkrope.runtime.caches).
PUBLIC: dict = {"build_qwen_rope_caches": build_qwen_rope_caches}


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the grids and the text length."""
    return grid.sample_request(img_shapes, txt_len)


def _is_triple(entry: Any) -> bool:
    return isinstance(entry, (list, tuple)) and len(entry) == 3 \
        and not any(isinstance(v, (list, tuple)) for v in entry)


def diffusers_img_shapes(img_shapes: Any) -> Any:
    """``img_shapes`` as diffusers' ``QwenEmbedRope`` reads it, returned as the images of one
    sample (the "grid" scheme's form). A list holds one entry per batch item and item 0's is
    used: an entry that is a list of triples is that item's images (the pipelines'
    ``[[(1, h, w), (1, h2, w2)]] * batch``), any other entry is the item's one image (diffusers'
    model test: ``[(1, h, w)] * batch``). Anything else (one ``(f, h, w)`` triple) is one image,
    left to the scheme's checks. Items that differ are refused in one line: diffusers would use
    item 0's positions for every item (with a warning), which is wrong for the others."""
    if not isinstance(img_shapes, list) or not img_shapes:
        return img_shapes
    items = []
    for entry in img_shapes:
        if isinstance(entry, list) and not _is_triple(entry):
            items.append(tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in entry))
        else:  # one image per batch item (a list triple too, which diffusers itself rejects)
            items.append((tuple(entry) if isinstance(entry, (list, tuple)) else entry,))
    if any(item != items[0] for item in items[1:]):
        raise InputError(
            f"img_shapes gives different images per batch item ({short_repr(img_shapes)}); the "
            f"RoPE caches have no batch axis (one row per token, shared by the batch) and "
            f"diffusers reads item 0 for every item. Fix: batch only samples of one size")
    return list(items[0])


def _check_txt_seq_lens(value: Any, batch: int, txt: int) -> None:
    """diffusers' ``txt_seq_lens``: one text length per batch item, each in 0..txt (the lengths
    themselves come from the mask; they are checked, not used)."""
    expected = (f"txt_seq_lens must be a list of {batch} integer text lengths (one per batch "
                f"item, each between 0 and the {txt} text tokens of encoder_hidden_states)")
    items = value.tolist() if isinstance(value, torch.Tensor) and value.dim() == 1 else value
    try:
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError
        lens = [operator.index(n) for n in items]
    except TypeError:
        raise InputError(f"{expected}; got {short_repr(value)}. Fix: pass "
                         f"prompt_embeds_mask.sum(dim=1).tolist(), or omit it") from None
    if len(lens) != batch or any(n < 0 or n > txt for n in lens):
        raise InputError(f"{expected}; got {lens}. Fix: pass prompt_embeds_mask.sum(dim=1)"
                         f".tolist(), or omit it")


class QwenImageTransformer(Transformer):
    """What diffusers' Qwen-Image pipelines call on ``pipe.transformer`` (module docstring).
    Built by :func:`qkrope.runtime.load_transformer` for a Qwen-Image export."""

    FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask",
                    "timestep", "img_shapes", "txt_seq_lens", "guidance", "attention_kwargs",
                    "controlnet_block_samples", "additional_t_cond", "return_dict")
    PIPELINES = "QwenImagePipeline, QwenImageEditPipeline"

    def prepare(self, hidden_states=None, encoder_hidden_states=None,
                encoder_hidden_states_mask=None, timestep=None, img_shapes=None,
                txt_seq_lens=None, guidance=None, attention_kwargs=None,
                controlnet_block_samples=None, additional_t_cond=None,
                return_dict: bool = True) -> Call:
        self._refuse_unsupported(guidance, attention_kwargs, controlnet_block_samples,
                                 additional_t_cond)
        require_arguments("Qwen-Image", encoder_hidden_states=encoder_hidden_states,
                          timestep=timestep, img_shapes=img_shapes)
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   f"[batch, text_tokens, {self.config.get('joint_attention_dim')}]")
        txt = int(encoder_hidden_states.shape[1])
        batch = int(encoder_hidden_states.shape[0])
        if txt_seq_lens is not None:
            _check_txt_seq_lens(txt_seq_lens, batch, txt)
        if isinstance(timestep, numbers.Real) and not isinstance(timestep, bool):
            timestep = torch.tensor(float(timestep))
        if isinstance(timestep, torch.Tensor) and timestep.dim() == 0:
            # one timestep for the whole batch (what diffusers' pipelines may pass)
            timestep = timestep.reshape(1).expand(batch)
        if isinstance(timestep, torch.Tensor):
            timestep = timestep.to(self.dtype)
        mask = encoder_hidden_states_mask
        if mask is not None and isinstance(mask, torch.Tensor):
            mask = mask.to(torch.bool)  # diffusers passes 1/0 integers: True = attend
        return Call(hidden_states, encoder_hidden_states,
                    {"img_shapes": diffusers_img_shapes(img_shapes), "txt_seq_len": txt}, timestep=timestep,
                    mask=mask, return_dict=return_dict)

    def rope_caches(self, call: Call):
        caches = super().rope_caches(call)
        hidden_states = call.hidden_states
        if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3 \
                and caches.img.shape[0] != hidden_states.shape[1]:
            raise InputError(
                f"img_shapes {call.request['img_shapes']} give {caches.img.shape[0]} image tokens "
                f"but hidden_states has {hidden_states.shape[1]}: img_shapes are the latent patch "
                f"grids (frames, height / vae_scale / 2, width / vae_scale / 2) of the images")
        return caches

    def _refuse_unsupported(self, guidance, attention_kwargs, controlnet_block_samples,
                            additional_t_cond) -> None:
        if controlnet_block_samples is not None:
            raise InputError("controlnet_block_samples: the exported transformer has no ControlNet "
                             "residual inputs. Fix: run a ControlNet pipeline on the PyTorch model")
        if additional_t_cond is not None:
            raise InputError("additional_t_cond: the exported transformer takes no additional "
                             "timestep conditioning (use_additional_t_cond models are not exported)")
        if guidance is not None:
            why = ("this transformer was exported without guidance embeddings "
                   "(guidance_embeds=False), so the value cannot be honoured. Fix: call the "
                   "pipeline without guidance_scale"
                   if not self.config.get("guidance_embeds", False) else
                   "guidance-distilled Qwen-Image models are not exported by qkrope yet (the "
                   "graph has no guidance input)")
            raise InputError(f"guidance was given, but {why}")
        refuse_kwargs(attention_kwargs, "attention_kwargs")


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return QwenImageTransformer



__all__ = ["QwenImageTransformer", "build_qwen_rope_caches", "diffusers_img_shapes", "dropin_class",
           "sample_request"]
