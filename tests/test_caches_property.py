"""Property of the RoPE converters (docs/spec.md section 5): every tensor handed to
``to_cos_sin_caches`` either converts to caches that give the same attention as the honest caches
(and pass ``validate_cos_sin_caches(full=True)``), or raises ``RopeCacheError`` — never a guess.

Inputs are drawn from the honest Qwen-Image caches of random image shapes and text lengths, full
or partial rotary, in every supported format (caches, complex frequencies, angle tables, (cos, sin)
pairs, half width or interleave-duplicated, flat or nested), stored in fp32/bf16/fp16, and then
either left alone (they must convert) or damaged in the ways the converter must notice (scaled,
noisy, interleaved layout, angle/cache confusion, cos passed as sin, NaN, low-precision angles):
those must convert to the same attention or raise. An angle table has no invariant, so damaged
angles (noisy, scaled, permuted) are simply other angles: for them "the same attention" is that of
cos/sin of the angles given.

"The same attention": the rotated output of qk_norm_rope_reference (fp32, weights 1) with the
converted caches against the honest ones. Bound, derived: a rotated value is a*c - b*n with
|a|, |b| <= max|y|; caches that went through bf16 differ from the honest values by at most half a
bf16 ulp of a value <= 1, 2^-9, so |diff| <= (|a| + |b|) * 2^-9 <= max|y| * 2^-8; fp16 is tighter.
Noise below 1e-6 (drawn for "negligible" damage) adds at most 2 * max|y| * 6e-6 (6 sigma). Damage
in between (1e-6 < noise < 1e-2) is not drawn: such a cache is numerically a bf16-accurate cache
whose error no check can tell from rounding, and it is accepted or refused depending on the draw.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkrope.export import qk_norm_rope_reference
from qkrope.runtime import RopeCacheError, build_qwen_rope_caches, to_cos_sin_caches, validate_cos_sin_caches

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NEGLIGIBLE = 1e-6
OUTPUT_BOUND = 2.0 ** -8 + 2 * 6 * NEGLIGIBLE  # x max|y| (module docstring)


def _attention(cache: torch.Tensor, head_dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cache.shape[0], 2, head_dim, generator=g)
    w = torch.ones(head_dim)
    return qk_norm_rope_reference(x, x, w, w, cache, interleaved=True)[0]


def _halves(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = cache.shape[1] // 2
    return cache[:, :h], cache[:, h:]


def _format(stream: torch.Tensor, fmt: str) -> tuple[torch.Tensor, ...]:
    """One stream's honest cache in format `fmt` (a tuple of 1 or 2 tensors)."""
    cos, sin = _halves(stream)
    if fmt == "cache":
        return (stream,)
    if fmt == "complex":
        return (torch.complex(cos, sin),)
    if fmt == "angles":
        return (torch.atan2(sin, cos),)
    if fmt == "half_pair":
        return (cos, sin)
    if fmt == "dup_pair":
        return (cos.repeat_interleave(2, dim=1), sin.repeat_interleave(2, dim=1))
    raise AssertionError(fmt)


def _damage(parts: tuple[torch.Tensor, ...], kind: str, rng: torch.Generator) -> tuple[torch.Tensor, ...]:
    t = parts[0]
    if kind == "none":
        return parts
    if kind == "negligible":
        return tuple(p + NEGLIGIBLE * torch.randn(p.shape, generator=rng) if not p.is_complex() else p
                     for p in parts)
    if kind == "noise":
        return tuple(p + 0.02 * torch.randn(p.shape, generator=rng) if not p.is_complex() else p * 1.05
                     for p in parts)
    if kind == "scaled":
        return tuple(p * 1.02 for p in parts)
    if kind == "interleaved_layout" and t.dim() == 2 and len(parts) == 1 and not t.is_complex():
        cos, sin = _halves(t)
        return (torch.stack([cos, sin], -1).flatten(1),)
    if kind == "cos_for_sin" and len(parts) == 2:
        return (parts[0], parts[0])
    if kind == "nan" and not t.is_complex():
        bad = t.clone()
        bad[0, 0] = float("nan")
        return (bad,) + parts[1:]
    if kind == "angles_as_given" and len(parts) == 1 and not t.is_complex():
        # the caller hands the *angles* of a cache where the converter expects a cache, or a
        # cache's values as angles: either way a table of the other kind
        cos, sin = _halves(t)
        return (torch.atan2(sin, cos),) if t.shape[1] % 2 == 0 else parts
    return parts


