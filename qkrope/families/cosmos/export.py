"""Cosmos-Predict2's export hooks (export layer): the config check, the attention processors,
the cache-input wrapper, the sample inputs and the post-export check that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers' ``CosmosRotaryPosEmbed`` builds the RoPE tables inside the forward (float32 pow, cos
and sin over the latent's grid). Here they come in as one ``[rows, rotary_dim]`` fp32 cache
(the image stream's; the text is never rotated) built outside the graph by the "scaled_grid"
scheme, and every self-attention's per-head RMSNorm + split-halves RoPE is one
``qkrope::QKNormRoPE`` node (``interleaved=False``). The cross-attention (video queries, text
keys, no RoPE) keeps diffusers' two RMSNorms as ordinary ops: the node normalises a q/k pair of
one sequence with one cache, and q and k differ in length there.

:class:`CosmosCacheInputTransformer` replays ``CosmosTransformer3DModel.forward`` for
Predict2's inference path: the latent (with the condition-mask channel a Video2World model
takes) plus the padding-mask channel, per-frame timesteps (a ``[batch]`` timestep is the same
value on every frame), the learnable positional embedding, no ControlNet residuals, no image
context (Predict2.5), no text attention mask (the pipelines pass none).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qkrope.errors import InputError
from qkrope.export.finalize import check_no_double
from qkrope.export.attention import _attention
from qkrope.export.fused_qk import FusedNormRoPE, check_cache
from qkrope.export.sample import one_grid
from qkrope.families._record import FamilyRecord

from . import THETA, rope_axes, setting_fields


def _sdpa(q, k, v, head_dim: int) -> torch.Tensor:
    """softmax attention over [B, S, H, D] inputs; returns [B, S, H * D] in q's dtype (as
    diffusers' dispatch_attention_fn + flatten + type_as)."""
    out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, head_dim)
    return out.transpose(1, 2).flatten(2, 3).type_as(q)


class CosmosSelfAttnProcessor:
    """Replaces ``CosmosAttnProcessor2_0`` on every block's ``attn1`` (self-attention with
    RoPE): q/k RMSNorm + split-halves rotation as one fused node; ``image_rotary_emb`` is the
    image cache."""

    def __init__(self, rounding: int):
        self.fused = FusedNormRoPE(rounding, interleaved=False)  # NeoX halves
        self.rounding = self.fused.rounding

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise InputError("the Cosmos self-attention takes no encoder_hidden_states or "
                             "attention_mask")
        check_cache(image_rotary_emb, "Cosmos")
        head_dim = attn.inner_dim // attn.heads
        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb)
        out = _sdpa(q, k, v, head_dim)
        return attn.to_out[1](attn.to_out[0](out))


