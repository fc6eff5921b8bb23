"""The "patch-grid" position scheme: caches from the token grid of one latent that the model
patchifies itself, each axis counted from 0, in float32 (numpy only; copied beside the Triton
rope model). HunyuanImage-2.1's scheme (diffusers' ``HunyuanImageRotaryPosEmbed``); the axes and
theta are the family record's and the model's sidecar's.

- Request fields: ``img_shapes`` (one ``(frames, height, width)`` token grid: the latent's
  axes divided by the patch size; a model with two RoPE axes takes one frame) and
  ``txt_seq_len``.
- Cache rows: image rows = frames x height x width, row-major (frame, then row, then column: the
  order of the model's patch embedding); text rows = ``txt_seq_len``, identity rows (cos 1,
  sin 0): this scheme has no text positions, the text is normalised but not rotated.
- The numpy pair: image token (f, y, x) holds, per axis, the angles ``pos * inv_freq`` of
  ``pos`` = its frame (three axes only), row and column (:func:`build`).
- Triton inputs: ``img_shapes`` INT64 [1, 3]; the text length is read off the text tensor.
- Profile limits: none (no table bounds the positions).

Bits. diffusers builds these caches with ``get_1d_rotary_pos_embed(use_real=True)`` in its
default float32: ``1.0 / theta ** (arange(0, d, 2) / d)`` (float32; the C library's ``powf``
for axes up to 64 wide, see :mod:`.grid`), the float32 products ``pos * inv_freq``, and their
cos and sin by torch's float32 ``cos`` / ``sin``. Those last two are device-dependent: on an x86
CPU torch evaluates them with SLEEF's vectorised 1-ulp functions, on a GPU with CUDA's ``cosf``
/ ``sinf``; neither is the C library's. This module uses the C library's ``cosf`` / ``sinf`` on
the same float32 angles (as :mod:`.grid`): the angles and frequencies are bit-equal to
diffusers', the cos and sin within one float32 ulp of any of those devices' (about 5% of the
entries differ in the last bit from a CPU torch's, tests/test_family_hunyuan_image.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np

from ._common import BadRequest, Setting, check_bytes, identity_rows, request_arrays, whole
from .grid import _cos_sin, check_img_shapes, inverse_frequencies

NAME = "patch-grid"
FIELDS = ("img_shapes", "txt_seq_len")
POSITION_FIELDS: tuple = ()
TEXT_LENGTH_FIELD = "txt_seq_len"
NEEDS: tuple = ()
#: The images a request holds: the latent's one grid (no condition images).
IMAGES = 1


class Positions(NamedTuple):
    """A checked request: the token grid ``(frames, height, width)`` and the text length."""

    grid: tuple
    txt_len: int


def positions(request: dict, setting: Setting, max_bytes=None) -> Positions:
    """The checked request; :class:`BadRequest` naming what is wrong (more than one image, a
    frame axis on a model with two RoPE axes), :class:`~._common.TooLarge` above ``max_bytes``,
    before anything is built."""
    shapes = check_img_shapes(request.get("img_shapes"))
    if len(shapes) != 1:
        raise BadRequest(f"img_shapes must hold one token grid (frames, height, width) for this "
                         f"model (it has no condition images); got {len(shapes)} grids. Fix: "
                         f"pass the grid of the latent alone")
    grid = shapes[0]
    if len(setting.axes_dim) == 2 and grid[0] != 1:
        raise BadRequest(f"img_shapes {list(grid)}: this model's RoPE has two axes (height, "
                         f"width), so its latent has one frame; got {grid[0]}. Fix: pass "
                         f"(1, height, width)")
    if len(setting.axes_dim) not in (2, 3):
        raise BadRequest(f"the patch-grid scheme takes two or three RoPE axes; got "
                         f"{list(setting.axes_dim)}. Fix: re-export the model")
    txt_len = whole(request.get("txt_seq_len"), "txt_seq_len")
    if txt_len < 1:
        raise BadRequest(f"txt_seq_len must be >= 1; got {txt_len!r}")
    pos = Positions(grid, txt_len)
    check_bytes(sum(rows(pos)), setting, max_bytes,
                f"img_shapes {[list(grid)]} with {txt_len} text tokens",
                "the grid is the latent's axes over the patch size (a 2048x2048 image of a 32x "
                "VAE is (1, 64, 64)), not pixels")
    return pos


def rows(pos: Positions) -> tuple:
    """(image rows, text rows) of the caches."""
    f, h, w = pos.grid
    return f * h * w, int(pos.txt_len)


def key(pos: Positions) -> tuple:
    return (NAME, pos.grid, pos.txt_len)


def describe(pos: Positions) -> str:
    return f"img_shapes {[list(pos.grid)]}"


def sample_request(img_shapes, txt_len: int) -> dict:
    """The request of a sample of these sizes (one grid: the latent's; more are refused by
    :func:`positions`)."""
    return {"img_shapes": [tuple(int(v) for v in s) for s in img_shapes],
            "txt_seq_len": int(txt_len)}


def check(pos: Positions, setting: Setting) -> None:
    """No table bounds the positions: nothing past the request's own checks."""


