"""The "table" position scheme: caches from integer position ids looked up in per-axis RoPE
tables (numpy only; copied beside the Triton rope model). diffusers' ``RopeEmbedder``
(Z-Image; Lumina-2 tabulates the same way); which family uses it, and how its pipelines lay the
ids out, is the family's (its drop-in's ``sample_request``).

- Request fields: ``txt_ids`` / ``img_ids``, ``[tokens, axes]`` whole non-negative numbers
  (diffusers' batched ``[batch, tokens, axes]`` form when every item is the same).
- Cache rows: one per id row; checks: those of the "ids" scheme (rank, axis count, at least one
  token, a real dtype, finite values, equal batch items, the bytes, bounded from the shapes
  first) plus whole, non-negative positions (a table has no row -1 or 2.5).
- The numpy pair: row t holds the table entries of ``ids[t, i]`` on every axis i (:func:`build`).
- Triton inputs: ``txt_ids`` / ``img_ids`` INT64 [-1, axes].
- Table lengths: ``Setting.table_lengths`` (the family's, from its diffusers config: Z-Image's
  ``axes_lens``) bound every position, on the local path and in the Triton rope model alike
  (:func:`check_lengths`).
- Profile limits: each image grid's frames, rows and columns within the tables' lengths
  (:func:`profile_limits`), so a size past them is refused before anything is allocated.

Bits. diffusers builds each axis' table once: ``freqs = 1 / theta ** (arange(0, d, 2) / d)`` in
float64, ``outer(arange(length), freqs)`` in float64 rounded to float32 (the angles), then
``torch.polar(1, angles)``, complex64, whose CPU kernel evaluates the C library's
single-precision ``cosf`` / ``sinf`` one element at a time (see :mod:`.grid`). A table row
depends only on its position, never on the table's length, so this module computes the rows a
request needs directly: the float64 frequencies with the C library's ``pow`` (Python's
``math.pow``), the product of the float64 position and frequency (one IEEE multiplication,
exact as torch's), rounded to float32, then ``cosf`` / ``sinf`` through ``ctypes``. torch's
float64 ``pow`` is vectorised (SLEEF) and may differ from the C library's in the last float64
bit; tests/test_family_z_image.py compares every row of the real model's tables bit for bit.
Where no C maths library can be loaded, numpy's float64 cos/sin rounded to float32 stand in
(within one float32 ulp; ``BIT_EXACT`` says which).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from . import ids as _ids
from ._common import (BadPositions, BadRequest, PositionOverflow, Setting,  # noqa: F401
                      cache_pair, check_bytes, request_arrays, show_rows,
                      stream_cache)
from .grid import _cos_sin

NAME = "table"
# The "ids" scheme's request fields (all positions) and checked request, its positions int64
FIELDS, POSITION_FIELDS, TEXT_LENGTH_FIELD, NEEDS = (_ids.FIELDS, _ids.POSITION_FIELDS,
                                                     _ids.TEXT_LENGTH_FIELD, _ids.NEEDS)
Positions = _ids.Positions


def check_table_ids(ids, n_axes: int, name: str, max_rows=None,
                    limit: str = "the cache byte limit allows") -> np.ndarray:
    """``ids`` as int64 ``[tokens, n_axes]`` table positions: the "ids" scheme's checks
    (:func:`qkrope.runtime.schemes.ids.check_ids`), then whole numbers >= 0."""
    pos = _ids.check_ids(ids, n_axes, name, max_rows, limit)
    whole = np.floor(pos) == pos
    if not whole.all() or (pos < 0).any():
        bad = int((~whole | (pos < 0)).any(axis=1).argmax())
        raise BadPositions(f"{name} must hold whole positions >= 0 (rows of the RoPE tables); "
                           f"token {bad} has {pos[bad].tolist()}. Fix: pass the integer "
                           f"position ids the pipeline lays out")
    return pos.astype(np.int64)


def check_lengths(pos: "Positions", lengths) -> None:
    """Every position below its axis' table length (``lengths``: the family's, e.g. Z-Image's
    ``axes_lens``; None: no bound known), else :class:`PositionOverflow` naming the stream, the
    axis and the positions it needs. The one check of both paths: the local drop-in (through
    :func:`positions`, and before a call runs) and the Triton rope model
    (:func:`triton_positions`)."""
    if lengths is None:
        return
    lengths = [int(n) for n in lengths]
    for name, ids in (("img_ids", pos.img), ("txt_ids", pos.txt)):
        if not ids.size:
            continue
        top = ids.max(axis=0)
        for axis, (need, have) in enumerate(zip((int(v) + 1 for v in top), lengths)):
            if need > have:
                raise PositionOverflow(
                    f"{name} needs {need} positions on axis {axis}, more than the model's RoPE "
                    f"tables hold (axes_lens {lengths}). Fix: a shorter prompt or a smaller "
                    f"image", stream="image" if name == "img_ids" else "text", required=need,
                    available=have)


def positions(request: dict, setting: Setting, max_bytes=None) -> Positions:
    """The checked request (``txt_ids``, ``img_ids``), bounded from the shapes first, each
    position within its table (:func:`check_lengths`)."""
    n_axes = len(setting.axes_dim)
    max_rows = None if max_bytes is None else max(0, int(max_bytes) // (setting.width * 4))
    _ids.bound(request, setting, max_bytes)
    pos = [check_table_ids(request.get(n), n_axes, n, max_rows) for n in FIELDS]
    check_bytes(pos[0].shape[0] + pos[1].shape[0], setting, max_bytes,
                f"txt_ids {list(pos[0].shape)} and img_ids {list(pos[1].shape)}",
                "one row per token: pass the ids of the latent's tokens (a 1024x1024 image has "
                "4096)")
    out = Positions(pos[0], pos[1])
    check_lengths(out, setting.table_lengths)
    return out


bound, rows, describe = _ids.bound, _ids.rows, _ids.describe  # the same ids fields


def key(pos: Positions) -> tuple:
    return (NAME,) + _ids.key(pos)[1:]


def check(pos: Positions, setting: Setting) -> None:
    """The tables' lengths (``setting.table_lengths``, from the family's config)."""
    check_lengths(pos, setting.table_lengths)


def triton_inputs(setting: Setting) -> list:
    """The rope model's inputs in place of the caches: (name, Triton type, dims)."""
    return [(n, "TYPE_INT64", [-1, len(setting.axes_dim)]) for n in FIELDS]


