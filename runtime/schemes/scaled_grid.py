"""The "scaled_grid" position scheme: caches from a video latent's token grid, every axis from
0, a RoPE base per axis and frame positions scaled to a base frame rate, in float32 as torch
computes them (numpy only; copied beside the Triton rope model). Cosmos-Predict2's scheme
(diffusers' ``CosmosRotaryPosEmbed``); the axes, bases, table size and base frame rate are the
family's (:class:`~._common.Setting` ``axes_dim``, ``axis_thetas``, ``max_positions``,
``base_fps``), so no family fact lives here.

- Request fields: ``grid`` (``(frames, height, width)`` in tokens, i.e. latent patches) and
  ``fps`` (None: an image call, positions unscaled; a number: a video's frame rate).
- Cache rows: ``f * h * w`` image rows in the model's token order (frames, then rows, then
  columns); no text rows (the text stream is not rotated: the cross-attention has no RoPE).
  Checks: positive whole numbers within ``max_positions`` per axis (diffusers' table), a
  finite positive fps.
- The numpy pair: row (t, h, w) holds ``cos`` of the frame, row and column angles, then their
  ``sin`` (the cos half, then the sin half, of a split-halves rotation).
- Triton inputs: ``grid`` INT64 [3] and ``fps`` FP32 [1] (0: none).
- Profile limits: each preset's grid within ``max_positions`` tokens per axis.

Bits. diffusers computes in float32: the exponents ``arange(0, d, 2) / d``, the inverse
frequencies ``1.0 / theta_i ** exponents`` (the base a float32 scalar), the positions (``seq /
fps * base_fps`` for a video), the angles ``outer(positions, frequencies)`` and their cos and
sin. Division and multiplication are IEEE operations, done here in the same order on the same
float32 values, so the angles are bit-identical. torch's float32 ``pow``, ``cos`` and ``sin``
on the CPU are SLEEF's vectorised functions (1-ulp bounds); here they are the correctly rounded
values (the C library's float64 function, rounded to float32). For ``pow`` these agree on every
exponent of the axes up to 128 wide for the bases of the configs tested (test_family_cosmos);
torch's ``cos`` / ``sin`` differ from the correctly rounded value in the last bit for a few per
cent of angles, so the caches are within one float32 ulp of diffusers' CPU caches, and that is
what the family's tests bound.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Sequence

import numpy as np

from ._common import BadRequest, PositionOverflow, Setting, check_bytes, finish  # noqa: F401
from ._common import check_grid as _check_grid, triton_grid

NAME = "scaled_grid"
FIELDS = ("grid", "fps")
POSITION_FIELDS: tuple = ()
TEXT_LENGTH_FIELD = None
NEEDS = ("axis_thetas", "max_positions")
#: The images a request holds: the one latent grid.
IMAGES = 1


class Positions(NamedTuple):
    """A checked request: the token grid and the frame rate (None: none)."""

    grid: tuple
    fps: object


#: A grid of this scheme's models, for the messages.
GRID_EXAMPLE = "(1, 44, 80) for a 704x1280 image with 2x2 patches"


def check_grid(grid) -> tuple:
    """``grid`` as a positive ``(frames, height, width)`` int triple (tokens)."""
    return _check_grid(grid, GRID_EXAMPLE)


def check_fps(fps):
    """None, or the video's frame rate as a finite number > 0 (an int stays an int)."""
    if fps is None:
        return None
    if hasattr(fps, "item") and getattr(fps, "size", 1) == 1:
        fps = fps.item()
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) \
            or fps <= 0:
        raise BadRequest(f"fps must be the video's frame rate, a finite number > 0 (or None for "
                         f"an image); got {fps!r:.60}")
    return fps


def positions(request: dict, setting: Setting, max_bytes=None) -> Positions:
    """The checked request; :class:`BadRequest` naming what is wrong, :class:`TooLarge` above
    ``max_bytes``, :class:`PositionOverflow` past the table (``max_positions``)."""
    unknown = sorted(set(request) - set(FIELDS))
    if unknown:
        raise BadRequest(f"the scaled_grid scheme takes {list(FIELDS)}; got {unknown}")
    grid = check_grid(request.get("grid"))
    fps = check_fps(request.get("fps"))
    f, h, w = grid
    check_bytes(f * h * w, setting, max_bytes, f"a token grid of {grid}",
                "give the grid in tokens (latent frames, latent rows / patch, latent columns / "
                "patch)")
    pos = Positions(grid, fps)
    check(pos, setting)
    return pos


def rows(pos: Positions) -> tuple:
    f, h, w = pos.grid
    return f * h * w, 0


def key(pos: Positions) -> tuple:
    return (NAME, pos.grid, None if pos.fps is None else (type(pos.fps).__name__, pos.fps))


def describe(pos: Positions) -> str:
    return "token grid"


def check(pos: Positions, setting: Setting) -> None:
    """Every axis within the table diffusers builds (``max_positions`` positions)."""
    limit = setting.max_positions
    if limit is None:
        return
    for name, n in zip(("frames", "height", "width"), pos.grid):
        if n > limit:
            raise PositionOverflow(
                f"the token grid {pos.grid} has {n} {name} positions, more than the {limit} the "
                f"model's RoPE table holds (max(max_size / patch_size) of its config). Fix: a "
                f"smaller latent, or a model whose max_size covers it",
                stream="image", required=int(n), available=int(limit))


