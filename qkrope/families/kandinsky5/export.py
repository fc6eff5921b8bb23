"""Kandinsky 5's export hooks (export layer): the attention processors, the cache-input
wrapper, the sample inputs and the checks :func:`qkrope.export.onnx_export.export_transformer`
asks for.

diffusers builds both RoPEs inside the forward (``Kandinsky5RoPE1D`` over the text,
``Kandinsky5RoPE3D`` over the latent's grid, its angles divided by ``scale_factor``). Here they
come in as two ``[rows, head_dim]`` fp32 caches built by the "divided_grid" scheme, and each
self-attention's q/k RMSNorm + interleaved RoPE is one ``qkrope::QKNormRoPE`` node: one per text
block (text cache), one per visual block (image cache). The visual blocks' cross-attention
(visual queries, text keys, no RoPE) keeps diffusers' two RMSNorms unfused (the node normalises
a q/k pair of one sequence).

diffusers rounds the rotated q and k to bfloat16 in every dtype: in bf16 that is the node's
``ROUNDING_TWO_STEPS``; in fp32 and fp16 the processor adds the same round trip (a Cast to bf16
and back) after the node. In fp32 that is bit for bit diffusers' order; in fp16 the node has
already rounded the rotated value to fp16, so the bf16 rounding is a double rounding: within
one bf16 step of diffusers' (docs/spec.md section 3.5), equal where the fp16 value is no bf16
tie.
Sparse ("nabla") attention is refused by config.
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import contract
from qkrope.errors import InputError
from qkrope.export.finalize import check_no_double
from qkrope.export.attention import _attention
from qkrope.export.ops import qk_norm_rope
from qkrope.export.sample import one_grid
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
from qkrope.families._record import FamilyRecord

from . import EPS, setting_fields

def _eps(norm: nn.Module, where: str) -> float:
    if not isinstance(norm, nn.RMSNorm) or norm.weight is None:
        raise InputError(f"{where} is {type(norm).__name__}, not an RMSNorm with a weight, "
                         f"which the QKNormRoPE node is; not a standard Kandinsky 5 model")
    # eps None: torch takes the machine epsilon of the normalised values' dtype (float32 here)
    return EPS if norm.eps is None else float(norm.eps)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1))


def _attend(q, k, v) -> torch.Tensor:
    """softmax attention over ``[B, S, H, D]``; ``[B, S, H * D]`` (diffusers' dispatch + flatten)."""
    out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, q.shape[-1])
    return out.transpose(1, 2).flatten(-2, -1)


def _unfused(attn, q, k, cache):
    """q and k normalised and rotated as diffusers does (float32 norm rounded to q's dtype,
    float32 rotation of the interleaved pairs rounded to bfloat16, then to q's dtype), from the
    node's cache rows."""
    half = cache.shape[1] // 2
    rows = cache[:q.shape[1]]
    cos, sin = rows[:, None, :half], rows[:, None, half:]  # [S, 1, D/2]
    out = []
    for x, norm in ((q, attn.query_norm), (k, attn.key_norm)):
        y = norm(x.float()).type_as(x).float().unflatten(-1, (-1, 2))
        even, odd = y[..., 0], y[..., 1]
        turned = torch.stack([cos * even - sin * odd, sin * even + cos * odd], dim=-1)
        out.append(turned.flatten(-2).to(torch.bfloat16).type_as(x))
    return out


class Kandinsky5Processor:
    """Replaces ``Kandinsky5AttnProcessor`` on every attention: a self-attention
    (``rotary_emb`` = its ``[rows, head_dim]`` cache) as one fused node, a cross-attention
    (``encoder_hidden_states`` given, no RoPE) with diffusers' norms unfused."""

    def __init__(self, rounding: int, *, fused: bool = True):
        self.rounding = contract.check_rounding(rounding)
        self.fused = fused

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None,
                 sparse_params=None):
        if sparse_params is not None:
            raise InputError("sparse_params (nabla sparse attention) is not in the exported "
                             "Kandinsky 5 graph. Fix: export a model with attention_type "
                             "'regular'")
        q = _heads(attn.to_query(hidden_states), attn.num_heads)
        if encoder_hidden_states is not None:  # the cross-attention: diffusers' norms as they are
            if rotary_emb is not None:
                raise InputError("the Kandinsky 5 cross-attention takes no RoPE")
            k = _heads(attn.to_key(encoder_hidden_states), attn.num_heads)
            v = _heads(attn.to_value(encoder_hidden_states), attn.num_heads)
            q = attn.query_norm(q.float()).type_as(q)
            k = attn.key_norm(k.float()).type_as(k)
            return attn.out_layer(_attend(q, k, v))
        if not isinstance(rotary_emb, torch.Tensor) or rotary_emb.dim() != 2:
            raise InputError("the patched Kandinsky 5 self-attention needs rotary_emb = the "
                             "[rows, head_dim] cache; run it through the cache-input wrapper")
        k = _heads(attn.to_key(hidden_states), attn.num_heads)
        v = _heads(attn.to_value(hidden_states), attn.num_heads)
        eps = _eps(attn.query_norm, "query_norm")
        if eps != _eps(attn.key_norm, "key_norm"):
            raise InputError(f"query_norm's eps {eps} and key_norm's {attn.key_norm.eps} "
                             f"differ; one QKNormRoPE node has one epsilon")
        if not self.fused:  # diffusers' norm and rotation from the same cache (the tests' graph)
            return attn.out_layer(_attend(*_unfused(attn, q, k, rotary_emb), v))
        return attn.out_layer(_attend(*fused(attn, q, k, rotary_emb, eps, self.rounding), v))


