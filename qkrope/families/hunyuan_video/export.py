"""HunyuanVideo-1.5's and HunyuanVideo's export hooks (export layer): the attention processor,
the cache-input wrappers, the sample inputs and the checks that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers builds these models' RoPE inside the forward (``HunyuanVideo15RotaryPosEmbed`` /
``HunyuanVideoRotaryPosEmbed``: float32 frequencies and their cos/sin over the latent's grid).
Here the tables come in as the two ``[rows, rotary_dim]`` fp32 caches and every attention's
per-head RMSNorm + RoPE is one ``qkrope::QKNormRoPE`` node per stream:

- double-stream blocks (both models): two nodes, the latent (``norm_q``/``norm_k``, the image
  cache) and the text (``norm_added_q``/``norm_added_k``, the text cache, whose rows are the
  identity: the text is normalised but not rotated);
- HunyuanVideo's single-stream blocks: one node over the ``[latent; text]`` sequence with the
  joined cache ``[image rows; identity rows]``, made in the graph from the two cache inputs.

The text mask. HunyuanVideo masks padded text keys (``[B, 1, 1, N]``). HunyuanVideo-1.5 masks
padded text keys and queries (``mask_q & mask_k``, ``[B, 1, N, N]``), so the rows of padded
text queries have no key; PyTorch's SDPA gives them zeros. Eager, the wrappers pass diffusers'
own mask (bit-exact); exported, the key mask alone (``[B, 1, 1, N]``), which keeps the graph
free of an N x N mask (N is tens of thousands of tokens at 720p): a padded query row then
attends the real keys, and HunyuanVideo-1.5's attention output rows of padded text tokens are
zeroed after it (a Where over the text rows alone), as SDPA gives them, so every token's values,
a padded one's included, are diffusers' (what ``check --blocks`` compares block by block).

HunyuanVideo-1.5's text sequence is [image embeddings; ByT5 tokens; MLLM tokens] reordered per
sample as diffusers does (real tokens first, padded ByT5/MLLM tokens zeroed): a stable partition
by the masks, written as a cumsum and a scatter (no data-dependent shapes), bit-exact with
diffusers' boolean indexing.

Refused in one line: HunyuanVideo-1.5's MeanFlow models (``use_meanflow``: ``timestep_r``),
HunyuanVideo's ``token_replace`` image conditioning, fused QKV projections.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qkrope import contract
from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.conv import patch_conv
from qkrope.export.fused_qk import FusedNormRoPE
from qkrope.export.sample import one_grid
from qkrope.families._record import FamilyRecord

from . import HUNYUAN_VIDEO, HUNYUAN_VIDEO15, HUNYUAN_VIDEO_FRAMEPACK


class HunyuanRope(NamedTuple):
    """What the blocks pass on as ``image_rotary_emb`` / ``freqs_cis``."""

    img: torch.Tensor  # [latent tokens, rotary_dim]
    txt: torch.Tensor  # [text tokens, rotary_dim] (identity rows)
    joint: torch.Tensor  # [latent rows; text rows]: HunyuanVideo's single-stream blocks


class HunyuanMask(NamedTuple):
    """The attention mask in its two forms (module docstring): ``eager`` as diffusers builds it,
    ``export`` the key mask ``[B, 1, 1, N]``; ``queries`` the text tokens whose queries diffusers
    masks (``[B, text tokens, 1]``, True = a real token; None: it masks keys alone)."""

    eager: torch.Tensor
    export: torch.Tensor
    queries: torch.Tensor | None = None


class HunyuanVideoAttnProcessor:
    """Replaces ``HunyuanVideoAttnProcessor2_0`` (double- and single-stream) and
    ``HunyuanVideo15AttnProcessor2_0``; ``image_rotary_emb`` is a :class:`HunyuanRope`,
    ``attention_mask`` a :class:`HunyuanMask`."""

    def __init__(self, rounding: int, *, fused: bool = True):
        self._fused = FusedNormRoPE(rounding, fused=fused)
        self.rounding = self._fused.rounding
        self.fused = fused

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if not isinstance(image_rotary_emb, HunyuanRope) or not isinstance(attention_mask,
                                                                           HunyuanMask):
            raise InputError("the patched HunyuanVideo attention needs image_rotary_emb="
                             "HunyuanRope(...) and attention_mask=HunyuanMask(...); run it "
                             "through the cache-input wrapper (cache_input_hunyuan)")
        if getattr(attn, "fused_projections", False):
            raise InputError("the HunyuanVideo attention has fused QKV projections; export the "
                             "model before fusing them")
        joint = attn.add_q_proj is None and encoder_hidden_states is not None
        if joint:  # HunyuanVideo's single-stream block: one [latent; text] sequence
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        if joint:
            q, k = self._fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.joint)
        else:
            q, k = self._fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.img)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            eq, ek = self._fused(eq, ek, attn.norm_added_q, attn.norm_added_k,
                                 image_rotary_emb.txt)
            q, k, v = (torch.cat(p, dim=1) for p in ((q, eq), (k, ek), (v, ev)))
        mask = attention_mask.export if torch.onnx.is_in_onnx_export() else attention_mask.eager
        out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                         q.shape[-1])
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        s_txt = encoder_hidden_states.shape[1]
        out, txt = out[:, :-s_txt], out[:, -s_txt:]
        if torch.onnx.is_in_onnx_export() and attention_mask.queries is not None:
            # a padded text query has no key in diffusers' mask: SDPA gives its row zeros
            txt = torch.where(attention_mask.queries, txt, torch.zeros_like(txt))
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            txt = attn.to_add_out(txt)
        return out, txt


def _block_counts(transformer: nn.Module) -> tuple[int, int]:
    """(double-stream, single-stream) blocks of the model (HunyuanVideo-1.5: no single)."""
    single = getattr(transformer, "single_transformer_blocks", None) or ()
    return len(transformer.transformer_blocks), len(single)


def node_count(transformer: nn.Module, kept: tuple[int, ...] | None = None) -> int:
    """QKNormRoPE nodes: two per double-stream block, one per single-stream block (of the
    ``kept`` (double[, single]) blocks; every block by default)."""
    double, single = (tuple(kept) + (0,))[:2] if kept is not None else _block_counts(transformer)
    return 2 * double + single


def _embed(t: nn.Module, latent: torch.Tensor) -> torch.Tensor:
    """The patch embedding (diffusers' ``x_embedder``: Conv3d, then tokens ``[B, N, C]``),
    its bf16 convolution in float32 in an export (export/conv.py)."""
    return patch_conv(t.x_embedder.proj, latent).flatten(2).transpose(1, 2)


def _unpatchify(t: nn.Module, x: torch.Tensor, shape) -> torch.Tensor:
    """diffusers' output reshape: tokens back to the 5-D latent (its operations, in its order)."""
    batch, _, frames, height, width = shape
    cfg = t.config
    p_t, p = int(cfg["patch_size_t"]), int(cfg["patch_size"])
    x = x.reshape(batch, frames // p_t, height // p, width // p, -1, p_t, p, p)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def _rope(img_cache: torch.Tensor, txt_cache: torch.Tensor, s_img: int, s_txt: int):
    return HunyuanRope(img_cache, txt_cache,
                       torch.cat([img_cache[:s_img], txt_cache[:s_txt]], dim=0))


def reorder_text(parts, masks):
    """HunyuanVideo-1.5's text sequence: ``parts`` (``[B, n_i, D]`` each, in order) with bool
    ``masks`` (``[B, n_i]``), every item's real tokens first, then its padded ones, each group in
    its original order (a stable partition; diffusers' boolean indexing per item). Returns the
    tokens and the new mask (True for the first real-count tokens)."""
    x = torch.cat(parts, dim=1)
    m = torch.cat(masks, dim=1)
    real = m.to(torch.int64)
    n_real = real.sum(dim=1, keepdim=True)
    dest = torch.where(m, real.cumsum(dim=1) - 1, n_real + (1 - real).cumsum(dim=1) - 1)
    out = torch.zeros_like(x).scatter(1, dest.unsqueeze(-1).expand_as(x), x)
    positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    return out, positions < n_real


class _CacheInput(nn.Module):
    """What both wrappers share: every attention gets the fused processor, and :meth:`blocks`
    are the blocks ``forward`` runs, the first ``kept`` (double[, single]) in execution order
    (every block by default; the final norm and projection follow the last kept block as the
    whole model's follow its last)."""

    def __init__(self, transformer: nn.Module, family: FamilyRecord, rounding: int,
                 fused: bool = True, kept: tuple[int, ...] | None = None):
        super().__init__()
        self.family = family
        self.rounding = contract.check_rounding(rounding)
        processor = HunyuanVideoAttnProcessor(self.rounding, fused=fused)
        single = getattr(transformer, "single_transformer_blocks", None) or ()
        for block in list(transformer.transformer_blocks) + list(single):
            block.attn.set_processor(processor)
        self.transformer = transformer
        self.double, self.single = (tuple(kept) + (0,))[:2] if kept is not None \
            else _block_counts(transformer)

    def blocks(self):
        """The kept blocks, in execution order."""
        t = self.transformer
        single = getattr(t, "single_transformer_blocks", None) or ()
        return list(t.transformer_blocks[:self.double]) + list(single[:self.single])


class HunyuanVideo15CacheInputTransformer(_CacheInput):
    """``HunyuanVideo15Transformer3DModel.forward`` (no MeanFlow) with the RoPE caches in place of
    its RoPE module; ``forward``'s arguments are the graph inputs in graph order."""

    def forward(self, latent, timestep, encoder_hidden_states, encoder_attention_mask,
                encoder_hidden_states_2, encoder_attention_mask_2, image_embeds,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        hidden_states = latent
        shape = hidden_states.shape
        temb = t.time_embed(timestep)
        x = _embed(t, hidden_states)
        text = t.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
        text = text + t.cond_type_embed(torch.zeros_like(text[:, :, 0], dtype=torch.long))
        text_2 = t.context_embedder_2(encoder_hidden_states_2)
        text_2 = text_2 + t.cond_type_embed(torch.ones_like(text_2[:, :, 0], dtype=torch.long))
        image = t.image_embedder(image_embeds)
        is_t2v = torch.all(image_embeds == 0)  # diffusers: the image tokens zeroed and masked
        image = torch.where(is_t2v, image * 0.0, image)
        image = image + t.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))
        mask_1 = encoder_attention_mask.bool()
        mask_2 = encoder_attention_mask_2.bool()
        mask_3 = (~is_t2v).expand(image.shape[0], image.shape[1])
        text, text_mask = reorder_text(
            [image, torch.where(mask_2.unsqueeze(-1), text_2, torch.zeros_like(text_2)),
             torch.where(mask_1.unsqueeze(-1), text, torch.zeros_like(text))],
            [mask_3, mask_2, mask_1])
        s_img, s_txt = x.shape[1], text.shape[1]
        full = F.pad(text_mask, (s_img, 0), value=True)
        n = full.shape[1]
        mask = HunyuanMask(full.view(-1, 1, 1, n) & full.view(-1, 1, n, 1),
                           full.view(-1, 1, 1, n), text_mask.unsqueeze(-1))
        rope = _rope(img_cos_sin_cache, txt_cos_sin_cache, s_img, s_txt)
        for block in self.blocks():
            x, text = block(x, text, temb, mask, rope)
        x = t.proj_out(t.norm_out(x, temb))
        return _unpatchify(t, x, shape)


class _HunyuanVideoBase(_CacheInput):
    def run(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
            pooled_projections, guidance, img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        shape = hidden_states.shape
        temb, _ = t.time_text_embed(timestep, pooled_projections, guidance)
        x = _embed(t, hidden_states)
        text = t.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
        s_img, s_txt = x.shape[1], text.shape[1]
        # diffusers: the first (latent + real text) tokens are attended, as keys
        real = s_img + encoder_attention_mask.sum(dim=1, dtype=torch.int)
        keys = torch.arange(s_img + s_txt, device=x.device).unsqueeze(0) < real.unsqueeze(1)
        keys = keys.unsqueeze(1).unsqueeze(1)
        mask = HunyuanMask(keys, keys)
        rope = _rope(img_cos_sin_cache, txt_cos_sin_cache, s_img, s_txt)
        for block in self.blocks():
            x, text = block(x, text, temb, mask, rope)
        x = t.proj_out(t.norm_out(x, temb))
        return _unpatchify(t, x, shape)


class _HunyuanVideoGuided(_HunyuanVideoBase):
    def forward(self, latent, timestep, encoder_hidden_states, encoder_attention_mask,
                pooled_projections, guidance, img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(latent, timestep, encoder_hidden_states, encoder_attention_mask,
                        pooled_projections, guidance, img_cos_sin_cache, txt_cos_sin_cache)


class _HunyuanVideo(_HunyuanVideoBase):
    def forward(self, latent, timestep, encoder_hidden_states, encoder_attention_mask,
                pooled_projections, img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(latent, timestep, encoder_hidden_states, encoder_attention_mask,
                        pooled_projections, None, img_cos_sin_cache, txt_cos_sin_cache)


# --------------------------------------------------------------------------------------------
# HunyuanVideo FramePack: HunyuanVideo's forward with the history parts before the latent
# --------------------------------------------------------------------------------------------

#: The history parts in sequence order, each with its patch (frames, rows, columns in latent
#: pixels) and its pooling of the latent's token grid (patch 2): the 4x, then 2x, then clean.
FRAMEPACK_HISTORY = (("proj_4x", (4, 8, 8), (4, 4, 4)), ("proj_2x", (2, 4, 4), (2, 2, 2)),
                     ("proj", (1, 2, 2), None))


def _pad_to(x: torch.Tensor, kernel) -> torch.Tensor:
    """``x`` ``[B, C, T, H, W]`` padded at the end of T, H and W by repeating the last slice, to
    whole multiples of ``kernel`` (diffusers' FramePack padding before a history patch)."""
    pads: list = []
    for size, k in zip(reversed(x.shape[2:]), reversed(kernel)):
        pads += [0, (k - size % k) % k]
    return F.pad(x, pads, mode="replicate")


def pooled_rows(rows: torch.Tensor, frames, height, width, kernel) -> torch.Tensor:
    """The cache rows of a history part at its patch: ``rows`` ``[frames * height * width,
    rotary_dim]`` of its full-resolution token grid, padded by repetition and averaged over
    each ``kernel`` block of the grid (diffusers pools its cos and sin tables so; the pair
    halves of the cache are columns, pooled alike)."""
    grid = rows.reshape(frames, height, width, rows.shape[-1]).permute(3, 0, 1, 2).unsqueeze(0)
    pooled = F.avg_pool3d(_pad_to(grid, kernel), kernel, stride=kernel)
    return pooled.flatten(2).squeeze(0).transpose(0, 1)


class HunyuanVideoFramepackCacheInputTransformer(_CacheInput):
    """``HunyuanVideoFramepackTransformer3DModel.forward`` with the RoPE caches in place of its
    RoPE module; ``forward``'s arguments are the graph inputs in graph order (guidance only
    where the config embeds it). The image cache has one row per full-resolution token of each
    part, in sequence order (``[4x; 2x; clean; latent]``, the "ids" scheme's rows of
    :func:`qkrope.families.hunyuan_video.dropin.framepack_ids`); the 2x and 4x rows are pooled
    here (:func:`pooled_rows`). The text cache's rows are the image embeddings' and the
    text's (identity)."""

    def run(self, latent, timestep, encoder_hidden_states, encoder_attention_mask,
            pooled_projections, image_embeds, guidance, latents_clean, latents_history_2x,
            latents_history_4x, img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        shape = latent.shape
        p = int(t.config["patch_size"])
        h, w = shape[3] // p, shape[4] // p
        x = _embed(t, latent)
        n_latent = x.shape[1]
        history = t.clean_x_embedder
        parts, rows, first = [], [], 0
        for (conv, kernel, pool), part in zip(FRAMEPACK_HISTORY, (
                latents_history_4x, latents_history_2x, latents_clean)):
            frames = part.shape[2]
            end = first + frames * h * w
            if pool is None:  # the clean part: patch (1, 2, 2), no padding (as diffusers)
                tokens = patch_conv(history.proj, part)
                rows.append(img_cos_sin_cache[first:end])
            else:
                tokens = patch_conv(getattr(history, conv), _pad_to(part, kernel))
                rows.append(pooled_rows(img_cos_sin_cache[first:end], frames, h, w, pool))
            parts.append(tokens.flatten(2).transpose(1, 2))
            first = end
        rows.append(img_cos_sin_cache[first:first + n_latent])
        x = torch.cat(parts + [x], dim=1)
        img_rows = torch.cat(rows, dim=0)
        temb, _ = t.time_text_embed(timestep, pooled_projections, guidance)
        text = t.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
        image = t.image_projection(image_embeds)
        text = torch.cat([image, text], dim=1)
        s_img, s_txt = x.shape[1], text.shape[1]
        # diffusers: the image tokens are real, then the text mask's; keys are masked
        real = s_img + image.shape[1] + encoder_attention_mask.sum(dim=1, dtype=torch.int)
        keys = torch.arange(s_img + s_txt, device=x.device).unsqueeze(0) < real.unsqueeze(1)
        keys = keys.unsqueeze(1).unsqueeze(1)
        mask = HunyuanMask(keys, keys)
        rope = _rope(img_rows, txt_cos_sin_cache, s_img, s_txt)
        for block in self.blocks():
            x, text = block(x, text, temb, mask, rope)
        # the latent's rows, sliced from a non-negative start: a negative symbolic start gives
        # torch.export an unbacked length, on which ModelOpt's quantizers guard (FP8)
        x = t.proj_out(t.norm_out(x.narrow(1, x.shape[1] - n_latent, n_latent), temb))
        return _unpatchify(t, x, shape)


class _FramepackGuided(HunyuanVideoFramepackCacheInputTransformer):
    def forward(self, latent, timestep, encoder_hidden_states, encoder_attention_mask,
                pooled_projections, image_embeds, guidance, latents_clean, latents_history_2x,
                latents_history_4x, img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(latent, timestep, encoder_hidden_states, encoder_attention_mask,
                        pooled_projections, image_embeds, guidance, latents_clean,
                        latents_history_2x, latents_history_4x, img_cos_sin_cache,
                        txt_cos_sin_cache)


class _Framepack(HunyuanVideoFramepackCacheInputTransformer):
    def forward(self, latent, timestep, encoder_hidden_states, encoder_attention_mask,
                pooled_projections, image_embeds, latents_clean, latents_history_2x,
                latents_history_4x, img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(latent, timestep, encoder_hidden_states, encoder_attention_mask,
                        pooled_projections, image_embeds, None, latents_clean,
                        latents_history_2x, latents_history_4x, img_cos_sin_cache,
                        txt_cos_sin_cache)


def has_guidance(transformer: nn.Module) -> bool:
    return bool(transformer.config.get("guidance_embeds", False))


def check_supported(transformer: nn.Module, family: FamilyRecord) -> None:
    """One line for a configuration the wrappers do not reproduce."""
    cfg = transformer.config
    if family is HUNYUAN_VIDEO15 and cfg.get("use_meanflow", False):
        raise InputError("the HunyuanVideo-1.5 config sets use_meanflow=True (the MeanFlow "
                         "super-resolution models take timestep_r), which qkrope's export does "
                         "not carry. Fix: export a standard HunyuanVideo-1.5 transformer")
    if family is HUNYUAN_VIDEO and cfg.get("image_condition_type") == "token_replace":
        raise InputError("the HunyuanVideo config sets image_condition_type='token_replace' "
                         "(first-frame token replacement blocks), which qkrope's export does not "
                         "carry. Fix: export a text-to-video or latent_concat image-to-video "
                         "HunyuanVideo transformer")
    if family is HUNYUAN_VIDEO_FRAMEPACK:
        missing = [k for k in ("has_image_proj", "has_clean_x_embedder") if not cfg.get(k)]
        if missing:
            raise InputError(f"the HunyuanVideo FramePack config sets {missing} false: diffusers' "
                             f"FramePack forward needs the image projection and the history "
                             f"patch embedder. Fix: export a FramePack checkpoint (both True)")
        if (int(cfg["patch_size"]), int(cfg["patch_size_t"])) != (2, 1):
            raise InputError(f"patch_size {cfg['patch_size']} / patch_size_t "
                             f"{cfg['patch_size_t']}: FramePack's history patches (1, 2, 2), "
                             f"(2, 4, 4) and (4, 8, 8) pool the RoPE of a patch-(1, 2, 2) "
                             f"latent grid. Fix: export a model with patch_size 2 and "
                             f"patch_size_t 1")
        if cfg.get("image_condition_type") == "token_replace":
            raise InputError("the FramePack config sets image_condition_type='token_replace', "
                             "which qkrope's export does not carry. Fix: export a FramePack "
                             "checkpoint (image_condition_type None)")
    if cfg.get("qk_norm", "rms_norm") != "rms_norm":
        raise InputError(f"qk_norm={cfg.get('qk_norm')!r}: the QKNormRoPE node is an RMSNorm. "
                         f"Fix: export a model with qk_norm='rms_norm'")
    axes = tuple(int(v) for v in cfg["rope_axes_dim"])
    head_dim = int(cfg["attention_head_dim"])
    if len(axes) != 3 or sum(axes) > head_dim:
        raise InputError(f"rope_axes_dim {list(axes)} must be three widths summing to at most "
                         f"attention_head_dim={head_dim}")


def cache_input_hunyuan(transformer: nn.Module, family: FamilyRecord, *,
                        rounding: int | None = None, fused: bool = True,
                        kept: tuple[int, ...] | None = None) -> nn.Module:
    """The wrapper whose ``forward`` arguments are the family's graph inputs, in graph order,
    running the first ``kept`` blocks of each list (:meth:`FamilyRecord.kept_blocks`; every
    block by default). ``fused=False`` puts diffusers' own norm and rotation (from the same
    caches) in place of the node: the same graph without QKNormRoPE, which the tests run
    through ONNX Runtime as the reference of its kernels' rounding."""
    check_supported(transformer, family)
    rounding = family.rounding if rounding is None else rounding
    if family is HUNYUAN_VIDEO15:
        cls = HunyuanVideo15CacheInputTransformer
    elif family is HUNYUAN_VIDEO_FRAMEPACK:
        cls = _FramepackGuided if has_guidance(transformer) else _Framepack
    else:
        cls = _HunyuanVideoGuided if has_guidance(transformer) else _HunyuanVideo
    return cls(transformer, family, rounding, fused, kept).eval()


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks (the wrapper refuses what it does not carry,
    before tracing)."""
    return None


def post_export(model) -> None:
    """No float64 anywhere in the graph (diffusers' RoPE is not in it)."""
    import onnx_ir as ir

    from qkrope.export.onnx_export import ExportError

    double = ir.DataType.DOUBLE
    values = list(model.graph.inputs) + list(model.graph.outputs) + list(
        model.graph.initializers.values())
    for node in model.graph.all_nodes():
        values += list(node.outputs)
    for value in values:
        if value is not None and value.dtype == double:
            raise ExportError(f"graph value {value.name} is DOUBLE: the HunyuanVideo graph must "
                              f"have no float64")


def sample_caches(family: FamilyRecord, grid, txt_len: int, axes, theta):
    """The caches of one latent grid ``(f, h, w)`` in tokens (the grid scheme, uncentred, text
    not rotated), as torch tensors."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    setting = checked_setting("grid", axes, theta, max_positions=family.max_positions,
                              scale_rope=family.scale_rope, rotated=family.rotated)
    caches = build_rope_caches("grid", {"img_shapes": [tuple(grid)], "txt_seq_len": txt_len},
                               setting)
    return caches.img.clone(), caches.txt.clone()


def sample_args(family: FamilyRecord, transformer: nn.Module, *, batch: int, grid,
                txt_len: int, dtype: torch.dtype, axes, theta, txt2_len: int = 4,
                image_len: int = 3) -> tuple:
    """The traced sample (random activations, a padded text mask, the caches of ``grid``)."""
    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    p_t, p = int(cfg["patch_size_t"]), int(cfg["patch_size"])
    f, h, w = (int(v) for v in grid)
    latent = torch.randn(batch, int(cfg["in_channels"]), f * p_t, h * p, w * p,
                         generator=g).to(dtype)
    timestep = torch.full((batch,), 500.0, dtype=dtype)
    text = torch.randn(batch, txt_len, int(cfg["text_embed_dim"]), generator=g).to(dtype)
    mask = torch.ones(batch, txt_len, dtype=torch.int64)
    mask[-1, txt_len // 2:] = 0  # a padded item
    if family is HUNYUAN_VIDEO_FRAMEPACK:
        return _framepack_sample(transformer, latent, timestep, text, mask, g, batch=batch,
                                 grid=(f, h, w), image_len=image_len, dtype=dtype, axes=axes,
                                 theta=theta)
    # HunyuanVideo-1.5's text stream is its three condition sequences joined (text_tokens)
    joined = txt_len + txt2_len + image_len if family is HUNYUAN_VIDEO15 else txt_len
    img, txt = sample_caches(family, (f, h, w), joined, axes, theta)
    if family is HUNYUAN_VIDEO15:
        text_2 = torch.randn(batch, txt2_len, int(cfg["text_embed_2_dim"]), generator=g).to(dtype)
        mask_2 = torch.ones(batch, txt2_len, dtype=torch.int64)
        mask_2[0, txt2_len // 2:] = 0
        image = torch.randn(batch, image_len, int(cfg["image_embed_dim"]), generator=g).to(dtype)
        return (latent, timestep, text, mask, text_2, mask_2, image, img, txt)
    pooled = torch.randn(batch, int(cfg["pooled_projection_dim"]), generator=g).to(dtype)
    args = (latent, timestep, text, mask, pooled)
    if has_guidance(transformer):
        args += (torch.full((batch,), 6.0, dtype=dtype),)
    return args + (img, txt)


def _framepack_sample(transformer, latent, timestep, text, mask, g, *, batch, grid, image_len,
                      dtype, axes, theta) -> tuple:
    """FramePack's traced sample: HunyuanVideo's, the image embeddings, the history latents
    and the ids caches of the sample's frame indices (dropin.framepack_sample_indices)."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    from .dropin import FRAMEPACK_SAMPLE_HISTORY, framepack_ids, framepack_sample_indices

    cfg = transformer.config
    f, h, w = grid
    shape = tuple(latent.shape)
    pooled = torch.randn(batch, int(cfg["pooled_projection_dim"]), generator=g).to(dtype)
    image = torch.randn(batch, image_len, int(cfg["image_proj_dim"]), generator=g).to(dtype)
    guidance = (torch.full((batch,), 6.0, dtype=dtype),) if has_guidance(transformer) else ()
    history = tuple(torch.randn(*shape[:2], n, *shape[3:], generator=g).to(dtype)
                    for n in FRAMEPACK_SAMPLE_HISTORY)
    setting = checked_setting("ids", axes, theta, rotated=HUNYUAN_VIDEO_FRAMEPACK.rotated)
    ids = framepack_ids(h, w, framepack_sample_indices(f))
    caches = build_rope_caches("ids", {"img_ids": ids, "txt_ids": torch.zeros(
        image_len + int(text.shape[1]), len(axes))}, setting)
    return ((latent, timestep, text, mask, pooled, image) + guidance + history
            + (caches.img.clone(), caches.txt.clone()))


def rope_setting(transformer: nn.Module) -> tuple[tuple[int, ...], float]:
    """The RoPE axes and theta diffusers built the model with (its rope module's)."""
    axes = tuple(int(v) for v in transformer.rope.rope_dim)
    theta = float(transformer.rope.theta)
    return axes, (int(theta) if theta.is_integer() else theta)


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """export_transformer's hook: :func:`plan` of the sample's latent grid. torch.export fixes an
    axis traced at size 1, so a grid with one frame is traced with two (the frames axis stays
    dynamic); a grid narrower than 2 tokens is refused in one line."""
    one_grid(sample, record.short)
    return plan(record, transformer, sample=sample, dtype=dtype, layers=layers,
                rounding=rounding)


def plan(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
         layers: int | None = None, rounding: int | None = None, fused: bool = True):
    """The export plan of ``transformer`` with its first ``layers`` blocks in execution order
    (HunyuanVideo: double-stream, then single-stream; every block by default). The sample's
    first image shape is the latent's token grid ``(f, h, w)``."""
    from qkrope.export.onnx_export import TransformerPlan

    axes, theta = rope_setting(transformer)
    counts = _block_counts(transformer)[:len(record.block_lists)]
    kept = record.kept_blocks(dict(transformer.config), layers)
    wrapper = cache_input_hunyuan(transformer, record, rounding=rounding, fused=fused,
                                  kept=kept)
    grid = tuple(sample.img_shapes[0])
    args = sample_args(record, transformer, batch=sample.batch, grid=grid,
                       txt_len=sample.txt_len, dtype=dtype, axes=axes, theta=theta)
    decl = record.graph if record is HUNYUAN_VIDEO15 else (
        record.decl(has_guidance(transformer)))
    axis_values = None
    if record is HUNYUAN_VIDEO15:  # the ByT5 and image tokens (sample_args), the joined text
        from qkrope import model_io

        txt2, image = int(args[4].shape[1]), int(args[6].shape[1])
        axis_values = {model_io.TXT2_TOKENS: txt2, model_io.IMAGE_EMBED_TOKENS: image,
                       model_io.TXT_CACHE_ROWS: int(args[-1].shape[0])}
    if record is HUNYUAN_VIDEO_FRAMEPACK:  # the image tokens, the history frames, the caches
        from qkrope import model_io

        from .dropin import FRAMEPACK_SAMPLE_HISTORY

        axis_values = {model_io.IMAGE_EMBED_TOKENS: int(args[5].shape[1]),
                       model_io.IMG_CACHE_ROWS: int(args[-2].shape[0]),
                       model_io.TXT_CACHE_ROWS: int(args[-1].shape[0])}
        axis_values.update(zip((model_io.CLEAN_FRAMES, model_io.HISTORY_2X_FRAMES,
                                model_io.HISTORY_4X_FRAMES),
                               FRAMEPACK_SAMPLE_HISTORY))
    blocks = " + ".join(f"{k} of {n} {kind}" for k, n, kind in zip(kept, counts,
                                                                    ("double", "single")))
    return TransformerPlan(
        axis_values=axis_values, wrapper=wrapper, args=args, decl=decl, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=node_count(transformer, kept) if fused else 0,
        num_layers_exported=sum(kept), blocks=f"{record.label}: {blocks} blocks")
