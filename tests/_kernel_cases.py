"""Shared cases and checks for the kernel tests (CPU build and CUDA launch of the same maths).

Numerical policy (see plugins/kernel/qknorm_rope_math.h):
- against an fp32 reference computed from the same (rounded) inputs: fp32 <= 1e-5 absolute,
  fp16 <= 2e-3 and bf16 <= 1e-2 relative (max |diff| / max |reference|);
- bit-exact with the reference (same dtype, same rounding mode) whenever the fp32 sum of squares
  is exact, which the "grid" inputs guarantee (x = k/16, |k| <= 127, D <= 512): then every
  operation is the same correctly rounded IEEE operation in the same order, in every dtype and
  every rounding mode;
- on arbitrary inputs the only freedom left is the order of the fp32 sum of squares (torch's
  vectorised CPU reduction; the kernel's per-lane fused multiply-adds and shuffle tree, which the
  CPU build reproduces exactly, see plugins/kernel/qknorm_rope_plan.h). A different order moves
  the sum, and so inv, by a few fp32 ulps (relative ~1e-7), far below a bf16/fp16 step (2^-8 /
  2^-11). Bound (docs/spec.md section 3), in steps of the dtype at the row's scale
  (finfo.eps * max |row|, which is >= one ulp of every element of the row):
    rounding=0: the output is rounded once, so a perturbed value can cross at most one rounding
      boundary: <= 1 step;
    rounding=1: the normalised value is rounded before the rotation, so each of the two values a
      rotated output combines can flip by one step (and |cos|, |sin| <= 1), and the final
      rounding adds none beyond the boundary it may cross: <= 2 steps.
    rounding=2 (FLUX): y = round(x * inv * w) is rounded before the rotation too. Written out: a
      flip moves y_i by one ulp(y_i) <= eps * |y_i|; the rotated value a*c - b*s (or a*s + b*c)
      then moves by <= eps * (|a||c| + |b||s|) <= eps * |(a, b)| (Cauchy-Schwarz, c^2 + s^2 = 1),
      and |(a, b)| = |(o_1, o_2)| <= sqrt(2) * max(|o_1|, |o_2|) <= sqrt(2) * row max (a rotation
      keeps the pair's length); the final rounding of the two differing values adds at most one
      more ulp of the output (<= one step): <= 1 + sqrt(2) steps. (A pass-through element, past
      rotary_dim, is one flip: <= 1 step.)
  The fraction of elements that differ has no derivable bound (it depends on how close values
  fall to rounding boundaries: an independent run of sglang's cases measured 0.34% on a small
  case), so only the magnitude is asserted.
"""

from __future__ import annotations

import itertools

import torch

from qkrope import contract
from qkrope.export import qk_norm_rope_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (head_dim, rotary_dim): fast-path sizes, general sizes, partial rotary on both paths.
HEAD_ROT = ((64, 64), (128, 128), (256, 256), (96, 96), (48, 48), (128, 64), (64, 32),
            (256, 128), (96, 32), (128, 40))
REL_TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
ABS_TOL_FP32 = 1e-5

CASES = list(itertools.product(DTYPES, (True, False), contract.ROUNDING_MODES, HEAD_ROT))
# Every head layout a family launches (its record's ``launches``, one home): heads, head_dim,
# rotated width, pairing, and the rounding modes it is planned with.
from qkrope import families  # noqa: E402

LAUNCH_LAYOUTS = sorted({(ln.heads, ln.head_dim, ln.rotary, ln.interleaved, ln.roundings)
                         for r in families.records() for ln in r.launches})


def layout_id(layout) -> str:
    heads, d, rot, inter, roundings = layout
    return (f"h{heads}-d{d}-rot{rot}-{'gptj' if inter else 'neox'}-"
            f"r{''.join(str(r) for r in roundings)}")


def case_id(case) -> str:
    dtype, inter, rnd, (d, r) = case
    return f"{str(dtype).split('.')[-1]}-{'gptj' if inter else 'neox'}-r{rnd}-d{d}-rot{r}"


def make_inputs(dtype, head_dim, rotary_dim, *, batch=2, seq=6, heads=3, extra_rows=3,
                grid=False, seed=0, device="cpu", weights_fp32=False):
    """q, k, q_weight, k_weight, cache. ``weights_fp32``: the weights stay float32 with full
    24-bit significands (values no 16-bit dtype holds: FLUX.3's fp32 norm weights under bf16),
    whatever ``dtype`` the activations have."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, seq, heads, head_dim)
    if grid:
        # exactly representable in bf16/fp16 and with an order-independent fp32 sum of squares
        q = torch.randint(-127, 128, shape, generator=g).float() / 16
        k = torch.randint(-127, 128, shape, generator=g).float() / 4
    else:
        q = torch.randn(shape, generator=g)
        k = torch.randn(shape, generator=g) * 3.0
    qw = torch.rand(head_dim, generator=g) + 0.5
    kw = torch.rand(head_dim, generator=g) * 2.0 - 1.0
    angles = torch.randn(seq + extra_rows, rotary_dim // 2, generator=g) * 3.0
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).float().contiguous()
    t = [x.to(dtype).to(device).contiguous() for x in (q, k)]
    t += [x.to(torch.float32 if weights_fp32 else dtype).to(device).contiguous() for x in (qw, kw)]
    return (*t, cache.to(device))


def reference(q, k, qw, kw, cache, **kw_):
    """The project's Python reference, on the CPU (norm_scope 1: :func:`row_scope_reference`)."""
    if kw_.get("norm_scope", 0) == 1:
        return row_scope_reference(q.cpu(), k.cpu(), qw.cpu(), kw.cpu(), cache.cpu(), **kw_)
    kw_.pop("norm_scope", None)
    return qk_norm_rope_reference(q.cpu(), k.cpu(), qw.cpu(), kw.cpu(), cache.cpu(), **kw_)


