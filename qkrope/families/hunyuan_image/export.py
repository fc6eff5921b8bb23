"""HunyuanImage-2.1's export hooks (export layer): the attention processor, the cache-input
wrapper, the sample inputs and the post-export check (no float64) that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers computes the RoPE inside the model from the latent's shape
(``HunyuanImageRotaryPosEmbed``); here the caches come in as graph inputs (the "patch-grid"
scheme) and every attention's per-head RMSNorm + RoPE is ``qkrope::QKNormRoPE``:

- double-stream blocks: two nodes, the image stream (``norm_q``/``norm_k``, the image cache) and
  the text stream (``norm_added_q``/``norm_added_k``, the text cache: identity rows, since the
  text is normalised but not rotated);
- single-stream blocks: one node over the ``[image; text]`` sequence (one ``norm_q``/``norm_k``
  over both, the image rotated) with the joined cache ``[image rows; text identity rows]``.

The joint sequence is image first, then text, in both kinds of block; the text mask becomes
the attention mask over ``[image (all True); text]`` keys, as in diffusers. The token refiner's
self-attention (``context_embedder``) has neither QK norm nor RoPE and is exported as diffusers
writes it.

The graph takes the latent as tokens ``[batch, tokens, channels x patch]`` (the drop-in packs
the pipelines' 4-D or 5-D latent; :func:`qkrope.runtime.latents.pack_patches`) and the wrapper
lays them out as one row of patches for diffusers' own patch embedding, so the convolution, its
weights and its bits are diffusers'; the sample leaves the graph as tokens
``[batch, tokens, out_channels x patch]`` before diffusers' unpatchify (a reshape and
permutation, done by the drop-in).

A model with the byT5 glyph branch (``context_embedder_2``: the base model, not the refiner)
is exported with two more inputs, the glyph tokens ``encoder_hidden_states_2`` ``[batch,
txt2_tokens, text_embed_2_dim]`` and their mask ``encoder_attention_mask_2`` (bool, as the
text's): the graph
projects them and joins them to the text as diffusers does (:func:`glyph_text`), so a prompt
with quoted text renders its glyphs; the text cache has a row per text and glyph token.

Not in the graph (the drop-in refuses them in one line): MeanFlow's ``timestep_r`` (refused at
export for a ``use_meanflow`` config), LoRA scales other than 1.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.finalize import check_no_double
from qkrope.export.conv import patch_conv
from qkrope.export.fused_qk import FusedNormRoPE
from qkrope.families._record import FamilyRecord


class HunyuanRope(NamedTuple):
    """What the blocks pass on as ``image_rotary_emb``: the two caches and their join."""

    img: torch.Tensor
    txt: torch.Tensor
    joint: torch.Tensor  # [img rows (image tokens); txt rows (text tokens)]


def _sdpa(q, k, v, mask, head_dim: int) -> torch.Tensor:
    """Attention over [B, S, H, D] inputs with a bool [B, 1, 1, S_kv] mask; [B, S, H * D]."""
    out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, head_dim)
    return out.transpose(1, 2).flatten(2, 3).to(q.dtype)


class HunyuanImageAttnProcessor:
    """Replaces diffusers' ``HunyuanImageAttnProcessor`` (both kinds of block);
    ``image_rotary_emb`` is a :class:`HunyuanRope`."""

    def __init__(self, rounding: int):
        self.fused = FusedNormRoPE(rounding)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if not isinstance(image_rotary_emb, HunyuanRope):
            raise InputError("the patched HunyuanImage attention needs image_rotary_emb="
                             "HunyuanRope(img, txt, joint); run it through "
                             "HunyuanImageCacheInputTransformer")
        if encoder_hidden_states is None:
            raise InputError("the HunyuanImage attention needs the text stream "
                             "(encoder_hidden_states)")
        heads = attn.heads
        s_txt = encoder_hidden_states.shape[1]
        single = attn.add_q_proj is None
        if single:  # one sequence [image; text], one norm, the image part rotated
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        q, k, v = (proj(hidden_states).unflatten(2, (heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        head_dim = q.shape[-1]
        if single:
            q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.joint)
        else:
            q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.img)
            tq, tk, tv = (proj(encoder_hidden_states).unflatten(2, (heads, -1))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            tq, tk = self.fused(tq, tk, attn.norm_added_q, attn.norm_added_k,
                                image_rotary_emb.txt)
            q, k, v = torch.cat([q, tq], 1), torch.cat([k, tk], 1), torch.cat([v, tv], 1)
        out = _sdpa(q, k, v, attention_mask, head_dim)
        hidden_states, encoder_hidden_states = out[:, :-s_txt], out[:, -s_txt:]
        if getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def patch_hunyuan_image(transformer: nn.Module, *, rounding: int) -> nn.Module:
    """Give every double- and single-stream attention its fused processor (in place)."""
    processor = HunyuanImageAttnProcessor(rounding)
    blocks = list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)
    if not blocks:
        raise InputError("the HunyuanImage model has no transformer blocks")
    for block in blocks:
        block.attn.set_processor(processor)
    return transformer


def node_count(transformer: nn.Module, kept: tuple[int, int] | None = None) -> int:
    """QKNormRoPE nodes of the export: two per double-stream block, one per single-stream (of
    the ``kept`` (double, single) blocks; every block by default)."""
    double, single = kept or (len(transformer.transformer_blocks),
                              len(transformer.single_transformer_blocks))
    return 2 * double + single


def patch_size(transformer: nn.Module) -> tuple:
    """The model's patch size, as diffusers' config has it (2 or 3 entries)."""
    return tuple(int(p) for p in transformer.config["patch_size"])


def glyph_text(glyph, glyph_mask, text, text_mask):
    """diffusers' text stream of a call with byT5 glyph text: per item, the real glyph tokens,
    the real text tokens, then the padded glyph and text tokens (a stable partition of
    ``[glyph; text]`` by the masks, which diffusers writes as boolean indexing per item; a
    scatter here, so the graph has no data-dependent shape). Padded tokens keep their values
    (masked as keys). Returns the tokens and their mask: True for each item's first (real)
    tokens."""
    x = torch.cat([glyph, text], dim=1)
    m = torch.cat([glyph_mask.to(torch.bool), text_mask.to(torch.bool)], dim=1)
    real = m.to(torch.int64)
    n_real = real.sum(dim=1, keepdim=True)
    dest = torch.where(m, real.cumsum(dim=1) - 1, n_real + (1 - real).cumsum(dim=1) - 1)
    out = torch.zeros_like(x).scatter(1, dest.unsqueeze(-1).expand_as(x), x)
    return out, torch.arange(x.shape[1], device=x.device).unsqueeze(0) < n_real


class HunyuanImageCacheInputTransformer(nn.Module):
    """A HunyuanImage transformer whose forward takes the graph inputs
    (:func:`graph_decl`): :meth:`run` replays diffusers' ``forward`` (no MeanFlow
    ``timestep_r``) on the packed latent with
    the caches in place of the rotary module, through the first ``kept`` (double, single)
    blocks (every block by default; nothing in a block depends on the block count, so a prefix
    computes what the whole model's first blocks compute, and norm_out / proj_out follow it as
    in the whole model). :func:`cache_input_hunyuan_image` gives the subclass whose ``forward``
    has exactly the graph's inputs."""

    def __init__(self, transformer: nn.Module, record: FamilyRecord, *,
                 rounding: int | None = None, kept: tuple[int, int] | None = None):
        super().__init__()
        self.family = record
        self.rounding = record.rounding if rounding is None else rounding
        patch_hunyuan_image(transformer, rounding=self.rounding)
        self.transformer = transformer
        self.patch = patch_size(transformer)
        self.double, self.single = kept or (len(transformer.transformer_blocks),
                                            len(transformer.single_transformer_blocks))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """diffusers' patch embedding of packed tokens ``[B, N, C x patch]``: the patches laid
        out as one row (``[B, C, p.., N * p_last]``), through the model's own convolution (its
        kernel and stride are the patch), flattened to ``[B, N, inner]`` as diffusers does."""
        n = tokens.shape[1]
        x = tokens.unflatten(-1, (-1,) + self.patch)  # [B, N, C, *patch]
        if len(self.patch) == 2:
            x = x.permute(0, 2, 3, 1, 4)  # [B, C, ph, N, pw]
        else:
            x = x.permute(0, 2, 3, 4, 1, 5)  # [B, C, pt, ph, N, pw]
        x = x.reshape(*x.shape[:-2], n * self.patch[-1])
        proj = self.transformer.x_embedder.proj
        if x.dtype == torch.bfloat16 and torch.onnx.is_in_onnx_export():
            # the graph's bf16 convolution in float32 (export/conv.py)
            return patch_conv(proj, x).flatten(2).transpose(1, 2)
        return self.transformer.x_embedder(x)

    def run(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
            img_cos_sin_cache, txt_cos_sin_cache, guidance=None, encoder_hidden_states_2=None,
            encoder_attention_mask_2=None):
        """diffusers' forward on the graph inputs; with the byT5 glyph text
        (``encoder_hidden_states_2`` and its mask, a model with ``context_embedder_2``) the
        text stream is :func:`glyph_text`'s join, and ``txt_cos_sin_cache`` has a row for each
        of its tokens (the text tokens and the glyph tokens: identity rows)."""
        t = self.transformer
        mask = encoder_hidden_states_mask.to(torch.bool)
        temb = t.time_guidance_embed(timestep, guidance=guidance, timestep_r=None)
        hidden_states = self.embed(hidden_states)
        encoder_hidden_states = t.context_embedder(encoder_hidden_states, timestep, mask)
        if encoder_hidden_states_2 is not None and t.context_embedder_2 is not None:
            encoder_hidden_states, mask = glyph_text(
                t.context_embedder_2(encoder_hidden_states_2), encoder_attention_mask_2,
                encoder_hidden_states, mask)
        s_img, s_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        joint = torch.cat([img_cos_sin_cache[:s_img], txt_cos_sin_cache[:s_txt]], dim=0)
        rope = HunyuanRope(img_cos_sin_cache, txt_cos_sin_cache, joint)
        attention_mask = F.pad(mask, (s_img, 0), value=True).unsqueeze(1).unsqueeze(2)
        for block in (list(t.transformer_blocks[:self.double])
                      + list(t.single_transformer_blocks[:self.single])):
            hidden_states, encoder_hidden_states = block(
                hidden_states, encoder_hidden_states, temb, attention_mask=attention_mask,
                image_rotary_emb=rope)
        return t.proj_out(t.norm_out(hidden_states, temb))