class CosmosCrossAttnProcessor:
    """Replaces ``CosmosAttnProcessor2_0`` on every block's ``attn2`` (video queries, text keys
    and values, no RoPE): diffusers' RMSNorms as they are (unfused), the attention through
    qkrope's exportable form."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if attention_mask is not None or image_rotary_emb is not None:
            raise InputError("the exported Cosmos cross-attention takes no attention_mask (the "
                             "pipelines pass none) and no RoPE")
        head_dim = attn.inner_dim // attn.heads
        q = attn.to_q(hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        k = attn.to_k(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        v = attn.to_v(encoder_hidden_states).unflatten(2, (attn.heads, -1)).transpose(1, 2)
        q, k = attn.norm_q(q), attn.norm_k(k)
        out = _attention(q, k, v, None, head_dim)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def check_supported(transformer: nn.Module) -> None:
    """Refuse, in one line, configurations the wrapper does not replay."""
    cfg = transformer.config
    if cfg.get("img_context_dim_in"):
        raise InputError("the diffusers config sets img_context_dim_in (Cosmos-Predict2.5 image "
                         "context), which qkrope's Cosmos export does not take yet (Predict2 "
                         "only). Fix: export a Cosmos-Predict2 model")
    if not cfg.get("concat_padding_mask", True):
        raise InputError("the diffusers config sets concat_padding_mask=False, which qkrope's "
                         "Cosmos export does not take (Predict2's models concatenate it). Fix: "
                         "export a Cosmos-Predict2 model")
    patch = tuple(int(p) for p in cfg.get("patch_size"))
    if patch[0] != 1:
        raise InputError(f"patch_size {list(patch)}: diffusers' Cosmos forward takes per-frame "
                         f"timesteps only with a temporal patch of 1")
    head_dim = int(cfg["attention_head_dim"])
    if sum(rope_axes(head_dim)) != head_dim or min(rope_axes(head_dim)) < 4:
        raise InputError(f"attention_head_dim {head_dim}: Cosmos's RoPE axes "
                         f"{rope_axes(head_dim)} need a head of at least 12")


def patch_transformer(transformer: nn.Module, *, rounding: int) -> nn.Module:
    """Give every block its fused self-attention and exportable cross-attention (in place)."""
    check_supported(transformer)
    self_attn, cross = CosmosSelfAttnProcessor(rounding), CosmosCrossAttnProcessor()
    for block in transformer.transformer_blocks:
        block.attn1.set_processor(self_attn)
        block.attn2.set_processor(cross)
    return transformer


def learnable_pos_embed(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``CosmosLearnablePositionalEmbed.forward`` with its norm factor computed from the static
    width (``sqrt(norm.numel() / emb.numel())`` = ``sqrt(1 / width)`` exactly as Python divides
    and numpy takes the root), so that the export has no symbolic float."""
    b, _, f, h, w = hidden_states.shape
    pt, ph, pw = module.patch_size
    t_, h_, w_ = f // pt, h // ph, w // pw
    emb_t = module.pos_emb_t[:t_][None, :, None, None, :].repeat(b, 1, h_, w_, 1)
    emb_h = module.pos_emb_h[:h_][None, None, :, None, :].repeat(b, t_, 1, w_, 1)
    emb_w = module.pos_emb_w[:w_][None, None, None, :, :].repeat(b, t_, h_, 1, 1)
    emb = (emb_t + emb_h + emb_w).flatten(1, 3)
    norm = torch.linalg.vector_norm(emb, dim=-1, keepdim=True, dtype=torch.float32)
    width = int(module.pos_emb_t.shape[-1])
    norm = torch.add(module.eps, norm, alpha=math.sqrt(1 / width))
    return (emb / norm).type_as(hidden_states)


class CosmosCacheInputTransformer(nn.Module):
    """``CosmosTransformer3DModel`` whose forward takes the graph inputs
    (:data:`qkrope.families.cosmos.COSMOS_TRANSFORMER`): ``latent [B, C, F, H, W]``,
    ``encoder_hidden_states [B, S_txt, text_embed_dim]``, ``frame_timestep [B, F]``,
    ``padding_mask [1, 1, H, W]`` (already at the latent's size) and ``img_cos_sin_cache
    [F/pt * H/ph * W/pw, head_dim]`` -> ``latent_sample [B, out_channels, F, H, W]``, running
    the first ``kept`` blocks (every block by default) and then the whole model's ``norm_out``
    and ``proj_out`` (what the model computes with its later blocks passed through)."""

    def __init__(self, transformer: nn.Module, *, rounding: int, kept: int | None = None):
        super().__init__()
        patch_transformer(transformer, rounding=rounding)
        self.transformer = transformer
        self.rounding = rounding
        self.kept = len(transformer.transformer_blocks) if kept is None else int(kept)

    def forward(self, latent, encoder_hidden_states, frame_timestep, padding_mask,
                img_cos_sin_cache):
        t = self.transformer
        batch, _, frames, height, width = latent.shape
        mask = padding_mask.unsqueeze(2).expand(batch, -1, frames, -1, -1).to(latent.dtype)
        hidden_states = torch.cat([latent, mask], dim=1)
        extra_pos_emb = (learnable_pos_embed(t.learnable_pos_embed, hidden_states)
                         if t.learnable_pos_embed is not None else None)
        p_t, p_h, p_w = t.config.patch_size
        post_f, post_h, post_w = frames // p_t, height // p_h, width // p_w
        hidden_states = t.patch_embed(hidden_states).flatten(1, 3)
        # diffusers' per-frame path (timestep [B, 1, T, 1, 1]): one embedding per frame,
        # repeated over the frame's tokens
        temb, embedded_timestep = t.time_embed(hidden_states, frame_timestep.flatten())
        temb, embedded_timestep = (
            x.view(batch, post_f, 1, 1, -1).expand(-1, -1, post_h, post_w, -1).flatten(1, 3)
            for x in (temb, embedded_timestep))
        text = encoder_hidden_states
        if t.config.use_crossattn_projection:
            text = t.crossattn_proj(text)
        for block in t.transformer_blocks[:self.kept]:
            hidden_states = block(hidden_states, text, embedded_timestep, temb,
                                  img_cos_sin_cache, extra_pos_emb, None, None)
        hidden_states = t.norm_out(hidden_states, embedded_timestep, temb)
        hidden_states = t.proj_out(hidden_states)
        hidden_states = hidden_states.unflatten(2, (p_h, p_w, p_t, -1))
        hidden_states = hidden_states.unflatten(1, (post_f, post_h, post_w))
        hidden_states = hidden_states.permute(0, 7, 1, 6, 2, 4, 3, 5)
        return hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """Cosmos's config is left to diffusers' own checks (and :func:`check_supported`)."""
    return None


