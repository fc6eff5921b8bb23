"""The "ids" position scheme: caches from the position of every token on every axis
(numpy only; copied beside the Triton rope model). FLUX.1's and FLUX.2's scheme (diffusers'
``FluxPosEmbed`` / ``Flux2PosEmbed``); the axes, theta and the pipelines' layout of the ids
are the family record's.

- Request fields: ``txt_ids`` / ``img_ids``, ``[tokens, axes]`` of any real dtype (diffusers'
  batched ``[batch, tokens, axes]`` form when every item is the same).
- Cache rows: one per id row; checks: the rank and axis count, at least one token, a real
  dtype, finite values, equal batch items, and the bytes the caches would take, bounded from
  the shapes before anything is read or converted (:func:`positions`).
- The numpy pair: row t holds ``pos[t, i] * freq`` of every axis i (:func:`build`).
- Triton inputs: ``txt_ids`` / ``img_ids`` FP32 [-1, axes]; each must have as many rows as its
  stream's tensor has tokens.
- Profile limits: none (no table bounds the positions).

Bits. diffusers (get_1d_rotary_pos_embed with freqs_dtype=float64 on the CPU) takes
``pos = ids.float()`` (float32), computes ``1.0 / theta ** (arange(0, d, 2) / d)`` and the
products ``pos * freq`` in float64, their cos and sin in float64, and rounds those to float32.
This module does the same operations in the same order, with the C library's float64 ``pow``,
``cos`` and ``sin`` (Python's math module calls them; numpy's own SIMD versions may differ in the
last float64 bit). torch evaluates its vectorised loops with SLEEF instead, whose float64
results can differ from the C library's in the last bit; after the rounding to float32 that
changes a value only when it lies that close to a float32 rounding boundary. So the caches are
bit-equal to diffusers' for the positions pipelines produce (tests/test_flux_caches.py checks
the pipelines' ids, and every integer position 0..4096 of both FLUX families' axes) and
otherwise within one float32 ulp. On MPS, NPU and Neuron devices diffusers computes the
frequencies and angles in float32 (no float64 there): its caches there are its CPU caches plus
the float32 rounding of the angles, ~|pos * freq| * 2^-24; these caches are the CPU (float64)
ones on every device.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np

from ._common import (BadPositions, BadRequest, Setting, TooLarge,  # noqa: F401
                      cache_pair, check_bytes, request_arrays, stream_cache)

NAME = "ids"
FIELDS = ("txt_ids", "img_ids")
#: Request fields whose tensors hold positions (a caller converts them as ``ids.float()``).
POSITION_FIELDS = ("txt_ids", "img_ids")
TEXT_LENGTH_FIELD = None
NEEDS: tuple = ()


class Positions(NamedTuple):
    """A checked request: float32 ``[tokens, axes]`` positions of each stream (the "table"
    scheme's: int64)."""

    txt: np.ndarray
    img: np.ndarray


def _batched_equal(arr: np.ndarray) -> bool:
    """Whether every item of a ``[batch, tokens, axes]`` array equals item 0, compared item by
    item (never a whole-batch temporary): a stride-0 batch (``expand``, ``broadcast_to``) holds
    one item, so it is equal without a look."""
    if arr.shape[0] <= 1 or arr.strides[0] == 0:
        return True
    first = arr[0]
    return all(np.array_equal(arr[b], first) for b in range(1, arr.shape[0]))


def check_ids(ids, n_axes: int, name: str, max_rows=None,
              limit: str = "the cache byte limit allows") -> np.ndarray:
    """``ids`` as the float32 ``[tokens, n_axes]`` positions diffusers uses (``ids.float()``).

    Accepted: ``[tokens, n_axes]`` of any real dtype, or diffusers' batched form
    ``[batch, tokens, n_axes]`` when every batch item holds the same ids (the caches have no
    batch axis; diffusers itself reads item 0). Raises :class:`BadPositions` for another rank or
    axis count, no tokens, a bool, complex or non-numeric dtype, and NaN or infinite values, and
    (``max_rows``) more rows than the caller's bound: checked from the shape, before the values
    are compared or converted."""
    example = (f"{name} must be [tokens, {n_axes}] position ids (one row per token, one column "
               f"per RoPE axis)")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as exc:  # ragged nested lists
        raise BadPositions(f"{example}; got {type(ids).__name__} that is no array ({exc})") from None
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer)
                                     or np.issubdtype(arr.dtype, np.floating)):
        raise BadPositions(f"{example}, integers or floats; got dtype {arr.dtype}")
    if arr.ndim == 3 and arr.shape[0] < 1:
        raise BadPositions(f"{example}; got shape {list(arr.shape)} (no batch item)")
    item = arr[0] if arr.ndim == 3 else arr
    if item.ndim != 2 or item.shape[1] != n_axes:
        hint = ""
        if item.ndim == 2 and item.shape[1] != n_axes:
            hint = (f" (ids of {item.shape[1]} columns are another model's: of a family whose "
                    f"RoPE has {item.shape[1]} axes, this model's has {n_axes})")
        raise BadPositions(f"{example} for a model with {n_axes} RoPE axes; got shape "
                           f"{list(arr.shape)}{hint}")
    if item.shape[0] < 1:
        raise BadPositions(f"{example} with at least one token; got shape {list(arr.shape)}")
    if max_rows is not None and item.shape[0] > max_rows:
        raise TooLarge(f"{name} {list(arr.shape)} has {item.shape[0]} rows, more than the "
                       f"{max_rows} {limit}. Fix: one row per token: pass the ids of the "
                       f"latent's tokens (a 1024x1024 image has 4096)",
                       rows=int(item.shape[0]), nbytes=-1)
    if arr.ndim == 3 and not _batched_equal(arr):
        raise BadPositions(
            f"{name} {list(arr.shape)} holds different ids per batch item; the RoPE caches "
            f"have no batch axis (one row per token, shared by the batch). Fix: pass the "
            f"[tokens, {n_axes}] ids of one item (diffusers uses item 0), or batch only "
            f"samples of one layout")
    pos = np.ascontiguousarray(item, np.float32)
    if not np.isfinite(pos).all():
        bad = int((~np.isfinite(pos)).any(axis=1).argmax())
        raise BadPositions(f"{name} has a NaN or infinite position (token {bad}: "
                           f"{item[bad].tolist()}, as float32 {pos[bad].tolist()}). Fix: pass "
                           f"finite positions")
    return pos


