"""rounding=2 (contract.ROUNDING_TWO_STEPS) vs diffusers' own FLUX attention, bit for bit in bf16 and
fp16: the q and k that FluxAttnProcessor (FLUX.1 double-stream block) and
Flux2ParallelSelfAttnProcessor (FLUX.2 single-stream block) hand to the attention after
torch.nn.RMSNorm and diffusers' apply_rotary_emb, captured at dispatch_attention_fn, against the
reference (and the torch op) run on the same projections with the caches taken from diffusers'
own pos_embed. Tiny modules built in code (2 heads x 128, FLUX's full interleaved rotary), random
norm weights, nothing downloaded. The other two modes are shown to differ (so the test can fail)."""

from __future__ import annotations

import pytest
import torch

from diffusers.models.transformers import transformer_flux, transformer_flux2

from qkrope import contract
from qkrope.export import qk_norm_rope, qk_norm_rope_reference

HEADS, HEAD_DIM = 2, 128
DIM = HEADS * HEAD_DIM
EPS = 1e-6


def _cache(freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers' (cos, sin), each [S, D] with every value repeated for a pair, as the node's
    [S, D] cache (cos half, sin half): one value per pair."""
    cos, sin = freqs
    return torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=-1).float().contiguous()


def _randomise_norms(module: torch.nn.Module, gen: torch.Generator) -> None:
    for m in module.modules():
        if isinstance(m, torch.nn.RMSNorm):
            m.weight.data.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen))


def _captured_qk(module, monkeypatch, target, **call):
    """Run the module; return the (query, key) its processor passed to dispatch_attention_fn."""
    seen = []

    def spy(query, key, value, **kw):
        seen.append((query.clone(), key.clone()))
        return torch.zeros_like(query)

    monkeypatch.setattr(target, "dispatch_attention_fn", spy)
    with torch.no_grad():
        module(**call)
    (qk,) = seen
    return qk


def _ids(txt: int, h: int, w: int, axes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Text ids at zero (FLUX.1) or with the last axis counting (FLUX.2), image ids (., row, col)."""
    txt_ids = torch.zeros(txt, axes)
    if axes == 4:
        txt_ids[:, 3] = torch.arange(txt)
    img = torch.zeros(h, w, axes)
    img[..., 1] = torch.arange(h)[:, None]
    img[..., 2] = torch.arange(w)[None, :]
    return txt_ids, img.reshape(h * w, axes)


def _modes_differ(x, w, cache, dtype, got):
    """The check can fail: the other two modes give other bits on these inputs."""
    for other in (contract.ROUNDING_ONE, contract.ROUNDING_EACH_STEP):
        out, _ = qk_norm_rope_reference(x, x, w, w, cache, eps=EPS, rounding=other)
        assert not torch.equal(out, got), (dtype, other)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flux1_double_block_norm_rope_is_bit_exact(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    attn = transformer_flux.FluxAttention(query_dim=DIM, heads=HEADS, dim_head=HEAD_DIM,
                                          added_kv_proj_dim=DIM, eps=EPS, bias=True)
    _randomise_norms(attn, gen)
    attn = attn.to(dtype).eval()
    txt, h, w = 5, 4, 6
    hs = torch.randn(2, h * w, DIM, generator=gen).to(dtype)
    ehs = torch.randn(2, txt, DIM, generator=gen).to(dtype)
    txt_ids, img_ids = _ids(txt, h, w, 3)
    freqs = transformer_flux.FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(
        torch.cat([txt_ids, img_ids]))
    q_ref, k_ref = _captured_qk(attn, monkeypatch, transformer_flux, hidden_states=hs,
                                encoder_hidden_states=ehs, image_rotary_emb=freqs)
    cache = _cache(freqs)
    with torch.no_grad():
        xq = attn.to_q(hs).unflatten(-1, (HEADS, HEAD_DIM))
        xk = attn.to_k(hs).unflatten(-1, (HEADS, HEAD_DIM))
        eq = attn.add_q_proj(ehs).unflatten(-1, (HEADS, HEAD_DIM))
        ek = attn.add_k_proj(ehs).unflatten(-1, (HEADS, HEAD_DIM))
        # the exporter's two nodes of a double block: image with norm_q/norm_k and the image
        # rows of the cache, text with norm_added_q/norm_added_k and the text rows
        img_q, img_k = qk_norm_rope(xq, xk, attn.norm_q.weight, attn.norm_k.weight,
                                    cache[txt:].contiguous(), eps=EPS, rounding=contract.ROUNDING_TWO_STEPS)
        txt_q, txt_k = qk_norm_rope(eq, ek, attn.norm_added_q.weight, attn.norm_added_k.weight,
                                    cache[:txt].contiguous(), eps=EPS,
                                    rounding=contract.ROUNDING_TWO_STEPS)
    assert q_ref.dtype == dtype
    assert torch.equal(torch.cat([txt_q, img_q], 1), q_ref)
    assert torch.equal(torch.cat([txt_k, img_k], 1), k_ref)
    _modes_differ(xq, attn.norm_q.weight, cache[txt:].contiguous(), dtype, img_q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flux2_single_block_norm_rope_is_bit_exact(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    attn = transformer_flux2.Flux2ParallelSelfAttention(query_dim=DIM, heads=HEADS,
                                                        dim_head=HEAD_DIM, eps=EPS, mlp_ratio=1.0)
    _randomise_norms(attn, gen)
    attn = attn.to(dtype).eval()
    txt, h, w = 4, 3, 5
    hs = torch.randn(1, txt + h * w, DIM, generator=gen).to(dtype)
    txt_ids, img_ids = _ids(txt, h, w, 4)
    freqs = transformer_flux2.Flux2PosEmbed(theta=2000, axes_dim=[32, 32, 32, 32])(
        torch.cat([txt_ids, img_ids]))
    q_ref, k_ref = _captured_qk(attn, monkeypatch, transformer_flux2, hidden_states=hs,
                                image_rotary_emb=freqs)
    cache = _cache(freqs)
    with torch.no_grad():
        qkv = attn.to_qkv_mlp_proj(hs)[..., :3 * attn.inner_dim]
        xq, xk, _ = (t.unflatten(-1, (HEADS, HEAD_DIM)) for t in qkv.chunk(3, dim=-1))
        # a single block: one node over [text; image] with the joined cache
        q, k = qk_norm_rope(xq.contiguous(), xk.contiguous(), attn.norm_q.weight,
                            attn.norm_k.weight, cache, eps=EPS, rounding=contract.ROUNDING_TWO_STEPS)
    assert q_ref.dtype == dtype
    assert torch.equal(q, q_ref)
    assert torch.equal(k, k_ref)
    _modes_differ(xq.contiguous(), attn.norm_q.weight, cache, dtype, q)


def test_fp32_flux_mode_is_the_one_rounding_mode():
    """With fp32 activations there is no narrower dtype to round to: all three modes coincide."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 4, 2, 64, generator=gen)
    w = 1 + 0.3 * torch.randn(64, generator=gen)
    ang = torch.randn(4, 32, generator=gen)
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    outs = [qk_norm_rope_reference(x, x, w, w, cache, rounding=r)[0] for r in contract.ROUNDING_MODES]
    assert all(torch.equal(o, outs[0]) for o in outs)
