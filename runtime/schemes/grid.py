"""The "grid" position scheme: caches from the latent grids of the images and a text length
(numpy only; copied beside the Triton rope model). Qwen-Image's scheme (diffusers'
``QwenEmbedRope``); which family uses it, and with which numbers, is the family record's.

- Request fields: ``img_shapes`` (``[(frames, height, width), ...]`` in latent patches; diffusers'
  per-batch form ``[[...]] * batch`` when every item is the same) and ``txt_seq_len``.
- Cache rows: image rows = sum of f x h x w, text rows = ``txt_seq_len``; checks: positive whole
  numbers, and the positions within the tables (``Setting.max_positions`` per axis and sign).
- The numpy pair: image k's tokens at (k + frame, centred row, centred column), or rows and
  columns counted from 0 (``Setting.scale_rope`` False: a video latent's own grid, HunyuanVideo),
  the text after the largest image (:func:`caches`); a text the model does not rotate gets
  identity rows and no table limit.
- Triton inputs: ``img_shapes`` INT64 [-1, 3]; the text length is read off the text tensor.
- Profile limits: each preset's image extent and the text rows left after it
  (:func:`profile_limits`).

Bits. diffusers builds its tables with ``torch.polar`` over float32 angles; torch's CPU kernel of
``polar`` evaluates the C library's single-precision ``cosf`` / ``sinf`` one element at a time.
This module calls the same two functions (``ctypes`` over the C maths library) on the same float32
angles, so the tables are bit-identical to diffusers' (``tests/test_rope_tables.py`` compares them
bit for bit). The inverse frequencies ``1 / theta ** (2i / d)`` use the C library's ``powf``,
which is what torch's float32 ``pow`` gives for axes up to 64 wide (32 frequencies; Qwen-Image's
axes are 16 and 56 wide); torch evaluates longer ones with a vectorised ``pow`` whose last bit can
differ. Where no C maths library can be loaded, numpy's float64 functions rounded to float32 are
used instead: within one float32 ulp of those bits, not bit-identical (``BIT_EXACT`` says which).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import numpy as np

from ._common import (BIT_EXACT, LIBM, BadRequest, PositionOverflow, Setting,  # noqa: F401
                      check_bytes, finish, request_arrays, whole)

NAME = "grid"
#: What a request gives in place of the caches.
FIELDS = ("img_shapes", "txt_seq_len")
#: Request fields given as tensors that are position values (none: the grids are counts).
POSITION_FIELDS: tuple = ()
#: The field a runner fills with the text tensor's length when the caller gives none.
TEXT_LENGTH_FIELD = "txt_seq_len"
#: Setting fields the scheme needs (besides axes_dim and theta).
NEEDS = ("max_positions",)

Shapes = Sequence[Sequence[int]]  # [(frames, height, width), ...] in latent patches


class Positions(NamedTuple):
    """A checked request: the image grids and the text length."""

    shapes: tuple
    txt_len: int


# --------------------------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------------------------

def _is_seq(entry: object) -> bool:
    return isinstance(entry, Sequence) and not isinstance(entry, (str, bytes))


def _is_triple(entry: object) -> bool:
    return _is_seq(entry) and len(entry) == 3 and all(not isinstance(v, Sequence) for v in entry)


def check_img_shapes(img_shapes: Shapes) -> tuple:
    """``img_shapes`` as a tuple of positive ``(f, h, w)`` int triples; diffusers' per-batch
    form (one list per batch item) when every item is the same."""
    example = ("img_shapes must be a list of (frames, height, width) triples in latent patches, "
               "e.g. [(1, 64, 64)] for a 1024x1024 image, or diffusers' per-batch form "
               "[[(1, 64, 64)]] * batch_size")
    if isinstance(img_shapes, np.ndarray):
        img_shapes = img_shapes.tolist()
    if isinstance(img_shapes, tuple) and _is_triple(img_shapes):
        img_shapes = [img_shapes]  # one (f, h, w) triple
    if not _is_seq(img_shapes):
        raise BadRequest(f"{example}; got {img_shapes!r}")
    entries = list(img_shapes)
    if entries and all(_is_seq(e) and not _is_triple(e) and len(e) > 0
                       and all(_is_triple(x) for x in e) for e in entries):
        # diffusers' pipelines pass one list of image shapes per batch item. The caches have no
        # batch axis, so this is unambiguous only when every batch item has the same images.
        per_item = [tuple(tuple(x) for x in e) for e in entries]
        if any(item != per_item[0] for item in per_item[1:]):
            raise BadRequest(
                f"img_shapes gives different images per batch item ({per_item}); the RoPE caches "
                f"have no batch axis (one row per token, shared by the batch), so every item of a "
                f"batch must have the same image shapes. Fix: batch only samples of one size.")
        entries = list(per_item[0])
    if not entries:
        raise BadRequest("img_shapes is empty: give at least one (frames, height, width) triple")
    shapes = []
    for entry in entries:
        if not _is_triple(entry):
            raise BadRequest(f"{example}; got the entry {entry!r} in {img_shapes!r}")
        f, h, w = (whole(v, "img_shapes values (frames, height, width)") for v in entry)
        if f < 1 or h < 1 or w < 1:
            raise BadRequest(f"img_shapes entries must be positive; got {(f, h, w)}")
        shapes.append((f, h, w))
    return tuple(shapes)


def positions(request: dict, setting: Setting, max_bytes=None) -> Positions:
    """The checked request (``img_shapes``, ``txt_seq_len``); :class:`BadRequest` naming what
    is wrong, and :class:`~._common.TooLarge` for caches above ``max_bytes``, before anything
    is built."""
    shapes = check_img_shapes(request.get("img_shapes"))
    txt_len = whole(request.get("txt_seq_len"), "txt_seq_len")
    if txt_len < 1:
        raise BadRequest(f"txt_seq_len must be >= 1; got {txt_len!r}")
    pos = Positions(shapes, txt_len)
    check_bytes(sum(rows(pos)), setting, max_bytes,
                f"img_shapes {list(shapes)} with {txt_len} text tokens",
                "the shapes are in latent patches (a 1024x1024 image is (1, 64, 64)), not pixels.")
    return pos


def rows(pos: Positions) -> tuple:
    """(image rows, text rows) of the caches."""
    return image_tokens(pos.shapes), int(pos.txt_len)


def key(pos: Positions) -> tuple:
    """What identifies the caches of a request (for a memo)."""
    return (NAME, pos.shapes, pos.txt_len)


def describe(pos: Positions) -> str:
    return f"img_shapes {list(pos.shapes)}"


def sample_request(img_shapes: Shapes, txt_len: int) -> dict:
    """The request of a sample of these sizes (what the exporter traces, ``qkrope check``
    feeds): the grids themselves."""
    return {"img_shapes": [tuple(int(v) for v in s) for s in img_shapes],
            "txt_seq_len": int(txt_len)}


def triton_inputs(setting: Setting) -> list:
    """The rope model's inputs in place of the caches: (name, Triton type, dims)."""
    return [("img_shapes", "TYPE_INT64", [-1, 3])]


