"""runtime/schemes/grid.py (numpy only) gives the bits the torch builder gave, and diffusers gives.

The reference below is the torch code that built the caches before the arithmetic moved to numpy
(diffusers' ``QwenEmbedRope`` calls, kept here verbatim as the yardstick).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from qkrope.families import by_name
from qkrope.runtime.caches import RopeCacheOverflowError, build_qwen_rope_caches
from qkrope.runtime.schemes import _common, grid as rt

# Qwen-Image's tables: diffusers tabulates positions 0..4095 (and -4096..-1) per axis
P = by_name("qwen-image").max_positions
assert P == 4096


def _qwen_caches(shapes, txt, axes_dim=(16, 56, 56), scale_rope=True):
    return rt.caches(shapes, txt, rt.Setting(tuple(axes_dim), 10000.0, P, scale_rope))


def _torch_tables(theta, axes_dim):
    pos_index = torch.arange(P)
    neg_index = torch.arange(P).flip(0) * -1 - 1

    def params(index, dim):
        inv_freq = 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))
        angles = torch.outer(index, inv_freq)
        return torch.polar(torch.ones_like(angles), angles)

    return (torch.cat([params(pos_index, d) for d in axes_dim], dim=1),
            torch.cat([params(neg_index, d) for d in axes_dim], dim=1))


def _torch_caches(shapes, txt, theta, axes, scale_rope):
    pos, neg = _torch_tables(theta, axes)
    splits = [d // 2 for d in axes]
    pf, ph, pw = pos.split(splits, dim=1)
    nf, nh, nw = neg.split(splits, dim=1)
    parts = []
    for k, (f, h, w) in enumerate(shapes):
        fp = pf[k:k + f].view(f, 1, 1, -1).expand(f, h, w, -1)
        if scale_rope:
            hp = torch.cat([nh[P - (h - h // 2):], ph[:h // 2]], dim=0)
            wp = torch.cat([nw[P - (w - w // 2):], pw[:w // 2]], dim=0)
        else:
            hp, wp = ph[:h], pw[:w]
        hp = hp.view(1, h, 1, -1).expand(f, h, w, -1)
        wp = wp.view(1, 1, w, -1).expand(f, h, w, -1)
        parts.append(torch.cat([fp, hp, wp], dim=-1).reshape(f * h * w, -1))
    img = torch.cat(parts, dim=0)
    off = max(max(h // 2, w // 2) if scale_rope else max(h, w) for _, h, w in shapes)
    t = pos[off:off + txt]
    cache = lambda z: torch.cat([z.real, z.imag], -1).float()  # noqa: E731
    return cache(img).numpy(), cache(t).numpy()


# Qwen-Image's axes, the tiny test configs' (qkrope.runtime.caches.default_axes_dims) and odd ones
AXES = [(16, 56, 56), (2, 2, 4), (4, 6, 6), (2, 14, 16), (8, 28, 28), (2, 30, 32)]
SHAPES = [([(1, 64, 64)], 512), ([(1, 4, 6)], 7), ([(1, 3, 3), (1, 2, 4)], 5),
          ([(2, 5, 7), (1, 1, 8190)], 3), ([(3, 8191, 1)], 1), ([(1, 83, 83)], 1024)]


@pytest.mark.skipif(not _common.BIT_EXACT, reason="no C maths library loadable through ctypes: the "
                                              "numpy fallback is within 1 ulp, not bit-exact")
@pytest.mark.parametrize("axes", AXES)
def test_tables_bit_identical_to_torch(axes):
    pos, neg = _torch_tables(10000, axes)
    tables = rt.axis_tables(10000.0, axes, P)
    cos = np.concatenate([c for c, _ in tables], axis=1)
    sin = np.concatenate([s for _, s in tables], axis=1)
    assert np.array_equal(cos[:P], pos.real.numpy()) and np.array_equal(sin[:P], pos.imag.numpy())
    # negative positions -4096..-1 are rows 4096..1 with the sine negated
    assert np.array_equal(cos[P:0:-1], neg.real.numpy())
    assert np.array_equal(-sin[P:0:-1], neg.imag.numpy())
    for scale_rope in (True, False):
        for shapes, txt in SHAPES:
            try:
                img, t = _qwen_caches(shapes, txt, axes_dim=axes, scale_rope=scale_rope)
            except rt.PositionOverflow:  # past the tables: tested below
                continue
            want = _torch_caches(shapes, txt, 10000, axes, scale_rope)
            assert np.array_equal(img, want[0]) and np.array_equal(t, want[1]), (shapes, txt)


def test_inverse_frequencies_match_torch_pow_up_to_width_64():
    """The documented range: every even axis width up to 64, for several bases."""
    for theta in (10000, 500.0, 1e6, 256.0):
        for dim in range(2, 66, 2):
            want = 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))
            assert np.array_equal(rt.inverse_frequencies(theta, dim), want.numpy()), (theta, dim)


def test_the_library_builder_uses_these_tables():
    shapes, txt = [(1, 5, 9), (1, 4, 4)], 11
    lib = build_qwen_rope_caches(shapes, txt, axes_dim=(4, 6, 6))
    img, t = _qwen_caches(shapes, txt, axes_dim=(4, 6, 6))
    assert np.array_equal(lib.img.numpy(), img) and np.array_equal(lib.txt.numpy(), t)
    with pytest.raises(RopeCacheOverflowError, match="text cache overflow") as info:
        build_qwen_rope_caches([(1, 8000, 8)], 100)
    assert (info.value.required, info.value.available) == (100, P - 4000)
    with pytest.raises(rt.PositionOverflow, match="image cache overflow") as info:
        rt.check(rt.Positions(((1, 1, 1), (P, 1, 1)), 1), rt.Setting((16, 56, 56), 1e4, P))
    assert info.value.stream == "image" and info.value.required == P + 1


@pytest.mark.parametrize("path", sorted(Path(rt.__file__).parent.glob("*.py")),
                         ids=lambda p: p.name)
def test_module_imports_nothing_but_numpy_and_the_standard_library(path):
    """The Triton rope model loads this package by path in a server with numpy only; its
    modules import each other relatively (nothing else)."""
    tree = ast.parse(path.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert all(n.module in ("_common", "grid", "ids", None) for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) and n.level)
    assert names <= {"__future__", "collections", "ctypes", "dataclasses", "functools", "math",
                     "numbers", "operator", "typing", "numpy"}, names
