"""Builders for the diffusers reference objects (tiny random configs, built in code)."""

from __future__ import annotations

import pytest
import torch

diffusers_qwen = pytest.importorskip(
    "diffusers.models.transformers.transformer_qwenimage",
    reason="requires diffusers (installed by the test extras: pip install -e '.[test]')")


def qwen_rope(axes_dim=(16, 56, 56), theta=10000):
    return diffusers_qwen.QwenEmbedRope(theta=theta, axes_dim=list(axes_dim), scale_rope=True)


def diffusers_freqs(img_shapes, txt_len, axes_dim=(16, 56, 56)):
    """diffusers' complex (img_freqs, txt_freqs) for one sample."""
    return qwen_rope(axes_dim)([list(img_shapes)], max_txt_seq_len=txt_len, device=torch.device("cpu"))


def qwen_attention(heads, head_dim, *, dtype=torch.float32, seed=0):
    """A diffusers Attention with the Qwen double-stream processor and random weights."""
    from diffusers.models.attention_processor import Attention

    dim = heads * head_dim
    torch.manual_seed(seed)
    attn = Attention(query_dim=dim, cross_attention_dim=None, added_kv_proj_dim=dim,
                     dim_head=head_dim, heads=heads, out_dim=dim, context_pre_only=False,
                     bias=True, processor=diffusers_qwen.QwenDoubleStreamAttnProcessor2_0(),
                     qk_norm="rms_norm", eps=1e-6)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.startswith("norm"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))  # RMSNorm weights near 1, not all 1
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return attn.to(dtype).eval()