def _takes_norm_scope() -> bool:
    import inspect
    return "norm_scope" in inspect.signature(qk_norm_rope_reference).parameters


def row_scope_reference(q, k, qw, kw, cache, *, eps=contract.DEFAULT_EPS,
                        interleaved=contract.DEFAULT_INTERLEAVED,
                        rounding=contract.DEFAULT_ROUNDING, norm_scope=1):
    """norm_scope 1 (docs/spec.md): one RMS over each token's heads x head_dim values, weight
    [heads * head_dim], then the per-head rotation. The project's reference where it takes
    ``norm_scope``; until then this model of the contract, written with the reference's own
    operations: mean of squares in fp32 over the flat row, torch.rsqrt, the rounding mode's
    order, the rotation in fp32."""
    if _takes_norm_scope():
        return qk_norm_rope_reference(q, k, qw, kw, cache, eps=eps, interleaved=interleaved,
                                      rounding=rounding, norm_scope=norm_scope)
    rot = cache.shape[1]
    half = rot // 2

    def one(x, w):
        b, s, h, d = x.shape
        xf = x.float()
        inv = torch.rsqrt(xf.reshape(b, s, h * d).pow(2).mean(-1) + eps)[..., None, None]
        wv = w.reshape(h, d)
        narrow = x.dtype != torch.float32
        if rounding == contract.ROUNDING_EACH_STEP and narrow:
            y = ((xf * inv).to(x.dtype) * wv).float()
        elif rounding == contract.ROUNDING_TWO_STEPS and narrow:
            y = (xf * inv * wv.float()).to(x.dtype).float()
        else:
            y = xf * inv * wv.float()
        rows = cache[:s].float()
        cos = rows[:, :half][None, :, None, :]
        sin = rows[:, half:rot][None, :, None, :]
        a, bb = (y[..., 0:rot:2], y[..., 1:rot:2]) if interleaved else (y[..., :half], y[..., half:rot])
        ra, rb = a * cos - bb * sin, a * sin + bb * cos
        out = torch.stack((ra, rb), -1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
        if rot < d:
            out = torch.cat((out, y[..., rot:]), -1)
        return out.to(x.dtype)

    return one(q, qw), one(k, kw)


def row_weights(inputs, seed=11):
    """The inputs of :func:`make_inputs` with [heads * head_dim] weights (norm_scope 1), in the
    dtype the inputs' weights have (q's, or float32)."""
    q, k, w, _, cache = inputs
    g = torch.Generator().manual_seed(seed)
    width = q.shape[-2] * q.shape[-1]
    qw = (torch.rand(width, generator=g) + 0.5).to(w.dtype).to(q.device)
    kw = (torch.rand(width, generator=g) * 2.0 - 1.0).to(w.dtype).to(q.device)
    return q, k, qw, kw, cache


def fp32_reference(q, k, qw, kw, cache, *, interleaved, norm_scope=0):
    return reference(q.float(), k.float(), qw.float(), kw.float(), cache, interleaved=interleaved,
                     rounding=0, norm_scope=norm_scope)


def check_against_fp32(outs, inputs, dtype, interleaved, norm_scope=0) -> float:
    """Return the error measure and assert it is within the tolerance."""
    ref32 = fp32_reference(*inputs, interleaved=interleaved, norm_scope=norm_scope)
    worst = 0.0
    for out, r in zip(outs, ref32):
        d = (out.cpu().float() - r).abs().max().item()
        if dtype == torch.float32:
            assert d <= ABS_TOL_FP32, f"fp32 max abs error {d:.3e} > {ABS_TOL_FP32}"
            worst = max(worst, d)
        else:
            rel = d / r.abs().max().item()
            assert rel <= REL_TOL[dtype], f"{dtype} relative error {rel:.3e} > {REL_TOL[dtype]}"
            worst = max(worst, rel)
    return worst


def assert_bit_exact(outs, refs):
    for name, out, r in zip(("q_out", "k_out"), outs, refs):
        out = out.cpu()
        assert out.dtype == r.dtype and out.shape == r.shape
        bad = (out.float() != r.float()) & ~(out.isnan() & r.isnan())
        assert not bad.any(), (f"{name}: {int(bad.sum())} of {out.numel()} elements differ from the "
                               f"reference, first at {tuple(bad.nonzero()[0].tolist())}")


def order_policy_steps(rounding: int) -> float:
    """Largest difference, in dtype steps at the row's scale, that a different order of the sum
    of squares can cause (module docstring)."""
    return {contract.ROUNDING_ONE: 1, contract.ROUNDING_EACH_STEP: 2,
            contract.ROUNDING_TWO_STEPS: 1 + 2 ** 0.5}[rounding]


def assert_within_order_policy(outs, refs, dtype, rounding):
    """Arbitrary inputs: differences only from the sum-of-squares order (module docstring)."""
    steps = order_policy_steps(rounding)
    eps = torch.finfo(dtype).eps
    for out, r in zip(outs, refs):
        out = out.cpu().float()
        r = r.float()
        diff = (out - r).abs()
        rowmax = r.abs().amax(dim=-1, keepdim=True)
        worst = float((diff / rowmax.clamp_min(torch.finfo(torch.float32).tiny)).max())
        assert bool((diff <= steps * eps * rowmax).all()), (
            f"difference {worst:.3e} x row max exceeds {steps:.3g} step(s) of {dtype} ({steps * eps:.3e}) "
            f"allowed for rounding={rounding}")
