"""Qwen-Image RoPE caches vs diffusers' QwenEmbedRope, converters and validation
(docs/spec.md sections 2, 5-7)."""

import math

import pytest
import torch

from qkrope.runtime import (RopeCacheError, RopeCacheOverflowError, RopeCaches,
                            build_qwen_rope_caches, to_cos_sin_caches, validate_cos_sin_caches)

from _diffusers_ref import diffusers_freqs

SHAPES = [
    [(1, 4, 4)],
    [(1, 5, 7)],          # odd, non-square
    [(1, 64, 64)],        # 1024x1024
    [(3, 4, 6)],          # several frames
    [(1, 6, 4), (1, 4, 4)],             # edit: target + one condition image
    [(1, 4, 6), (1, 3, 5), (1, 8, 2)],  # edit with 3 images, different sizes
]


@pytest.mark.parametrize("img_shapes", SHAPES, ids=str)
@pytest.mark.parametrize("txt_len", [1, 7, 300])
def test_caches_match_diffusers_bit_for_bit(img_shapes, txt_len):
    img_freqs, txt_freqs = diffusers_freqs(img_shapes, txt_len)
    caches = build_qwen_rope_caches(img_shapes, txt_len)
    assert caches.img.dtype == torch.float32 and caches.txt.dtype == torch.float32
    assert caches.img.shape == (sum(f * h * w for f, h, w in img_shapes), 128)
    assert caches.txt.shape == (txt_len, 128)
    assert torch.equal(caches.img, torch.cat([img_freqs.real, img_freqs.imag], -1).float())
    assert torch.equal(caches.txt, torch.cat([txt_freqs.real, txt_freqs.imag], -1).float())


def test_spec_check_values():
    caches = build_qwen_rope_caches([(1, 4, 4)], 3)
    assert caches.img.shape == (16, 128) and caches.txt.shape == (3, 128)
    # token 10 = (frame 0, h index 2, w index 2) -> positions (0, 0, 0): cos 1, sin 0
    assert torch.equal(caches.img[10], torch.cat([torch.ones(64), torch.zeros(64)]))
    assert caches.img[5, 8].item() == pytest.approx(math.cos(-1), abs=1e-7)
    assert caches.img[5, 72].item() == pytest.approx(math.sin(-1), abs=1e-7)
    assert caches.img[5, 8].item() == pytest.approx(0.5403023, abs=1e-7)
    assert caches.img[5, 72].item() == pytest.approx(-0.8414710, abs=1e-7)
    # text offset 2: text token 0 sits at position 2 on all three axes
    inv_freq_frame0 = 1.0  # j = 0 of every axis
    assert caches.txt[0, 0].item() == pytest.approx(math.cos(2 * inv_freq_frame0), abs=1e-7)
    assert caches.txt[0, 8].item() == pytest.approx(math.cos(2), abs=1e-7)  # height axis j=0


def test_text_overflow_boundary():
    """offset + S_txt = 4096 passes, 4097 fails; the numbers are sglang's: required = text tokens,
    txt_cache_len = rows left for text (4096 - offset)."""
    # offset = max(h//2, w//2) = 32 for (1, 64, 64): 32 + 4064 = 4096 is the last that fits
    ok = build_qwen_rope_caches([(1, 64, 64)], 4096 - 32)
    assert ok.txt.shape[0] == 4064
    with pytest.raises(RopeCacheOverflowError) as err:
        build_qwen_rope_caches([(1, 64, 64)], 4097 - 32)
    msg = str(err.value)
    assert "text cache overflow" in msg
    assert "required_txt_seq_len=4065" in msg and "txt_cache_len=4064" in msg and "overflow=1" in msg
    assert (err.value.required, err.value.available, err.value.overflow) == (4065, 4064, 1)
    assert isinstance(err.value, ValueError) and isinstance(err.value, RuntimeError)
    # the offset comes from the largest of several images
    with pytest.raises(RopeCacheOverflowError, match="txt_cache_len=4046, overflow=4"):
        build_qwen_rope_caches([(1, 4, 4), (1, 100, 20)], 4050)


def test_image_extent_limits_match_the_tables():
    """Centred heights/widths reach -(n - n//2): more than 4096 patches fit the 4096-entry tables."""
    img, txt = build_qwen_rope_caches([(1, 8190, 1)], 1)
    freqs = diffusers_freqs([(1, 8190, 1)], 1)
    assert torch.equal(img, torch.cat([freqs[0].real, freqs[0].imag], -1).float())
    with pytest.raises(RopeCacheOverflowError, match="image cache overflow"):
        build_qwen_rope_caches([(1, 8194, 1)], 1)
    with pytest.raises(RopeCacheOverflowError, match="image cache overflow"):
        build_qwen_rope_caches([(4097, 1, 1)], 1)


