"""MiniMax-H3's export hooks (export layer): the attention processor, the cache-input wrapper,
the sample inputs and the checks :func:`qkrope.export.onnx_export.export_transformer` asks for.

diffusers builds the RoPE inside the forward (``MiniMaxH3RotaryPosEmbed``: float32 angles of
every packed row's ``position_ids``). Here the angles come in as two ``[rows, 96]`` fp32 caches
(the video rows'; the text rows' then the audio rows'), which the wrapper scatters into packed
order with the same three index tensors the model scatters its rows with, and every block's
q / k RMSNorm + partial NeoX rotation is one ``qkrope::QKNormRoPE`` node (``interleaved=0``, a
96-wide cache under a 128-wide head). The token refiner's attentions (q / k normalised, not
rotated) keep diffusers' processor.
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import contract
from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.fused_qk import FusedNormRoPE, PatchedBlockList, check_cache, shared_eps
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
from qkrope.families._record import FamilyRecord

#: The modulation rows per noise level (one per stream tag: 0 video, 1 text, 2 audio).
MODALITIES = 3


class MiniMaxH3AttnProcessor:
    """Replaces ``MiniMaxH3AttnProcessor`` on every transformer block's attention: q / k
    RMSNorm and the rotation of the leading ``rotary_dim`` channels as one node;
    ``rotary_emb`` is the packed ``[rows, rotary_dim]`` cache (the wrapper's)."""

    def __init__(self, rounding: int):
        self.rounding = contract.check_rounding(rounding)
        self.fused = FusedNormRoPE(self.rounding, interleaved=False)

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        if attention_mask is not None:
            raise InputError("the exported MiniMax-H3 attention takes no attention_mask (the "
                             "model packs one unmasked document)")
        check_cache(rotary_emb, "MiniMax-H3", "rotary_emb")
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, rotary_emb)
        out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                         attn.head_dim)
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def packed_cache(img_cache, txt_cache, video_indices, audio_indices, text_indices, rows: int):
    """The ``[rows, rotary_dim]`` cache in packed order: the video rows' cache at
    ``video_indices``, the text cache's first rows at ``text_indices``, its next ones (the
    audio rows) at ``audio_indices``."""
    nv, nt, na = video_indices.shape[0], text_indices.shape[0], audio_indices.shape[0]
    cache = img_cache.new_zeros((rows, img_cache.shape[1]))
    cache = cache.index_copy(0, text_indices, txt_cache[:nt])
    cache = cache.index_copy(0, video_indices, img_cache[:nv])
    return cache.index_copy(0, audio_indices, txt_cache[nt:nt + na])


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


class MiniMaxH3CacheInputTransformer(PatchedBlockList):
    """``MiniMaxH3Transformer3DModel.forward`` with the two caches in place of
    ``position_ids`` and its RoPE module, running the first ``kept`` blocks; ``forward``'s
    arguments are the graph inputs in graph order; returns ``(sample, audio_sample)``."""

    def __init__(self, transformer: nn.Module, family: FamilyRecord, rounding: int,
                 kept: int | None = None):
        super().__init__(transformer, family, rounding, kept, blocks="transformer_blocks",
                         attention="attn", processor=MiniMaxH3AttnProcessor)

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, timestep_levels,
                timestep_indices, token_tags, video_indices, audio_indices, text_indices,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        rows = timestep_indices.shape[0]
        cache = packed_cache(img_cos_sin_cache, txt_cos_sin_cache, video_indices, audio_indices,
                             text_indices, rows)
        video = t.proj_in(hidden_states.to(_dtype_of(t.proj_in)))
        audio = t.audio_proj_in(audio_hidden_states.to(_dtype_of(t.audio_proj_in)))
        text = t.context_embedder(encoder_hidden_states.to(_dtype_of(t.context_embedder)))
        text = t.token_refiner(text)
        # zeros made in float32 and cast: an ONNX ConstantOfShape of bf16 fails onnx's checker
        x = torch.zeros((text.shape[0], rows, text.shape[-1]), dtype=torch.float32,
                        device=text.device).to(text.dtype)
        x = x.index_copy(1, text_indices, text)
        x = x.index_copy(1, video_indices, video.to(text.dtype))
        x = x.index_copy(1, audio_indices, audio.to(text.dtype))
        temb = t.time_proj(timestep_levels)
        temb = t.time_embedder(temb.to(_dtype_of(t.time_embedder)))
        adaln = timestep_indices * MODALITIES + token_tags
        for block in list(t.transformer_blocks)[:self.kept]:
            x = block(x, temb, adaln, cache)
        x = t.norm_out(x, temb, timestep_indices).to(_dtype_of(t.proj_out))
        sample = t.proj_out(x).index_select(1, video_indices)
        audio_sample = t.audio_proj_out(x).index_select(1, audio_indices)
        return sample, audio_sample