def triton_inputs(setting: Setting) -> list:
    return [("grid", "TYPE_INT64", [3]), ("fps", "TYPE_FP32", [1])]


def triton_request(request: dict, setting: Setting) -> dict:
    """The arrays a Triton client sends for ``request`` (:func:`triton_inputs`; fps 0: none)."""
    fps = request.get("fps")
    return {"grid": np.asarray(request["grid"], np.int64).reshape(3),
            "fps": np.asarray([0.0 if fps is None else fps], np.float32)}


def triton_positions(inputs: dict, shapes: dict, names: dict, setting: Setting, *,
                     max_img: int, max_txt: int) -> Positions:
    """The checked request of a Triton client: ``grid`` [3] (tokens), ``fps`` [1] (0: an image
    call), ``shapes["latent"]`` the latent's shape in tokens ``[batch, tokens, ...]`` (the text
    is not read: it has no rows). The grid must be the latent's, within ``max_img`` tokens."""
    fps = np.asarray(inputs["fps"])
    if fps.shape != (1,) or not np.issubdtype(fps.dtype, np.floating):
        raise BadRequest(f"fps must be FP32 [1] (the frame rate; 0 for an image); got "
                         f"{fps.dtype} {list(fps.shape)}")
    f, h, w = triton_grid(inputs, shapes, names, max_img, GRID_EXAMPLE)
    rate = float(fps[0])
    return positions({"grid": (f, h, w), "fps": None if rate == 0 else rate}, setting)


def profile_limits(setting: Setting, grids: Sequence, txt_max: int):
    """The first preset grid with an axis past ``max_positions`` tokens, as ``("image", index,
    needed, available)``; None when every grid fits (the text has no positions)."""
    if setting.max_positions is None:
        return None
    for i, grid in enumerate(grids):
        if max(grid) > setting.max_positions:
            return ("image", i, int(max(grid)), int(setting.max_positions))
    return None


# --------------------------------------------------------------------------------------------
# The arithmetic (float32, diffusers' order)
# --------------------------------------------------------------------------------------------

def _pow32(base: np.float32, exponents: np.ndarray) -> np.ndarray:
    """float32 ``base ** exponents``, correctly rounded (float64 ``pow`` of the float32 values:
    exact to well within the float32 rounding)."""
    b = float(base)
    return np.array([math.pow(b, float(e)) for e in exponents], np.float64).astype(np.float32)


def frequencies(theta: float, dim: int) -> np.ndarray:
    """``1.0 / theta ** (arange(0, dim, 2)[:dim // 2] / dim)`` in float32."""
    exponents = np.arange(0, dim, 2, dtype=np.float32)[: dim // 2] / np.float32(dim)
    return np.float32(1.0) / _pow32(np.float32(theta), exponents)


def axis_positions(n: int, fps, base_fps) -> np.ndarray:
    """Positions ``0..n-1`` in float32, scaled ``/ fps * base_fps`` where ``fps`` is given."""
    seq = np.arange(int(n), dtype=np.float32)
    if fps is None or base_fps is None:
        return seq
    return (seq / np.float32(fps)) * np.float32(base_fps)


def _cos_sin32(angles: np.ndarray) -> tuple:
    """float32 cos and sin of float32 ``angles``, correctly rounded."""
    flat = angles.astype(np.float64).ravel().tolist()
    cos = np.fromiter(map(math.cos, flat), np.float64, len(flat)).astype(np.float32)
    sin = np.fromiter(map(math.sin, flat), np.float64, len(flat)).astype(np.float32)
    return cos.reshape(angles.shape), sin.reshape(angles.shape)


def tables(pos: Positions, setting: Setting) -> list:
    """Per axis (frames, height, width): the float32 ``(cos, sin)`` of ``[n_i, d_i / 2]``."""
    thetas = setting.axis_thetas or (setting.theta,) * 3
    out = []
    for i, (n, dim, theta) in enumerate(zip(pos.grid, setting.axes_dim, thetas)):
        seq = axis_positions(n, pos.fps if i == 0 else None, setting.base_fps)
        angles = np.multiply.outer(seq, frequencies(theta, int(dim)))  # float32 products
        out.append(_cos_sin32(angles))
    return out


def cache(pos: Positions, setting: Setting) -> np.ndarray:
    """The ``[f * h * w, sum(axes_dim)]`` float32 image cache."""
    (ct, st), (ch, sh), (cw, sw) = tables(pos, setting)
    f, h, w = pos.grid
    t_i, h_i, w_i = (a.reshape(-1) for a in np.meshgrid(np.arange(f), np.arange(h),
                                                        np.arange(w), indexing="ij"))
    return np.ascontiguousarray(np.concatenate(
        [ct[t_i], ch[h_i], cw[w_i], st[t_i], sh[h_i], sw[w_i]], axis=1), np.float32)


def build(pos: Positions, setting: Setting) -> tuple:
    """``(img, txt)`` float32 caches: the image cache and no text rows."""
    img = cache(pos, setting)
    return finish((img, np.zeros((0, img.shape[1]), np.float32)), setting)


def sample_request(grid, fps=None) -> dict:
    """The request of a sample of this token grid."""
    return {"grid": tuple(int(v) for v in grid), "fps": fps}