# One subclass per graph signature (torch.export names the graph inputs after forward's
# parameters): with and without guidance, with and without the byT5 glyph inputs.
class _Guided(HunyuanImageCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                timestep, guidance, img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                        timestep, img_cos_sin_cache, txt_cos_sin_cache, guidance)


class _Plain(HunyuanImageCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                timestep, img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                        timestep, img_cos_sin_cache, txt_cos_sin_cache)


class _GuidedGlyph(HunyuanImageCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                encoder_hidden_states_2, encoder_attention_mask_2, timestep, guidance,
                img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                        timestep, img_cos_sin_cache, txt_cos_sin_cache, guidance,
                        encoder_hidden_states_2, encoder_attention_mask_2)


class _PlainGlyph(HunyuanImageCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                encoder_hidden_states_2, encoder_attention_mask_2, timestep, img_cos_sin_cache,
                txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                        timestep, img_cos_sin_cache, txt_cos_sin_cache, None,
                        encoder_hidden_states_2, encoder_attention_mask_2)


def has_glyph(transformer: nn.Module) -> bool:
    """Whether the model has the byT5 glyph branch (``context_embedder_2``: the base model; the
    refiner has none): its graph takes the glyph tokens and their mask."""
    return getattr(transformer, "context_embedder_2", None) is not None