def test_builder_memoises_and_rejects_bad_shapes():
    a = build_qwen_rope_caches([(1, 4, 4)], 5)
    b = build_qwen_rope_caches([[1, 4, 4]], 5)
    assert a.img is b.img  # a denoising loop does not rebuild them
    with pytest.raises(ValueError, match="img_shapes"):
        build_qwen_rope_caches([(1, 4)], 5)
    with pytest.raises(ValueError, match="positive"):
        build_qwen_rope_caches([(1, 0, 4)], 5)
    with pytest.raises(ValueError, match="txt_seq_len"):
        build_qwen_rope_caches([(1, 4, 4)], 0)


# ---------------------------------------------------------------------------------------------
# Converters (docs/spec.md section 5)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    shapes, txt = [(1, 4, 6), (1, 3, 3)], 5
    return build_qwen_rope_caches(shapes, txt), diffusers_freqs(shapes, txt)


def _half(cache):
    h = cache.shape[1] // 2
    return cache[:, :h], cache[:, h:]


def test_convert_complex_pair(reference):
    caches, (img_f, txt_f) = reference
    out = to_cos_sin_caches((img_f, txt_f))
    assert isinstance(out, RopeCaches)
    assert torch.equal(out.img, caches.img) and torch.equal(out.txt, caches.txt)


def test_convert_real_angles(reference):
    caches, (img_f, txt_f) = reference
    for head_dim in (128, None):
        out = to_cos_sin_caches((img_f.angle(), txt_f.angle()), head_dim=head_dim)
        torch.testing.assert_close(out.img, caches.img, atol=1e-6, rtol=0)
        torch.testing.assert_close(out.txt, caches.txt, atol=1e-6, rtol=0)


def test_convert_half_width_cos_sin_nested_and_flat(reference):
    caches, _ = reference
    (ic, is_), (tc, ts) = _half(caches.img), _half(caches.txt)
    for fmt in (((ic, is_), (tc, ts)), (ic, is_, tc, ts)):
        for head_dim in (128, None):
            out = to_cos_sin_caches(fmt, head_dim=head_dim)
            assert torch.equal(out.img, caches.img) and torch.equal(out.txt, caches.txt)


def test_convert_full_width_interleave_duplicated(reference):
    caches, _ = reference
    (ic, is_), (tc, ts) = _half(caches.img), _half(caches.txt)
    dup = [t.repeat_interleave(2, dim=1) for t in (ic, is_, tc, ts)]
    for head_dim in (128, None):
        out = to_cos_sin_caches(tuple(dup), head_dim=head_dim)
        assert torch.equal(out.img, caches.img) and torch.equal(out.txt, caches.txt)
    # bf16 tables come back as fp32
    out = to_cos_sin_caches(tuple(t.to(torch.bfloat16) for t in dup), head_dim=128)
    assert out.img.dtype == torch.float32


def test_convert_rejects_neox_half_duplicated(reference):
    caches, _ = reference
    (ic, is_), (tc, ts) = _half(caches.img), _half(caches.txt)
    neox = [torch.cat([t, t], dim=1) for t in (ic, is_, tc, ts)]
    with pytest.raises(RopeCacheError, match="NeoX"):
        to_cos_sin_caches(tuple(neox), head_dim=128)


def test_convert_existing_caches_and_garbage(reference):
    caches, _ = reference
    out = to_cos_sin_caches(caches, head_dim=128)
    assert out.img is caches.img  # already fp32 contiguous: no copy
    out = to_cos_sin_caches((caches.img.double(), caches.txt), head_dim=128)
    assert out.img.dtype == torch.float32
    for bad in (None, "rope", (caches.img,), {"img": caches.img}, (caches.img[None], caches.txt)):
        with pytest.raises(RopeCacheError, match="^image_rotary_emb must be cos_sin_cache tensors"):
            to_cos_sin_caches(bad)


# ---------------------------------------------------------------------------------------------
# Validation (docs/spec.md section 7)
# ---------------------------------------------------------------------------------------------

def _validate(emb, **kw):
    args = dict(head_dim=128, img_seq_len=24 + 9, txt_seq_len=5)
    args.update(kw)
    return validate_cos_sin_caches(emb, **args)


def test_validate_accepts_good_caches_without_copying(reference):
    caches, _ = reference
    out = _validate(caches, full=True)
    assert out.img is caches.img and out.txt is caches.txt
    # R > S is allowed
    assert _validate(caches, img_seq_len=10, txt_seq_len=1).img is caches.img


