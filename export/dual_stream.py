"""The shared export of every dual-stream diffusers transformer (export layer): attentions with
the dual-stream attribute layout (``to_q``/``to_k``/``to_v``, ``norm_q``/``norm_k``,
``add_q_proj``/``add_k_proj``/``add_v_proj``, ``norm_added_q``/``norm_added_k``, ``to_out``,
``to_add_out``), double-stream blocks over the image and text streams, then single-stream blocks
over ``[text; image]``, RoPE from position ids. What a family differs by is data
(:class:`qkrope.families._dual_stream.DualStream`, passed by its export hook).

diffusers' processor normalises each stream per head (``torch.nn.RMSNorm``), joins the streams
as ``[text; image]`` and rotates the joined sequence with float64-built tables. Here each norm
+ RoPE is one ``qkrope::QKNormRoPE`` call (:func:`qkrope.export.ops.qk_norm_rope`): two per
double-stream attention (the image cache, the text cache), one per single-stream attention (the
joined cache). What a block passes as ``image_rotary_emb`` is a :class:`JointRope`, made once
per forward by the cache-input wrapper (:func:`joint_rope`).

``attention_mask`` is passed to softmax attention as diffusers passes it to SDPA: a bool mask
keeps (True) or drops keys, a float mask is added to the scores
(:func:`qkrope.export.attention._attention` exports both).

:class:`CacheInputTransformer` replays a dual-stream forward (embedders, blocks, output) with
the caches in place of the ids; :func:`cache_input` gives its subclass whose ``forward`` has
exactly the graph's inputs; :func:`prepare` is the family hook's whole body.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from qkrope.errors import InputError
from qkrope.model_io import GUIDANCE, POOLED_PROJECTIONS

from .attention import _attention
from .finalize import check_no_double
from .sample import check_layers
from .fused_qk import FusedNormRoPE, norm_eps  # noqa: F401 (the dual-stream families' names)


class JointRope(NamedTuple):
    """What the blocks pass on as ``image_rotary_emb``: the two caches and their join."""

    img: torch.Tensor
    txt: torch.Tensor
    joint: torch.Tensor  # [txt rows (text tokens); img rows (image tokens)]


def joint_rope(img_cache: torch.Tensor, txt_cache: torch.Tensor, s_img, s_txt) -> JointRope:
    """The caches of a ``[text; image]`` model: each stream's, and their join, sliced to the
    streams' token counts (a cache may have more rows than tokens)."""
    return JointRope(img_cache, txt_cache, torch.cat([txt_cache[:s_txt], img_cache[:s_img]],
                                                     dim=0))


def sdpa(q, k, v, head_dim: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax attention over [B, S, H, D] inputs; returns [B, S, H * D] in q's dtype."""
    out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, head_dim)
    return out.transpose(1, 2).flatten(2, 3).to(q.dtype)


class DualStreamAttnProcessor:
    """Replaces the processor of an attention with the dual-stream attribute layout
    (double-stream with ``encoder_hidden_states``, single-stream without);
    ``image_rotary_emb`` is a :class:`JointRope`. ``masked``: whether the model passes an
    ``attention_mask`` (refused otherwise, so that a mask never goes unnoticed)."""

    def __init__(self, rounding: int, *, masked: bool = False):
        self.fused = FusedNormRoPE(rounding)
        self.masked = masked

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if attention_mask is not None and not self.masked:
            raise InputError("this export of the attention takes no attention_mask (the model "
                             "attends to every token)")
        if not isinstance(image_rotary_emb, JointRope):
            raise InputError("the patched attention needs image_rotary_emb=JointRope(img, "
                             "txt, joint); run it through the family's cache-input wrapper")
        if getattr(attn, "fused_projections", False):
            raise InputError("the attention has fused QKV projections (fuse_qkv_"
                             "projections()); export the model before fusing them")
        head_dim = attn.head_dim
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        if encoder_hidden_states is None:  # single-stream: the [text; image] sequence
            q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.joint)
            return sdpa(q, k, v, head_dim, attention_mask)
        tq, tk, tv = (proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
                      for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.img)
        tq, tk = self.fused(tq, tk, attn.norm_added_q, attn.norm_added_k, image_rotary_emb.txt)
        out = sdpa(torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1),
                   head_dim, attention_mask)
        s_txt = encoder_hidden_states.shape[1]
        txt_out = attn.to_add_out(out[:, :s_txt].contiguous())
        img_out = attn.to_out[1](attn.to_out[0](out[:, s_txt:].contiguous()))
        return img_out, txt_out


# --------------------------------------------------------------------------------------------
# The cache-input wrapper and the export plan of a dual-stream transformer
# --------------------------------------------------------------------------------------------

def blocks_of(transformer: nn.Module) -> list:
    """The model's blocks in execution order (double-stream, then single-stream)."""
    return list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)


