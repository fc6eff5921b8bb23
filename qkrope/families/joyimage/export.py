"""JoyImage Edit's export hooks (export layer): the attention processor, the cache-input
wrapper, the sample inputs and the checks :func:`qkrope.export.onnx_export.export_transformer`
asks for.

diffusers builds the RoPE tables inside the forward (``get_rotary_pos_embed``: float32
frequencies, cos/sin over the latent's token grid). Here they come in as two ``[rows,
rotary_dim]`` fp32 caches built by the "grid" scheme (uncentred), and each block's attention is
two ``qkrope::QKNormRoPE`` nodes: the latent's q/k (``img_attn_q_norm`` / ``img_attn_k_norm``,
the image cache) and the text's (``txt_attn_q_norm`` / ``txt_attn_k_norm``, the text cache
of identity rows: normalised, not rotated). The joint attention over ``[latent; text]`` and
everything else is diffusers' own modules.

Refused in one line: ``rope_type`` other than "rope" (mrope rotates the text from the grid's
largest index on), RoPE axes that do not add up to the head.
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import contract
from qkrope.errors import InputError
from qkrope.export.finalize import check_no_double
from qkrope.export.attention import _attention
from qkrope.export.conv import patch_conv
from qkrope.export.ops import qk_norm_rope
from qkrope.export.sample import one_grid
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
from qkrope.families._record import FamilyRecord


def _heads(qkv: torch.Tensor, heads: int):
    """A fused QKV projection's output ``[B, S, 3 * H * D]`` as q, k, v ``[B, S, H, D]``."""
    return (t.unflatten(-1, (heads, -1)) for t in qkv.chunk(3, dim=-1))


def norm_eps(norm: nn.Module, dtype: torch.dtype) -> float:
    """The eps ``torch.nn.RMSNorm`` uses (None: the machine epsilon of the input's dtype)."""
    return float(norm.eps) if norm.eps is not None else float(torch.finfo(dtype).eps)


class JoyImageFusedAttnProcessor:
    """Replaces ``JoyImageAttnProcessor``: q/k norm + RoPE of each stream as one fused node,
    ``image_rotary_emb`` = (image cache, text cache)."""

    def __init__(self, rounding: int):
        self.rounding = contract.check_rounding(rounding)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, image_rotary_emb=None,
                 **kwargs):
        if kwargs:
            raise InputError(f"the exported JoyImage attention takes no {sorted(kwargs)}")
        if not (isinstance(image_rotary_emb, tuple) and len(image_rotary_emb) == 2
                and all(isinstance(c, torch.Tensor) and c.dim() == 2 for c in image_rotary_emb)):
            raise InputError("the patched JoyImage attention needs image_rotary_emb = (image "
                             "cache, text cache), [rows, rotary_dim] each; run it through "
                             "JoyImageCacheInputTransformer")
        img_cache, txt_cache = image_rotary_emb
        heads = attn.heads
        iq, ik, iv = _heads(attn.img_attn_qkv(hidden_states), heads)
        tq, tk, tv = _heads(attn.txt_attn_qkv(encoder_hidden_states), heads)
        attrs = contract.NodeAttributes(norm_eps(attn.img_attn_q_norm, iq.dtype), True,
                                        self.rounding)
        iq, ik = qk_norm_rope(iq, ik, attn.img_attn_q_norm.weight, attn.img_attn_k_norm.weight,
                              img_cache, **attrs.as_kwargs())
        tq, tk = qk_norm_rope(tq, tk, attn.txt_attn_q_norm.weight, attn.txt_attn_k_norm.weight,
                              txt_cache, **attrs.as_kwargs())
        q, k, v = (torch.cat(pair, dim=1).transpose(1, 2)
                   for pair in ((iq, tq), (ik, tk), (iv, tv)))
        out = _attention(q, k, v, None, int(q.shape[-1]))
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        s_img = hidden_states.shape[1]
        return attn.img_attn_proj(out[:, :s_img]), attn.txt_attn_proj(out[:, s_img:])