def graph_decl(record: FamilyRecord, transformer: nn.Module):
    """The graph of this model: the record's (less guidance for a model without guidance
    embeddings), with the glyph tokens and their mask after the text mask for a model with the
    byT5 branch (the order of the wrappers' forward arguments)."""
    from qkrope.model_io import (ENCODER_ATTENTION_MASK_2, ENCODER_HIDDEN_STATES_2,
                                 ENCODER_HIDDEN_STATES_MASK, ModelDecl)

    decl = record.decl(has_guidance(transformer))
    if not has_glyph(transformer):
        return decl
    inputs = list(decl.inputs)
    at = inputs.index(ENCODER_HIDDEN_STATES_MASK) + 1
    inputs[at:at] = [ENCODER_HIDDEN_STATES_2, ENCODER_ATTENTION_MASK_2]
    return ModelDecl(decl.kind, tuple(inputs), decl.outputs)


def has_guidance(transformer: nn.Module) -> bool:
    """Whether the model embeds a distilled guidance value (the config's guidance_embeds)."""
    return bool(transformer.config.get("guidance_embeds", False))


def cache_input_hunyuan_image(transformer: nn.Module, record: FamilyRecord, *,
                              rounding: int | None = None,
                              kept: tuple[int, int] | None = None
                              ) -> HunyuanImageCacheInputTransformer:
    """The wrapper whose ``forward`` arguments are the graph inputs, in graph order, running
    the first ``kept`` (double, single) blocks (every block by default)."""
    cls = {(True, False): _Guided, (False, False): _Plain, (True, True): _GuidedGlyph,
           (False, True): _PlainGlyph}[has_guidance(transformer), has_glyph(transformer)]
    return cls(transformer, record, rounding=rounding, kept=kept).eval()


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """Refuses, before diffusers builds the model, what the graph cannot take: a MeanFlow model
    (``use_meanflow``: its pipeline passes ``timestep_r`` every step) and a RoPE whose axes do
    not fit the patch grid; the rest is left to diffusers' own checks."""
    from qkrope.export.patch_diffusers import read_config

    path, cfg = read_config(directory)
    if cfg.get("use_meanflow"):
        raise InputError(f"{path}: use_meanflow=true (a MeanFlow-distilled HunyuanImage): its "
                         f"pipeline passes timestep_r every step, which the exported graph does "
                         f"not take. Fix: export the base (non-MeanFlow) checkpoint")
    axes, patch = cfg.get("rope_axes_dim", (64, 64)), cfg.get("patch_size", (1, 1))
    if not isinstance(axes, (list, tuple)) or not isinstance(patch, (list, tuple)) \
            or len(axes) != len(patch) or len(axes) not in (2, 3):
        raise InputError(f"{path}: rope_axes_dim {axes!r} and patch_size {patch!r} must both "
                         f"have 2 (image) or 3 (video latent) entries. Fix: correct the config")
    return None


