"""Chroma's export hooks (export layer): the shared dual-stream export
(:mod:`qkrope.export.dual_stream`: the fused processor, with the attention mask, the sample,
the no-float64 check) with Chroma's own wrapper.

diffusers' ``ChromaTransformer2DModel`` is FLUX.1's attention code (``FluxAttention`` with
``FluxAttnProcessor``, RoPE tables from ``FluxPosEmbed`` in float64) with other modulations:
two ``QKNormRoPE`` nodes per double-stream block (image and text stream, each with its cache),
one per single-stream block (the ``[text; image]`` sequence, the joined cache).

:class:`ChromaCacheInputTransformer` replays diffusers' ``forward`` for the inference path (no
ControlNet residuals, no IP-Adapter): the graph inputs are ``hidden_states,
encoder_hidden_states, encoder_hidden_states_mask, timestep, img_cos_sin_cache,
txt_cos_sin_cache``. The text mask is joined with ones for the image tokens, as the pipelines
do, and the blocks turn it into diffusers' pairwise mask (added to the scores: a float mask).
The timestep embedding's guidance half, which diffusers builds from a Python list of the batch
size, is built from zeros of the timestep's shape (the same values, a dynamic batch).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope.export import dual_stream
from qkrope.export.dual_stream import (CacheInputTransformer, check_config, joint_rope,
                                       post_export)
from qkrope.families._record import FamilyRecord

from . import DUAL_STREAM


def input_vec(embed: nn.Module, timestep: torch.Tensor) -> torch.Tensor:
    """``ChromaCombinedTimestepTextProjEmbeddings.forward`` (the approximator's input) with the
    guidance projection of zeros taken from the timestep's shape instead of a list of the
    batch size (a constant batch in the traced graph): Timesteps of 0 is cos 0 = 1 and
    sin 0 = 0 whatever the input's dtype, so the values are diffusers'."""
    mod_len = embed.mod_proj.shape[0]
    batch = timestep.shape[0]
    times = embed.time_proj(timestep).to(dtype=timestep.dtype)
    guidance = embed.guidance_proj(torch.zeros_like(timestep)).to(dtype=timestep.dtype)
    mod_proj = embed.mod_proj.to(dtype=times.dtype, device=times.device).repeat(batch, 1, 1)
    both = torch.cat([times, guidance], dim=1).unsqueeze(1).repeat(1, mod_len, 1)
    return torch.cat([both, mod_proj], dim=-1).to(timestep.dtype)


class ChromaCacheInputTransformer(CacheInputTransformer):
    """A Chroma transformer whose ``forward`` takes the graph inputs
    (:data:`qkrope.families.chroma.CHROMA_TRANSFORMER`, in graph order), running the first
    ``kept`` (double, single) blocks. The modulation rows of each block are those of the whole
    model (their offsets count every block), so a prefix computes what the whole model's first
    blocks compute."""

    masked = True  # the pipelines' attention_mask reaches every attention

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        s_img, s_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        rope = joint_rope(img_cos_sin_cache, txt_cos_sin_cache, s_img, s_txt)
        # the pipelines' attention_mask: the text mask, then ones for the image tokens
        mask = torch.cat([encoder_hidden_states_mask,
                          torch.ones_like(hidden_states[:, :, 0],
                                          dtype=encoder_hidden_states_mask.dtype)], dim=1)
        hidden_states = t.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        pooled_temb = t.distilled_guidance_layer(input_vec(t.time_text_embed, timestep))
        encoder_hidden_states = t.context_embedder(encoder_hidden_states)
        n_double, n_single = len(t.transformer_blocks), len(t.single_transformer_blocks)
        img_offset = 3 * n_single
        txt_offset = img_offset + 6 * n_double
        for index, block in enumerate(t.transformer_blocks[:self.double]):
            img_mod, txt_mod = img_offset + 6 * index, txt_offset + 6 * index
            temb = torch.cat((pooled_temb[:, img_mod:img_mod + 6],
                              pooled_temb[:, txt_mod:txt_mod + 6]), dim=1)
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                temb=temb, image_rotary_emb=rope, attention_mask=mask)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for index, block in enumerate(t.single_transformer_blocks[:self.single]):
            hidden_states = block(hidden_states=hidden_states,
                                  temb=pooled_temb[:, 3 * index:3 * index + 3],
                                  image_rotary_emb=rope, attention_mask=mask)
        hidden_states = hidden_states[:, s_txt:, ...]
        hidden_states = t.norm_out(hidden_states, pooled_temb[:, -2:])
        return t.proj_out(hidden_states)


def sample_mask(batch: int, txt_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The traced text mask: ones, the last quarter of the second item's tokens 0 (as
    :func:`qkrope.runtime.inputs.make_inputs` makes it), in the model's dtype."""
    mask = torch.ones(batch, txt_len)
    if batch > 1:
        mask[1, txt_len - max(1, txt_len // 4):] = 0
    return mask.to(dtype)


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` with its first ``layers`` blocks in execution order
    (:func:`qkrope.export.dual_stream.prepare`, every attention on the masked processor). The
    sidecar records the RoPE axes (the config's axes_dims_rope) and theta (10000, fixed in
    diffusers' code; read from the built model)."""
    return dual_stream.prepare(record, DUAL_STREAM, transformer, sample=sample, dtype=dtype,
                               layers=layers, rounding=rounding,
                               base=ChromaCacheInputTransformer,
                               mask=sample_mask(sample.batch, sample.txt_len, dtype))


__all__ = ["input_vec", "ChromaCacheInputTransformer", "sample_mask", "prepare", "check_config",
           "post_export"]