def _rows_of(ids) -> int | None:
    """The token rows of ``ids`` from its shape alone (None: no usable shape)."""
    shape = getattr(ids, "shape", None)
    if shape is None or len(shape) not in (2, 3):
        return None
    return int(shape[-2])


def bound(request: dict, setting: Setting, max_bytes=None) -> None:
    """Refuse (:class:`~._common.TooLarge`) caches above ``max_bytes`` from the ids' shapes
    alone (tensors or arrays, before their values are read or converted)."""
    shapes = {n: _rows_of(request.get(n)) for n in FIELDS}
    if all(r is not None for r in shapes.values()):
        check_bytes(sum(shapes.values()), setting, max_bytes,
                    f"txt_ids {list(request['txt_ids'].shape)} and img_ids "
                    f"{list(request['img_ids'].shape)}",
                    "one row per token: pass the ids of the latent's tokens (a 1024x1024 image "
                    "has 4096)")


def positions(request: dict, setting: Setting, max_bytes=None) -> Positions:
    """The checked request (``txt_ids``, ``img_ids``). The caches' bytes are bounded from the
    shapes first (so a stride-0 view of a few bytes that claims millions of rows is refused
    before any copy), then each stream is checked (:func:`check_ids`)."""
    n_axes = len(setting.axes_dim)
    per_row = setting.width * 4
    max_rows = None if max_bytes is None else max(0, int(max_bytes) // per_row)
    bound(request, setting, max_bytes)
    pos = [check_ids(request.get(n), n_axes, n, max_rows) for n in FIELDS]
    tokens = pos[0].shape[0] + pos[1].shape[0]
    check_bytes(tokens, setting, max_bytes,
                f"txt_ids {list(pos[0].shape)} and img_ids {list(pos[1].shape)}",
                "one row per token: pass the ids of the latent's tokens (a 1024x1024 image has "
                "4096)")
    return Positions(pos[0], pos[1])


def rows(pos: Positions) -> tuple:
    """(image rows, text rows) of the caches."""
    return int(pos.img.shape[0]), int(pos.txt.shape[0])


def key(pos: Positions) -> tuple:
    return (NAME, pos.txt.shape, pos.txt.tobytes(), pos.img.shape, pos.img.tobytes())


def describe(pos: Positions) -> str:
    return "img_ids / txt_ids rows"


def check(pos: Positions, setting: Setting) -> None:
    """No table bounds the positions: nothing past the request's own checks."""


def triton_inputs(setting: Setting) -> list:
    """The rope model's inputs in place of the caches: (name, Triton type, dims)."""
    return [(n, "TYPE_FP32", [-1, len(setting.axes_dim)]) for n in FIELDS]


def triton_request(request: dict, setting: Setting) -> dict:
    """The arrays a Triton client sends for ``request`` (:func:`triton_inputs`)."""
    return request_arrays(triton_inputs(setting), request)


def profile_limits(setting: Setting, grids: Sequence, txt_max: int):
    """Ids have no table: every profile is usable (None)."""
    return None


def sample_ids(img_shapes, txt_len: int, *, n_axes: int, image_step: int,
               text_axis=None) -> tuple:
    """(txt_ids, img_ids), float32 ``[tokens, n_axes]``, laid out as the pipelines of a family
    lay them out for images of ``img_shapes`` (``(frames, h, w)`` in latent patches, the first
    the output image, the others condition / reference images) and ``txt_len`` text tokens:
    image k at (k * ``image_step`` + frame, row, column, 0...), text at 0 with, when
    ``text_axis`` is given, that axis the token index. The family's record gives the layout."""
    rows = []
    for k, (f, h, w) in enumerate(img_shapes):
        frame, y, x = np.meshgrid(np.arange(int(f)), np.arange(int(h)), np.arange(int(w)),
                                  indexing="ij")
        first = frame.reshape(-1) + image_step * k
        cols = [first, y.reshape(-1), x.reshape(-1)]
        cols += [np.zeros_like(first)] * (n_axes - 3)
        rows.append(np.stack(cols, axis=1))
    img = np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, n_axes), np.float32)
    txt = np.zeros((int(txt_len), n_axes), np.float32)
    if text_axis is not None:
        txt[:, int(text_axis)] = np.arange(int(txt_len), dtype=np.float32)
    return txt, img