def post_export(model) -> None:
    """No float64 in the HunyuanImage graph."""
    check_no_double(model, "the HunyuanImage graph")


#: The glyph tokens of the traced sample (a dynamic axis: any length runs).
GLYPH_TOKENS = 5


def sample_args(transformer: nn.Module, sample, dtype: torch.dtype, setting,
                guided: bool) -> tuple:
    """The traced sample: random packed latent tokens and text, the text mask with the last
    item's last token masked, for a model with the byT5 branch :data:`GLYPH_TOKENS` glyph
    tokens (bool mask, as the text's: the first item's first two real, the others padding), timestep,
    guidance where the graph has it, and the caches of the sample's token grid (a text row per
    text and glyph token)."""
    from qkrope.runtime.caches import build_rope_caches

    cfg = transformer.config
    glyph = GLYPH_TOKENS if has_glyph(transformer) else 0
    grid = tuple(int(v) for v in sample.img_shapes[0])
    tokens = grid[0] * grid[1] * grid[2]
    caches = build_rope_caches("patch-grid", {"img_shapes": [grid],
                                              "txt_seq_len": sample.txt_len + glyph}, setting)
    g = torch.Generator().manual_seed(1)
    b = sample.batch
    features = int(cfg["in_channels"]) * math.prod(patch_size(transformer))
    mask = torch.ones(b, sample.txt_len, dtype=torch.bool)
    mask[-1, -1] = False
    args = [torch.randn(b, tokens, features, generator=g).to(dtype),
            torch.randn(b, sample.txt_len, int(cfg["text_embed_dim"]), generator=g).to(dtype),
            mask]
    if glyph:
        glyph_mask = torch.zeros(b, glyph, dtype=torch.bool)
        glyph_mask[0, :2] = True
        args += [torch.randn(b, glyph, int(cfg["text_embed_2_dim"]), generator=g).to(dtype),
                 glyph_mask]
    args.append(torch.full((b,), 500.0, dtype=dtype))
    if guided:
        args.append(torch.full((b,), 3500.0, dtype=dtype))
    return tuple(args) + (caches.img.clone(), caches.txt.clone())


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` with its first ``layers`` blocks in execution order
    (double-stream, then single-stream; every block by default). The sidecar records the RoPE axes (the config's ``rope_axes_dim``) and theta (``rope_theta``,
    256 by default), as read from the loaded model."""
    from qkrope.export.onnx_export import TransformerPlan
    from qkrope.runtime.caches import checked_setting

    cfg = dict(transformer.config)
    head_dim = int(cfg["attention_head_dim"])
    axes = tuple(int(v) for v in transformer.rope.rope_dim)
    theta = float(transformer.rope.theta)  # the value diffusers built the model with
    theta = int(theta) if theta.is_integer() else theta
    if sum(axes) > head_dim:
        raise InputError(f"rope_axes_dim {list(axes)} sums to {sum(axes)}, more than "
                         f"attention_head_dim={head_dim}")
    grid = tuple(int(v) for v in sample.img_shapes[0])
    if len(axes) == 2 and grid[0] != 1:
        raise InputError(f"--img-shape {list(grid)}: an image HunyuanImage model's latent has "
                         f"one frame. Fix: --img-shape 1 H W")
    guided = has_guidance(transformer)
    setting = checked_setting(record.scheme, axes, theta, rotated=record.rotated)
    double, single = kept = record.kept_blocks(cfg, layers)
    wrapper = cache_input_hunyuan_image(transformer, record, rounding=rounding, kept=kept)
    args = sample_args(transformer, sample, dtype, setting, guided)
    axis_values = None
    if has_glyph(transformer):  # the glyph tokens, and the text cache's rows over both
        from qkrope import model_io

        axis_values = {model_io.TXT2_TOKENS: GLYPH_TOKENS,
                       model_io.TXT_CACHE_ROWS: int(args[-1].shape[0])}
    return TransformerPlan(
        axis_values=axis_values, wrapper=wrapper, args=args,
        decl=graph_decl(record, transformer), axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=node_count(transformer, kept),
        num_layers_exported=double + single,
        blocks=f"{record.label}: {double} of {len(transformer.transformer_blocks)} double + "
               f"{single} of {len(transformer.single_transformer_blocks)} single blocks")