def triton_inputs(setting: Setting) -> list:
    """The rope model's inputs in place of the caches: (name, Triton type, dims)."""
    return [("img_shapes", "TYPE_INT64", [-1, 3])]


def triton_request(request: dict, setting: Setting) -> dict:
    """The arrays a Triton client sends for ``request`` (:func:`triton_inputs`)."""
    return request_arrays(triton_inputs(setting), request)


def profile_limits(setting: Setting, grids: Sequence, txt_max: int):
    """No table: every profile is usable (None)."""
    return None


@functools.lru_cache(maxsize=32)
def axis_table(theta: float, dim: int, count: int) -> tuple:
    """``(cos, sin)`` float32 ``[count, dim / 2]`` of positions 0..count-1 on one axis (the
    float32 angles ``pos * inv_freq``; read-only)."""
    angles = np.outer(np.arange(int(count), dtype=np.int64).astype(np.float32),
                      inverse_frequencies(theta, int(dim)))  # float32 products
    cos, sin = _cos_sin(angles)
    cos.flags.writeable = False
    sin.flags.writeable = False
    return cos, sin


def build(pos: Positions, setting: Setting) -> tuple:
    """``(img [f*h*w, width], txt [txt_len, width])`` float32 caches (cos half then sin half,
    axes in order within each half; the text identity rows) of a checked request."""
    f, h, w = pos.grid
    axes = tuple(int(d) for d in setting.axes_dim)
    sizes = (h, w) if len(axes) == 2 else (f, h, w)
    grids = np.meshgrid(*[np.arange(n, dtype=np.int64) for n in sizes], indexing="ij")
    cos, sin = [], []
    for dim, n, g in zip(axes, sizes, grids):
        c, s = axis_table(float(setting.theta), dim, n)
        cos.append(c[g.ravel()])
        sin.append(s[g.ravel()])
    img = np.ascontiguousarray(np.concatenate(cos + sin, axis=1), np.float32)
    return img, identity_rows(pos.txt_len, setting.width)


def caches(grid: Sequence[int], txt_len: int, setting: Setting) -> tuple:
    """:func:`build` of an already-validated grid and text length."""
    return build(Positions(tuple(int(v) for v in grid), int(txt_len)), setting)


def triton_positions(inputs: dict, shapes: dict, names: dict, setting: Setting, *,
                     max_img: int, max_txt: int) -> Positions:
    """The checked request of a Triton client (as :func:`.grid.triton_positions`): ``inputs``
    the ``img_shapes`` array, ``shapes`` the shapes of the latent (``"latent"``, packed tokens
    ``[batch, tokens, features]``) and the text tensor (``"txt"``, only its length is read)."""
    arr = np.asarray(inputs["img_shapes"])
    if arr.ndim != 2 or arr.shape != (1, 3):
        raise BadRequest(f"img_shapes must be [1, 3] (frames, height, width of the latent's "
                         f"token grid, e.g. [[1, 64, 64]]); got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer) or (arr < 1).any():
        raise BadRequest(f"img_shapes entries must be positive integers; got {arr.tolist()}")
    grid = tuple(int(v) for v in arr[0])
    tokens = grid[0] * grid[1] * grid[2]  # Python ints: no overflow
    if tokens > max_img:
        raise BadRequest(f"img_shapes {[list(grid)]} give {tokens} image tokens, more than the "
                         f"{max_img} the served model accepts")
    text, latent = shapes["txt"], shapes["latent"]
    if len(text) != 2 or text[1] < 1:
        raise BadRequest(f"{names['txt']} must be [batch, txt_tokens] with at least one token; "
                         f"got shape {list(text)}")
    if int(text[1]) > max_txt:
        raise BadRequest(f"{names['txt']} has {int(text[1])} text tokens, more than the "
                         f"{max_txt} the served model accepts")
    if len(latent) != 3 or latent[1] != tokens:
        raise BadRequest(f"img_shapes {[list(grid)]} give {tokens} image tokens but "
                         f"{names['latent']} has shape {list(latent)}: the grid must be that "
                         f"of its tokens (axis 1)")
    return positions({"img_shapes": [grid], "txt_seq_len": int(text[1])}, setting)
