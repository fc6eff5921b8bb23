"""FLUX.1's and FLUX.2's export hooks (export layer): the shared dual-stream export
(:mod:`qkrope.export.dual_stream`: the fused processors, the cache-input wrapper, the sample,
the no-float64 check) with each record's :data:`qkrope.families.flux.DUAL_STREAM`, plus what
only FLUX.2 has: its parallel single-stream attention (``Flux2ParallelSelfAttnProcessor``: QKV
and the MLP input in one projection) and its blocks (shared modulations, single-stream blocks
over the joined sequence).

Every attention's per-head RMSNorm + RoPE is one ``qkrope::QKNormRoPE`` node: two per
double-stream block (image and text stream, each with its cache), one per single-stream block
(the ``[text; image]`` sequence, the joined cache made in the graph from the two cache inputs).
The wrapper replays diffusers' ``forward`` for the standard inference path (no ControlNet
residuals, no IP-Adapter, no FLUX.2 KV cache).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope.errors import InputError
from qkrope.export import dual_stream
from qkrope.export.dual_stream import (CacheInputTransformer, FusedNormRoPE, JointRope,
                                       check_config, post_export, sdpa)
from qkrope.families._record import FamilyRecord

from . import DUAL_STREAM, FLUX1

#: What the blocks pass on as ``image_rotary_emb`` (the shared dual-stream code's name).
FluxRope = JointRope


def sample_ids(family: FamilyRecord, img_shapes, txt_len: int):
    """Position ids as the FLUX pipelines make them, for the traced sample, as torch tensors
    (:func:`qkrope.families.flux.dropin.flux_sample_ids`: the one home of that layout)."""
    from qkrope.families.flux.dropin import flux_sample_ids

    txt, img = flux_sample_ids(family.name, img_shapes, txt_len)
    return torch.from_numpy(txt), torch.from_numpy(img)


class Flux2ParallelSelfAttnProcessor:
    """Replaces FLUX.2's ``Flux2ParallelSelfAttnProcessor`` (single-stream blocks: QKV and the
    MLP input in one projection, attention and MLP outputs through one projection)."""

    def __init__(self, rounding: int):
        self.fused = FusedNormRoPE(rounding)

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise InputError("the FLUX export takes no attention_mask")
        if not isinstance(image_rotary_emb, FluxRope):
            raise InputError("the patched FLUX.2 attention needs image_rotary_emb=FluxRope(...)")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = projected.split([3 * attn.inner_dim, projected.shape[-1] - 3 * attn.inner_dim],
                                   dim=-1)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.joint)
        out = sdpa(q, k, v, attn.head_dim)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class Flux2CacheInputTransformer(CacheInputTransformer):
    """FLUX.2's blocks: the three shared modulations made once, single-stream blocks over the
    joined ``[text; image]`` sequence."""

    def blocks(self, hidden_states, encoder_hidden_states, temb, rope):
        t = self.transformer
        mod_img = t.double_stream_modulation_img(temb)
        mod_txt = t.double_stream_modulation_txt(temb)
        mod_single = t.single_stream_modulation(temb)
        for block in t.transformer_blocks[:self.double]:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                temb_mod_img=mod_img, temb_mod_txt=mod_txt, image_rotary_emb=rope)
        s_txt = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for block in t.single_transformer_blocks[:self.single]:
            hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=None,
                                  temb_mod=mod_single, image_rotary_emb=rope)
        return hidden_states[:, s_txt:]


def cache_input_flux(transformer: nn.Module, family: FamilyRecord, *,
                     rounding: int | None = None,
                     layers: int | None = None) -> CacheInputTransformer:
    """The wrapper whose ``forward`` arguments are the family's graph inputs, in graph order
    (``layers``: the first ``layers`` blocks in execution order only)."""
    rounding = family.rounding if rounding is None else rounding
    kept = family.kept_blocks(transformer.config, layers)
    base, single = ((CacheInputTransformer, None) if family is FLUX1 else
                    (Flux2CacheInputTransformer, Flux2ParallelSelfAttnProcessor(rounding)))
    return dual_stream.cache_input(base, transformer, family, DUAL_STREAM[family.name], kept,
                                   rounding=rounding, single=single)


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` with its first ``layers`` blocks in execution order
    (:func:`qkrope.export.dual_stream.prepare`). The sidecar records the RoPE axes (3 for
    FLUX.1, 4 for FLUX.2) and theta (FLUX.1's 10000 is fixed in diffusers' code, FLUX.2's is
    the config's rope_theta, 2000 by default), as read from the loaded model."""
    if record is FLUX1:
        return dual_stream.prepare(record, DUAL_STREAM[record.name], transformer, sample=sample,
                                   dtype=dtype, layers=layers, rounding=rounding)
    return dual_stream.prepare(record, DUAL_STREAM[record.name], transformer, sample=sample,
                               dtype=dtype, layers=layers, rounding=rounding,
                               base=Flux2CacheInputTransformer,
                               single=Flux2ParallelSelfAttnProcessor(rounding))


__all__ = ["FluxRope", "sample_ids", "Flux2ParallelSelfAttnProcessor",
           "Flux2CacheInputTransformer", "cache_input_flux", "prepare", "check_config",
           "post_export"]
