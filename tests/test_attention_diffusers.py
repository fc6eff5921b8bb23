"""QwenImageAttention vs diffusers' Attention + QwenDoubleStreamAttnProcessor2_0 (same weights)."""

import math

import pytest
import torch

from qkrope.export import QwenImageAttention, qk_norm_rope
from qkrope.runtime import RopeCacheError, build_qwen_rope_caches

from _diffusers_ref import diffusers_freqs, diffusers_qwen, qwen_attention

AXES = {32: (8, 12, 12), 64: (16, 24, 24), 128: (16, 56, 56)}

CONFIGS = [
    # heads, head_dim, batch, img_shapes, txt_len, masked
    (2, 32, 1, [(1, 4, 4)], 5, False),
    (3, 64, 2, [(1, 5, 3)], 7, True),
    (2, 128, 2, [(1, 4, 6), (1, 3, 3)], 6, True),      # edit: target + condition image
    (3, 64, 1, [(1, 2, 4), (1, 4, 2), (1, 3, 3)], 4, False),  # three images
    (2, 128, 1, [(2, 3, 4)], 3, True),                  # several frames
]


def _case(heads, head_dim, batch, img_shapes, txt_len, masked, dtype):
    attn = qwen_attention(heads, head_dim, dtype=torch.float32)
    s_img = sum(f * h * w for f, h, w in img_shapes)
    dim = heads * head_dim
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(batch, s_img, dim, generator=g).to(dtype)
    ehs = torch.randn(batch, txt_len, dim, generator=g).to(dtype)
    mask = None
    if masked:
        mask = torch.ones(batch, txt_len, dtype=torch.bool)
        mask[-1, txt_len // 2:] = False  # padding at the end of the last prompt
    freqs = diffusers_freqs(img_shapes, txt_len, AXES[head_dim])
    caches = build_qwen_rope_caches(img_shapes, txt_len, axes_dim=AXES[head_dim])
    return attn.to(dtype), hs, ehs, mask, freqs, caches


def _run_diffusers(attn, hs, ehs, mask, freqs):
    with torch.no_grad():
        return attn(hidden_states=hs, encoder_hidden_states=ehs, encoder_hidden_states_mask=mask,
                    image_rotary_emb=freqs)


def _ids(c):
    return f"h{c[0]}xd{c[1]}-b{c[2]}-{len(c[3])}img-t{c[4]}{'-mask' if c[5] else ''}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_fp32_matches_diffusers(cfg):
    attn, hs, ehs, mask, freqs, caches = _case(*cfg, dtype=torch.float32)
    ref = _run_diffusers(attn, hs, ehs, mask, freqs)
    ours = QwenImageAttention.from_diffusers(attn).eval()
    with torch.no_grad():
        out = ours(hs, ehs, caches, mask)
    for r, o in zip(ref, out):
        assert o.shape == r.shape and o.dtype == torch.float32
        assert (o - r).abs().max().item() <= 1e-5


def _bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers at magnitude x (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(x)) - 7)


@pytest.mark.parametrize("cfg", CONFIGS, ids=_ids)
def test_bf16_within_one_bf16_step_of_diffusers(cfg):
    """Bound and why: with rounding=0 the fused op rounds q/k once where diffusers rounds three
    times, so q/k differ by at most one bf16 ulp per element. Through softmax and the bf16 output
    projection that moves an output by about one bf16 step at the output's magnitude, and the
    final rounding of each output can add one more: |ours - diffusers| <= 2 ulp_bf16(max|ref|).
    Measured: 1.0-1.1 ulp on these configs. Accuracy against an fp32 run of the same bf16 weights
    and inputs must also stay within one step of diffusers' own bf16 error."""
    attn, hs, ehs, mask, freqs, caches = _case(*cfg, dtype=torch.bfloat16)
    ref = _run_diffusers(attn, hs, ehs, mask, freqs)
    truth = _run_diffusers(attn.float(), hs.float(), ehs.float(), mask, freqs)
    attn = attn.bfloat16()
    ours = QwenImageAttention.from_diffusers(attn).eval()
    assert ours.to_q.weight.dtype == torch.bfloat16
    with torch.no_grad():
        out = ours(hs, ehs, caches, mask)
    for r, o, t in zip(ref, out, truth):
        assert o.dtype == torch.bfloat16
        step = _bf16_ulp(r.float().abs().max().item())
        err = (o.float() - r.float()).abs().max().item()
        assert err <= 2 * step, (err, step)
        ours_err = (o.float() - t).abs().max().item()
        ref_err = (r.float() - t).abs().max().item()
        assert ours_err <= ref_err + step, (ours_err, ref_err, step)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", CONFIGS[1:3], ids=_ids)
