"""PRX's export hooks (export layer): the attention processor, the cache-input wrapper, the
sample inputs and the checks :func:`qkrope.export.onnx_export.export_transformer` asks for.

diffusers builds the RoPE inside the forward (``PRXEmbedND``: float64 angles of the image's
(row, column) ids, their cos / sin rounded to float32, as 2 x 2 rotation matrices). Here the
table comes in as the ``[rows, head_dim]`` fp32 image cache and each block's image q / k
RMSNorm + RoPE is one ``qkrope::QKNormRoPE`` node; the text keys' RMSNorm (not rotated, no
queries) stays diffusers' module. The text mask: diffusers keeps the keys of real text tokens
and every image key (``[B, 1, 1, text + image]``, True = attended); the wrapper builds the same
boolean mask from the int64 graph input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.finalize import check_no_double
from qkrope.export.fused_qk import FusedNormRoPE, PatchedBlockList, check_cache, norm_eps
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
from qkrope.families._record import FamilyRecord


class PRXAttnProcessor:
    """Replaces ``PRXAttnProcessor2_0``: ``image_rotary_emb`` is the image cache
    ``[rows, head_dim]`` and ``attention_mask`` the joint bool key mask ``[B, 1, 1, text +
    image]`` (the wrapper's)."""

    def __init__(self, rounding: int):
        self.fused = FusedNormRoPE(rounding)
        self.rounding = self.fused.rounding

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, **kwargs):
        if kwargs:
            raise InputError(f"the patched PRX attention takes no {sorted(kwargs)}")
        check_cache(image_rotary_emb, "PRX")
        heads, head_dim = attn.heads, attn.head_dim
        q, k, v = attn.img_qkv_proj(hidden_states).unflatten(-1, (3, heads, head_dim)).unbind(2)
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb)
        tk, tv = attn.txt_kv_proj(encoder_hidden_states).unflatten(
            -1, (2, heads, head_dim)).unbind(2)
        tk = attn.norm_added_k(tk)
        k, v = torch.cat([tk, k], dim=1), torch.cat([tv, v], dim=1)
        out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         attention_mask, head_dim)
        out = attn.to_out[0](out.transpose(1, 2).flatten(2, 3))
        return attn.to_out[1](out) if len(attn.to_out) > 1 else out


def check_supported(transformer: nn.Module) -> None:
    """One line for a configuration the wrapper does not reproduce."""
    cfg = transformer.config
    if cfg.get("resolution_embeds", False):
        raise InputError("the PRX config sets resolution_embeds=True (the latent's height and "
                         "width embedded into every block's modulation), which the packed "
                         "tokens of qkrope's PRX graph do not carry. Fix: run this model on "
                         "PyTorch")
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_heads"])
    axes = rope_setting(transformer)[0]
    if len(axes) != 2 or sum(axes) != head_dim:
        raise InputError(f"the PRX config's axes_dim {list(axes)} must be two widths filling "
                         f"the {head_dim}-wide head (the model rotates the whole head)")


class PRXCacheInputTransformer(PatchedBlockList):
    """``PRXTransformer2DModel.forward`` over the packed latent patches with the image cache in
    place of its RoPE module, running the first ``kept`` blocks; ``forward``'s arguments are
    the graph inputs in graph order."""

    def __init__(self, transformer: nn.Module, family: FamilyRecord, rounding: int,
                 kept: int | None = None):
        super().__init__(transformer, family, rounding, kept, blocks="blocks",
                         attention="attention", processor=PRXAttnProcessor)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep,
                img_cos_sin_cache):
        t = self.transformer
        text = t.txt_in(encoder_hidden_states)
        x = t.img_in(hidden_states)
        vec = t._compute_timestep_embedding(timestep, dtype=x.dtype)
        mask = F.pad(encoder_attention_mask.to(torch.bool), (0, x.shape[1]), value=True)
        mask = mask[:, None, None, :]
        for block in list(t.blocks)[:self.kept]:
            x = block(hidden_states=x, encoder_hidden_states=text, temb=vec,
                      image_rotary_emb=img_cos_sin_cache, attention_mask=mask)
        return t.final_layer(x, vec)


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks (the wrapper refuses what it does not carry,
    before tracing)."""
    return None


def post_export(model) -> None:
    """No float64 in the traced graph (diffusers builds the RoPE in float64)."""
    check_no_double(model, "the PRX graph")


def rope_setting(transformer: nn.Module) -> tuple[tuple[int, ...], float]:
    """The RoPE axes and theta diffusers built the model with (its position embedder's)."""
    axes = tuple(int(v) for v in transformer.pe_embedder.axes_dim)
    theta = float(transformer.pe_embedder.theta)
    return axes, (int(theta) if theta.is_integer() else theta)


def grid_ids(h: int, w: int) -> torch.Tensor:
    """The image's position ids as diffusers' ``get_image_ids`` lays them out: (row, column) of
    each patch in row-major order, float32 ``[h * w, 2]``."""
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=1).float()


def sample_cache(family: FamilyRecord, grid, axes, theta) -> torch.Tensor:
    """The image cache of one latent grid ``(h, w)`` in patches (the "ids" scheme)."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    setting = checked_setting("ids", axes, theta, rotated=family.rotated)
    h, w = (int(v) for v in grid)
    caches = build_rope_caches("ids", {"img_ids": grid_ids(h, w),
                                       "txt_ids": torch.zeros(1, len(axes))}, setting)
    return caches.img.clone()


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export plan of ``transformer`` with its first ``layers`` blocks (every block by
    default) over the sample's first grid ``(1, h, w)`` in patches: random packed patches,
    text with a padded last item, timestep 0.5 (float32) and the image cache."""
    from qkrope.export.onnx_export import TransformerPlan

    from qkrope.export.sample import check_layers, one_image

    check_supported(transformer)
    h, w = one_image(sample, record.short)
    cfg = transformer.config
    axes, theta = rope_setting(transformer)
    total = int(cfg["depth"])
    check_layers(layers, total, "depth")
    kept = record.kept_blocks(dict(cfg), layers)[0]
    wrapper = PRXCacheInputTransformer(transformer, record, rounding, kept).eval()
    g = torch.Generator().manual_seed(1)
    b, txt, p = sample.batch, sample.txt_len, int(cfg["patch_size"])
    mask = torch.ones(b, txt, dtype=torch.int64)
    mask[-1, txt // 2:] = 0  # a padded item
    args = (torch.randn(b, h * w, int(cfg["in_channels"]) * p * p, generator=g).to(dtype),
            torch.randn(b, txt, int(cfg["context_in_dim"]), generator=g).to(dtype),
            mask, torch.full((b,), 0.5, dtype=torch.float32),
            sample_cache(record, (h, w), axes, theta))
    block = transformer.blocks[0].attention
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=kept, num_layers_exported=kept,
        blocks=f"{record.label}: {kept} of {total} blocks", heads=int(block.heads),
        head_dim=int(block.head_dim), eps=norm_eps(block.norm_q, "norm_q"))
