"""FLUX.1's and FLUX.2's part of the pipeline drop-in (runtime layer): ``FluxPipeline``,
``FluxKontextPipeline``, ``Flux2Pipeline`` and ``Flux2KleinPipeline`` call
``pipe.transformer(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
txt_ids, guidance, ...)``; :class:`FluxTransformer` maps that call onto the generic drop-in
(:mod:`qkrope.runtime._dropin`) and the "ids" position scheme (a condition or reference image's
ids are part of ``img_ids``).

Refused in one line, never ignored: ControlNet residuals, IP-Adapter image embeddings, a LoRA
scale other than 1 (or other ``joint_attention_kwargs``), FLUX.2's KV-cache modes
(``kv_cache``, ``kv_cache_mode``, ``num_ref_tokens``), a ``guidance`` value for a FLUX.1 model
exported without guidance embeddings. A FLUX.2 model without guidance embeddings (klein)
ignores ``guidance``, as diffusers' own model does.

Also the family's public cache builder :func:`build_flux_rope_caches` (``PUBLIC``), the ids its
pipelines lay out for given sizes (:func:`flux_sample_ids`, :func:`sample_request`: what
``make_inputs`` and the exporter's sample need) and :func:`caches_from_ids`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from qkrope.errors import InputError
from qkrope.families.flux import FLUX1, FLUX2
from qkrope.model_io import POOLED_PROJECTIONS
from qkrope.runtime._dropin import (Call, Transformer, missing_arguments, per_item, position_ids,
                                    refuse_kwargs, tensor_arg)
from qkrope.runtime.caches import RopeCaches, build_rope_caches, checked_setting
from qkrope.runtime.schemes import ids as ids_scheme

#: How each family's pipelines lay out the ids of the images of a sample: image k's first axis
#: at k * step (FLUX.1: a Kontext condition image at 1; FLUX.2: reference image k at 10 * k),
#: and the text's token index on an axis (FLUX.2's 4th) or nowhere (FLUX.1: text ids all 0).
_SAMPLE_LAYOUT = {FLUX1.name: dict(image_step=1, text_axis=None),
                  FLUX2.name: dict(image_step=10, text_axis=3)}
_BY_NAME = {r.name: r for r in (FLUX1, FLUX2)}


class IPAdapterUnsupportedError(InputError, AttributeError):
    """An IP-Adapter was asked of the exported model (an AttributeError too: ``hasattr`` on the
    drop-in's ``encoder_hid_proj`` is False)."""


def build_flux_rope_caches(txt_ids: object, img_ids: object, *, axes_dims: Sequence[int],
                           theta: float,
                           device: torch.device | str | None = None) -> RopeCaches:
    """FLUX.1's or FLUX.2's RoPE caches from the position ids its pipeline passes, as diffusers'
    ``FluxPosEmbed`` / ``Flux2PosEmbed`` compute them (on the CPU: float64, then float32; the
    "ids" scheme, :mod:`qkrope.runtime.schemes.ids`, says the bits).

    Args:
        txt_ids: ``[txt_tokens, len(axes_dims)]`` position ids of the text tokens (FLUX.1: all
            zero; FLUX.2: ``(0, 0, 0, l)``), any real dtype, a tensor or array; diffusers'
            batched ``[batch, tokens, axes]`` form is accepted when its items are equal.
        img_ids: ``[img_tokens, len(axes_dims)]`` of the image tokens, condition (Kontext) and
            reference (FLUX.2) images included, in the order of the model's image sequence.
        axes_dims: the RoPE width of each axis: FLUX.1 ``(16, 56, 56)``, FLUX.2
            ``(32, 32, 32, 32)`` (the records' ``axes``).
        theta: the RoPE base: FLUX.1 10000, FLUX.2 2000 (its config's ``rope_theta``).
        device: where the caches are put.

    Returns:
        ``RopeCaches(img [img_tokens, sum(axes_dims)], txt [txt_tokens, sum(axes_dims)])``,
        fp32; a single-stream block's joint cache is ``torch.cat([txt, img])``. No position
        limit; refused above ``MAX_CACHE_BYTES``, from the shapes, before anything is copied.
        Results are memoised per ids: treat them as read-only.

    Raises:
        InputError: ids of another shape or axis count, no tokens, a bool or complex dtype,
        NaN/inf positions, different ids per batch item, bad ``axes_dims`` / ``theta``, caches
        above the byte limit.
    """
    setting = checked_setting("ids", axes_dims, theta, what="axes_dims")
    return build_rope_caches("ids", {"txt_ids": txt_ids, "img_ids": img_ids}, setting,
                             device=device)


#: Public names this family adds to qkrope.runtime (and qkrope.runtime.caches).
PUBLIC: dict = {"build_flux_rope_caches": build_flux_rope_caches}


def flux_sample_ids(family: str, img_shapes, txt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(txt_ids, img_ids), float32 ``[tokens, axes]``, as the FLUX pipelines make them for
    images of ``img_shapes`` (``(frames, h, w)`` in latent patches, the first the output image,
    the others condition / reference images) and ``txt_len`` text tokens: image k at
    (k, row, column) (FLUX.1: a condition image at first axis 1, like Kontext; FLUX.2: a 4th axis
    at 0 and reference images at first axis 10 * k), text at 0 (FLUX.2: its 4th axis the token
    index). What the exporter traces and what ``qkrope check`` feeds."""
    if family not in _BY_NAME:
        raise ValueError(f"flux_sample_ids: {family!r} is not one of {sorted(_BY_NAME)}")
    record = _BY_NAME[family]
    return ids_scheme.sample_ids(img_shapes, txt_len, n_axes=len(record.axes),
                                 **_SAMPLE_LAYOUT[family])


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the ids the family's pipelines pass."""
    txt, img = flux_sample_ids(record.name, img_shapes, txt_len)
    return {"txt_ids": txt, "img_ids": img}


def caches_from_ids(family: str, txt_ids: torch.Tensor, img_ids: torch.Tensor, *,
                    axes_dims: Sequence[int], theta: float, head_dim: int,
                    device: torch.device | str | None = None) -> RopeCaches:
    """FLUX's RoPE caches from its position ids (``[tokens, axes]``; FLUX.1 3 axes, FLUX.2 4):
    :func:`build_flux_rope_caches`, whose width must be the model's ``head_dim`` (FLUX rotates
    the whole head)."""
    caches = build_flux_rope_caches(txt_ids, img_ids, axes_dims=axes_dims, theta=theta,
                                    device=device)
    if caches.img.shape[-1] != head_dim:
        raise InputError(f"{family}: the RoPE axes {list(axes_dims)} give caches of width "
                         f"{caches.img.shape[-1]}, the model's heads are {head_dim} wide. Fix: "
                         f"re-export the model (its sidecar's axes_dims_rope is inconsistent)")
    return caches


def _ids(value: Any, name: str, tokens: int, axes: int) -> torch.Tensor:
    return position_ids(value, name, tokens, axes, fix="pass the ids the FLUX pipeline prepares")


class FluxTransformer(Transformer):
    """What diffusers' FLUX pipelines call on ``pipe.transformer`` (module docstring). Built by
    :func:`qkrope.runtime.load_transformer` for a FLUX.1 or FLUX.2 export."""

    FORWARD_ARGS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                    "img_ids", "txt_ids", "guidance", "joint_attention_kwargs",
                    "controlnet_block_samples", "controlnet_single_block_samples",
                    "return_dict", "controlnet_blocks_repeat", "kv_cache", "kv_cache_mode",
                    "num_ref_tokens", "ref_fixed_timestep")
    PIPELINES = "FluxPipeline, FluxKontextPipeline, Flux2Pipeline, Flux2KleinPipeline"

    def __init__(self, runner, record, *, device=None):
        super().__init__(runner, record, device=device)
        self.family = record
        self._guided = "guidance" in runner.io.roles
        # FLUX.1 embeds the pooled CLIP projection; FLUX.2 has none
        self._pooled = POOLED_PROJECTIONS in record.graph.inputs

    @property
    def encoder_hid_proj(self):
        raise IPAdapterUnsupportedError(
            "IP-Adapter: the exported FLUX transformer has no image-projection (encoder_hid_proj)"
            " or IP-Adapter attention. Fix: run IP-Adapter pipelines on the PyTorch model")

    def prepare(self, hidden_states=None, encoder_hidden_states=None, pooled_projections=None,
                timestep=None, img_ids=None, txt_ids=None, guidance=None,
                joint_attention_kwargs: Mapping | None = None, controlnet_block_samples=None,
                controlnet_single_block_samples=None, return_dict: bool = True,
                controlnet_blocks_repeat: bool = False, kv_cache=None,
                kv_cache_mode: str | None = None, num_ref_tokens: int = 0,
                ref_fixed_timestep: float = 0.0) -> Call:
        self._refuse_unsupported(joint_attention_kwargs, controlnet_block_samples,
                                 controlnet_single_block_samples, kv_cache, kv_cache_mode,
                                 num_ref_tokens)
        needed = [("encoder_hidden_states", encoder_hidden_states), ("timestep", timestep),
                  ("img_ids", img_ids), ("txt_ids", txt_ids)]
        if self._pooled:
            needed.append(("pooled_projections", pooled_projections))
        missing = [n for n, v in needed if v is None]
        if missing:
            raise missing_arguments(self.record.label, missing)
        for name, t in (("hidden_states", hidden_states),
                        ("encoder_hidden_states", encoder_hidden_states)):
            tensor_arg(t, name, 3, "[batch, tokens, features]")
        batch = int(hidden_states.shape[0])
        # one prompt for several images: FluxPipeline given prompt_embeds does not repeat them
        # for num_images_per_prompt, and diffusers' model broadcasts the text's batch of 1
        # (through the timestep modulation); the graph has one batch axis, so it is expanded
        if encoder_hidden_states.shape[0] == 1 < batch:
            encoder_hidden_states = encoder_hidden_states.expand(batch, -1, -1)
        conditioning: dict[str, torch.Tensor] = {}
        if self._pooled:
            tensor_arg(pooled_projections, "pooled_projections", 2,
                       f"[batch, {self.config.get('pooled_projection_dim')}] (the pooled CLIP "
                       f"prompt embedding)", "pass the pipeline's pooled_prompt_embeds tensor, "
                       "e.g. torch.stack(items) for a list of [dim] tensors")
            if pooled_projections.shape[0] == 1 < batch:
                pooled_projections = pooled_projections.expand(batch, -1)
            conditioning["pooled_projections"] = pooled_projections.to(self.dtype)
        elif pooled_projections is not None:
            raise InputError(f"pooled_projections was given, but the {self.record.short} "
                             f"transformer takes none (it has no pooled text embedding). Fix: "
                             f"drop it")
        if guidance is not None and self._guided:
            conditioning["guidance"] = per_item(guidance, "guidance", batch, self.dtype)
        elif guidance is not None and self._pooled:
            raise InputError("guidance was given, but this FLUX.1 transformer was exported "
                             "without guidance embeddings (guidance_embeds=False, e.g. schnell)"
                             ", so the value cannot be honoured. Fix: drop guidance")
        elif guidance is None and self._guided:
            raise InputError("this transformer embeds a guidance scale (guidance_embeds=True, "
                             "e.g. FLUX dev) and needs guidance=[batch] values; got None. Fix: "
                             "pass guidance (the pipeline's guidance_scale)")
        # FLUX.2 without guidance embeddings (klein): diffusers ignores guidance, so does this
        timestep = per_item(timestep, "timestep", batch, self.dtype)
        axes = len(self._setting.axes_dim)
        request = {"txt_ids": _ids(txt_ids, "txt_ids", int(encoder_hidden_states.shape[1]), axes),
                   "img_ids": _ids(img_ids, "img_ids", int(hidden_states.shape[1]), axes)}
        return Call(hidden_states, encoder_hidden_states, request, timestep=timestep,
                    conditioning=conditioning, return_dict=return_dict)

    def rope_caches(self, call: Call):
        caches = super().rope_caches(call)
        head_dim = self._runner.io.head_dim
        if head_dim is not None and caches.img.shape[-1] != int(head_dim):
            raise InputError(f"{self.record.name}: the RoPE axes {list(self._setting.axes_dim)} "
                             f"give caches of width {caches.img.shape[-1]}, the model's heads are "
                             f"{head_dim} wide. Fix: re-export the model (its sidecar's "
                             f"axes_dims_rope is inconsistent)")
        return caches

    def _refuse_unsupported(self, joint_attention_kwargs, controlnet_block_samples,
                            controlnet_single_block_samples, kv_cache, kv_cache_mode,
                            num_ref_tokens) -> None:
        if controlnet_block_samples is not None or controlnet_single_block_samples is not None:
            raise InputError("controlnet_block_samples / controlnet_single_block_samples: the "
                             "exported FLUX transformer has no ControlNet residual inputs. Fix: "
                             "run ControlNet pipelines on the PyTorch model")
        if kv_cache is not None or kv_cache_mode is not None or num_ref_tokens:
            raise InputError(
                f"FLUX.2's KV cache (kv_cache_mode={kv_cache_mode!r}, num_ref_tokens="
                f"{num_ref_tokens!r}) is not in the exported graph, which recomputes the "
                f"reference tokens every step. Fix: use Flux2KleinPipeline (not the KV pipeline)"
                f", or run the KV pipeline on the PyTorch model")
        kwargs = joint_attention_kwargs
        if isinstance(kwargs, Mapping) and any(k in kwargs for k in ("ip_adapter_image_embeds",
                                                                      "ip_hidden_states")):
            raise IPAdapterUnsupportedError(
                "joint_attention_kwargs carries IP-Adapter image embeddings, which the exported "
                "FLUX transformer cannot take. Fix: run IP-Adapter pipelines on the PyTorch model")
        refuse_kwargs(kwargs, "joint_attention_kwargs")


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point): one for both FLUX records."""
    return FluxTransformer


PUBLIC["IPAdapterUnsupportedError"] = IPAdapterUnsupportedError

__all__ = ["FluxTransformer", "IPAdapterUnsupportedError", "build_flux_rope_caches",
           "caches_from_ids", "dropin_class", "flux_sample_ids", "sample_request"]
