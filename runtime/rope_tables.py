"""Qwen-Image RoPE cache arithmetic with numpy only (no torch, no qkrope imports).

One home for the numbers behind :func:`qkrope.runtime.caches.build_qwen_rope_caches` and the
Triton rope model (``qkrope triton-repo`` copies this file next to that model's ``model.py``, so a
server's Python needs numpy and nothing else):

- the per-axis frequency tables of diffusers' ``QwenEmbedRope`` (positions 0..4095 and
  -4096..-1 of each of the three axes),
- the positions of every image token (frame offset k for image k, centred height/width with
  ``scale_rope``) and of the text tokens (after the largest image),
- the overflow limits of those tables, with the messages that name them.

Bits. diffusers builds its tables with ``torch.polar`` over float32 angles; torch's CPU kernel of
``polar`` evaluates the C library's single-precision ``cosf`` / ``sinf`` one element at a time.
This module calls the same two functions (``ctypes`` over the C maths library) on the same float32
angles, so the tables are bit-identical to diffusers' and to what this project computed with torch
before (``tests/test_rope_tables.py`` compares them bit for bit). The inverse frequencies
``1 / theta ** (2i / d)`` use the C library's ``powf``, which is what torch's float32 ``pow``
gives for axes up to 64 wide (32 frequencies; Qwen-Image's axes are 16 and 56 wide); torch
evaluates longer ones with a vectorised ``pow`` whose last bit can differ. Where no C maths
library can be loaded, numpy's float64 functions rounded to float32 are used instead: within one
float32 ulp of those bits, not bit-identical (:data:`BIT_EXACT` says which).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Sequence

import numpy as np

THETA = 10000
AXES_DIM = (16, 56, 56)
# diffusers tabulates positions 0..4095 (and -4096..-1) per axis.
MAX_POSITIONS = 4096

Shapes = Sequence[Sequence[int]]  # [(frames, height, width), ...] in latent patches


class PositionOverflow(ValueError):
    """The positions of a request run past the tables (``stream`` is "image" or "text")."""

    def __init__(self, message: str, *, stream: str, required: int, available: int):
        super().__init__(message)
        self.stream = stream
        self.required = required
        self.available = available


def _libm():
    for name in (ctypes.util.find_library("m"), "libm.so.6"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            cosf, sinf, powf = lib.cosf, lib.sinf, lib.powf
        except (OSError, AttributeError):
            continue
        for fn in (cosf, sinf, powf):
            fn.restype = ctypes.c_float
            fn.argtypes = [ctypes.c_float] * (2 if fn is powf else 1)
        return cosf, sinf, powf
    return None


_LIBM = _libm()
BIT_EXACT = _LIBM is not None


def _cos_sin(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin of float32 ``angles`` (see the module docstring for the bits)."""
    if _LIBM is None:
        wide = angles.astype(np.float64)
        return np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)
    cosf, sinf, _ = _LIBM
    flat = angles.ravel().tolist()  # Python floats hold float32 values exactly
    cos = np.fromiter(map(cosf, flat), np.float32, len(flat)).reshape(angles.shape)
    sin = np.fromiter(map(sinf, flat), np.float32, len(flat)).reshape(angles.shape)
    return cos, sin


def inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """``1 / theta ** (arange(0, dim, 2) / dim)`` in float32, as diffusers computes it."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = float(np.float32(theta))
    if _LIBM is None:
        power = np.power(base, exponents.astype(np.float64)).astype(np.float32)
    else:
        powf = _LIBM[2]
        power = np.array([powf(base, e) for e in exponents.tolist()], np.float32)
    return np.float32(1.0) / power


@functools.lru_cache(maxsize=8)
def axis_tables(theta: float, axes_dim: tuple[int, ...]) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Per axis, ``(cos, sin)`` float32 ``[MAX_POSITIONS + 1, dim / 2]`` of the angles
    ``m * inv_freq`` for m = 0..4096 (read-only). Position p >= 0 is row p; position -m is
    ``(cos[m], -sin[m])`` (float32 negation of an angle is exact and cosf/sinf are even/odd)."""
    out = []
    magnitudes = np.arange(MAX_POSITIONS + 1, dtype=np.int64).astype(np.float32)
    for dim in axes_dim:
        angles = np.outer(magnitudes, inverse_frequencies(theta, dim))  # float32 products
        cos, sin = _cos_sin(angles)
        cos.flags.writeable = False
        sin.flags.writeable = False
        out.append((cos, sin))
    return tuple(out)


def _rows(table: tuple[np.ndarray, np.ndarray], positions: np.ndarray):
    cos, sin = table
    mag = np.abs(positions)
    s = sin[mag]
    return cos[mag], np.where((positions < 0)[:, None], -s, s)


def image_tokens(shapes: Shapes) -> int:
    """Rows of the image cache: the latent's tokens, sum of frames x height x width."""
    return sum(int(f) * int(h) * int(w) for f, h, w in shapes)