def check_supported(transformer: nn.Module) -> None:
    """One line for a model the wrapper does not reproduce."""
    rope = transformer.rope
    width = 6 * int(rope.rope_freq_dim)
    head_dim = int(transformer.config["attention_head_dim"])
    if width > head_dim:
        raise InputError(f"the MiniMax-H3 config's rope_freq_dim {rope.rope_freq_dim} rotates "
                         f"{width} channels, more than the {head_dim}-wide head")


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks and :func:`check_supported`."""
    return None


def post_export(model) -> None:
    """Nothing to check past the node count (the RoPE is float32 in diffusers)."""
    return None


def rope_setting(transformer: nn.Module) -> tuple[tuple[int, ...], float]:
    """The RoPE axes (t, h, w: ``2 * rope_freq_dim`` each) and theta of the model's RoPE."""
    f = int(transformer.config["rope_freq_dim"])
    theta = float(transformer.config["rope_theta"])
    return (2 * f,) * 3, (int(theta) if theta.is_integer() else theta)


def audio_rows(grid) -> int:
    """The audio rows of an export sample of latent grid ``(f, h, w)`` (a sample has no audio
    size of its own): ``3 f + 1``, never a traced size of another axis."""
    return 3 * int(grid[0]) + 1


def sample_args(transformer: nn.Module, grid, txt_len: int, batch: int, dtype: torch.dtype,
                seed: int = 1) -> tuple:
    """The graph inputs of a sample: a video grid ``(f, h, w)`` in patches, ``txt_len`` text
    rows, :func:`audio_rows` audio rows, packed as :func:`qkrope.families.minimax_h3.dropin
    .packed_layout` lays them out (two noise levels), random latents and text."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    from .dropin import packed_layout, stream_request

    cfg = transformer.config
    layout = packed_layout(grid, txt_len, audio_rows(grid))
    axes, theta = rope_setting(transformer)
    caches = build_rope_caches("ids-float32", stream_request(layout),
                               checked_setting("ids-float32", axes, theta))
    p = [int(v) for v in cfg["patch_size"]]
    g = torch.Generator().manual_seed(seed)
    nv, na = layout["video_indices"].shape[0], layout["audio_indices"].shape[0]
    return (torch.randn(batch, nv, int(cfg["in_channels"]) * p[0] * p[1] * p[2],
                        generator=g).to(dtype),
            torch.randn(batch, na, int(cfg["audio_in_channels"]), generator=g).to(dtype),
            torch.randn(batch, txt_len, int(cfg["text_dim"]), generator=g).to(dtype),
            torch.tensor([0.7, 0.0], dtype=torch.float32),
            layout["timestep_indices"], layout["token_tags"], layout["video_indices"],
            layout["audio_indices"], layout["text_indices"],
            caches.img.clone(), caches.txt.clone())


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export plan of ``transformer`` with its first ``layers`` blocks (every block by
    default) over the sample's grid ``(f, h, w)`` in patches (:func:`sample_args`)."""
    from qkrope.export.onnx_export import TransformerPlan
    from qkrope.export.sample import check_layers, one_grid

    check_supported(transformer)
    grid = one_grid(sample, record.short)
    if sample.txt_len < 2:
        raise InputError(f"a {record.short} export traces at least 2 text rows (torch.export "
                         f"fixes an axis of size 1). Fix: pass --txt-len 2 or more")
    cfg = transformer.config
    total = int(cfg["num_layers"])
    check_layers(layers, total, "num_layers")
    kept = record.kept_blocks(dict(cfg), layers)[0]
    wrapper = MiniMaxH3CacheInputTransformer(transformer, record, rounding, kept).eval()
    axes, theta = rope_setting(transformer)
    args = sample_args(transformer, grid, sample.txt_len, sample.batch, dtype)
    attn = transformer.transformer_blocks[0].attn
    eps = shared_eps(attn.norm_q, attn.norm_k)
    rows = int(args[4].shape[0])
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=kept, num_layers_exported=kept,
        blocks=f"{record.label}: {kept} of {total} blocks", heads=int(attn.heads),
        head_dim=int(attn.head_dim), eps=eps,
        attributes=contract.NodeAttributes(eps, False, wrapper.rounding),
        interleaved=False,
        axis_values={"audio_tokens": int(args[1].shape[1]), "packed_rows": rows,
                     "noise_levels": int(args[3].shape[0]),
                     "txt_cache_rows": int(args[10].shape[0])})