def triton_request(request: dict, setting: Setting) -> dict:
    """The arrays a Triton client sends for ``request`` (:func:`triton_inputs`)."""
    return request_arrays(triton_inputs(setting), request)


# --------------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------------

def _cos_sin(angles: np.ndarray) -> tuple:
    """float32 cos and sin of float32 ``angles`` (see the module docstring for the bits)."""
    if LIBM is None:
        wide = angles.astype(np.float64)
        return np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)
    cosf, sinf, _ = LIBM
    flat = angles.ravel().tolist()  # Python floats hold float32 values exactly
    cos = np.fromiter(map(cosf, flat), np.float32, len(flat)).reshape(angles.shape)
    sin = np.fromiter(map(sinf, flat), np.float32, len(flat)).reshape(angles.shape)
    return cos, sin


def inverse_frequencies(theta: float, dim: int) -> np.ndarray:
    """``1 / theta ** (arange(0, dim, 2) / dim)`` in float32, as diffusers computes it."""
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    base = float(np.float32(theta))
    if LIBM is None:
        power = np.power(base, exponents.astype(np.float64)).astype(np.float32)
    else:
        powf = LIBM[2]
        power = np.array([powf(base, e) for e in exponents.tolist()], np.float32)
    return np.float32(1.0) / power


def _cos_sin64(magnitudes: np.ndarray, theta: float, dim: int) -> tuple:
    """float32 cos and sin of the float64 angles ``m / theta ** (2i / dim)``, as diffusers'
    ``get_1d_rotary_pos_embed(..., freqs_dtype=torch.float64)`` computes them (float64
    frequencies, outer product, cos / sin, then ``.float()``)."""
    exponents = np.arange(0, dim, 2, dtype=np.float64)[: dim // 2] / np.float64(dim)
    freqs = 1.0 / (np.float64(theta) ** exponents)
    angles = np.outer(magnitudes.astype(np.float64), freqs)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@functools.lru_cache(maxsize=8)
def axis_tables(theta: float, axes_dim: tuple, max_positions: int,
                precision: str = "float32") -> tuple:
    """Per axis, ``(cos, sin)`` float32 ``[max_positions + 1, dim / 2]`` of the angles
    ``m * inv_freq`` for m = 0..max_positions (read-only). Position p >= 0 is row p; position -m
    is ``(cos[m], -sin[m])`` (float32 negation of an angle is exact and cosf/sinf are even/odd).
    ``precision`` "float64": the angles, cos and sin in float64, rounded once
    (:class:`~._common.Setting`)."""
    out = []
    magnitudes = np.arange(int(max_positions) + 1, dtype=np.int64).astype(np.float32)
    for dim in axes_dim:
        if precision == "float64":
            cos, sin = _cos_sin64(magnitudes, theta, dim)
        else:
            angles = np.outer(magnitudes, inverse_frequencies(theta, dim))  # float32 products
            cos, sin = _cos_sin(angles)
        cos.flags.writeable = False
        sin.flags.writeable = False
        out.append((cos, sin))
    return tuple(out)


def _rows(table: tuple, positions_: np.ndarray):
    cos, sin = table
    mag = np.abs(positions_)
    s = sin[mag]
    return cos[mag], np.where((positions_ < 0)[:, None], -s, s)


def image_tokens(shapes: Shapes) -> int:
    """Rows of the image cache: the latent's tokens, sum of frames x height x width."""
    return sum(int(f) * int(h) * int(w) for f, h, w in shapes)


def text_offset(shapes: Shapes, scale_rope: bool = True) -> int:
    """Position of the first text token: just after the largest image's positions."""
    return max(max(int(h) // 2, int(w) // 2) if scale_rope else max(int(h), int(w))
               for _, h, w in shapes)


def image_extent(frames_offset: int, shape: Sequence[int], scale_rope: bool = True) -> int:
    """The table entries image ``frames_offset`` of shape ``(f, h, w)`` needs per axis and
    direction: frames use positions k .. k+f-1; centred height/width use -(n - n//2) .. n//2 - 1,
    uncentred ones 0 .. n-1. It fits when <= the tables' positions."""
    f, h, w = (int(v) for v in shape)
    extent = max(h - h // 2, w - w // 2) if scale_rope else max(h, w)
    return max(int(frames_offset) + f, extent)


def text_rows(shapes: Shapes, max_positions: int, scale_rope: bool = True) -> int:
    """The text tokens the tables leave after these images: text token j sits at position
    offset + j (the offset set by the largest image) and the tables end at max_positions."""
    return int(max_positions) - text_offset(shapes, scale_rope)


def _max_positions(setting: Setting) -> int:
    if not isinstance(setting.max_positions, int) or setting.max_positions < 1:
        raise BadRequest(f"the grid scheme needs the size of its position tables "
                         f"(max_positions); got {setting.max_positions!r}. Fix: re-export the "
                         f"model with `qkrope export`")
    return setting.max_positions


def check(pos: Positions, setting: Setting) -> None:
    """Raise :class:`PositionOverflow` where an image or the text runs past the tables."""
    limit = _max_positions(setting)
    scale_rope = setting.scale_rope
    for k, (f, h, w) in enumerate(pos.shapes):
        needed = image_extent(k, (f, h, w), scale_rope)
        if needed > limit:
            raise PositionOverflow(
                f"RoPE image cache overflow: image {k} has shape {(f, h, w)} "
                f"(frames, height, width in latent patches) but the position tables hold "
                f"{limit} positions per axis and direction. Fix: use fewer frames or "
                f"a smaller image.", stream="image", required=needed, available=limit)
    if "txt" not in setting.rotated:
        return  # the text gets identity rows: no position of it is read from the tables
    offset = text_offset(pos.shapes, scale_rope)
    # Text token j sits at position offset + j; the table ends at max_positions, so the text
    # stream has max_positions - offset rows. The three numbers mean what sglang's guard reports.
    txt_cache_len = text_rows(pos.shapes, limit, scale_rope)
    if pos.txt_len > txt_cache_len:
        raise PositionOverflow(
            f"RoPE text cache overflow: required_txt_seq_len={pos.txt_len}, "
            f"txt_cache_len={txt_cache_len}, overflow={pos.txt_len - txt_cache_len} (the text "
            f"positions start at offset {offset}, set by the largest image, and the position "
            f"table ends at {limit}). Fix: shorten the prompt to at most "
            f"{txt_cache_len} tokens, or use fewer or smaller images.",
            stream="text", required=pos.txt_len, available=txt_cache_len)


def _centred(n: int) -> np.ndarray:
    return np.arange(-(n - n // 2), n // 2, dtype=np.int64)


def build(pos: Positions, setting: Setting) -> tuple:
    """``(img [image_tokens, width], txt [txt_len, width])`` float32 caches (cos half then sin
    half, axes in (frame, height, width) order within each half) of a checked request; raises
    :class:`PositionOverflow` past the tables."""
    check(pos, setting)
    shapes, txt_len, scale_rope = pos.shapes, pos.txt_len, setting.scale_rope
    tables = axis_tables(float(setting.theta), tuple(int(d) for d in setting.axes_dim),
                         int(setting.max_positions), setting.precision)
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
    if "txt" in setting.rotated:
        offset = text_offset(shapes, scale_rope)
        text = np.arange(offset, offset + txt_len, dtype=np.int64)
        parts = [_rows(t, text) for t in tables]
        txt = np.concatenate([c for c, _ in parts] + [s for _, s in parts], axis=1)
    else:  # normalised, not rotated (finish() writes its identity rows)
        txt = np.zeros((txt_len, img.shape[1]), np.float32)
    return finish((np.ascontiguousarray(img, np.float32), np.ascontiguousarray(txt, np.float32)),
                  setting)


def caches(shapes: Shapes, txt_len: int, setting: Setting) -> tuple:
    """:func:`build` of already-validated ``shapes`` and ``txt_len``."""
    return build(Positions(tuple((int(f), int(h), int(w)) for f, h, w in shapes), int(txt_len)),
                 setting)


# --------------------------------------------------------------------------------------------
# Profile limits
# --------------------------------------------------------------------------------------------

def profile_limits(setting: Setting, grids: Sequence, txt_max: int):
    """What an engine profile of these image ``grids`` (``(f, h, w)``, one per preset) and up
    to ``txt_max`` text tokens can use: None when every call it admits fits the tables, else
    ``(kind, index, needed, available)`` with kind "image" (preset ``index`` needs ``needed``
    positions per axis) or "text" (``available`` text rows are left after preset ``index``,
    -1: the text alone)."""
    limit = _max_positions(setting)
    for k, shape in enumerate(grids):
        needed = image_extent(0, shape, setting.scale_rope)
        if needed > limit:
            return ("image", k, needed, limit)
    if "txt" not in setting.rotated:  # identity text rows: no table bounds the text
        return None
    if not grids:
        rows_left, index = limit, -1
    else:
        rows_left, index = min((text_rows([s], limit, setting.scale_rope), k)
                               for k, s in enumerate(grids))
    if txt_max > rows_left:
        return ("text", index, txt_max, rows_left)
    return None


# --------------------------------------------------------------------------------------------
# A Triton request (the rope model beside a served transformer)
# --------------------------------------------------------------------------------------------

def triton_positions(inputs: dict, shapes: dict, names: dict, setting: Setting, *,
                     max_img: int, max_txt: int) -> Positions:
    """The checked request of a Triton client: ``inputs`` the arrays of :func:`triton_inputs`
    by name, ``shapes`` the shapes of the latent (``"latent"``) and the text tensor (``"txt"``,
    ``[batch, txt_tokens]``: only the length is read), ``names`` their input names (for
    messages); the served model's limits in tokens. Hostile sizes are refused with Python ints
    before any array is made from them."""
    arr = np.asarray(inputs["img_shapes"])
    if arr.ndim != 2 or arr.shape[1] != 3 or arr.shape[0] < 1:
        raise BadRequest(f"img_shapes must be [images, 3] (frames, height, width in latent "
                         f"patches, e.g. [[1, 64, 64]] for a 1024x1024 image); got shape "
                         f"{list(arr.shape)}")
    if arr.shape[0] > max_img:  # every image has at least one token
        raise BadRequest(f"img_shapes has {arr.shape[0]} images, more than the {max_img} image "
                         f"tokens the served model accepts")
    if not np.issubdtype(arr.dtype, np.integer) or (arr < 1).any():
        raise BadRequest(f"img_shapes entries must be positive integers; got "
                         f"{_show(arr.tolist())}")
    rows_ = tuple(tuple(int(v) for v in row) for row in arr)
    tokens = sum(f * h * w for f, h, w in rows_)  # Python ints: no overflow
    if tokens > max_img:
        raise BadRequest(
            f"img_shapes {_show(rows_)} give {tokens} image tokens, more than the {max_img} the "
            f"served model accepts (its profile's largest image cache); the shapes are in "
            f"latent patches (a 1024x1024 image is [1, 64, 64])")
    text, latent = shapes["txt"], shapes["latent"]
    if len(text) != 2 or text[1] < 1:
        raise BadRequest(f"{names['txt']} must be [batch, txt_tokens] with at least one token; "
                         f"got shape {list(text)}")
    txt_len = int(text[1])
    if txt_len > max_txt:
        raise BadRequest(f"{names['txt']} has {txt_len} text tokens, more than the {max_txt} "
                         f"the served model accepts (its profile's largest text cache)")
    if len(latent) != 3 or latent[1] != tokens:
        raise BadRequest(
            f"img_shapes {_show(rows_)} give {tokens} image tokens but {names['latent']} has "
            f"shape {list(latent)}: img_shapes are the latent patch grids (frames, height / "
            f"vae_scale / 2, width / vae_scale / 2) of the images, and their tokens are "
            f"{names['latent']}'s axis 1")
    return Positions(rows_, txt_len)


def _show(rows_) -> str:
    """img_shapes for a message: the first few rows (a hostile request may send thousands)."""
    rows_ = [list(r) for r in rows_]
    return str(rows_) if len(rows_) <= 4 else f"{str(rows_[:4])[:-1]}, ... ({len(rows_)} images)]"
