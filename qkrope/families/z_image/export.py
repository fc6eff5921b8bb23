"""Z-Image's export hooks (export layer): the config check, the attention processor, the
cache-input wrapper, the sample inputs and the post-export check (no float64) that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers' Z-Image takes lists of per-sample latents and caption features, pads each caption
and each image to a multiple of 32 tokens (with learned pad tokens), builds per-sample position
ids and looks them up in complex64 RoPE tables (``RopeEmbedder``), which no ONNX exporter
translates. Here:

- the graph takes one call's samples with equal positions (docs/spec.md section 6c): the latent
  patches ``[B, N, p*p*C]`` (patchified as diffusers does, by the drop-in), the caption
  features ``[B, S, cap_feat_dim]`` already padded to ``S`` (a multiple of 32 in a pipeline)
  with the mask of the real tokens, the timestep (float32, as the pipelines pass it) and the
  two 2-D caches: image token t and caption token j, shared by the batch;
- in the graph the image is padded to a multiple of 32 with ``x_pad_token`` (its pad tokens
  sit at position (0, 0, 0): identity cache rows, made in the graph), caption pad tokens
  (mask False) become ``cap_pad_token``;
- :class:`ZImageAttnProcessor` replaces ``ZSingleStreamAttnProcessor`` on every attention: the
  noise refiner's (image cache), the context refiner's (caption cache) and the main layers'
  (``[image; caption]``, the joined cache: Slice + Concat in the graph), one
  ``qkrope::QKNormRoPE`` node each. Every Z-Image attention normalises and rotates q and k.
- ``--layers K`` keeps the first K blocks in that order (the record's block lists); the rest of
  the model (embedders, pad tokens, final layer) is the whole model's.
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import contract
from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.finalize import check_no_double
from qkrope.export.ops import qk_norm_rope

from . import SEQ_MULTIPLE, Z_IMAGE


class ZImageAttnProcessor:
    """Replaces diffusers' ``ZSingleStreamAttnProcessor``: ``freqs_cis`` is the 2-D cache of the
    sequence (``[rows >= S, rotary_dim]`` fp32), not the complex table."""

    def __init__(self, rounding: int):
        self.rounding = contract.check_rounding(rounding)
        self._attributes: dict[float, contract.NodeAttributes] = {}

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 freqs_cis=None):
        if attention_mask is not None or encoder_hidden_states is not None:
            raise InputError("the Z-Image export's attention takes no attention_mask or "
                             "encoder_hidden_states (its samples are never padded)")
        if not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dim() != 2 \
                or freqs_cis.is_complex():
            raise InputError("the patched Z-Image attention needs freqs_cis as a 2-D fp32 "
                             "cos/sin cache; run it through ZImageCacheInputTransformer")
        if attn.norm_q is None or attn.norm_k is None:
            raise InputError("the Z-Image attention has no q/k RMSNorm (qk_norm=False), which "
                             "the QKNormRoPE node needs")
        eps = float(attn.norm_q.eps)
        if eps not in self._attributes:
            self._attributes[eps] = contract.NodeAttributes(eps, True, self.rounding)
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = qk_norm_rope(q, k, attn.norm_q.weight, attn.norm_k.weight, freqs_cis,
                            **self._attributes[eps].as_kwargs())
        head_dim = q.shape[-1]
        out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, head_dim)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        out = attn.to_out[0](out)
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def kept_blocks(transformer: nn.Module, kept: tuple[int, ...] | None = None) -> list:
    """The blocks the export runs, in the order the forward runs them: noise refiner, context
    refiner, main layers (the siglip refiner of an Omni model is not exported); ``kept``: how
    many of each list (the record's ``kept_blocks``; every block by default)."""
    lists = (transformer.noise_refiner, transformer.context_refiner, transformer.layers)
    kept = tuple(len(b) for b in lists) if kept is None else kept
    return [block for blocks, k in zip(lists, kept) for block in list(blocks)[:k]]


def attentions(transformer: nn.Module, kept: tuple[int, ...] | None = None) -> list:
    """The attention of each block the export runs (:func:`kept_blocks`), in order."""
    return [b.attention for b in kept_blocks(transformer, kept)]


def node_count(transformer: nn.Module, kept: tuple[int, ...] | None = None) -> int:
    """QKNormRoPE nodes of the export: one per attention of the kept blocks."""
    return len(attentions(transformer, kept))


def patch_size(transformer: nn.Module) -> tuple[int, int]:
    """(patch, frame patch) the export uses: the first of the model's (the pipelines' 2 and 1)."""
    cfg = transformer.config
    return int(cfg["all_patch_size"][0]), int(cfg["all_f_patch_size"][0])


class ZImageCacheInputTransformer(nn.Module):
    """``ZImageTransformer2DModel`` for one call of equal-positioned samples with the RoPE
    caches as inputs (module docstring):

    ``forward(hidden_states [B, N, pf*p*p*C], encoder_hidden_states [B, S, cap_feat_dim],
    encoder_hidden_states_mask [B, S] bool, timestep [B] fp32, img_cos_sin_cache [>= N, rd],
    txt_cos_sin_cache [>= S, rd]) -> sample [B, N, pf*p*p*C_out]`` (the image tokens, before
    diffusers' unpatchify). ``kept``: how many blocks of each list run (noise refiner, context
    refiner, main layers: the record's ``kept_blocks`` for ``--layers``; every block by
    default); the rest of the model (embedders, pad tokens, final layer) is the whole
    model's, as diffusers' forward with the later blocks passing their stream through."""

    def __init__(self, transformer: nn.Module, *, rounding: int = Z_IMAGE.rounding,
                 kept: tuple[int, ...] | None = None):
        super().__init__()
        self.rounding = contract.check_rounding(rounding)
        lists = (transformer.noise_refiner, transformer.context_refiner, transformer.layers)
        self.kept = tuple(len(b) for b in lists) if kept is None else tuple(kept)
        processor = ZImageAttnProcessor(self.rounding)
        for attn in attentions(transformer, self.kept):
            attn.set_processor(processor)
        self.key = "-".join(str(v) for v in patch_size(transformer))
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        batch, n_img = hidden_states.shape[0], hidden_states.shape[1]
        s_txt = encoder_hidden_states.shape[1]
        adaln = t.t_embedder(timestep * t.t_scale).type_as(hidden_states)
        # the image: embedded, padded to a multiple of 32 with x_pad_token at position (0, 0, 0)
        x = t.all_x_embedder[self.key](hidden_states)
        pad = (SEQ_MULTIPLE - n_img % SEQ_MULTIPLE) % SEQ_MULTIPLE
        x = torch.cat([x, t.x_pad_token.to(x.dtype).expand(batch, pad, -1)], dim=1)
        half = img_cos_sin_cache.shape[1] // 2
        identity = torch.cat([img_cos_sin_cache.new_ones(pad, half),
                              img_cos_sin_cache.new_zeros(pad, half)], dim=1)
        img_rope = torch.cat([img_cos_sin_cache[:n_img], identity], dim=0)
        noise, context, main = self.kept
        for layer in t.noise_refiner[:noise]:
            x = layer(x, None, img_rope, adaln)
        # the caption: pad tokens (mask False) replaced by cap_pad_token
        cap = t.cap_embedder(encoder_hidden_states)
        mask = encoder_hidden_states_mask.to(torch.bool).unsqueeze(-1)
        cap = torch.where(mask, cap, t.cap_pad_token.to(cap.dtype))
        txt_rope = txt_cos_sin_cache[:s_txt]
        for layer in t.context_refiner[:context]:
            cap = layer(cap, None, txt_rope)
        # the main layers over [image; caption]
        unified = torch.cat([x, cap], dim=1)
        joint = torch.cat([img_rope, txt_rope], dim=0)
        for layer in t.layers[:main]:
            unified = layer(unified, None, joint, adaln)
        out = t.all_final_layer[self.key](unified, c=adaln)
        return out[:, :n_img]


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """Refused in one line before diffusers builds the model: an Omni model (siglip_feat_dim:
    its pipeline passes nested lists and SigLIP features, which this graph does not take) and
    qk_norm False (nothing to fuse). The rest is left to diffusers' own checks."""
    from qkrope.export.patch_diffusers import read_config

    path, raw = read_config(directory)
    if raw.get("siglip_feat_dim") is not None:
        raise InputError(f"{path} is a Z-Image-Omni model (siglip_feat_dim is set), whose "
                         f"pipeline passes nested lists and SigLIP features; qkrope exports the "
                         f"text-to-image model only. Fix: export a Z-Image / Z-Image-Turbo "
                         f"transformer")
    if raw.get("qk_norm", True) is not True:
        raise InputError(f"{path} sets qk_norm={raw.get('qk_norm')!r}: its attentions have no "
                         f"q/k RMSNorm for the QKNormRoPE node to fuse. Fix: export a model with "
                         f"qk_norm true")
    return raw


def post_export(model) -> None:
    """No float64 in the Z-Image graph (diffusers builds Z-Image's RoPE tables in float64)."""
    check_no_double(model, "the Z-Image graph")


def sample_args(transformer: nn.Module, sample, dtype: torch.dtype, axes, theta) -> tuple:
    """The traced sample: random latent patches and caption features, the last caption token
    of the last item a pad token, timestep 0.5 (float32), the caches of the pipelines' ids."""
    from qkrope.families.z_image.dropin import caches_for_sizes

    cfg = transformer.config
    p, pf = patch_size(transformer)
    g = torch.Generator().manual_seed(1)
    b, n, s = sample.batch, sample.img_tokens, sample.txt_len
    caches = caches_for_sizes(sample.img_shapes, s, axes=axes, theta=theta)
    hs = torch.randn(b, n, pf * p * p * int(cfg["in_channels"]), generator=g).to(dtype)
    ehs = torch.randn(b, s, int(cfg["cap_feat_dim"]), generator=g).to(dtype)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[-1, -1] = False
    return (hs, ehs, mask, torch.full((b,), 0.5, dtype=torch.float32),
            caches.img.clone(), caches.txt.clone())


def prepare(record, transformer: nn.Module, *, sample, dtype: torch.dtype, layers: int | None,
            rounding: int):
    """The export of ``transformer`` (a placeholder skeleton) with its first ``layers`` blocks
    in execution order (noise refiner, context refiner, then main layers; every block by
    default). The sidecar records the RoPE axes (the config's ``axes_dims``) and theta
    (``rope_theta``), as diffusers built the model."""
    from qkrope.export.onnx_export import TransformerPlan

    cfg = dict(transformer.config)
    heads = int(cfg["n_heads"])
    head_dim = int(cfg["dim"]) // heads
    axes = tuple(int(v) for v in cfg["axes_dims"])
    theta = float(transformer.rope_theta)
    theta = int(theta) if theta.is_integer() else theta
    if sum(axes) != head_dim:
        raise InputError(f"axes_dims {list(axes)} sums to {sum(axes)}, not the head width "
                         f"dim / n_heads = {head_dim}: Z-Image rotates the whole head")
    if len(sample.img_shapes) != 1 or sample.img_shapes[0][0] != 1:
        raise InputError(f"a Z-Image sample is one image of one frame; got --img-shape "
                         f"{sample.img_shapes}. Fix: pass one --img-shape 1 H W")
    kept = record.kept_blocks(cfg, layers)
    wrapper = ZImageCacheInputTransformer(transformer, rounding=rounding, kept=kept).eval()
    eps = {float(a.norm_q.eps) for a in attentions(transformer, kept)}
    if len(eps) != 1:
        raise InputError(f"the Z-Image attentions use different RMSNorm epsilons {sorted(eps)}; "
                         f"the export records one")
    args = sample_args(transformer, sample, dtype, axes, theta)
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=node_count(transformer, kept),
        num_layers_exported=sum(kept),
        blocks=f"{record.label}: {kept[0]} of {len(transformer.noise_refiner)} noise-refiner + "
               f"{kept[1]} of {len(transformer.context_refiner)} context-refiner + "
               f"{kept[2]} of {len(transformer.layers)} main blocks",
        heads=heads, head_dim=head_dim, eps=eps.pop())
