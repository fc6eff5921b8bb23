"""Ideogram 4's export hooks (export layer): the attention processor, the cache-input wrapper,
the sample inputs and the checks :func:`qkrope.export.onnx_export.export_transformer` asks for.

diffusers builds the RoPE inside the forward (``Ideogram4MRoPE`` over ``position_ids``); here
the caches come in as graph inputs (the text region's and the image's ``[rows, head_dim]``
float32 rows, joined ``[text; image]`` in the graph) and each block's q / k RMSNorm + RoPE is
one ``qkrope::QKNormRoPE`` node (NeoX pairing over the whole head). diffusers' packed sequence
is rebuilt from the two regions: the text features masked and projected, the image latents
projected, each plus its indicator embedding; the block-diagonal mask is the pipeline's
(padding segment -1, text and image segment 1) from the int64 text mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.fused_qk import FusedNormRoPE, PatchedBlockList, check_cache, norm_eps
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
from qkrope.families._record import FamilyRecord
from qkrope.families.ideogram4 import PAIRS


class Ideogram4AttnProcessor:
    """Replaces diffusers' ``Ideogram4AttnProcessor``: ``image_rotary_emb`` is the joined cache
    ``[rows, head_dim]`` and ``attention_mask`` the bool ``[B, 1, L, L]`` segment mask."""

    def __init__(self, rounding: int):
        self.fused = FusedNormRoPE(rounding, interleaved=False)  # NeoX halves
        self.rounding = self.fused.rounding

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None,
                 **kwargs):
        if kwargs:
            raise InputError(f"the patched Ideogram 4 attention takes no {sorted(kwargs)}")
        check_cache(image_rotary_emb, "Ideogram 4")
        shape = (attn.num_heads, attn.head_dim)
        q = attn.to_q(hidden_states).unflatten(-1, shape)
        k = attn.to_k(hidden_states).unflatten(-1, shape)
        v = attn.to_v(hidden_states).unflatten(-1, shape)
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb)
        out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         attention_mask, attn.head_dim)
        return attn.to_out[0](out.transpose(1, 2).flatten(2, 3))


def check_supported(transformer: nn.Module) -> None:
    """One line for a configuration the wrapper does not reproduce."""
    cfg = transformer.config
    head_dim = int(cfg["attention_head_dim"])
    if head_dim != 2 * PAIRS:
        raise InputError(f"the Ideogram 4 config's attention_head_dim is {head_dim}; the export "
                         f"serves diffusers' {2 * PAIRS} (the sidecar records its cache as "
                         f"{PAIRS} one-pair axes). Fix: run this model on PyTorch")
    section = tuple(int(v) for v in cfg["mrope_section"])
    if len(section) != 3 or any(3 * s > head_dim // 2 + 2 for s in section[1:]):
        raise InputError(f"the Ideogram 4 config's mrope_section {list(section)} must be three "
                         f"counts whose interleaved frequencies fit the {head_dim // 2} pairs")


class Ideogram4CacheInputTransformer(PatchedBlockList):
    """``Ideogram4Transformer2DModel.forward`` over the two regions of the pipeline's packed
    sequence (the text region ``[left padding][text]`` and the image), with the caches in place
    of its RoPE module and the segment mask from the text mask, running the first ``kept``
    blocks; ``forward``'s arguments are the graph inputs in graph order; it returns the image
    rows of the prediction."""

    def __init__(self, transformer: nn.Module, family: FamilyRecord, rounding: int,
                 kept: int | None = None):
        super().__init__(transformer, family, rounding, kept, blocks="layers",
                         attention="attention", processor=Ideogram4AttnProcessor)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        dtype = hidden_states.dtype
        txt, img = encoder_hidden_states.shape[1], hidden_states.shape[1]
        real = encoder_attention_mask != 0
        keep = real.to(dtype).unsqueeze(-1)
        text = t.llm_cond_proj(t.llm_cond_norm(encoder_hidden_states * keep)) * keep
        image = t.input_proj(hidden_states)
        indicator = t.embed_image_indicator.weight
        x = torch.cat([text + indicator[0], image + indicator[1]], dim=1)
        # the pipeline passes the timestep in the model's dtype; the embedding rounds to it
        t_cond = t.t_embedding(timestep.to(dtype)).unsqueeze(1)
        adaln_input = F.silu(t.adaln_proj(t_cond))
        cache = torch.cat([txt_cos_sin_cache[:txt], img_cos_sin_cache[:img]], dim=0)
        # the pipeline's segments: padding -1, text and image 1 (each token sees its own)
        segment = torch.cat([torch.where(real, 1, -1),
                             torch.ones_like(real[:, :1], dtype=torch.int64).expand(-1, img)],
                            dim=1)
        mask = (segment.unsqueeze(2) == segment.unsqueeze(1)).unsqueeze(1)
        for block in list(t.layers)[:self.kept]:
            x = block(x, mask, cache, adaln_input)
        return t.final_layer(x, conditioning=adaln_input)[:, txt:]


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks (the wrapper refuses what it does not carry,
    before tracing)."""
    return None


