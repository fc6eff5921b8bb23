"""The "ids-float32" position scheme: the "ids" scheme's request, checks, rows and Triton inputs
(:mod:`.ids`), with float32 arithmetic: a model whose RoPE module computes its angles in float32
from per-token position ids (MiniMax-H3's ``MiniMaxH3RotaryPosEmbed``: one ``inv_freq`` of
``d / 2`` frequencies shared by every axis, each axis ``d`` wide).

Bits. The frequencies are ``1 / theta ** (arange(0, d, 2) / d)`` in float32 (the C library's
``powf``, what torch's float32 ``pow`` gives for axes up to 64 wide: :mod:`.grid`); row t holds
the float32 products ``pos[t, i] * freq`` (one IEEE multiply, the same bits everywhere) and their
float32 cos and sin by the C library's ``cosf`` / ``sinf``. torch's ``Tensor.cos`` / ``sin`` on the
CPU evaluate vectorised (SLEEF, 1-ulp accurate) rather than the C library's: the caches are within
one float32 ulp of diffusers' and bit-equal where both round alike (tests/test_family_minimax_h3.py
measures both on a packed sequence's positions).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ._common import Setting, cache_pair, stream_cache
from .grid import _cos_sin, inverse_frequencies
from .ids import (FIELDS, NEEDS, POSITION_FIELDS, TEXT_LENGTH_FIELD, Positions,  # noqa: F401
                  bound, check, check_ids, describe, positions, profile_limits, rows,
                  sample_ids, triton_inputs, triton_positions, triton_request)

NAME = "ids-float32"


def key(pos: Positions) -> tuple:
    return (NAME, pos.txt.shape, pos.txt.tobytes(), pos.img.shape, pos.img.tobytes())


def cache(pos: np.ndarray, *, axes_dim: Sequence[int], theta: float) -> np.ndarray:
    """The ``[tokens, sum(axes_dim)]`` float32 cache (cos half then sin half, axes in order
    within each half) of float32 positions ``pos`` [tokens, len(axes_dim)]: row t holds the cos
    and sin of the float32 angles ``pos[t, i] * freq`` of every axis i."""
    def unique(column: np.ndarray) -> tuple:
        bits, inverse = np.unique(np.ascontiguousarray(column).view(np.int32),
                                  return_inverse=True)
        return bits.view(np.float32), inverse

    def cos_sin(values: np.ndarray, dim: int) -> tuple:
        angles = (values[:, None] * inverse_frequencies(theta, dim)[None, :]).astype(np.float32)
        return _cos_sin(angles)

    return stream_cache(pos, axes_dim, unique, cos_sin)


def build(pos: Positions, setting: Setting) -> tuple:
    """``(img, txt)`` float32 caches of a checked request."""
    return cache_pair(cache, pos, setting)
