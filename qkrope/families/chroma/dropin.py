"""Chroma's part of the pipeline drop-in (runtime layer): ``ChromaPipeline``,
``ChromaImg2ImgPipeline`` and ``ChromaInpaintPipeline`` call ``pipe.transformer(hidden_states,
timestep, encoder_hidden_states, txt_ids, img_ids, attention_mask, joint_attention_kwargs,
return_dict=False)``; :class:`ChromaTransformer` maps that call onto the generic drop-in
(:mod:`qkrope.runtime._dropin`) and the "ids" position scheme.

The mask: the pipelines pass ``attention_mask`` = [text mask; ones for the image tokens] in the
prompt embeddings' float dtype, and diffusers' SDPA adds a float mask to the scores (it does not
drop keys: diffusers issues 12116, 13619). The graph takes the text part
(``encoder_hidden_states_mask``, in the model's dtype) and adds the same pairwise products, so
the drop-in reproduces the stock pipelines. Refused in one line: a bool mask (diffusers drops
keys for it; the graph adds a float one), a mask whose image part is not all ones, ControlNet
residuals, IP-Adapter image embeddings, a LoRA scale other than 1 (or other
``joint_attention_kwargs``). ``attention_mask=None`` (no pipeline passes it) runs with the text
mask all ones: a uniform +1 on every score, which softmax cancels up to rounding. The drop-in's
config has ``guidance_embeds=False``, which ``ChromaInpaintPipeline`` reads and diffusers' own
Chroma config lacks (with the stock transformer that pipeline stops with an AttributeError).

Also the family's cache builder :func:`caches_from_ids`, the ids its pipelines lay out for given
sizes (:func:`sample_ids`, :func:`sample_request`: what ``make_inputs`` and the exporter's
sample need).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from qkrope.errors import InputError
from qkrope.runtime._dropin import (Call, Transformer, missing_arguments, per_item, position_ids,
                                    refuse_kwargs, tensor_arg)
from qkrope.runtime.caches import RopeCaches, build_rope_caches, checked_setting
from qkrope.runtime.schemes import ids as ids_scheme


class IPAdapterUnsupportedError(InputError, AttributeError):
    """An IP-Adapter was asked of the exported model (an AttributeError too: ``hasattr`` on the
    drop-in's ``encoder_hid_proj`` is False)."""


def sample_ids(img_shapes, txt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(txt_ids, img_ids), float32 ``[tokens, 3]``, as the Chroma pipelines make them: text ids
    all 0, the image's patch at (0, row, column) (FLUX.1's layout; a further image of
    ``img_shapes`` at first axis k, as FLUX.1 Kontext lays out a condition image)."""
    return ids_scheme.sample_ids(img_shapes, txt_len, n_axes=3, image_step=1, text_axis=None)


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the ids the pipelines pass."""
    txt, img = sample_ids(img_shapes, txt_len)
    return {"txt_ids": txt, "img_ids": img}


def caches_from_ids(txt_ids: Any, img_ids: Any, *, axes_dims: Sequence[int], theta: float,
                    head_dim: int, device: torch.device | str | None = None) -> RopeCaches:
    """Chroma's RoPE caches from its position ids (``[tokens, 3]``), as diffusers'
    ``FluxPosEmbed`` computes them (float64, then float32: the "ids" scheme), as wide as the
    model's heads (Chroma rotates the whole head)."""
    setting = checked_setting("ids", axes_dims, theta, what="axes_dims")
    caches = build_rope_caches("ids", {"txt_ids": txt_ids, "img_ids": img_ids}, setting,
                               device=device)
    if caches.img.shape[-1] != head_dim:
        raise InputError(f"chroma: the RoPE axes {list(axes_dims)} give caches of width "
                         f"{caches.img.shape[-1]}, the model's heads are {head_dim} wide. Fix: "
                         f"re-export the model (its sidecar's axes_dims_rope is inconsistent)")
    return caches


def _ids(value: Any, name: str, tokens: int) -> Any:
    return position_ids(value, name, tokens, 3, fix="pass the ids the Chroma pipeline prepares")


class ChromaTransformer(Transformer):
    """What diffusers' Chroma pipelines call on ``pipe.transformer`` (module docstring). Built
    by :func:`qkrope.runtime.load_transformer` for a Chroma export."""

    FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids",
                    "attention_mask", "joint_attention_kwargs", "controlnet_block_samples",
                    "controlnet_single_block_samples", "return_dict", "controlnet_blocks_repeat")
    PIPELINES = "ChromaPipeline, ChromaImg2ImgPipeline, ChromaInpaintPipeline"

    def __init__(self, runner, record, *, device=None):
        from qkrope.runtime._dropin import frozen_config

        super().__init__(runner, record, device=device)
        # ChromaInpaintPipeline (diffusers 0.42.1) reads transformer.config.guidance_embeds,
        # which ChromaTransformer2DModel's config lacks (the stock model fails there with an
        # AttributeError); Chroma embeds no guidance, so the drop-in's config says False (the
        # pipeline then passes none, as to every Chroma transformer)
        if "guidance_embeds" not in self.config:
            self.config = frozen_config({**self.config, "guidance_embeds": False})

    @property
    def encoder_hid_proj(self):
        raise IPAdapterUnsupportedError(
            "IP-Adapter: the exported Chroma transformer has no image-projection "
            "(encoder_hid_proj) or IP-Adapter attention. Fix: run IP-Adapter pipelines on the "
            "PyTorch model")

    def prepare(self, hidden_states=None, encoder_hidden_states=None, timestep=None,
                img_ids=None, txt_ids=None, attention_mask=None,
                joint_attention_kwargs: Mapping | None = None, controlnet_block_samples=None,
                controlnet_single_block_samples=None, return_dict: bool = True,
                controlnet_blocks_repeat: bool = False) -> Call:
        if controlnet_block_samples is not None or controlnet_single_block_samples is not None:
            raise InputError("controlnet_block_samples / controlnet_single_block_samples: the "
                             "exported Chroma transformer has no ControlNet residual inputs. "
                             "Fix: run ControlNet pipelines on the PyTorch model")
        kwargs = joint_attention_kwargs
        if isinstance(kwargs, Mapping) and any(k in kwargs for k in ("ip_adapter_image_embeds",
                                                                      "ip_hidden_states")):
            raise IPAdapterUnsupportedError(
                "joint_attention_kwargs carries IP-Adapter image embeddings, which the exported "
                "Chroma transformer cannot take. Fix: run IP-Adapter pipelines on the PyTorch "
                "model")
        refuse_kwargs(kwargs, "joint_attention_kwargs")
        missing = [n for n, v in (("encoder_hidden_states", encoder_hidden_states),
                                  ("timestep", timestep), ("img_ids", img_ids),
                                  ("txt_ids", txt_ids)) if v is None]
        if missing:
            raise missing_arguments("Chroma", missing)
        for name, t in (("hidden_states", hidden_states),
                        ("encoder_hidden_states", encoder_hidden_states)):
            tensor_arg(t, name, 3, "[batch, tokens, features]")
        batch = int(hidden_states.shape[0])
        s_img, s_txt = int(hidden_states.shape[1]), int(encoder_hidden_states.shape[1])
        mask = self._text_mask(attention_mask, batch, s_txt, s_img)
        timestep = per_item(timestep, "timestep", batch, self.dtype)
        request = {"txt_ids": _ids(txt_ids, "txt_ids", s_txt),
                   "img_ids": _ids(img_ids, "img_ids", s_img)}
        return Call(hidden_states, encoder_hidden_states, request, timestep=timestep, mask=mask,
                    return_dict=return_dict)

    def _text_mask(self, attention_mask, batch: int, s_txt: int, s_img: int):
        """The graph's text mask from the pipelines' ``attention_mask`` ([batch, text + image]
        tokens, float), or None (the runner's all-ones mask)."""
        if attention_mask is None:
            return None
        layout = f"[batch, txt_tokens + img_tokens] = [{batch}, {s_txt + s_img}]"
        tensor_arg(attention_mask, "attention_mask", 2, layout,
                   "pass the mask the Chroma pipeline prepares (the prompt mask, then ones for "
                   "the image tokens)")
        if tuple(attention_mask.shape) != (batch, s_txt + s_img):
            raise InputError(f"attention_mask must be {layout}; got "
                             f"{tuple(attention_mask.shape)}. Fix: pass the prompt mask "
                             f"followed by ones for the image tokens, one row per batch item")
        if attention_mask.dtype == torch.bool or not attention_mask.is_floating_point():
            raise InputError(
                f"attention_mask is {attention_mask.dtype}; diffusers' SDPA drops keys for a bool "
                f"mask, while this export adds the float 0/1 mask the Chroma pipelines pass "
                f"(prompt_attention_mask in the prompt embeddings' dtype). Fix: pass the mask "
                f"as a float tensor (attention_mask.to(prompt_embeds.dtype)), or run the "
                f"PyTorch model for a dropping mask")
        if not bool((attention_mask[:, s_txt:] == 1).all()):
            raise InputError("attention_mask's image part (after the text tokens) is not all "
                             "ones; the graph takes a text mask and joins ones for the image, "
                             "as the Chroma pipelines do. Fix: mask only text tokens")
        return attention_mask[:, :s_txt].to(self.dtype)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return ChromaTransformer


__all__ = ["ChromaTransformer", "IPAdapterUnsupportedError", "caches_from_ids", "dropin_class",
           "sample_ids", "sample_request"]
