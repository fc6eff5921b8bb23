"""Motif-Video's export hooks (export layer): the attention processor, the cache-input wrapper,
the sample inputs and the checks :func:`qkrope.export.onnx_export.export_transformer` asks for.

diffusers builds the RoPE inside the forward (``MotifVideoRotaryPosEmbed``: float64 frequencies
over the latent's grid, their cos / sin in float32). Here the tables come in as the two
``[rows, rotary_dim]`` fp32 caches and every attention's per-head RMSNorm + RoPE is one
``qkrope::QKNormRoPE`` node per stream:

- double-stream blocks: two nodes, the latent (``norm_q``/``norm_k``, the image cache) and the
  text (``norm_added_q``/``norm_added_k``, the text cache, identity rows: normalised, not
  rotated);
- single-stream blocks: one node over ``[latent; text]`` with the joined cache ``[image rows;
  identity rows]``, made in the graph from the two cache inputs.

The text mask: diffusers masks padded text keys (``[B, 1, 1, N]``, True = attended); the
wrapper builds the same boolean mask from the int64 graph input.
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
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
from qkrope.families._record import FamilyRecord


class MotifRope(NamedTuple):
    """What the blocks pass on as ``image_rotary_emb``."""

    img: torch.Tensor  # [latent tokens, rotary_dim]
    txt: torch.Tensor  # [text tokens, rotary_dim] (identity rows)
    joint: torch.Tensor  # [latent rows; text rows]: the single-stream blocks


def _eps(norm: nn.Module | None, where: str) -> float:
    eps = getattr(norm, "eps", None)
    if not isinstance(norm, nn.RMSNorm) or eps is None or norm.weight is None:
        raise InputError(f"{where} is {type(norm).__name__}, not an RMSNorm with an epsilon and a "
                         f"weight, which the QKNormRoPE node is; not a standard Motif-Video model")
    return float(eps)


class MotifVideoAttnProcessor:
    """Replaces ``MotifVideoAttnProcessor2_0`` (double- and single-stream);
    ``image_rotary_emb`` is a :class:`MotifRope`."""

    def __init__(self, rounding: int, *, fused: bool = True):
        self.node = FusedNormRoPE(rounding, fused=fused)
        self.rounding = self.node.rounding

    def _fused(self, q, k, norm_q, norm_k, cache):
        for norm, where in ((norm_q, "norm_q"), (norm_k, "norm_k")):
            _eps(norm, where)  # an RMSNorm (the node's norm), not another kind
        return self.node(q, k, norm_q, norm_k, cache)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if not isinstance(image_rotary_emb, MotifRope):
            raise InputError("the patched Motif-Video attention needs image_rotary_emb="
                             "MotifRope(...); run it through the cache-input wrapper "
                             "(cache_input_motif)")
        if getattr(attn, "fused_projections", False):
            raise InputError("the Motif-Video attention has fused QKV projections; export the "
                             "model before fusing them")
        joint = attn.add_q_proj is None and encoder_hidden_states is not None
        if joint:  # the single-stream block: one [latent; text] sequence
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        q, k, v = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = self._fused(q, k, attn.norm_q, attn.norm_k,
                           image_rotary_emb.joint if joint else image_rotary_emb.img)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            eq, ek, ev = (proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            eq, ek = self._fused(eq, ek, attn.norm_added_q, attn.norm_added_k,
                                 image_rotary_emb.txt)
            q, k, v = (torch.cat(p, dim=1) for p in ((q, eq), (k, ek), (v, ev)))
        out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         attention_mask, q.shape[-1])
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        s_txt = encoder_hidden_states.shape[1]
        out, txt = out[:, :-s_txt], out[:, -s_txt:]
        if attn.to_out is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if attn.to_add_out is not None:
            txt = attn.to_add_out(txt)
        return out, txt


def node_count(kept: tuple[int, ...]) -> int:
    """QKNormRoPE nodes: two per double-stream block, one per single-stream block."""
    double, single = (tuple(kept) + (0,))[:2]
    return 2 * double + single


def check_supported(transformer: nn.Module) -> None:
    """One line for a configuration the node or the wrapper does not reproduce."""
    cfg = transformer.config
    if cfg.get("qk_norm", "rms_norm") != "rms_norm":
        raise InputError(f"the Motif-Video config sets qk_norm={cfg.get('qk_norm')!r}: the "
                         f"QKNormRoPE node is a per-head RMSNorm with a weight. Fix: export a "
                         f"model with qk_norm='rms_norm'")
    crossed = [k for k in ("enable_text_cross_attention_dual",
                           "enable_text_cross_attention_single") if cfg.get(k, False)]
    if crossed:
        raise InputError(f"the Motif-Video config sets {' and '.join(crossed)}=True (text "
                         f"cross-attention: latent queries rotated, text keys not), which "
                         f"qkrope's export does not carry. Fix: export a model without text "
                         f"cross-attention")
    if int(cfg.get("num_decoder_layers", 0) or 0) > 0:
        raise InputError(f"the Motif-Video config sets num_decoder_layers="
                         f"{cfg['num_decoder_layers']} (decoder blocks over the latent twice), "
                         f"which qkrope's export does not carry. Fix: export a model with "
                         f"num_decoder_layers=0")
    axes = tuple(int(v) for v in cfg["rope_axes_dim"])
    head_dim = int(cfg["attention_head_dim"])
    if len(axes) != 3 or sum(axes) > head_dim:
        raise InputError(f"rope_axes_dim {list(axes)} must be three widths summing to at most "
                         f"attention_head_dim={head_dim}")


class MotifVideoCacheInputTransformer(nn.Module):
    """``MotifVideoTransformer3DModel.forward`` (no image embeddings) with the RoPE caches in
    place of its RoPE module, running the first ``kept`` (double, single) blocks; ``forward``'s
    arguments are the graph inputs in graph order."""

    def __init__(self, transformer: nn.Module, family: FamilyRecord, rounding: int,
                 fused: bool = True, kept: tuple[int, ...] | None = None):
        super().__init__()
        self.family = family
        self.rounding = contract.check_rounding(rounding)
        processor = MotifVideoAttnProcessor(self.rounding, fused=fused)
        for block in list(transformer.transformer_blocks) + list(
                transformer.single_transformer_blocks):
            block.attn.set_processor(processor)
        self.transformer = transformer
        self.double, self.single = tuple(kept) if kept is not None else (
            len(transformer.transformer_blocks), len(transformer.single_transformer_blocks))

    def blocks(self):
        """The kept blocks, in execution order."""
        t = self.transformer
        return list(t.transformer_blocks[:self.double]) + list(
            t.single_transformer_blocks[:self.single])

    def forward(self, latent, timestep, encoder_hidden_states, encoder_attention_mask,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        batch, _, frames, height, width = latent.shape
        p_t, p = int(t.config["patch_size_t"]), int(t.config["patch_size"])
        temb = t.time_text_embed(timestep)
        x = patch_conv(t.x_embedder.proj, latent).flatten(2).transpose(1, 2)
        text = t.context_embedder(encoder_hidden_states)
        s_img, s_txt = x.shape[1], text.shape[1]
        mask = F.pad(encoder_attention_mask.to(torch.bool), (s_img, 0), value=True)
        mask = mask.unsqueeze(1).unsqueeze(1)
        rope = MotifRope(img_cos_sin_cache, txt_cos_sin_cache,
                         torch.cat([img_cos_sin_cache[:s_img], txt_cos_sin_cache[:s_txt]], dim=0))
        for block in self.blocks():
            x, text = block(x, text, temb, mask, rope, 0)
        x = t.proj_out(t.norm_out(x, temb))
        # diffusers' output reshape: tokens back to the 5-D latent, its operations in its order
        x = x.reshape(batch, frames // p_t, height // p, width // p, -1, p_t, p, p)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def cache_input_motif(transformer: nn.Module, family: FamilyRecord, *,
                      rounding: int | None = None, fused: bool = True,
                      kept: tuple[int, ...] | None = None) -> nn.Module:
    """The wrapper whose ``forward`` arguments are the graph inputs, in graph order.
    ``fused=False`` puts diffusers' own norm and rotation (from the same caches) in place of the
    node: the same graph without QKNormRoPE (the tests' reference of the kernels' rounding)."""
    check_supported(transformer)
    rounding = family.rounding if rounding is None else rounding
    return MotifVideoCacheInputTransformer(transformer, family, rounding, fused, kept).eval()


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks (the wrapper refuses what it does not carry,
    before tracing)."""
    return None