def sample_args(transformer: nn.Module, sample, dtype: torch.dtype, setting) -> tuple:
    """The traced sample: a random latent of the first image shape's grid (tokens times the
    patch), text, per-frame timesteps, a zero padding mask and the grid's cache."""
    from qkrope.runtime.caches import build_rope_caches

    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    grid = tuple(int(v) for v in sample.img_shapes[0])
    pt, ph, pw = (int(p) for p in cfg["patch_size"])
    b = sample.batch
    latent = torch.randn(b, int(cfg["in_channels"]), grid[0] * pt, grid[1] * ph, grid[2] * pw,
                         generator=g).to(dtype)
    text = torch.randn(b, sample.txt_len, int(cfg["text_embed_dim"]), generator=g).to(dtype)
    timestep = torch.full((b, grid[0] * pt), 0.5, dtype=dtype)
    mask = torch.zeros(1, 1, grid[1] * ph, grid[2] * pw, dtype=dtype)
    caches = build_rope_caches("scaled_grid", {"grid": grid, "fps": None}, setting)
    return latent, text, timestep, mask, caches.img.clone()


def model_setting_of(transformer: nn.Module):
    """The RoPE setting of a loaded model (the record's scheme and the family's rule)."""
    from qkrope.runtime.caches import checked_setting

    cfg = dict(transformer.config)
    return checked_setting("scaled_grid", rope_axes(int(cfg["attention_head_dim"])), THETA,
                           rotated=("img",), **setting_fields(cfg))


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` with its first ``layers`` blocks (every block by
    default; one list, ``transformer_blocks``)."""
    from qkrope.export.onnx_export import TransformerPlan

    cfg = dict(transformer.config)
    one_grid(sample, record.short)
    head_dim = int(cfg["attention_head_dim"])
    (kept,) = record.kept_blocks(cfg, layers)
    wrapper = CosmosCacheInputTransformer(transformer, rounding=rounding, kept=kept).eval()
    args = sample_args(transformer, sample, dtype, model_setting_of(transformer))
    n = len(transformer.transformer_blocks)
    return TransformerPlan(  # one QKNormRoPE node per kept block (its self-attention)
        wrapper=wrapper, args=args, decl=record.graph, axes=rope_axes(head_dim),
        theta=int(THETA), rounding=rounding, nodes=kept, num_layers_exported=kept,
        blocks=f"{record.label}: {kept} of {n} blocks", interleaved=False,
        eps=float(transformer.transformer_blocks[0].attn1.norm_q.eps))


def post_export(model) -> None:
    """No float64 anywhere (the stock RoPE is float32, but nothing may bring one in)."""
    check_no_double(model, "the Cosmos graph")