def patch_attentions(transformer: nn.Module, label: str, processor, single=None) -> None:
    """Give every block's ``attn`` ``processor`` (``single`` for an attention with
    ``to_qkv_mlp_proj``, a parallel single-stream attention), in place."""
    blocks = blocks_of(transformer)
    if not blocks:
        raise InputError(f"the {label} model has no transformer blocks")
    for block in blocks:
        parallel = single is not None and hasattr(block.attn, "to_qkv_mlp_proj")
        block.attn.set_processor(single if parallel else processor)


def node_count(double: int, single: int) -> int:
    """QKNormRoPE nodes of ``double`` double-stream and ``single`` single-stream blocks."""
    return 2 * double + single


def rope_setting(transformer: nn.Module, label: str) -> tuple[tuple[int, ...], float, int]:
    """(axes, theta, head_dim) as the loaded model was built: the config's axes_dims_rope, which
    must fill the head (the model rotates the whole head), and its position embedder's theta."""
    cfg = transformer.config
    head_dim = int(cfg["attention_head_dim"])
    axes = tuple(int(v) for v in cfg["axes_dims_rope"])
    theta = float(transformer.pos_embed.theta)
    theta = int(theta) if theta.is_integer() else theta
    if sum(axes) != head_dim:
        raise InputError(f"axes_dims_rope {list(axes)} sums to {sum(axes)}, not "
                         f"attention_head_dim={head_dim}: {label} rotates the whole head. Fix: "
                         f"correct the model's config.json")
    return axes, theta, head_dim


def has_guidance(transformer: nn.Module, record=None) -> bool:
    """Whether the model embeds a guidance value (the config's guidance_embeds) that the graph
    of ``record`` takes (where given)."""
    if record is not None and GUIDANCE not in record.graph.inputs:
        return False
    return bool(transformer.config.get("guidance_embeds", False))


class CacheInputTransformer(nn.Module):
    """A dual-stream transformer whose forward takes the graph inputs: :meth:`run` with the RoPE
    caches in place of the ids, over the first ``kept`` (double, single) blocks. The embedders
    follow ``spec`` (:class:`qkrope.families._dual_stream.DualStream`); :meth:`blocks` runs
    blocks whose single-stream ones take and return the (text, image) pair, a family whose
    blocks differ overrides it. :func:`cache_input` gives the subclass whose ``forward`` has
    exactly the graph's inputs. ``masked``: whether the blocks pass an attention mask (the
    default processor's)."""

    masked = False

    def __init__(self, transformer: nn.Module, record, spec, kept: tuple[int, int], *,
                 rounding: int, processor=None, single=None):
        super().__init__()
        self.family, self.spec = record, spec
        self.double, self.single = kept
        self.rounding = rounding
        patch_attentions(transformer, record.label,
                         processor or DualStreamAttnProcessor(rounding, masked=self.masked),
                         single)
        self.transformer = transformer

    def embed(self, hidden_states, encoder_hidden_states, timestep, pooled, guidance):
        """(image stream, text stream, timestep embedding) before the first block."""
        t, kind = self.transformer, self.spec.temb
        hidden_states = t.x_embedder(hidden_states)
        scale = self.spec.timestep_scale
        timestep = timestep.to(hidden_states.dtype)
        timestep = timestep * scale if scale != 1 else timestep
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        if kind == "time_text_embed":
            temb = (t.time_text_embed(timestep, pooled) if guidance is None
                    else t.time_text_embed(timestep, guidance, pooled))
        elif kind == "time_guidance_embed":
            temb = t.time_guidance_embed(timestep, guidance)
        elif kind == "time_embed":
            temb = t.time_embed(timestep, hidden_states.dtype)
        else:
            temb = t.timestep_embedder(t.time_proj(timestep).to(dtype=hidden_states.dtype))
        if self.spec.context_norm is not None:
            encoder_hidden_states = getattr(t, self.spec.context_norm)(encoder_hidden_states)
        return hidden_states, t.context_embedder(encoder_hidden_states), temb

    def blocks(self, hidden_states, encoder_hidden_states, temb, rope):
        """The kept blocks; returns the image stream."""
        t = self.transformer
        for block in list(t.transformer_blocks)[:self.double] + \
                list(t.single_transformer_blocks)[:self.single]:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                temb=temb, image_rotary_emb=rope)
        return hidden_states

    def run(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
            txt_cos_sin_cache, pooled_projections=None, guidance=None):
        rope = joint_rope(img_cos_sin_cache, txt_cos_sin_cache, hidden_states.shape[1],
                          encoder_hidden_states.shape[1])
        hidden_states, encoder_hidden_states, temb = self.embed(
            hidden_states, encoder_hidden_states, timestep, pooled_projections, guidance)
        hidden_states = self.blocks(hidden_states, encoder_hidden_states, temb, rope)
        t = self.transformer
        return t.proj_out(t.norm_out(hidden_states, temb))


# One forward per graph signature: torch.export names the graph inputs after forward's
# parameters, and the graphs differ by pooled_projections and guidance.
def _pooled_guided(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
                   guidance, img_cos_sin_cache, txt_cos_sin_cache):
    return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                    txt_cos_sin_cache, pooled_projections, guidance)


