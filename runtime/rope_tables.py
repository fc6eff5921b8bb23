"""RoPE cache arithmetic with numpy only (no torch, no qkrope imports): Qwen-Image's caches
from image shapes, FLUX.1's and FLUX.2's from position ids (section "FLUX" below).

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
import math
from collections import OrderedDict
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


class CacheBudget:
    """Least-recently-used caches, at most ``limit`` bytes in all (a larger entry is not kept).
    Values are tuples of arrays or tensors (anything with ``nbytes``); numpy arrays are made
    read-only. Not thread-safe: callers that share one hold a lock around get/put."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.nbytes = 0
        self._items: OrderedDict = OrderedDict()

    def get(self, key):
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        size = sum(a.nbytes for a in value)
        if size > self.limit or key in self._items:
            return
        while self._items and self.nbytes + size > self.limit:
            _, old = self._items.popitem(last=False)
            self.nbytes -= sum(a.nbytes for a in old)
        for a in value:
            if isinstance(a, np.ndarray):
                a.flags.writeable = False
        self._items[key] = value
        self.nbytes += size

    def __len__(self) -> int:
        return len(self._items)


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


# --------------------------------------------------------------------------------------------
# FLUX: caches from position ids (diffusers' FluxPosEmbed / Flux2PosEmbed)
# --------------------------------------------------------------------------------------------
#
# A FLUX pipeline gives every token its position on each RoPE axis (``txt_ids`` / ``img_ids``,
# [tokens, axes], float or int): FLUX.1 has 3 axes (text ids all zero; image (0, row, column); a
# Kontext condition image (1, row, column)), FLUX.2 4 (T, H, W, L: text (0, 0, 0, l); image
# (0, row, column, 0); reference image k (10 + 10k, row, column, 0)). No table bounds them.
#
# Bits. diffusers (get_1d_rotary_pos_embed with freqs_dtype=float64 on the CPU) takes
# ``pos = ids.float()`` (float32), computes ``1.0 / theta ** (arange(0, d, 2) / d)`` and the
# products ``pos * freq`` in float64, their cos and sin in float64, and rounds those to float32.
# This module does the same operations in the same order, with the C library's float64 ``pow``,
# ``cos`` and ``sin`` (Python's math module calls them; numpy's own SIMD versions may differ in the
# last float64 bit). torch evaluates its vectorised loops with SLEEF instead, whose float64
# results (a frequency, a cosine) can differ from the C library's in the last bit; after the
# rounding to float32 that changes a value only when it lies that close to a float32 rounding
# boundary. So the caches are bit-equal to diffusers' for the positions pipelines produce
# (tests/test_flux_caches.py checks the pipelines' ids, and every integer position 0..4096 of
# both families' axes; on this project's AMD EPYC, torch 2.13 CPU, the first integer position
# that differs is 61639 on a FLUX.2 axis) and otherwise within one float32 ulp. With ids on a
# CUDA device diffusers computes the same float64 operations with CUDA's maths library (the same
# last-bit caveat). On MPS, NPU and Neuron devices diffusers computes the frequencies and angles
# in float32 (those devices have no float64): its caches there are its CPU caches plus the
# float32 rounding of the angles, ~|pos * freq| * 2^-24; these caches are the CPU (float64) ones
# on every device.

#: FLUX.1 (diffusers' FluxTransformer2DModel: FluxPosEmbed(theta=10000), not in its config).
FLUX1_THETA = 10000
FLUX1_AXES_DIM = (16, 56, 56)
#: FLUX.2 (Flux2Transformer2DModel's config defaults rope_theta and axes_dims_rope).
FLUX2_THETA = 2000
FLUX2_AXES_DIM = (32, 32, 32, 32)
#: A sidecar's ``config.family`` -> (its name in messages, the axes and theta it has by default).
FLUX_FAMILIES = {"flux1": ("FLUX.1", FLUX1_AXES_DIM, FLUX1_THETA),
                 "flux2": ("FLUX.2", FLUX2_AXES_DIM, FLUX2_THETA)}


def flux_setting(family: str, axes_dims_rope=None, rope_theta=None, diffusers_config=None):
    """(axes, theta) of a FLUX model from what its sidecar config records: ``axes_dims_rope``
    and ``rope_theta``, else the diffusers config's ``rope_theta`` (FLUX.2), else the family's
    (FLUX.1's theta 10000 is in no config). Unchecked: the caller checks the values."""
    _, axes, theta = FLUX_FAMILIES[family]
    if axes_dims_rope is not None:
        axes = axes_dims_rope
    if rope_theta is not None:
        theta = rope_theta
    elif isinstance(diffusers_config, dict) and diffusers_config.get("rope_theta") is not None:
        theta = diffusers_config["rope_theta"]
    return axes, theta


