"""The "divided_grid" position scheme: image caches from a video latent's token grid, every axis
counted from 0 and its angles divided by a per-call factor per axis, and text caches from the
text's 1-D positions over the whole head (numpy only; copied beside the Triton rope model). The
axes, base and table sizes are the family's (:class:`~._common.Setting` ``axes_dim``, ``theta``,
``max_positions`` = the text table's rows, ``table_lengths`` = each image axis' table rows), so
no family fact lives here.

- Request fields: ``grid`` (``(frames, height, width)`` in tokens, i.e. latent patches),
  ``scale`` (three positive numbers, one divisor per axis) and ``txt_seq_len``.
- Cache rows: ``f * h * w`` image rows in the token order frames, rows, columns; ``txt_seq_len``
  text rows (positions 0..L-1). Checks: positive whole numbers, each axis within its table
  (``table_lengths``), the text within ``max_positions``, finite positive divisors.
- The numpy pair: an image row holds ``cos`` of the frame, row and column angles, then their
  ``sin`` (the cos half then the sin half of the node's cache); a text row the same over one
  axis as wide as the three together.
- Triton inputs: ``grid`` INT64 [3] and ``scale`` FP32 [3]; the text length is read off the
  text tensor.
- Profile limits: each preset grid within its axes' tables, the text within its table.

Arithmetic, all float32 as torch does it: the frequencies of an axis ``d`` wide are
``exp(-ln(theta) * j / (d / 2))`` for ``j < d / 2`` (the product by the float32 ``-ln(theta)``,
then the division, then ``exp``); the angles ``position * frequency``, divided by the axis'
float32 factor (an IEEE division: bit-identical to torch's); then cos and sin. ``exp``, ``cos``
and ``sin`` are the correctly rounded float32 values (float64 functions rounded); torch's CPU
kernels are within one ulp of them and differ in the last bit for some arguments, so a cache
entry is within ``position * ulp(frequency) / factor + 2 ulp(angle) + 2**-23`` of torch's
(the bound the family's tests check).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Sequence

import numpy as np

from ._common import BadRequest, PositionOverflow, Setting, check_bytes  # noqa: F401
from ._common import check_grid as _check_grid, triton_grid, whole

NAME = "divided_grid"
FIELDS = ("grid", "scale", "txt_seq_len")
POSITION_FIELDS: tuple = ()
TEXT_LENGTH_FIELD = "txt_seq_len"
NEEDS = ("max_positions", "table_lengths")
#: The images a request holds: the one latent grid.
IMAGES = 1


class Positions(NamedTuple):
    """A checked request: the token grid, the three divisors (float32) and the text length."""

    grid: tuple
    scale: tuple
    txt_len: int


#: A grid of this scheme's models, for the messages.
GRID_EXAMPLE = "(31, 30, 52) for 121 frames at 480x832 with 2x2 patches"


def check_grid(grid) -> tuple:
    """``grid`` as a positive ``(frames, height, width)`` int triple (tokens)."""
    return _check_grid(grid, GRID_EXAMPLE)


def check_scale(scale) -> tuple:
    """Three finite divisors > 0, as float32 values (what torch divides the float32 angles
    by)."""
    if hasattr(scale, "tolist"):
        scale = scale.tolist()
    if not isinstance(scale, (list, tuple)) or len(scale) != 3 or any(
            isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
            or v <= 0 for v in scale):
        raise BadRequest(f"scale must be three finite numbers > 0 (the angle divisor of the "
                         f"frames, rows and columns, e.g. (1, 2, 2)); got {scale!r:.80}")
    return tuple(float(np.float32(v)) for v in scale)


def positions(request: dict, setting: Setting, max_bytes=None) -> Positions:
    """The checked request; :class:`BadRequest` naming what is wrong, :class:`TooLarge` above
    ``max_bytes``, :class:`PositionOverflow` past a table."""
    unknown = sorted(set(request) - set(FIELDS))
    if unknown:
        raise BadRequest(f"the divided_grid scheme takes {list(FIELDS)}; got {unknown}")
    if len(setting.axes_dim) != 3:
        raise BadRequest(f"the divided_grid scheme takes three RoPE axes; got "
                         f"{list(setting.axes_dim)}. Fix: re-export the model")
    grid = check_grid(request.get("grid"))
    scale = check_scale(request.get("scale"))
    txt_len = whole(request.get("txt_seq_len"), "txt_seq_len")
    if txt_len < 1:
        raise BadRequest(f"txt_seq_len must be >= 1; got {txt_len!r}")
    pos = Positions(grid, scale, txt_len)
    check_bytes(sum(rows(pos)), setting, max_bytes, f"a token grid of {grid} with {txt_len} "
                f"text tokens", "give the grid in tokens (latent frames, latent rows / patch, "
                "latent columns / patch)")
    check(pos, setting)
    return pos


def rows(pos: Positions) -> tuple:
    f, h, w = pos.grid
    return f * h * w, int(pos.txt_len)


def key(pos: Positions) -> tuple:
    return (NAME, pos.grid, pos.scale, pos.txt_len)


def describe(pos: Positions) -> str:
    return f"token grid {list(pos.grid)} / {list(pos.scale)}"


def sample_request(grid, txt_len: int, scale=(1.0, 1.0, 1.0)) -> dict:
    """The request of a sample of this token grid and text length."""
    return {"grid": tuple(int(v) for v in grid), "scale": tuple(scale),
            "txt_seq_len": int(txt_len)}


def check(pos: Positions, setting: Setting) -> None:
    """Every image axis within its table (``table_lengths``), the text within
    ``max_positions``."""
    if setting.table_lengths is not None:
        for name, n, limit in zip(("frames", "height", "width"), pos.grid,
                                  setting.table_lengths):
            if n > int(limit):
                raise PositionOverflow(
                    f"the token grid {pos.grid} has {n} {name} positions, more than the {limit} "
                    f"the model's RoPE table holds. Fix: a smaller latent",
                    stream="image", required=int(n), available=int(limit))
    if setting.max_positions is not None and pos.txt_len > int(setting.max_positions):
        raise PositionOverflow(
            f"{pos.txt_len} text tokens, more than the {setting.max_positions} positions the "
            f"model's text RoPE table holds. Fix: a shorter prompt",
            stream="text", required=int(pos.txt_len), available=int(setting.max_positions))


def triton_inputs(setting: Setting) -> list:
    return [("grid", "TYPE_INT64", [3]), ("scale", "TYPE_FP32", [3])]


def triton_request(request: dict, setting: Setting) -> dict:
    """The arrays a Triton client sends for ``request`` (:func:`triton_inputs`)."""
    return {"grid": np.asarray(request["grid"], np.int64).reshape(3),
            "scale": np.asarray(request["scale"], np.float32).reshape(3)}


def triton_positions(inputs: dict, shapes: dict, names: dict, setting: Setting, *,
                     max_img: int, max_txt: int) -> Positions:
    """The checked request of a Triton client: ``grid`` [3] (tokens), ``scale`` [3],
    ``shapes["latent"]`` the latent's shape in tokens ``[batch, tokens, ...]`` and
    ``shapes["txt"]`` the text's (its length is read)."""
    scale = np.asarray(inputs["scale"])
    if scale.shape != (3,) or not np.issubdtype(scale.dtype, np.floating):
        raise BadRequest(f"scale must be FP32 [3] (the angle divisor per axis); got "
                         f"{scale.dtype} {list(scale.shape)}")
    f, h, w = triton_grid(inputs, shapes, names, max_img, GRID_EXAMPLE)
    text = shapes["txt"]
    if len(text) < 2 or text[1] < 1:
        raise BadRequest(f"{names['txt']} must be [batch, txt_tokens, ...] with at least one "
                         f"token; got shape {list(text)}")
    if int(text[1]) > max_txt:
        raise BadRequest(f"{names['txt']} has {int(text[1])} text tokens, more than the "
                         f"{max_txt} the served model accepts")
    return positions({"grid": (f, h, w), "scale": scale.tolist(),
                      "txt_seq_len": int(text[1])}, setting)