def post_export(model) -> None:
    """No float64 anywhere in the graph (diffusers' float64 RoPE is not in it)."""
    import onnx_ir as ir

    from qkrope.export.onnx_export import ExportError

    values = list(model.graph.inputs) + list(model.graph.outputs) + list(
        model.graph.initializers.values())
    for node in model.graph.all_nodes():
        values += list(node.outputs)
    for value in values:
        if value is not None and value.dtype == ir.DataType.DOUBLE:
            raise ExportError(f"graph value {value.name} is DOUBLE: the Motif-Video graph must "
                              f"have no float64")


def sample_caches(family: FamilyRecord, grid, txt_len: int, axes, theta):
    """The caches of one latent grid ``(f, h, w)`` in tokens (the grid scheme, uncentred,
    float64 tables, text not rotated), as torch tensors."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    setting = checked_setting("grid", axes, theta, max_positions=family.max_positions,
                              scale_rope=family.scale_rope, rotated=family.rotated,
                              precision=family.rope_precision)
    caches = build_rope_caches("grid", {"img_shapes": [tuple(grid)], "txt_seq_len": txt_len},
                               setting)
    return caches.img.clone(), caches.txt.clone()


def rope_setting(transformer: nn.Module) -> tuple[tuple[int, ...], float]:
    """The RoPE axes and theta diffusers built the model with (its rope module's)."""
    axes = tuple(int(v) for v in transformer.rope.rope_dim)
    theta = float(transformer.rope.theta)
    return axes, (int(theta) if theta.is_integer() else theta)


def sample_args(family: FamilyRecord, transformer: nn.Module, *, batch: int, grid,
                txt_len: int, dtype: torch.dtype, axes, theta) -> tuple:
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
    img, txt = sample_caches(family, (f, h, w), txt_len, axes, theta)
    return (latent, timestep, text, mask, img, txt)


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
    (double-stream, then single-stream; every block by default). The sample's first image shape
    is the latent's token grid ``(f, h, w)``."""
    from qkrope.export.onnx_export import TransformerPlan

    axes, theta = rope_setting(transformer)
    counts = record.block_counts(dict(transformer.config))
    kept = record.kept_blocks(dict(transformer.config), layers)
    wrapper = cache_input_motif(transformer, record, rounding=rounding, fused=fused, kept=kept)
    args = sample_args(record, transformer, batch=sample.batch, grid=tuple(sample.img_shapes[0]),
                       txt_len=sample.txt_len, dtype=dtype, axes=axes, theta=theta)
    blocks = " + ".join(f"{k} of {n} {kind}" for k, n, kind in zip(kept, counts,
                                                                    ("double", "single")))
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=node_count(kept) if fused else 0,
        num_layers_exported=sum(kept), blocks=f"{record.label}: {blocks} blocks")