def fused(attn, q, k, cache, eps: float, rounding: int):
    """The self-attention's q and k as the export computes them: one node (``rounding``), then
    diffusers' bf16 round trip of the rotated values where q is not bf16 (docs/spec.md 3.5)."""
    attrs = contract.NodeAttributes(eps, True, rounding)
    q, k = qk_norm_rope(q, k, attn.query_norm.weight, attn.key_norm.weight, cache,
                        **attrs.as_kwargs())
    if q.dtype != torch.bfloat16:  # diffusers' rotated values pass through bfloat16
        q, k = (x.to(torch.bfloat16).to(q.dtype) for x in (q, k))
    return q, k


def check_supported(transformer: nn.Module) -> None:
    """One line for a configuration the graph does not carry."""
    cfg = transformer.config
    if cfg.get("attention_type", "regular") != "regular":
        raise InputError(f"the Kandinsky 5 config sets attention_type="
                         f"{cfg.get('attention_type')!r} (nabla sparse attention), which "
                         f"qkrope's export does not carry. Fix: export with attention_type "
                         f"'regular'")
    axes = tuple(int(v) for v in cfg["axes_dims"])
    if len(axes) != 3 or any(d % 2 for d in axes):
        raise InputError(f"axes_dims {list(axes)} must be three even widths (frames, rows, "
                         f"columns)")


def patch_transformer(transformer: nn.Module, *, rounding: int, fused: bool = True
                      ) -> nn.Module:
    """Every attention of the text and visual blocks through :class:`Kandinsky5Processor`
    (``fused=False``: diffusers' norm and rotation in place of the node)."""
    check_supported(transformer)
    processor = Kandinsky5Processor(rounding, fused=fused)
    for block in transformer.text_transformer_blocks:
        block.self_attention.set_processor(processor)
    for block in transformer.visual_transformer_blocks:
        block.self_attention.set_processor(processor)
        block.cross_attention.set_processor(processor)
    return transformer