def profile_limits(setting: Setting, grids: Sequence, txt_max: int):
    """The first preset grid with an axis past its table as ``("image", index, needed,
    available)``, or the text past its table as ``("text", -1, needed, available)``; None when
    everything fits."""
    if setting.table_lengths is not None:
        for i, grid in enumerate(grids):
            for n, limit in zip(grid, setting.table_lengths):
                if int(n) > int(limit):
                    return ("image", i, int(n), int(limit))
    if setting.max_positions is not None and txt_max > int(setting.max_positions):
        return ("text", -1, int(txt_max), int(setting.max_positions))
    return None


# --------------------------------------------------------------------------------------------
# The arithmetic (float32, torch's order)
# --------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def frequencies(theta: float, dim: int) -> np.ndarray:
    """The ``dim / 2`` float32 frequencies of an axis ``dim`` wide:
    ``exp(-ln(theta) * j / (dim / 2))``, the exponent in float32 as torch forms it."""
    half = int(dim) // 2
    exponent = (np.float32(-math.log(theta)) * np.arange(half, dtype=np.float32)) \
        / np.float32(half)
    out = np.exp(exponent.astype(np.float64)).astype(np.float32)
    out.flags.writeable = False
    return out


def angles(count: int, theta: float, dim: int, divisor: float = 1.0) -> np.ndarray:
    """float32 ``[count, dim / 2]``: ``outer(0..count-1, frequencies) / divisor``."""
    table = np.multiply.outer(np.arange(int(count), dtype=np.float32),
                              frequencies(float(theta), int(dim)))
    return table / np.float32(divisor)


def _cos_sin32(values: np.ndarray) -> tuple:
    flat = values.astype(np.float64)
    return np.cos(flat).astype(np.float32), np.sin(flat).astype(np.float32)


def image_cache(pos: Positions, setting: Setting) -> np.ndarray:
    """The ``[f * h * w, sum(axes_dim)]`` float32 image cache."""
    cos, sin = [], []
    index = np.meshgrid(*[np.arange(n) for n in pos.grid], indexing="ij")
    for n, dim, divisor, idx in zip(pos.grid, setting.axes_dim, pos.scale, index):
        c, s = _cos_sin32(angles(n, setting.theta, dim, divisor))
        cos.append(c[idx.ravel()])
        sin.append(s[idx.ravel()])
    return np.ascontiguousarray(np.concatenate(cos + sin, axis=1), np.float32)


def text_cache(txt_len: int, setting: Setting) -> np.ndarray:
    """The ``[txt_len, sum(axes_dim)]`` float32 text cache (one axis over the whole width)."""
    c, s = _cos_sin32(angles(txt_len, setting.theta, setting.width))
    return np.ascontiguousarray(np.concatenate([c, s], axis=1), np.float32)


def build(pos: Positions, setting: Setting) -> tuple:
    """``(img, txt)`` float32 caches of a checked request."""
    return image_cache(pos, setting), text_cache(pos.txt_len, setting)