def test_validate_rejects_diffusers_style_four_tuple(reference):
    """The case this project exists for: per-stream (cos, sin) passed where caches are expected."""
    caches, _ = reference
    four = (*_half(caches.img), *_half(caches.txt))
    with pytest.raises(RopeCacheError) as err:
        _validate(four)
    msg = str(err.value)
    assert msg.startswith("image_rotary_emb must be cos_sin_cache tensors")
    assert "a tuple of 4 tensors, which looks like a (cos, sin) pair per stream" in msg
    assert "to_cos_sin_caches" in msg


@pytest.mark.parametrize("what", ["complex", "nested", "one", "3d", "none", "list3"])
def test_validate_rejects_wrong_containers(reference, what):
    caches, (img_f, txt_f) = reference
    emb = {
        "complex": (img_f, txt_f),
        "nested": (_half(caches.img), _half(caches.txt)),
        "one": caches.img,
        "3d": (caches.img[None], caches.txt),
        "none": None,
        "list3": [caches.img, caches.txt, caches.txt],
    }[what]
    with pytest.raises(RopeCacheError, match="^image_rotary_emb must be cos_sin_cache tensors") as e:
        _validate(emb)
    assert "to_cos_sin_caches" in str(e.value)
    if what == "complex":
        assert "complex" in str(e.value)


def test_validate_dtype_width_rows_contiguity_device(reference):
    caches, _ = reference
    img, txt = caches
    with pytest.raises(RopeCacheError, match="img cos_sin_cache must be float32; got torch.bfloat16"):
        _validate((img.bfloat16(), txt))
    with pytest.raises(RopeCacheError, match="txt cos_sin_cache width .* got 127"):
        _validate((img, txt[:, :127].contiguous()))
    with pytest.raises(RopeCacheError, match="width .* got 130"):
        _validate((img, torch.zeros(5, 130)))
    with pytest.raises(RopeCacheOverflowError) as err:
        _validate((img[:30].contiguous(), txt))
    assert "required=33, available=30, overflow=3" in str(err.value)
    with pytest.raises(RopeCacheError, match="contiguous"):
        _validate((img, torch.cat([txt, txt], 1)[:, ::2]))
    with pytest.raises(RopeCacheError, match="on cpu but the activations are on meta"):
        _validate(caches, device="meta")
    # partial rotary: width < head_dim is fine
    _validate((img[:, :64].contiguous(), txt[:, :64].contiguous()))


def test_validate_full_checks_values(reference):
    caches, _ = reference
    img, txt = caches
    bad = img.clone()
    bad[3, 5] = float("nan")
    _validate((bad, txt))  # the default check reads metadata only
    with pytest.raises(RopeCacheError, match="non-finite"):
        _validate((bad, txt), full=True)
    angles = torch.rand(5, 128)
    with pytest.raises(RopeCacheError, match=r"cos\^2 \+ sin\^2"):
        _validate((img, angles), full=True)


def test_validate_default_path_does_not_synchronise(reference, monkeypatch):
    """Metadata only: no tensor data is read (would force a device sync on CUDA)."""
    caches, _ = reference
    calls = []
    for name in ("item", "tolist", "__bool__", "all", "any"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=orig, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1])
    _validate(caches)
    assert calls == []


@pytest.mark.parametrize("head_dim", [128, None])
def test_convert_partial_rotary_tables(reference, head_dim):
    """rotary_dim 64 < head_dim 128: full-width interleave-duplicated (cos, sin) tables are as
    wide as half a head, and angle tables are a quarter of it; neither may be mistaken for the
    other format."""
    caches, _ = reference
    (ic, is_), (tc, ts) = _half(caches.img), _half(caches.txt)
    ic, is_, tc, ts = (t[:, :32].contiguous() for t in (ic, is_, tc, ts))  # 32 pairs: rd = 64
    want_img, want_txt = torch.cat([ic, is_], -1), torch.cat([tc, ts], -1)
    dup = tuple(t.repeat_interleave(2, dim=1) for t in (ic, is_, tc, ts))  # [S, 64] each
    out = to_cos_sin_caches(dup, head_dim=head_dim)
    assert torch.equal(out.img, want_img) and torch.equal(out.txt, want_txt)
    out = to_cos_sin_caches((ic, is_, tc, ts), head_dim=head_dim)  # half width [S, 32]
    assert torch.equal(out.img, want_img) and torch.equal(out.txt, want_txt)
    angles = (torch.atan2(is_, ic), torch.atan2(ts, tc))  # [S, 32] angle tables
    out = to_cos_sin_caches(angles, head_dim=head_dim)
    torch.testing.assert_close(out.img, want_img, atol=1e-6, rtol=0)
    assert out.img.shape[1] == 64
    out = to_cos_sin_caches((want_img, want_txt), head_dim=head_dim)  # already caches [S, 64]
    assert out.img is want_img or torch.equal(out.img, want_img)