def test_rounding_1_is_bit_exact_with_diffusers(cfg, dtype):
    attn, hs, ehs, mask, freqs, caches = _case(*cfg, dtype=dtype)
    heads, head_dim = cfg[0], cfg[1]
    # the QK-norm + RoPE step alone: diffusers' RMSNorm + apply_rotary_emb_qwen
    x = attn.to_q(hs).unflatten(-1, (heads, head_dim))
    y = attn.add_k_proj(ehs).unflatten(-1, (heads, head_dim))
    with torch.no_grad():
        ref_img = diffusers_qwen.apply_rotary_emb_qwen(attn.norm_q(x), freqs[0], use_real=False)
        ref_txt = diffusers_qwen.apply_rotary_emb_qwen(attn.norm_added_k(y), freqs[1],
                                                       use_real=False)
        img, _ = qk_norm_rope(x, x, attn.norm_q.weight, attn.norm_q.weight, caches.img, rounding=1)
        _, txt = qk_norm_rope(y, y, attn.norm_added_k.weight, attn.norm_added_k.weight,
                              caches.txt, rounding=1)
    assert torch.equal(img, ref_img)
    assert torch.equal(txt, ref_txt)
    # and then the whole block
    ref = _run_diffusers(attn, hs, ehs, mask, freqs)
    ours = QwenImageAttention.from_diffusers(attn, rounding=1).eval()
    with torch.no_grad():
        out = ours(hs, ehs, caches, mask)
    for r, o in zip(ref, out):
        assert torch.equal(o, r)


def test_attention_refuses_diffusers_rope_input():
    attn, hs, ehs, mask, freqs, caches = _case(*CONFIGS[0], dtype=torch.float32)
    ours = QwenImageAttention.from_diffusers(attn)
    h = caches.img.shape[1] // 2
    four = (caches.img[:, :h], caches.img[:, h:], caches.txt[:, :h], caches.txt[:, h:])
    for bad in (freqs, four):
        with pytest.raises(RopeCacheError, match="^image_rotary_emb must be cos_sin_cache tensors"):
            ours(hs, ehs, bad, mask)
    with pytest.raises(RopeCacheError, match="required=16, available=15"):
        ours(hs, ehs, (caches.img[:15].contiguous(), caches.txt), mask)


def test_state_dict_names_are_diffusers_names():
    attn = qwen_attention(2, 32)
    ours = QwenImageAttention(64, 2, 32)
    assert set(ours.state_dict()) == set(attn.state_dict())
    with pytest.raises(ValueError, match="heads \\* head_dim must equal dim"):
        QwenImageAttention(100, 2, 32)


# ------------------------------------------------------------------ bad block inputs: one line each
def _block_inputs(batch=2, s_img=16, txt=5, dim=64):
    caches = build_qwen_rope_caches([(1, 4, 4)], txt, axes_dim=(8, 12, 12))
    return (torch.randn(batch, s_img, dim), torch.randn(batch, txt, dim), caches)


@pytest.mark.parametrize("case, match", [
    ("batch", r"hidden_states has batch 2 but encoder_hidden_states has batch 3 "
              r"\(hidden_states \[2, 16, 64\], encoder_hidden_states \[3, 5, 64\]\)"),
    ("mask_len", r"encoder_hidden_states_mask must be \[batch, txt_tokens\] = \[2, 5\] "
                 r"\(encoder_hidden_states \[2, 5, 64\]\); got \[2, 4\]"),
    ("mask_batch", r"encoder_hidden_states_mask must be \[batch, txt_tokens\] = \[2, 5\]"),
    ("mask_3d", r"encoder_hidden_states_mask must be \[batch, txt_tokens\] = \[2, 5\]"),
    ("hs_2d", r"hidden_states must be \[batch, img_tokens, dim=64\]; got \[16, 64\]"),
    ("ehs_2d", r"encoder_hidden_states must be \[batch, txt_tokens, dim=64\]; got \[5, 64\]"),
    ("width", r"hidden_states must be \[batch, img_tokens, dim=64\]; got \[2, 16, 32\]"),
])
def test_forward_names_mismatched_shapes(case, match):
    from qkrope.errors import InputError

    attn = QwenImageAttention(64, 2, 32)
    hs, ehs, caches = _block_inputs()
    mask = None
    if case == "batch":
        ehs = torch.randn(3, 5, 64)
    elif case == "mask_len":
        mask = torch.ones(2, 4, dtype=torch.bool)
    elif case == "mask_batch":
        mask = torch.ones(1, 5, dtype=torch.bool)
    elif case == "mask_3d":
        mask = torch.ones(2, 5, 1, dtype=torch.bool)
    elif case == "hs_2d":
        hs = hs[0]
    elif case == "ehs_2d":
        ehs = ehs[0]
    elif case == "width":
        hs = hs[..., :32]
    with pytest.raises(InputError, match=match):
        attn(hs, ehs, caches, mask)