def rope_setting(transformer: nn.Module) -> tuple[tuple[int, ...], int | float]:
    """The RoPE axes and theta the model was built with (its config, diffusers' defaults)."""
    cfg = transformer.config
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    axes = tuple(int(v) for v in (cfg.get("rope_dim_list") or [head_dim // 3] * 3))
    theta = float(cfg.get("theta", 256))
    return axes, (int(theta) if theta.is_integer() else theta)


def check_supported(transformer: nn.Module) -> None:
    """Refuse, in one line, configurations the wrapper does not replay."""
    cfg = transformer.config
    if cfg.get("rope_type", "rope") != "rope":
        raise InputError(f"the diffusers config sets rope_type {cfg.get('rope_type')!r}: "
                         f"JoyImage's mrope rotates the text after the latent grid, which this "
                         f"export does not carry (text rows are identity). Fix: export a model "
                         f"with rope_type 'rope'")
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    axes, _ = rope_setting(transformer)
    if len(axes) != 3 or sum(axes) != head_dim or any(a % 2 for a in axes):
        raise InputError(f"rope_dim_list {list(axes)}: the RoPE axes must be three even widths "
                         f"adding up to the head ({head_dim})")


class JoyImageCacheInputTransformer(nn.Module):
    """``JoyImageEditTransformer3DModel.forward`` (a 5-D latent) whose arguments are the graph
    inputs (:data:`qkrope.families.joyimage.JOYIMAGE_TRANSFORMER`): ``latent [B, C, F, H, W]``,
    ``timestep [B]``, ``encoder_hidden_states [B, S_txt, text_dim]``, ``img_cos_sin_cache`` and
    ``txt_cos_sin_cache`` -> ``latent_sample [B, out_channels, F, H, W]``, running the first
    ``kept`` blocks (every block by default), then the whole model's ``norm_out`` and
    ``proj_out``."""

    def __init__(self, transformer: nn.Module, *, rounding: int, kept: int | None = None):
        super().__init__()
        check_supported(transformer)
        processor = JoyImageFusedAttnProcessor(rounding)
        for block in transformer.double_blocks:
            block.attn.set_processor(processor)
        self.transformer = transformer
        self.rounding = processor.rounding
        self.kept = len(transformer.double_blocks) if kept is None else int(kept)

    def forward(self, latent, timestep, encoder_hidden_states, img_cos_sin_cache,
                txt_cos_sin_cache):
        t = self.transformer
        batch, _, frames, height, width = latent.shape
        p_t, p_h, p_w = (int(p) for p in t.config.patch_size)
        img = patch_conv(t.img_in, latent).flatten(2).transpose(1, 2)
        _, vec, txt = t.condition_embedder(timestep, encoder_hidden_states)
        vec = vec.unflatten(1, (6, -1))  # time_proj_dim is 6 x hidden_size
        rope = (img_cos_sin_cache, txt_cos_sin_cache)
        for block in t.double_blocks[:self.kept]:
            img, txt = block(hidden_states=img, encoder_hidden_states=txt, temb=vec,
                             image_rotary_emb=rope)
        img = t.proj_out(t.norm_out(img))
        # diffusers' unpatchify: tokens (f, h, w) x (pt, ph, pw, c) -> [B, C, F, H, W]
        img = img.reshape(batch, frames // p_t, height // p_h, width // p_w, p_t, p_h, p_w, -1)
        img = img.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return img.flatten(6, 7).flatten(4, 5).flatten(2, 3)


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks and :func:`check_supported` (before
    tracing)."""
    return None


def sample_caches(record: FamilyRecord, grid, txt_len: int, axes, theta):
    """The caches of one latent grid ``(f, h, w)`` in tokens and ``txt_len`` text tokens (the
    "grid" scheme, uncentred, text rows identity), as torch tensors."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    setting = checked_setting("grid", axes, theta, max_positions=record.max_positions,
                              scale_rope=record.scale_rope, rotated=record.rotated)
    caches = build_rope_caches("grid", {"img_shapes": [tuple(grid)], "txt_seq_len": txt_len},
                               setting)
    return caches.img.clone(), caches.txt.clone()


def sample_args(record: FamilyRecord, transformer: nn.Module, *, batch: int, grid,
                txt_len: int, dtype: torch.dtype) -> tuple:
    """The traced sample: a random latent of ``grid`` (tokens times the patch), a timestep,
    random text and the grid's caches."""
    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    p_t, p_h, p_w = (int(p) for p in cfg["patch_size"])
    f, h, w = (int(v) for v in grid)
    latent = torch.randn(batch, int(cfg["in_channels"]), f * p_t, h * p_h, w * p_w,
                         generator=g).to(dtype)
    timestep = torch.full((batch,), 500.0, dtype=dtype)
    text = torch.randn(batch, txt_len, int(cfg["text_dim"]), generator=g).to(dtype)
    axes, theta = rope_setting(transformer)
    img, txt = sample_caches(record, (f, h, w), txt_len, axes, theta)
    return latent, timestep, text, img, txt


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` with its first ``layers`` blocks (every block by
    default): two nodes per kept block. The sample's one image shape is the latent's token
    grid; one frame is traced with two (torch.export fixes an axis traced at size 1)."""
    from qkrope.export.onnx_export import TransformerPlan

    one_grid(sample, record.short)
    cfg = dict(transformer.config)
    (kept,) = record.kept_blocks(cfg, layers)
    wrapper = JoyImageCacheInputTransformer(transformer, rounding=rounding, kept=kept).eval()
    args = sample_args(record, transformer, batch=sample.batch, grid=sample.img_shapes[0],
                       txt_len=sample.txt_len, dtype=dtype)
    axes, theta = rope_setting(transformer)
    n = len(transformer.double_blocks)
    norm = transformer.double_blocks[0].attn.img_attn_q_norm
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=2 * kept, num_layers_exported=kept,
        blocks=f"{record.label}: {kept} of {n} blocks", eps=norm_eps(norm, dtype),
        heads=int(cfg["num_attention_heads"]),
        head_dim=int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def post_export(model) -> None:
    """No float64 anywhere in the graph (diffusers' RoPE is not in it)."""
    check_no_double(model, "the JoyImage graph")
