"""What every position scheme shares (numpy and the standard library only, no qkrope imports:
``qkrope triton-repo`` copies this package beside the Triton rope model).

- :class:`Setting`: the RoPE numbers a model was exported with (axes widths, theta, and for a
  scheme with position tables their size); the caller fills it from the family's record and the
  model's sidecar, so no family fact lives here.
- the errors a scheme raises (:class:`BadRequest`, :class:`BadPositions`,
  :class:`PositionOverflow`): plain ``ValueError`` subclasses whose message is one line saying
  what arrived and the fix; qkrope turns them into its own errors, the Triton model into
  INVALID_ARG answers.
- :class:`CacheBudget`, the byte-bounded LRU both the library's memo and the Triton model use.
- the C library's float32 ``cosf`` / ``sinf`` / ``powf`` (see :mod:`.grid` for the bits).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import numpy as np

#: Bytes of one fp32 cache value (the caches are float32 on every device).
FP32 = 4


#: The two token streams of a cache pair, image first.
STREAMS = ("img", "txt")
#: The table precisions a Setting may name.
PRECISIONS = ("float32", "float64")


@dataclass(frozen=True)
class Setting:
    """The RoPE numbers of one exported model: ``axes_dim`` (the rotated width of each position
    axis, even, summing to the cache width; a 0-wide axis has no frequencies and gives no
    columns), ``theta`` (the base) and, for a scheme that reads
    tabulated positions (grid), ``max_positions`` (entries per axis and sign) and
    ``scale_rope`` (centred height / width)."""

    axes_dim: tuple
    theta: float
    max_positions: Optional[int] = None
    scale_rope: bool = True
    #: The streams the model rotates; a stream that is normalised but not rotated gets identity
    #: rows (cos 1, sin 0: the fused node's rotation leaves its values exactly as they are).
    rotated: tuple = STREAMS
    #: How the grid scheme's tables are computed: "float32" (float32 angles, the C library's
    #: cosf / sinf: torch.polar over float32 frequencies) or "float64" (float64 frequencies,
    #: angles, cos and sin, then rounded to float32: diffusers' get_1d_rotary_pos_embed with
    #: freqs_dtype=float64).
    precision: str = "float32"
    #: A base per axis where a family's axes have their own (the scaled_grid scheme; None:
    #: ``theta`` for every axis), as the family computes them (float64).
    axis_thetas: Optional[tuple] = None
    #: The frame rate frame positions are scaled to (scaled_grid: position * base_fps / fps
    #: when a call gives its fps; None: no scaling).
    base_fps: Optional[float] = None
    #: The rows of each axis' RoPE table (the table scheme: a position must be below its
    #: axis' length; None: no bound known), as the family's config gives them.
    table_lengths: Optional[tuple] = None

    @property
    def width(self) -> int:
        """The cache width (rotary_dim): the axes widths summed."""
        return sum(int(d) for d in self.axes_dim)


#: The numpy dtype of each Triton type the schemes' rope model inputs use.
TRITON_NUMPY = {"TYPE_INT64": np.int64, "TYPE_FP32": np.float32}


def request_arrays(spec: list, request: dict) -> dict:
    """The arrays a Triton client sends for the fields of ``request``, for the rope model
    inputs ``spec`` (a scheme's ``triton_inputs``: name, Triton type, dims): each field as that
    type, a ``[-1, n]`` input as rows of n (a list of triples, a tensor)."""
    out = {}
    for name, kind, dims in spec:
        value = request[name]
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        arr = np.asarray(value, TRITON_NUMPY[kind])
        out[name] = arr.reshape(-1, dims[-1]) if len(dims) == 2 else arr.reshape(dims)
    return out


def identity_rows(rows: int, width: int) -> np.ndarray:
    """``rows`` cache rows that rotate by nothing: cos 1 in the first half, sin 0 in the second
    (x * 1 - y * 0 = x exactly for finite values)."""
    out = np.zeros((int(rows), int(width)), np.float32)
    out[:, : int(width) // 2] = 1.0
    return out


def finish(pair: tuple, setting: "Setting") -> tuple:
    """A scheme's ``(img, txt)`` pair with the streams ``setting`` does not rotate replaced by
    identity rows (normalised, not rotated)."""
    if tuple(setting.rotated) == STREAMS:
        return pair
    return tuple(c if s in setting.rotated else identity_rows(c.shape[0], c.shape[1])
                 for s, c in zip(STREAMS, pair))


def whole(value: object, what: str) -> int:
    """An integer given as an int (or numpy/torch integer), never a float, str or bool."""
    if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) is not None \
            and str(getattr(value, "dtype")) in ("bool", "torch.bool"):
        raise BadRequest(f"{what} must be an integer; got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise BadRequest(f"{what} must be an integer; got {value!r:.60} "
                         f"({type(value).__name__})") from None


def check_grid(grid, example: str) -> tuple:
    """``grid`` as a positive ``(frames, height, width)`` int triple (tokens), given as a
    triple or ``[(f, h, w)]`` (one grid, the img_shapes form); ``example``: a scheme's model's
    grid, for the message."""
    example = f"grid must be the latent's token grid (frames, height, width), e.g. {example}"
    if isinstance(grid, np.ndarray):
        grid = grid.tolist()
    if isinstance(grid, (list, tuple)) and len(grid) == 1 and isinstance(grid[0], (list, tuple)):
        grid = grid[0]
    if not isinstance(grid, (list, tuple)) or len(grid) != 3:
        raise BadRequest(f"{example}; got {grid!r:.80}")
    f, h, w = (whole(v, "grid values (frames, height, width)") for v in grid)
    if min(f, h, w) < 1:
        raise BadRequest(f"{example}; got {(f, h, w)}: every axis needs at least one token")
    return (f, h, w)


def triton_grid(inputs: dict, shapes: dict, names: dict, max_img: int, example: str) -> tuple:
    """The ``(f, h, w)`` token grid of a Triton request to a one-grid scheme: ``inputs["grid"]``
    INT64 [3], within ``max_img`` tokens and the tokens of the latent (``shapes["latent"]``,
    ``[batch, tokens, ...]``, named ``names["latent"]``); ``example`` as :func:`check_grid`."""
    grid = np.asarray(inputs["grid"])
    if grid.shape != (3,) or not np.issubdtype(grid.dtype, np.integer):
        raise BadRequest(f"grid must be INT64 [3] (frames, height, width of the latent's token "
                         f"grid); got {grid.dtype} {list(grid.shape)}")
    f, h, w = check_grid(grid.tolist(), example)
    tokens = f * h * w  # Python ints: no overflow
    if tokens > max_img:
        raise BadRequest(f"grid {[f, h, w]} gives {tokens} image tokens, more than the "
                         f"{max_img} the served model accepts")
    latent = shapes["latent"]
    if len(latent) < 2 or latent[1] != tokens:
        raise BadRequest(f"grid {[f, h, w]} gives {tokens} image tokens but {names['latent']} "
                         f"has {latent[1] if len(latent) > 1 else '?'}: the grid must be that "
                         f"of its tokens")
    return f, h, w


def stream_cache(pos: np.ndarray, axes_dim, unique, cos_sin) -> np.ndarray:
    """The ``[tokens, sum(axes_dim)]`` float32 cache (cos half then sin half, axes in order
    within each half) of positions ``pos`` [tokens, len(axes_dim)]: each distinct position of
    an axis is evaluated once, ``unique(column)`` giving ``(values, inverse)`` and
    ``cos_sin(values, dim)`` their float32 cos and sin rows (the scheme's arithmetic)."""
    cos_parts, sin_parts = [], []
    for i, dim in enumerate(axes_dim):
        values, inverse = unique(pos[:, i])
        cos, sin = cos_sin(values, int(dim))
        cos_parts.append(cos[inverse.ravel()])
        sin_parts.append(sin[inverse.ravel()])
    return np.ascontiguousarray(np.concatenate(cos_parts + sin_parts, axis=1), np.float32)


def cache_pair(cache, pos, setting: "Setting") -> tuple:
    """``(img, txt)`` float32 caches of a checked request whose streams' positions are
    ``pos.img`` and ``pos.txt``: ``cache(positions, axes_dim=, theta=)`` per stream."""
    axes, theta = tuple(int(d) for d in setting.axes_dim), float(setting.theta)
    return finish((cache(pos.img, axes_dim=axes, theta=theta),
                   cache(pos.txt, axes_dim=axes, theta=theta)), setting)


class BadRequest(ValueError):
    """The request's fields are not what the scheme takes (the message says what and the fix)."""


class BadPositions(BadRequest):
    """Position ids that no cache can be built from (the message says what and the fix)."""


class PositionOverflow(BadRequest):
    """The positions of a request run past the tables (``stream`` is "image" or "text")."""

    def __init__(self, message: str, *, stream: str, required: int, available: int):
        super().__init__(message)
        self.stream = stream
        self.required = required
        self.available = available


class TooLarge(BadRequest):
    """The caches would be larger than the caller's byte bound (refused before building)."""

    def __init__(self, message: str, *, rows: int, nbytes: int):
        super().__init__(message)
        self.rows = rows
        self.nbytes = nbytes


def check_bytes(rows: int, setting: Setting, max_bytes: Optional[int], what: str, fix: str) -> None:
    """Raise :class:`TooLarge` when ``rows`` cache rows of ``setting``'s width exceed
    ``max_bytes`` (None: no bound), naming ``what`` was asked and ``fix``."""
    nbytes = int(rows) * setting.width * FP32
    if max_bytes is not None and nbytes > max_bytes:
        raise TooLarge(f"{what} need RoPE caches of {nbytes / 2**30:.1f} GiB ({rows} rows x "
                       f"{setting.width} fp32), more than the {max_bytes / 2**30:.0f} GiB limit "
                       f"(qkrope.runtime.caches.MAX_CACHE_BYTES). Fix: {fix}",
                       rows=int(rows), nbytes=nbytes)


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

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0

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


LIBM = _libm()
#: Whether the C maths library could be loaded (grid's tables are then bit-exact).
BIT_EXACT = LIBM is not None


def check_token_shapes(latent, text, mask, *, latent_5d: bool = True) -> None:
    """The ranks and batch of the tensors whose shapes carry a call's token counts: ``latent``
    (``hidden_states``: ``[batch, tokens, dim]``, or with ``latent_5d`` a 5-D latent the model
    patchifies), ``text`` (``encoder_hidden_states``: ``[batch, tokens, dim]``; None where the
    caller has only the mask) and ``mask`` (``encoder_hidden_states_mask``: ``[batch,
    txt_tokens]``; None: no mask). Shapes as tuples of ints. One check for both paths: the local
    runner (:func:`qkrope.runtime.runner.check_roles`) and the Triton rope model call it, so a
    ``[1, L, 1]`` mask is refused with the same line on both. Raises :class:`BadRequest`."""
    for name, shape in (("hidden_states", latent), ("encoder_hidden_states", text)):
        if shape is None or (name == "hidden_states" and latent_5d and len(shape) == 5):
            continue
        if len(shape) != 3:
            raise BadRequest(f"{name} must be 3-D [batch, tokens, dim]; got shape "
                             f"{tuple(shape)}. Fix: add the batch dimension "
                             f"({name}.unsqueeze(0)) or flatten heads into dim")
    b = int(latent[0])  # the batch every other tensor follows (the served rope model sees
    # the latent and the mask, not always the text: the mask is checked before the text, and
    # its expected length read from the mask itself only when it is 2-D)
    if mask is not None:
        got = tuple(int(d) for d in mask)
        if len(got) != 2:
            raise BadRequest(
                f"encoder_hidden_states_mask must be [batch, txt_tokens] (2-D, batch {b}; 1 = "
                f"attend); got shape {got}. Fix: one row per batch item, one column per text "
                f"token")
        s_txt = int(text[1]) if text is not None else got[1]
        if got != (b, s_txt):
            raise BadRequest(
                f"encoder_hidden_states_mask must be [batch, txt_tokens] = {(b, s_txt)} (1 = "
                f"attend); got {got}. Fix: one row per batch item, one column per text token")
    if text is not None and int(text[0]) != b:
        raise BadRequest(
            f"batch mismatch: hidden_states has batch {b}, encoder_hidden_states has "
            f"{int(text[0])}. Fix: give both the same batch (e.g. repeat the prompt embedding "
            f"for classifier-free guidance)")


#: Triton's type names of a mask input, as torch / numpy name them.
TRITON_MASK_DTYPES = {"TYPE_BOOL": "bool", "TYPE_INT64": "int64", "TYPE_INT32": "int32",
                      "TYPE_FP32": "float32", "TYPE_FP16": "float16", "TYPE_BF16": "bfloat16"}


def check_mask_dtype(got: str, want: str | None, label: str = "encoder_hidden_states_mask"
                     ) -> None:
    """The prompt mask's dtype (``got``, torch's / numpy's name) is the model's (``want``; None:
    not known, not judged), else :class:`BadRequest`: the one check of the local runner and
    the Triton rope model, after :func:`check_token_shapes`."""
    if want is None or got == want:
        return
    raise BadRequest(f"{label} has dtype {got}; the model expects {want} [batch, txt_tokens]. "
                     f"Fix: pass mask.to(torch.{want})"
                     + (" (True = attend; for a 1/0 float mask use mask > 0)"
                        if want == "bool" else ""))


def show_rows(rows, limit: int = 4) -> str:
    """Rows of a request for a message: the first few (a hostile request may send thousands)."""
    rows = [list(r) for r in rows]
    return str(rows) if len(rows) <= limit else f"{str(rows[:limit])[:-1]}, ... ({len(rows)} rows)]"
