"""qk_norm_rope (the reference and the torch custom op) vs an independent formula and properties."""

import math

import numpy as np
import pytest
import torch

from qkrope import contract
from qkrope.errors import InputError
from qkrope.export import qk_norm_rope, qk_norm_rope_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _independent(x, w, cache, eps, interleaved):
    """Row by row, pair by pair, in float64: written from the spec, not from the reference."""
    b_, s_, h_, d = x.shape
    rd = cache.shape[1]
    half = rd // 2
    out = torch.empty(x.shape, dtype=torch.float64)
    xd, wd, cd = x.double(), w.double(), cache.double()
    for b in range(b_):
        for s in range(s_):
            for h in range(h_):
                row = xd[b, s, h]
                y = row / torch.sqrt((row * row).mean() + eps) * wd
                o = y.clone()
                for j in range(half):
                    i0, i1 = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
                    c, n = cd[s, j], cd[s, half + j]
                    o[i0] = y[i0] * c - y[i1] * n
                    o[i1] = y[i0] * n + y[i1] * c
                out[b, s, h] = o
    return out


def _inputs(shape, rotary_dim, rows, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape, generator=g).to(dtype)
    k = (3 * torch.randn(shape, generator=g)).to(dtype)
    d = shape[-1]
    qw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    kw = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    angles = torch.rand(rows, rotary_dim // 2, generator=g) * 20 - 10
    cache = torch.cat([angles.cos(), angles.sin()], -1)
    return q, k, qw, kw, cache


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("shape,rotary_dim,rows", [
    ((2, 5, 3, 32), 32, 5),
    ((1, 4, 2, 64), 48, 9),    # partial rotary, extra cache rows
    ((1, 3, 2, 128), 128, 3),
])
def test_reference_matches_independent_formula_fp32(shape, rotary_dim, rows, interleaved):
    q, k, qw, kw, cache = _inputs(shape, rotary_dim, rows, torch.float32)
    q_out, k_out = qk_norm_rope(q, k, qw, kw, cache, eps=1e-6, interleaved=interleaved)
    torch.testing.assert_close(q_out.double(), _independent(q, qw, cache, 1e-6, interleaved),
                               atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(k_out.double(), _independent(k, kw, cache, 1e-6, interleaved),
                               atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_is_one_rounding_of_the_fp32_result(dtype):
    """rounding=0: the output is the fp32 result rounded once (within half a ulp of it)."""
    q, k, qw, kw, cache = _inputs((2, 6, 3, 64), 64, 6, dtype)
    q_out, _ = qk_norm_rope(q, k, qw, kw, cache)
    exact = qk_norm_rope_reference(q.float(), k.float(), qw.float(), kw.float(), cache)[0]
    assert q_out.dtype == dtype
    assert torch.equal(q_out, exact.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotation_preserves_the_norm_of_each_pair(dtype):
    q, k, qw, kw, cache = _inputs((1, 4, 2, 64), 64, 4, torch.float32)
    ones = torch.ones(64)
    normed, _ = qk_norm_rope(q, k, ones, ones, torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], -1))
    rotated, _ = qk_norm_rope(q, k, ones, ones, cache)
    pair_norm = lambda t: t.double().reshape(*t.shape[:-1], 32, 2).norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(pair_norm(rotated), pair_norm(normed), atol=1e-5, rtol=1e-5)
    # and RMS of a normalised row (unit weights) is 1
    rms = normed.double().pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-5, rtol=0)


def test_identity_row_leaves_the_normalised_values_unchanged():
    q, k, qw, kw, cache = _inputs((2, 3, 2, 32), 32, 3, torch.float32)
    cache[1] = torch.cat([torch.ones(16), torch.zeros(16)])  # angle 0 for token 1
    q_out, _ = qk_norm_rope(q, k, qw, kw, cache)
    x = q[:, 1].double()
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * qw.double()
    torch.testing.assert_close(q_out[:, 1].double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_partial_rotary_leaves_the_tail_normalised_but_unrotated(interleaved):
    q, k, qw, kw, cache = _inputs((1, 5, 2, 64), 16, 5, torch.float32)
    q_out, _ = qk_norm_rope(q, k, qw, kw, cache, interleaved=interleaved)
    x = q.double()
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * qw.double()
    torch.testing.assert_close(q_out[..., 16:].double(), normed[..., 16:], atol=1e-6, rtol=1e-6)
    assert not torch.allclose(q_out[..., :16].double(), normed[..., :16], atol=1e-3)


def test_eps_sits_inside_the_square_root():
    q = torch.zeros(1, 1, 1, 4)
    q[..., 0] = 1e-3
    w = torch.ones(4)
    cache = torch.cat([torch.ones(1, 2), torch.zeros(1, 2)], -1)
    out, _ = qk_norm_rope(q, q, w, w, cache, eps=1e-6)
    expected = 1e-3 / math.sqrt(1e-6 / 4 + 1e-6)
    assert out[0, 0, 0, 0].item() == pytest.approx(expected, rel=1e-6)


def test_neox_and_interleaved_pair_different_dims():
    q, k, qw, kw, cache = _inputs((1, 2, 1, 8), 8, 2, torch.float32)
    a, _ = qk_norm_rope(q, k, qw, kw, cache, interleaved=True)
    b, _ = qk_norm_rope(q, k, qw, kw, cache, interleaved=False)
    assert not torch.allclose(a, b)
    # NeoX equals interleaved on a de-interleaved layout
    perm = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
    c, _ = qk_norm_rope(q[..., perm], k[..., perm], qw[perm], kw[perm], cache, interleaved=False)
    torch.testing.assert_close(c, a[..., perm], atol=1e-6, rtol=1e-6)


def test_custom_op_is_registered_and_traceable():
    q, k, qw, kw, cache = _inputs((1, 4, 2, 32), 32, 4, torch.float32)

    class M(torch.nn.Module):
        def forward(self, q, k, qw, kw, cache):
            return qk_norm_rope(q, k, qw, kw, cache)

    ep = torch.export.export(M(), (q, k, qw, kw, cache))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.qkrope.qk_norm_rope.default in targets
    torch.testing.assert_close(ep.module()(q, k, qw, kw, cache)[0], M()(q, k, qw, kw, cache)[0])


@pytest.mark.parametrize("bad,match", [
    (dict(q=torch.zeros(1, 4, 2)), "q and k must both be"),
    (dict(k=torch.zeros(1, 4, 2, 32, dtype=torch.float16)), "share one dtype"),
    (dict(qw=torch.ones(16)), r"q_weight must be \[32\]"),
    (dict(cache=torch.ones(4, 32, dtype=torch.float16)), "2-D float32"),
    (dict(cache=torch.ones(4, 31)), "even and in"),
    (dict(cache=torch.ones(4, 34)), "even and in"),
    (dict(cache=torch.ones(3, 32)), r"required=4, available=3, overflow=1"),
    (dict(eps=0.0), "eps must be"),
    (dict(rounding=3), "rounding must be"),
])
def test_bad_arguments_are_named(bad, match):
    args = dict(q=torch.zeros(1, 4, 2, 32), k=torch.zeros(1, 4, 2, 32), qw=torch.ones(32),
                kw=torch.ones(32), cache=torch.ones(4, 32))
    kw = {key: bad.pop(key) for key in ("eps", "rounding") if key in bad}
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        qk_norm_rope(args["q"], args["k"], args["qw"], args["kw"], args["cache"], **kw)


# ------------------------------------------------------------------ bad arguments: one line each
def _args(head_dim=32, **over):
    args = dict(q=torch.zeros(1, 4, 2, head_dim), k=torch.zeros(1, 4, 2, head_dim),
                qw=torch.ones(head_dim), kw=torch.ones(head_dim), cache=torch.ones(4, 32))
    args.update(over)
    return args


def _call(args, **kw):
    return qk_norm_rope(args["q"], args["k"], args["qw"], args["kw"], args["cache"], **kw)


@pytest.mark.parametrize("name", ["cache", "qw", "kw", "k"])
def test_tensor_on_another_device_than_q_is_refused(name):
    """A cache (or weight, or k) on the meta device used to give uninitialised memory."""
    args = _args()
    args[name] = args[name].to("meta")
    with pytest.raises(InputError, match=rf"(?s)on device meta.*q is on cpu"):
        _call(args)


@pytest.mark.parametrize("value", ["no", "yes", 2, -1, 0.5, None, "1"])
def test_interleaved_must_be_a_bool_or_0_1(value):
    with pytest.raises(InputError, match="interleaved must be True/False"):
        _call(_args(), interleaved=value)


@pytest.mark.parametrize("value", [True, False, 0, 1, np.bool_(True)])
def test_interleaved_bool_or_0_1_is_accepted(value):
    _call(_args(), interleaved=value)


@pytest.mark.parametrize("head_dim", [63, 1024, 514])
def test_head_dim_outside_the_kernel_rule_is_refused(head_dim):
    args = _args(head_dim, cache=torch.ones(4, 32))
    with pytest.raises(InputError, match=rf"head_dim must be even and in \[2, 512\].*; got {head_dim}"):
        _call(args)


@pytest.mark.parametrize("eps", [1e-50, -1e-50, 0.0, 1.0, 1.5, float("nan"), float("inf"),
                                 "1e-6", True])
def test_eps_outside_the_one_float32_rule_is_refused(eps):
    with pytest.raises(InputError, match="eps must be a finite float with 0 < eps < 1 in float32"):
        _call(_args(), eps=eps)


def test_eps_rule_is_the_contract_rule():
    assert contract.epsilon_error(1e-6) is None and contract.epsilon_error(1e-45) is None
    assert contract.epsilon_error(0.99999994) is None
    for bad in (1e-50, 0.0, 1.0, 0.99999999, float("nan"), -1.0, 1e39):
        assert contract.epsilon_error(bad) is not None, bad