def flux_sample_ids(family: str, img_shapes, txt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(txt_ids, img_ids), float32 ``[tokens, axes]``, as the FLUX pipelines make them for
    images of ``img_shapes`` (``(frames, h, w)`` in latent patches, the first the output image,
    the others condition / reference images) and ``txt_len`` text tokens: image k at
    (k, row, column) (FLUX.1: a condition image at first axis 1, like Kontext; FLUX.2: a 4th axis
    at 0 and reference images at first axis 10 * k), text at 0 (FLUX.2: its 4th axis the token
    index). What the exporter traces and what ``qkrope check`` feeds."""
    if family not in FLUX_FAMILIES:
        raise ValueError(f"flux_sample_ids: {family!r} is not one of {sorted(FLUX_FAMILIES)}")
    flux2 = family == "flux2"
    rows = []
    for k, (f, h, w) in enumerate(img_shapes):
        frame, y, x = np.meshgrid(np.arange(int(f)), np.arange(int(h)), np.arange(int(w)),
                                  indexing="ij")
        first = frame.reshape(-1) + (10 * k if flux2 else k)
        cols = [first, y.reshape(-1), x.reshape(-1)]
        if flux2:
            cols.append(np.zeros_like(first))
        rows.append(np.stack(cols, axis=1))
    img = np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, 4 if flux2 else 3),
                                                                         np.float32)
    txt = np.zeros((int(txt_len), 4 if flux2 else 3), np.float32)
    if flux2:
        txt[:, 3] = np.arange(int(txt_len), dtype=np.float32)
    return txt, img


class BadPositions(ValueError):
    """Position ids that no FLUX cache can be built from (the message says what and the fix)."""


def check_ids(ids, n_axes: int, name: str) -> np.ndarray:
    """``ids`` as the float32 ``[tokens, n_axes]`` positions diffusers uses (``ids.float()``).

    Accepted: ``[tokens, n_axes]`` of any real dtype, or diffusers' batched form
    ``[batch, tokens, n_axes]`` when every batch item holds the same ids (the caches have no
    batch axis; diffusers itself reads item 0). Raises :class:`BadPositions` for another rank or
    axis count, no tokens, a bool, complex or non-numeric dtype, and NaN or infinite values."""
    example = (f"{name} must be [tokens, {n_axes}] position ids (one row per token, one column "
               f"per RoPE axis)")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise BadPositions(f"{example}; got {type(ids).__name__} that is no array ({exc})") from None
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer)
                                     or np.issubdtype(arr.dtype, np.floating)):
        raise BadPositions(f"{example}, integers or floats; got dtype {arr.dtype}")
    if arr.ndim == 3:
        if arr.shape[0] < 1:
            raise BadPositions(f"{example}; got shape {list(arr.shape)} (no batch item)")
        if arr.shape[0] > 1 and not (arr == arr[:1]).all():
            raise BadPositions(
                f"{name} {list(arr.shape)} holds different ids per batch item; the RoPE caches "
                f"have no batch axis (one row per token, shared by the batch). Fix: pass the "
                f"[tokens, {n_axes}] ids of one item (diffusers uses item 0), or batch only "
                f"samples of one layout")
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[1] != n_axes:
        hint = ""
        if arr.ndim == 2 and {arr.shape[1], n_axes} == {3, 4}:
            hint = (" (FLUX.1's ids have 3 columns, FLUX.2's 4: these ids are of the other "
                    "family than the model's RoPE axes)")
        raise BadPositions(f"{example} for a model with {n_axes} RoPE axes; got shape "
                           f"{list(arr.shape)}{hint}")
    if arr.shape[0] < 1:
        raise BadPositions(f"{example} with at least one token; got shape {list(arr.shape)}")
    pos = arr.astype(np.float32)
    if not np.isfinite(pos).all():
        bad = int((~np.isfinite(pos)).any(axis=1).argmax())
        raise BadPositions(f"{name} has a NaN or infinite position (token {bad}: "
                           f"{arr[bad].tolist()}, as float32 {pos[bad].tolist()}). Fix: pass "
                           f"finite positions")
    return pos


def flux_frequencies(theta: float, dim: int) -> np.ndarray:
    """``1.0 / theta ** (arange(0, dim, 2) / dim)`` in float64 (the C library's ``pow``)."""
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    return 1.0 / np.array([math.pow(float(theta), e) for e in exponents.tolist()], np.float64)


def _cos_sin64(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 roundings of the float64 cos and sin of float64 ``values`` (C library)."""
    flat = values.ravel().tolist()
    cos = np.fromiter(map(math.cos, flat), np.float64, len(flat)).reshape(values.shape)
    sin = np.fromiter(map(math.sin, flat), np.float64, len(flat)).reshape(values.shape)
    return cos.astype(np.float32), sin.astype(np.float32)


def flux_cache(pos: np.ndarray, *, axes_dim: Sequence[int], theta: float) -> np.ndarray:
    """The ``[tokens, sum(axes_dim)]`` float32 cache (cos half then sin half, axes in order
    within each half) of float32 positions ``pos`` [tokens, len(axes_dim)] from
    :func:`check_ids`: row t holds the pair angles ``pos[t, i] * freq`` of every axis i."""
    cos_parts, sin_parts = [], []
    for i, dim in enumerate(axes_dim):
        # Each distinct position is evaluated once (an image's rows share their column positions).
        # Unique by bit pattern, so that -0.0 keeps its sign (sin(-0.0) is -0.0).
        bits, inverse = np.unique(np.ascontiguousarray(pos[:, i]).view(np.int32),
                                  return_inverse=True)
        values = bits.view(np.float32).astype(np.float64)
        angles = np.multiply.outer(values, flux_frequencies(theta, int(dim)))
        cos, sin = _cos_sin64(angles)
        cos_parts.append(cos[inverse.ravel()])
        sin_parts.append(sin[inverse.ravel()])
    return np.ascontiguousarray(np.concatenate(cos_parts + sin_parts, axis=1), np.float32)


def flux_cache_nbytes(tokens: int, axes_dim: Sequence[int]) -> int:
    """Bytes of one fp32 cache of ``tokens`` rows."""
    return int(tokens) * sum(int(d) for d in axes_dim) * 4