def test_convert_rejects_tables_wider_than_the_head(reference):
    caches, _ = reference
    with pytest.raises(RopeCacheError, match="head_dim=64"):
        to_cos_sin_caches(caches, head_dim=64)
    (ic, is_), (tc, ts) = _half(caches.img), _half(caches.txt)
    with pytest.raises(RopeCacheError, match="more than head_dim=32"):
        to_cos_sin_caches((ic, is_, tc, ts), head_dim=32)


def test_convert_degenerate_tables_decided_by_head_dim_or_refused():
    """All positions 0: cos == 1, sin == 0 fits both 'half width' and 'duplicated full width'.
    head_dim decides only when the half-width reading would not fit the head; otherwise both
    readings are possible and the converter refuses instead of guessing."""
    ones, zeros = torch.ones(3, 64), torch.zeros(3, 64)
    assert to_cos_sin_caches((ones, zeros, ones, zeros), head_dim=64).img.shape == (3, 64)
    for head_dim in (128, None):
        with pytest.raises(RopeCacheError, match="read both as half width"):
            to_cos_sin_caches((ones, zeros, ones, zeros), head_dim=head_dim)


# ---------------------------------------------------------------------------------------------
# Classification never guesses, and the builder refuses bad arguments
# ---------------------------------------------------------------------------------------------

def _partial(cache, pairs):
    h = cache.shape[1] // 2
    return torch.cat([cache[:, :pairs], cache[:, h:h + pairs]], dim=-1).contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pairs", [64, 16])  # full rotary (128 wide), partial (32 wide)
def test_low_precision_cache_is_a_cache(reference, dtype, pairs):
    """A correct cache stored in bf16/fp16 is converted with .float(), never taken for angles
    (the old 1e-3 check made a 32-wide bf16 cache for head_dim 64 a 64-wide cos(cache) table
    that passed full validation and moved the attention output by 0.28)."""
    caches, _ = reference
    img, txt = _partial(caches.img, pairs), _partial(caches.txt, pairs)
    low = (img.to(dtype), txt.to(dtype))
    for head_dim in (2 * pairs, 128, None):
        out = to_cos_sin_caches(low, head_dim=head_dim)
        assert out.img.shape == img.shape and out.img.dtype == torch.float32
        assert torch.equal(out.img, low[0].float()) and torch.equal(out.txt, low[1].float())
    validate_cos_sin_caches(out, head_dim=2 * pairs, img_seq_len=img.shape[0],
                            txt_seq_len=txt.shape[0], full=True)
    # the .float() of such a cache is a cache too (what the error messages tell users to do)
    assert torch.equal(to_cos_sin_caches((low[0].float(), low[1].float())).img, low[0].float())