class Kandinsky5CacheInputTransformer(nn.Module):
    """``Kandinsky5Transformer3DModel.forward`` (regular attention) with the two caches in place
    of its RoPE modules, running the first ``kept`` (text, visual) blocks; ``forward``'s
    arguments are the graph inputs in graph order: ``latent [B, C, F, H, W]`` (channels first),
    ``encoder_hidden_states [B, L, in_text_dim]``, ``timestep [B]``, ``pooled_projections [B,
    in_text_dim2]``, ``img_cos_sin_cache [F/pt * H/ph * W/pw, head_dim]``, ``txt_cos_sin_cache
    [L, head_dim]`` -> ``latent_sample [B, out_visual_dim, F, H, W]``."""

    def __init__(self, transformer: nn.Module, *, rounding: int,
                 kept: tuple[int, ...] | None = None, fused: bool = True):
        super().__init__()
        patch_transformer(transformer, rounding=rounding, fused=fused)
        self.transformer = transformer
        self.rounding = rounding
        self.text_kept, self.visual_kept = tuple(kept) if kept is not None else (
            len(transformer.text_transformer_blocks), len(transformer.visual_transformer_blocks))

    def forward(self, latent, encoder_hidden_states, timestep, pooled_projections,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        text = t.text_embeddings(encoder_hidden_states)
        time_embed = t.time_embeddings(timestep)
        time_embed = time_embed + t.pooled_text_embeddings(pooled_projections)
        visual = t.visual_embeddings(latent.permute(0, 2, 3, 4, 1))  # channels last
        for block in t.text_transformer_blocks[:self.text_kept]:
            text = block(text, time_embed, txt_cos_sin_cache)
        shape = visual.shape[:-1]
        visual = visual.flatten(1, 3)
        for block in t.visual_transformer_blocks[:self.visual_kept]:
            visual = block(visual, text, time_embed, img_cos_sin_cache, None)
        visual = visual.reshape(*shape, visual.shape[-1])
        return t.out_layer(visual, text, time_embed).permute(0, 4, 1, 2, 3)


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """Nothing to check before the model is built: diffusers' checks and
    :func:`check_supported` run on it."""
    return None


def post_export(model) -> None:
    """No float64 anywhere in the graph."""
    check_no_double(model, "the Kandinsky 5 graph")


def model_setting_of(transformer: nn.Module):
    """The RoPE setting of a loaded model (the divided_grid scheme's)."""
    from qkrope.runtime.caches import checked_setting

    cfg = dict(transformer.config)
    return checked_setting("divided_grid", tuple(int(v) for v in cfg["axes_dims"]),
                           float(transformer.visual_rope_embeddings.max_period),
                           **setting_fields(cfg))


def sample_caches(transformer: nn.Module, grid, txt_len: int, scale=(1.0, 2.0, 2.0)) -> tuple:
    """The caches of one token grid ``(f, h, w)`` and a text length, as torch tensors."""
    from qkrope.runtime.caches import build_rope_caches

    caches = build_rope_caches("divided_grid", {"grid": tuple(grid), "scale": tuple(scale),
                                                "txt_seq_len": int(txt_len)},
                               model_setting_of(transformer))
    return caches.img.clone(), caches.txt.clone()


def sample_args(transformer: nn.Module, sample, dtype: torch.dtype) -> tuple:
    """The traced sample: a random channels-first latent of the first grid (tokens times the
    patch), text, timesteps, pooled text and the grid's caches."""
    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    f, h, w = (int(v) for v in sample.img_shapes[0])
    pt, ph, pw = (int(p) for p in cfg["patch_size"])
    channels = 2 * int(cfg["in_visual_dim"]) + 1 if cfg.get("visual_cond") \
        else int(cfg["in_visual_dim"])
    b = sample.batch
    latent = torch.randn(b, channels, f * pt, h * ph, w * pw, generator=g).to(dtype)
    text = torch.randn(b, sample.txt_len, int(cfg["in_text_dim"]), generator=g).to(dtype)
    timestep = torch.full((b,), 500.0, dtype=dtype)
    pooled = torch.randn(b, int(cfg["in_text_dim2"]), generator=g).to(dtype)
    img, txt = sample_caches(transformer, (f, h, w), sample.txt_len)
    return latent, text, timestep, pooled, img, txt


def node_count(kept: tuple[int, ...]) -> int:
    """QKNormRoPE nodes of the kept (text, visual) blocks: one per block, none when no visual
    block is kept (the output layer reads the latent alone, so the text blocks' values reach
    no output and the graph drops them: ``--layers`` within the text blocks)."""
    text, visual = (tuple(kept) + (0,))[:2]
    return text + visual if visual else 0


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int, fused: bool = True):
    """The export of ``transformer`` with its first ``layers`` blocks in execution order (text
    blocks, then visual blocks; every block by default); ``fused=False``: the same graph with
    diffusers' norm and rotation in place of the nodes (the tests' reference graph)."""
    from qkrope.export.onnx_export import TransformerPlan

    one_grid(sample, record.short)
    cfg = dict(transformer.config)
    counts = record.block_counts(cfg)
    kept = record.kept_blocks(cfg, layers)
    wrapper = Kandinsky5CacheInputTransformer(transformer, rounding=rounding, kept=kept,
                                              fused=fused).eval()
    args = sample_args(transformer, sample, dtype)
    attn = transformer.visual_transformer_blocks[0].self_attention
    axes = tuple(int(v) for v in cfg["axes_dims"])
    blocks = " + ".join(f"{k} of {n} {kind}" for k, n, kind in zip(kept, counts,
                                                                    ("text", "visual")))
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes,
        theta=int(transformer.visual_rope_embeddings.max_period), rounding=rounding,
        nodes=node_count(kept) if fused else 0, num_layers_exported=sum(kept),
        blocks=f"{record.label}: {blocks} blocks", heads=int(attn.num_heads),
        head_dim=sum(axes), eps=_eps(attn.query_norm, "query_norm"), interleaved=True)