def post_export(model) -> None:
    """Nothing past the generic checks (diffusers' RoPE is float32: no DOUBLE to look for)."""


def rope_setting(transformer: nn.Module) -> tuple[tuple[int, ...], float]:
    """The cache's "axes" (one pair each, ``head_dim / 2`` of them) and the config's theta (the
    sidecar's record; a one-pair axis' frequency is 1 whatever theta is)."""
    cfg = transformer.config
    theta = float(cfg["rope_theta"])
    return (2,) * (int(cfg["attention_head_dim"]) // 2), (int(theta) if theta.is_integer()
                                                          else theta)


def sample_cache(family: FamilyRecord, transformer: nn.Module, grid, txt_len: int):
    """``(img, txt)`` caches of a sample: an ``(h, w)`` patch grid and ``txt_len`` text-region
    tokens laid out as :func:`qkrope.families.ideogram4.dropin.sample_request` lays them out."""
    from qkrope.families.ideogram4.dropin import layout_request
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    axes, theta = rope_setting(transformer)
    setting = checked_setting("ids", axes, theta, rotated=family.rotated)
    h, w = (int(v) for v in grid)
    request = layout_request(dict(transformer.config), h, w, int(txt_len))
    caches = build_rope_caches("ids", request, setting)
    return caches.img.clone(), caches.txt.clone()


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export plan of ``transformer`` with its first ``layers`` blocks (every block by
    default) over the sample's first grid ``(1, h, w)`` in patches: random image latents, a
    text region whose first third is left padding (mask 0) in every item, timestep 0.5 and the
    two caches."""
    from qkrope.export.onnx_export import TransformerPlan

    from qkrope.export.sample import check_layers, one_image

    check_supported(transformer)
    h, w = one_image(sample, record.short)
    cfg = transformer.config
    axes, theta = rope_setting(transformer)
    total = int(cfg["num_layers"])
    check_layers(layers, total, "num_layers")
    kept = record.kept_blocks(dict(cfg), layers)[0]
    wrapper = Ideogram4CacheInputTransformer(transformer, record, rounding, kept).eval()
    g = torch.Generator().manual_seed(1)
    b, txt = sample.batch, max(int(sample.txt_len), 2)
    mask = torch.ones(b, txt, dtype=torch.int64)
    mask[:, : txt // 3] = 0  # left padding, as the pipeline lays a shorter prompt out
    img_cache, txt_cache = sample_cache(record, transformer, (h, w), txt)
    args = (torch.randn(b, h * w, int(cfg["in_channels"]), generator=g).to(dtype),
            torch.randn(b, txt, int(cfg["llm_features_dim"]), generator=g).to(dtype),
            mask, torch.full((b,), 0.5, dtype=torch.float32), img_cache, txt_cache)
    block = transformer.layers[0].attention
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=kept, num_layers_exported=kept,
        blocks=f"{record.label}: {kept} of {total} blocks", heads=int(block.num_heads),
        head_dim=int(block.head_dim), eps=norm_eps(block.norm_q, "norm_q"))