@pytest.mark.parametrize("make, match", [
    (lambda c: c * 1.05, "neither a cos/sin cache"),                       # scaled: |.|^2 = 1.1
    (lambda c: c + 0.05 * torch.randn(c.shape, generator=torch.Generator().manual_seed(0)),
     "neither a cos/sin cache"),                                           # noisy
    (lambda c: torch.stack([c[:, :c.shape[1] // 2], c[:, c.shape[1] // 2:]], -1).flatten(1),
     "interleaved column by column"),                                      # (cos_j, sin_j) layout
    (lambda c: c.to(torch.bfloat16).float() * 1.01, "neither a cos/sin cache"),
])
def test_near_caches_are_refused_not_guessed(reference, make, match):
    caches, _ = reference
    bad = (make(caches.img), make(caches.txt))
    with pytest.raises(RopeCacheError, match=match):
        to_cos_sin_caches(bad, head_dim=128)


def test_tables_that_cannot_be_classified_are_errors(reference):
    caches, (img_f, txt_f) = reference
    angles = (torch.atan2(_half(caches.img)[1], _half(caches.img)[0]),
              torch.atan2(_half(caches.txt)[1], _half(caches.txt)[0]))
    with pytest.raises(RopeCacheError, match="angle table stored in torch.bfloat16"):
        to_cos_sin_caches(tuple(a.to(torch.bfloat16) for a in angles))
    nan = caches.img.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(RopeCacheError, match="NaN or inf"):
        to_cos_sin_caches((nan, caches.txt))
    with pytest.raises(RopeCacheError, match="empty"):
        to_cos_sin_caches((caches.img[:0], caches.txt))
    with pytest.raises(RopeCacheError, match="cannot read the values"):
        to_cos_sin_caches((caches.img.to("meta"), caches.txt.to("meta")))
    with pytest.raises(RopeCacheError, match="cannot read the values"):
        to_cos_sin_caches((caches.img.to_sparse(), caches.txt.to_sparse()))
    # complex frequencies and angle tables wider than the head
    with pytest.raises(RopeCacheError, match="more than head_dim=64"):
        to_cos_sin_caches((img_f, txt_f), head_dim=64)
    with pytest.raises(RopeCacheError, match="more than head_dim=64"):
        to_cos_sin_caches(angles, head_dim=64)
    # (cos, sin) pairs that are not cos and sin of one angle
    (ic, _), (tc, _) = _half(caches.img), _half(caches.txt)
    with pytest.raises(RopeCacheError, match="not cos and sin of the same angles"):
        to_cos_sin_caches((ic, ic, tc, tc))
    # half-width (cos, sin) pairs whose cache would be wider than the head
    (ic, is_), (tc, ts) = _half(caches.img), _half(caches.txt)
    with pytest.raises(RopeCacheError, match="more than head_dim=100"):
        to_cos_sin_caches((ic, is_, tc, ts), head_dim=100)


def test_validate_full_refuses_meta_and_sparse_clearly(reference):
    caches, _ = reference
    meta = (caches.img.to("meta"), caches.txt.to("meta"))
    kw = dict(head_dim=128, img_seq_len=caches.img.shape[0], txt_seq_len=caches.txt.shape[0])
    validate_cos_sin_caches(meta, **kw)  # metadata only: fine
    with pytest.raises(RopeCacheError, match="meta tensor"):
        validate_cos_sin_caches(meta, full=True, **kw)
    with pytest.raises(RopeCacheError, match="to_dense"):
        validate_cos_sin_caches((caches.img.to_sparse(), caches.txt), **kw)


@pytest.mark.parametrize("theta", [0, -1.0, float("nan"), float("inf"), "10000", True])
def test_builder_refuses_bad_theta(theta):
    with pytest.raises(ValueError, match="theta"):
        build_qwen_rope_caches([(1, 4, 4)], 3, theta=theta)


@pytest.mark.parametrize("img_shapes, txt", [
    ([(1, 4.7, 4)], 3), ([(1, 4.0, 4)], 3), ([(1, "4", 4)], 3), ([(True, 4, 4)], 3),
    ([(1, 4, 4)], True), ([(1, 4, 4)], 3.0), ([(1, 4, 4)], "3"), ("1,4,4", 3),
])
def test_builder_refuses_coercible_values(img_shapes, txt):
    with pytest.raises(ValueError, match="img_shapes|txt_seq_len"):
        build_qwen_rope_caches(img_shapes, txt)


def test_builder_accepts_diffusers_nested_per_batch_shapes():
    flat = build_qwen_rope_caches([(1, 4, 6), (1, 2, 2)], 5)
    for nested in ([[(1, 4, 6), (1, 2, 2)]], [[(1, 4, 6), (1, 2, 2)]] * 3,
                   [[[1, 4, 6], [1, 2, 2]]] * 2):
        got = build_qwen_rope_caches(nested, 5)
        assert torch.equal(got.img, flat.img) and torch.equal(got.txt, flat.txt)
    with pytest.raises(ValueError, match="different images per batch item"):
        build_qwen_rope_caches([[(1, 4, 6)], [(1, 4, 4)]], 5)


def test_builder_refuses_huge_shapes_before_allocating(monkeypatch):
    """Shapes given in pixels (4096 instead of 256 patches) fail fast, with the limit."""
    import qkrope.runtime.caches as caches_mod

    def no_build(*a, **k):
        raise AssertionError("the caches were being built")

    monkeypatch.setattr(caches_mod, "_build_cached", no_build)
    with pytest.raises(ValueError, match="GiB limit"):
        build_qwen_rope_caches([(1, 4096, 4096)], 512)  # 8 GiB
    with pytest.raises(ValueError, match="GiB limit"):
        build_qwen_rope_caches([(4000, 64, 64)], 512)
    # one token, but position tables of 4097 rows x rotary_dim: bounded by the kernel's head
    with pytest.raises(ValueError, match=r"rotary_dim of 1000004, wider than any attention head"):
        build_qwen_rope_caches([(1, 1, 1)], 2, axes_dim=(2, 2, 10**6))
