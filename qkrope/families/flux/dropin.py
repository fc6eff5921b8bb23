"""FLUX.1's and FLUX.2's part of the pipeline drop-in (runtime layer): ``FluxPipeline``,
``FluxKontextPipeline``, ``Flux2Pipeline`` and ``Flux2KleinPipeline`` call
``pipe.transformer(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
txt_ids, guidance, ...)``; :class:`FluxTransformer` is the shared dual-stream drop-in
(:class:`qkrope.runtime.dual_stream.DualStreamTransformer`: ids, pooled projections, guidance,
its refusals) with each record's :data:`qkrope.families.flux.DUAL_STREAM` and FLUX.2's KV-cache
modes (``kv_cache``, ``kv_cache_mode``, ``num_ref_tokens``) refused in one line. A guidance
value for a FLUX.1 model exported without guidance embeddings is refused; a FLUX.2 model
without them (klein) ignores it, as diffusers' own model does.

Also the family's public cache builder :func:`build_flux_rope_caches` (``PUBLIC``), the ids its
pipelines lay out for given sizes (:func:`flux_sample_ids`, :func:`sample_request`: what
``make_inputs`` and the exporter's sample need) and :func:`caches_from_ids`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from qkrope.errors import InputError
from qkrope.families.flux import DUAL_STREAM, FLUX1, FLUX2
from qkrope.runtime.caches import RopeCaches, build_rope_caches, checked_setting
from qkrope.runtime.dual_stream import (DualStreamTransformer, IPAdapterUnsupportedError,
                                        caches_from_ids, sample_ids)

_BY_NAME = {r.name: r for r in (FLUX1, FLUX2)}


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
    return sample_ids(DUAL_STREAM[family].ids, img_shapes, txt_len)


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the ids the family's pipelines pass."""
    txt, img = flux_sample_ids(record.name, img_shapes, txt_len)
    return {"txt_ids": txt, "img_ids": img}


class FluxTransformer(DualStreamTransformer):
    """What diffusers' FLUX pipelines call on ``pipe.transformer`` (module docstring). Built by
    :func:`qkrope.runtime.load_transformer` for a FLUX.1 or FLUX.2 export."""

    SPEC = DUAL_STREAM[FLUX1.name]  # the forward arguments and pipelines (both records')

    @classmethod
    def spec_for(cls, record):
        return DUAL_STREAM[record.name]

    def refuse(self, call: dict) -> None:
        super().refuse(call)
        kv_cache, mode, refs = (call.get("kv_cache"), call.get("kv_cache_mode"),
                                call.get("num_ref_tokens"))
        if kv_cache is not None or mode is not None or refs:
            raise InputError(
                f"FLUX.2's KV cache (kv_cache_mode={mode!r}, num_ref_tokens={refs!r}) is not in "
                f"the exported graph, which recomputes the reference tokens every step. Fix: use "
                f"Flux2KleinPipeline (not the KV pipeline), or run the KV pipeline on the "
                f"PyTorch model")


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point): one for both FLUX records."""
    return FluxTransformer


PUBLIC["IPAdapterUnsupportedError"] = IPAdapterUnsupportedError

__all__ = ["FluxTransformer", "IPAdapterUnsupportedError", "build_flux_rope_caches",
           "caches_from_ids", "dropin_class", "flux_sample_ids", "sample_request"]