def text_offset(shapes: Shapes, scale_rope: bool = True) -> int:
    """Position of the first text token: just after the largest image's positions."""
    return max(max(int(h) // 2, int(w) // 2) if scale_rope else max(int(h), int(w))
               for _, h, w in shapes)


def image_extent(frames_offset: int, shape: Sequence[int], scale_rope: bool = True) -> int:
    """The table entries image ``frames_offset`` of shape ``(f, h, w)`` needs per axis and
    direction: frames use positions k .. k+f-1; centred height/width use -(n - n//2) .. n//2 - 1
    (both tables hold 4096 entries), uncentred ones 0 .. n-1. It fits when <= MAX_POSITIONS."""
    f, h, w = (int(v) for v in shape)
    extent = max(h - h // 2, w - w // 2) if scale_rope else max(h, w)
    return max(int(frames_offset) + f, extent)


def text_rows(shapes: Shapes, scale_rope: bool = True) -> int:
    """The text tokens the tables leave after these images: text token j sits at position
    offset + j (the offset set by the largest image) and the tables end at MAX_POSITIONS."""
    return MAX_POSITIONS - text_offset(shapes, scale_rope)


def check_positions(shapes: Shapes, txt_len: int, scale_rope: bool = True) -> None:
    """Raise :class:`PositionOverflow` where an image or the text runs past the tables."""
    for k, (f, h, w) in enumerate(shapes):
        needed = image_extent(k, (f, h, w), scale_rope)
        if needed > MAX_POSITIONS:
            raise PositionOverflow(
                f"QwenImage RoPE image cache overflow: image {k} has shape {(f, h, w)} "
                f"(frames, height, width in latent patches) but the position tables hold "
                f"{MAX_POSITIONS} positions per axis and direction. Fix: use fewer frames or "
                f"a smaller image.", stream="image", required=needed,
                available=MAX_POSITIONS)
    offset = text_offset(shapes, scale_rope)
    # Text token j sits at position offset + j; the table ends at 4096, so the text stream has
    # 4096 - offset rows. The three numbers mean what sglang's guard reports.
    txt_cache_len = text_rows(shapes, scale_rope)
    if txt_len > txt_cache_len:
        raise PositionOverflow(
            f"QwenImage RoPE text cache overflow: required_txt_seq_len={txt_len}, "
            f"txt_cache_len={txt_cache_len}, overflow={txt_len - txt_cache_len} (the text "
            f"positions start at offset {offset}, set by the largest image, and the position "
            f"table ends at {MAX_POSITIONS}). Fix: shorten the prompt to at most "
            f"{txt_cache_len} tokens, or use fewer or smaller images.",
            stream="text", required=txt_len, available=txt_cache_len)


def cache_nbytes(shapes: Shapes, txt_len: int, axes_dim: Sequence[int] = AXES_DIM) -> int:
    """Bytes of the two fp32 caches: one row of sum(axes_dim) values per token."""
    return (image_tokens(shapes) + int(txt_len)) * sum(axes_dim) * 4


def _centred(n: int) -> np.ndarray:
    return np.arange(-(n - n // 2), n // 2, dtype=np.int64)


def qwen_caches(shapes: Shapes, txt_len: int, *, theta: float = THETA,
                axes_dim: Sequence[int] = AXES_DIM,
                scale_rope: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(img [image_tokens, sum(axes_dim)], txt [txt_len, sum(axes_dim)])`` float32 caches
    (cos half then sin half, axes in (frame, height, width) order within each half) for
    already-validated shapes; raises :class:`PositionOverflow` past the tables."""
    shapes = [(int(f), int(h), int(w)) for f, h, w in shapes]
    txt_len = int(txt_len)
    check_positions(shapes, txt_len, scale_rope)
    tables = axis_tables(float(theta), tuple(int(d) for d in axes_dim))
    img_cos, img_sin = [], []
    for k, (f, h, w) in enumerate(shapes):
        axes_pos = [np.arange(k, k + f, dtype=np.int64),
                    _centred(h) if scale_rope else np.arange(h, dtype=np.int64),
                    _centred(w) if scale_rope else np.arange(w, dtype=np.int64)]
        grid = np.meshgrid(*axes_pos, indexing="ij")  # token order: frame, then row, then column
        parts = [_rows(t, g.ravel()) for t, g in zip(tables, grid)]
        img_cos.append(np.concatenate([c for c, _ in parts], axis=1))
        img_sin.append(np.concatenate([s for _, s in parts], axis=1))
    img = np.concatenate([np.concatenate(img_cos, axis=0), np.concatenate(img_sin, axis=0)],
                         axis=1)
    offset = text_offset(shapes, scale_rope)
    text = np.arange(offset, offset + txt_len, dtype=np.int64)
    parts = [_rows(t, text) for t in tables]
    txt = np.concatenate([c for c, _ in parts] + [s for _, s in parts], axis=1)
    return np.ascontiguousarray(img, np.float32), np.ascontiguousarray(txt, np.float32)