# --------------------------------------------------------------------------------------------
# The arithmetic
# --------------------------------------------------------------------------------------------

def frequencies(theta: float, dim: int) -> np.ndarray:
    """``1.0 / theta ** (arange(0, dim, 2) / dim)`` in float64 (the C library's ``pow``)."""
    exponents = np.arange(0, dim, 2, dtype=np.float64) / dim
    return 1.0 / np.array([math.pow(float(theta), e) for e in exponents.tolist()], np.float64)


def _cos_sin64(values: np.ndarray) -> tuple:
    """float32 roundings of the float64 cos and sin of float64 ``values`` (C library)."""
    flat = values.ravel().tolist()
    cos = np.fromiter(map(math.cos, flat), np.float64, len(flat)).reshape(values.shape)
    sin = np.fromiter(map(math.sin, flat), np.float64, len(flat)).reshape(values.shape)
    return cos.astype(np.float32), sin.astype(np.float32)


def cache(pos: np.ndarray, *, axes_dim: Sequence[int], theta: float) -> np.ndarray:
    """The ``[tokens, sum(axes_dim)]`` float32 cache (cos half then sin half, axes in order
    within each half) of float32 positions ``pos`` [tokens, len(axes_dim)] from
    :func:`check_ids`: row t holds the pair angles ``pos[t, i] * freq`` of every axis i."""
    def unique(column: np.ndarray) -> tuple:
        # Each distinct position is evaluated once (an image's rows share their column
        # positions). Unique by bit pattern, so that -0.0 keeps its sign (sin(-0.0) is -0.0).
        bits, inverse = np.unique(np.ascontiguousarray(column).view(np.int32),
                                  return_inverse=True)
        return bits.view(np.float32).astype(np.float64), inverse

    return stream_cache(pos, axes_dim, unique,
                        lambda values, dim: _cos_sin64(np.multiply.outer(values,
                                                                         frequencies(theta, dim))))


def build(pos: Positions, setting: Setting) -> tuple:
    """``(img, txt)`` float32 caches of a checked request."""
    return cache_pair(cache, pos, setting)


# --------------------------------------------------------------------------------------------
# A Triton request (the rope model beside a served transformer)
# --------------------------------------------------------------------------------------------

def triton_positions(inputs: dict, shapes: dict, names: dict, setting: Setting, *,
                     max_img: int, max_txt: int, check=check_ids) -> Positions:
    """The checked request of a Triton client: ``inputs`` the ids by name, ``shapes`` the shapes
    of the latent (``"latent"``) and the text tensor (``"txt"``), ``names`` their input names;
    each stream's ids must have one row per token of its tensor (axis 1), within the served
    model's limits (bounded by ``check``, the scheme's ids check, before any value is read or
    converted)."""
    n_axes = len(setting.axes_dim)
    pos = {}
    for stream, limit in (("img", max_img), ("txt", max_txt)):
        name = f"{stream}_ids"
        ids = check(inputs[name], n_axes, name, limit,
                    f"the served model accepts (its profile's largest {stream} cache)")
        shape = shapes["latent" if stream == "img" else "txt"]
        tensor = names["latent" if stream == "img" else "txt"]
        # axis 1 is the tokens of the latent, the text, or the text mask (a model with one)
        if len(shape) < 2 or shape[1] != ids.shape[0]:
            raise BadRequest(f"{name} has {ids.shape[0]} rows (one per token) but {tensor} has "
                             f"shape {list(shape)}: the ids must be those of its tokens (axis 1)")
        pos[stream] = ids
    return Positions(pos["txt"], pos["img"])