def _pooled(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
            img_cos_sin_cache, txt_cos_sin_cache):
    return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                    txt_cos_sin_cache, pooled_projections)


def _guided(self, hidden_states, encoder_hidden_states, timestep, guidance, img_cos_sin_cache,
            txt_cos_sin_cache):
    return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                    txt_cos_sin_cache, guidance=guidance)


def _plain(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
           txt_cos_sin_cache):
    return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                    txt_cos_sin_cache)


_FORWARDS = {(True, True): _pooled_guided, (True, False): _pooled, (False, True): _guided,
             (False, False): _plain}
_CLASSES: dict = {}


def cache_input(base: type, transformer: nn.Module, record, spec, kept, *, rounding: int,
                **kwargs) -> CacheInputTransformer:
    """``base`` (:class:`CacheInputTransformer` or a family's subclass) with the ``forward``
    of the record's graph for this model (pooled projections where the graph has them,
    guidance where the model embeds it; a ``base`` that defines ``forward`` keeps its own), in
    eval mode."""
    key = (POOLED_PROJECTIONS in record.graph.inputs, has_guidance(transformer, record))
    if "forward" in vars(base):  # a family's wrapper of its own graph signature
        return base(transformer, record, spec, kept, rounding=rounding, **kwargs).eval()
    if (base, key) not in _CLASSES:
        _CLASSES[(base, key)] = type(base.__name__, (base,), {"forward": _FORWARDS[key]})
    return _CLASSES[(base, key)](transformer, record, spec, kept, rounding=rounding,
                                 **kwargs).eval()


def sample_args(record, transformer: nn.Module, sample, dtype: torch.dtype, caches, *,
                mask=None) -> tuple:
    """The traced sample in graph order: random activations (and pooled projections where the
    graph has them), the text ``mask`` where given, timestep 0.5, guidance 3.5 where the model
    embeds it, and ``caches``."""
    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    b = sample.batch
    args = [torch.randn(b, sample.img_tokens, int(cfg["in_channels"]), generator=g).to(dtype),
            torch.randn(b, sample.txt_len, int(cfg["joint_attention_dim"]),
                        generator=g).to(dtype)]
    if POOLED_PROJECTIONS in record.graph.inputs:
        args.append(torch.randn(b, int(cfg["pooled_projection_dim"]), generator=g).to(dtype))
    if mask is not None:
        args.append(mask)
    args.append(torch.full((b,), 0.5, dtype=dtype))
    if has_guidance(transformer, record):
        args.append(torch.full((b,), 3.5, dtype=dtype))
    return tuple(args) + (caches.img.clone(), caches.txt.clone())


def sample_caches(record, spec, sample, axes, theta, head_dim: int):
    """The caches of the ids the family's pipelines lay out for the sample's sizes."""
    from qkrope.runtime.dual_stream import caches_from_ids, sample_ids

    txt_ids, img_ids = sample_ids(spec.ids, sample.img_shapes, sample.txt_len)
    return caches_from_ids(record.short, txt_ids, img_ids, axes_dims=axes, theta=theta,
                           head_dim=head_dim)


def prepare(record, spec, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int, base: type = CacheInputTransformer,
            mask=None, **kwargs):
    """The export plan of a dual-stream ``transformer`` (a placeholder skeleton) with its first
    ``layers`` blocks in execution order (double-stream, then single-stream; every block by
    default): ``base``'s wrapper (``kwargs``: its processors), the sample (with the text
    ``mask`` where the graph has one), the graph, the RoPE axes and theta the model was built
    with (the sidecar records them)."""
    from .transformer_export import TransformerPlan

    axes, theta, head_dim = rope_setting(transformer, record.short)
    total = sum(record.block_counts(transformer.config))
    check_layers(layers, total, " + ".join(blocks.key for blocks in record.block_lists))
    double, single = kept = record.kept_blocks(transformer.config, layers)
    wrapper = cache_input(base, transformer, record, spec, kept, rounding=rounding, **kwargs)
    caches = sample_caches(record, spec, sample, axes, theta, head_dim)
    args = sample_args(record, transformer, sample, dtype, caches, mask=mask)
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.decl(has_guidance(transformer, record)),
        axes=axes, theta=theta, rounding=wrapper.rounding, nodes=node_count(double, single),
        num_layers_exported=double + single,
        blocks=f"{record.label}: {double} of {len(transformer.transformer_blocks)} double + "
               f"{single} of {len(transformer.single_transformer_blocks)} single blocks")


def post_export(model) -> None:
    """No float64 in the traced graph (diffusers builds these models' RoPE in float64)."""
    check_no_double(model, "the dual-stream graph")


def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks (the RoPE axes: :func:`rope_setting`)."""
    return None


__all__ = ["JointRope", "joint_rope", "norm_eps", "FusedNormRoPE", "sdpa",
           "DualStreamAttnProcessor", "blocks_of", "patch_attentions",
           "node_count", "rope_setting", "has_guidance", "CacheInputTransformer", "cache_input",
           "sample_args", "sample_caches", "prepare", "post_export", "check_config"]