def triton_request(request: dict, setting: Setting) -> dict:
    """The arrays a Triton client sends for ``request`` (:func:`triton_inputs`)."""
    return request_arrays(triton_inputs(setting), request)


def profile_limits(setting: Setting, grids: Sequence, txt_max: int):
    """What an engine profile (or a call) of these image ``grids`` (``(f, h, w)`` token grids,
    one per preset) can use within the tables (``setting.table_lengths``; None: no length
    known, every profile usable): None when each grid fits, else ``("image", index, needed,
    available)``. A grid's frames, rows and columns are ids along the tables' axes 0, 1 and 2,
    so it needs at least f, h and w rows there; a family's layout may add an offset (Z-Image's
    frame ids follow the caption's), which :func:`check_lengths` bounds on each call's ids.
    ``txt_max``: the text's rows are the family's layout, bounded per call the same way."""
    lengths = setting.table_lengths
    if lengths is None:
        return None
    lengths = [int(n) for n in lengths]
    for k, shape in enumerate(grids):
        for need, have in zip((int(v) for v in shape), lengths):
            if need > have:
                return ("image", k, need, have)
    return None


# --------------------------------------------------------------------------------------------
# The arithmetic
# --------------------------------------------------------------------------------------------

frequencies = _ids.frequencies


def angles(positions_: np.ndarray, theta: float, dim: int) -> np.ndarray:
    """The float32 table angles of whole ``positions_`` on an axis of width ``dim``: the float64
    products ``position * freq`` rounded to float32."""
    return np.multiply.outer(positions_.astype(np.float64),
                             frequencies(theta, dim)).astype(np.float32)


def cache(pos: np.ndarray, *, axes_dim: Sequence[int], theta: float) -> np.ndarray:
    """The ``[tokens, sum(axes_dim)]`` float32 cache (cos half then sin half, axes in order
    within each half) of int64 positions ``pos`` [tokens, len(axes_dim)]: each distinct
    position of an axis is evaluated once."""
    return stream_cache(pos, axes_dim, lambda column: np.unique(column, return_inverse=True),
                        lambda values, dim: _cos_sin(angles(values, theta, dim)))


def build(pos: Positions, setting: Setting) -> tuple:
    """``(img, txt)`` float32 caches of a checked request."""
    return cache_pair(cache, pos, setting)


# --------------------------------------------------------------------------------------------
# A Triton request (the rope model beside a served transformer)
# --------------------------------------------------------------------------------------------

def triton_positions(inputs: dict, shapes: dict, names: dict, setting: Setting, *,
                     max_img: int, max_txt: int) -> Positions:
    """The checked request of a Triton client (the "ids" scheme's, with int64 table ids), its
    positions within the tables."""
    out = _ids.triton_positions(inputs, shapes, names, setting, max_img=max_img,
                                max_txt=max_txt, check=check_table_ids)
    check_lengths(out, setting.table_lengths)
    return out