FORMATS = ("cache", "complex", "angles", "half_pair", "dup_pair")
DAMAGE = ("none", "negligible", "noise", "scaled", "interleaved_layout", "cos_for_sin", "nan",
          "angles_as_given")


@st.composite
def problems(draw):
    images = draw(st.lists(st.tuples(st.just(1), st.integers(1, 6), st.integers(1, 6)),
                           min_size=1, max_size=2))
    txt = draw(st.integers(1, 6))
    pairs = draw(st.sampled_from((64, 16, 8)))  # full rotary for head 128, or partial
    head_dim = draw(st.sampled_from((2 * pairs, 128)))
    fmt = draw(st.sampled_from(FORMATS))
    dtype = draw(st.sampled_from(DTYPES))
    damage = draw(st.sampled_from(DAMAGE))
    nested = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return images, txt, pairs, head_dim, fmt, dtype, damage, nested, seed


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fixed examples: same verdict anywhere
@given(problems())
def test_converts_to_the_same_attention_or_raises(problem):
    images, txt, pairs, head_dim, fmt, dtype, damage, nested, seed = problem
    full = build_qwen_rope_caches(images, txt)
    honest = []
    for stream in full:
        cos, sin = _halves(stream)
        honest.append(torch.cat([cos[:, :pairs], sin[:, :pairs]], dim=-1).contiguous())
    rng = torch.Generator().manual_seed(seed)
    given_parts = []
    for stream in honest:
        parts = _format(stream, fmt)
        parts = tuple(p.to(dtype) if not p.is_complex() else p for p in parts)
        given_parts.append(_damage(parts, damage, rng))
    if len(given_parts[0]) == 1:
        arg = (given_parts[0][0], given_parts[1][0])
    elif nested:
        arg = (given_parts[0], given_parts[1])
    else:
        arg = (*given_parts[0], *given_parts[1])

    try:
        out = to_cos_sin_caches(arg, head_dim=head_dim)
    except RopeCacheError:
        # honest inputs in a supported format must convert; angles in bf16/fp16 are refused by
        # design (they cannot hold RoPE angles), as are (cos, sin) tables with one angle per row
        # that both the half-width and the duplicated reading fit (a text stream of one token at
        # position 0): the width cannot decide them
        def one_angle_per_row(t):
            return bool(torch.equal(t, t[:, :1].expand_as(t)))
        ambiguous = fmt in ("half_pair", "dup_pair") and any(
            one_angle_per_row(_halves(c)[0]) and one_angle_per_row(_halves(c)[1]) for c in honest)
        # negligible noise on a duplicated table breaks its exact duplication: refused as
        # nearly-duplicated (neither reading is certain)
        near_dup = fmt == "dup_pair" and damage == "negligible"
        assert damage not in ("none", "negligible") or ambiguous or near_dup or (
            fmt == "angles" and dtype != torch.float32), f"an honest {fmt} input in {dtype} was refused"
        return
    if fmt == "angles" and damage != "none":
        # an angle table has no invariant: damaged angles (noisy, scaled, permuted) are other
        # angles, and converting them faithfully is the converter's job
        honest = [torch.cat([torch.cos(p[0].float()), torch.sin(p[0].float())], -1)
                  for p in given_parts]
    for got, want in zip(out, honest):
        assert got.dtype == torch.float32 and got.shape == want.shape, (
            f"{fmt}/{damage}/{dtype}: converted to {tuple(got.shape)}, honest {tuple(want.shape)}")
        y = _attention(want, head_dim, seed)
        diff = (_attention(got, head_dim, seed) - y).abs().max()
        assert diff <= OUTPUT_BOUND * y.abs().max(), (
            f"{fmt}/{damage}/{dtype} converted to a different attention: max diff {float(diff):.3g}")
    validate_cos_sin_caches(out, head_dim=head_dim, img_seq_len=honest[0].shape[0],
                            txt_seq_len=honest[1].shape[0], full=True)
