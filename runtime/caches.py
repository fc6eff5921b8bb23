"""RoPE caches in the 2-D ``cos_sin_cache`` format (docs/spec.md sections 2, 5, 6, 7).

- :func:`build_rope_caches` computes a model's caches from what its pipeline passes, through the
  model's position scheme (:mod:`qkrope.runtime.schemes`: "grid", image shapes and a text length;
  "ids", per-token position ids), checked and memoised in one place;
- :func:`caches_for` does it for an exported model, with the scheme and RoPE numbers its sidecar
  and family record give, checked against the model (cache widths, an engine's profiles) first;
- :func:`to_cos_sin_caches` converts the other RoPE formats in use to the cache pair;
- :func:`validate_cos_sin_caches` checks a cache pair before it reaches a model or an engine and
  never copies or converts anything.

The families' own builders (``build_qwen_rope_caches``, ``build_flux_rope_caches``) live in
their folders (``qkrope/families/<family>/dropin.py``, ``PUBLIC``) and are found here by name
(module ``__getattr__``), so ``from qkrope.runtime.caches import ...`` keeps working.
"""

from __future__ import annotations

import collections
import math
import numbers
import operator
import threading
from typing import Any, Mapping, NamedTuple, Sequence

import torch

from qkrope import contract, model_io
from qkrope.errors import InputError, QkropeError

from . import schemes
from .schemes import Setting

# Refuse, before allocating, caches larger than this (a 1328x1328 image with 1024 text tokens
# needs 3.9 MiB; shapes given in pixels instead of latent patches would need terabytes).
MAX_CACHE_BYTES = 2 * 2**30

_CONVERT_HINT = ("Fix: convert it with qkrope.runtime.to_cos_sin_caches(image_rotary_emb, "
                 "head_dim=...) or build it with qkrope.runtime.caches_for(model_path, ...).")


class RopeCaches(NamedTuple):
    """The pair an attention block consumes: one ``[rows, rotary_dim]`` fp32 cache per stream,
    cos half then sin half, row t for token t."""

    img: torch.Tensor
    txt: torch.Tensor


class RopeCacheError(QkropeError, RuntimeError):
    """A RoPE cache input is malformed. The message says what arrived and how to fix it."""


class RopeCacheOverflowError(RopeCacheError, ValueError):
    """A cache has fewer rows than its stream has tokens (or the position table is exceeded)."""

    def __init__(self, message: str, *, required: int, available: int):
        super().__init__(message)
        self.required = required
        self.available = available
        self.overflow = required - available


def __getattr__(name: str):
    """A family's public name, found through the registry: the drop-in class of any record
    (``dropin_class``: what a saved pipeline's model_index.json names, so every family's
    reloads with nothing listed) or a name its dropin module's ``PUBLIC`` offers (builders)."""
    if name.startswith("_"):
        raise AttributeError(name)
    from qkrope import families

    for record in families.records():
        module = families.hooks(record, "dropin")
        cls = module.dropin_class(record)
        if cls.__name__ == name:
            return cls
        public = getattr(module, "PUBLIC", {})
        if name in public:
            return public[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# The RoPE setting of a model
# --------------------------------------------------------------------------------------------

def default_axes_dims(rotary_dim: int) -> tuple[int, int, int]:
    """RoPE widths of three (frame, height, width) axes for a head of ``rotary_dim`` rotated
    dims, in the proportions (1, 3.5, 3.5) / 8 of the widest grid models (16, 56, 56 for 128),
    each even. Used for the tiny test/benchmark configurations whose heads are not 128 wide."""
    if rotary_dim < 6 or rotary_dim % 2:
        raise InputError(f"rotary_dim must be even and >= 6 (three RoPE axes); got {rotary_dim}")
    f = 2 * max(1, rotary_dim // 16)
    rest = rotary_dim - f
    h = 2 * (rest // 4)
    return (f, h, rest - h)


def _whole(value: object, what: str) -> int:
    """An integer argument given as an int (or numpy/torch integer), never a float, str or bool."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise InputError(f"{what} must be an integer; got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InputError(f"{what} must be an integer; got {value!r} ({type(value).__name__})") from None


def checked_setting(scheme_name: str, axes_dim: Sequence[int], theta: float, *,
                    max_positions: int | None = None, scale_rope: bool = True,
                    what: str = "axes_dim",
                    rotated: Sequence[str] = schemes.STREAMS,
                    precision: str = "float32",
                    axis_thetas: Sequence[float] | None = None,
                    base_fps: float | None = None,
                    table_lengths: Sequence[int] | None = None) -> Setting:
    """A :class:`~qkrope.runtime.schemes.Setting` from the caller's numbers, each checked: the
    axes even widths >= 0, at least one > 0 (three for the grid scheme: frame, height, width;
    a 0-wide axis gives no columns), whose sum fits
    the widest head the kernel takes, theta a finite number > 0; ``rotated`` the streams the
    model rotates (a stream normalised but not rotated gets identity rows)."""
    grid = scheme_name == "grid"
    if isinstance(axes_dim, (str, bytes)) or not isinstance(axes_dim, Sequence):
        raise InputError(f"{what} must be the RoPE width of each axis, e.g. (16, 56, 56); got "
                         f"{axes_dim!r}")
    axes = tuple(_whole(d, f"{what} values") for d in axes_dim)
    # Every scheme's cache is its axes' columns side by side (divided_grid's text rows span the
    # whole width), so a 0-wide axis is meaningful in each: it contributes no columns and
    # rotates nothing, as diffusers' position embedders give it (Bria 3.2's [0, 48, 48]).
    # At least one axis must be wide, or the cache has no columns at all.
    if not axes or any(d < 0 or d % 2 for d in axes) or (grid and len(axes) != 3) \
            or not any(axes):
        raise InputError(f"{what} must be {'three ' if grid else ''}positive even widths or 0 (an "
                         f"axis not rotated), one per RoPE axis, at least one positive, e.g. "
                         f"(16, 56, 56) or (0, 48, 48); got {axes_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or \
            not math.isfinite(theta) or theta <= 0:
        raise InputError(f"theta (the RoPE base) must be a finite number > 0, e.g. 10000; got "
                         f"{theta!r}")
    if not isinstance(scale_rope, bool):
        raise InputError(f"scale_rope must be True or False; got {scale_rope!r}")
    # the grid scheme's position tables (memoised) hold one fp32 row of sum(axes) values per
    # position: bounded by the widest head the kernel takes, as every cache is
    if sum(axes) > contract.MAX_HEAD_DIM:
        raise InputError(
            f"{what} {list(axes)} gives a rotary_dim of {sum(axes)}, wider than any attention "
            f"head the QKNormRoPE kernel takes (head_dim <= {contract.MAX_HEAD_DIM}). Fix: check "
            f"the model's axes_dims_rope")
    if isinstance(rotated, str) or not set(rotated) <= set(schemes.STREAMS):
        raise InputError(f"rotated must name streams among {list(schemes.STREAMS)}; got "
                         f"{rotated!r}")
    rotated = tuple(s for s in schemes.STREAMS if s in rotated)
    if precision not in schemes.PRECISIONS:
        raise InputError(f"precision must be one of {list(schemes.PRECISIONS)}; got "
                         f"{precision!r}")
    if axis_thetas is not None:
        axis_thetas = tuple(float(t) for t in axis_thetas)
        if len(axis_thetas) != len(axes) or not all(math.isfinite(t) and t > 0
                                                    for t in axis_thetas):
            raise InputError(f"axis_thetas must be one finite base > 0 per RoPE axis "
                             f"({len(axes)}); got {axis_thetas!r}")
    if table_lengths is not None:  # the table scheme's rows per axis (Z-Image's axes_lens)
        table_lengths = tuple(_whole(n, "the RoPE table lengths") for n in table_lengths)
        if len(table_lengths) != len(axes) or min(table_lengths) < 1:
            raise InputError(f"the RoPE table lengths must be one length >= 1 per RoPE axis "
                             f"({len(axes)}); got {list(table_lengths)}")
    return Setting(axes, float(theta), max_positions, scale_rope, rotated, precision,
                   axis_thetas=axis_thetas,
                   base_fps=None if base_fps is None else float(base_fps),
                   table_lengths=table_lengths)


def model_setting(config: Any, record, source: str = "the sidecar") -> Setting:
    """The RoPE setting of an exported model: its sidecar's ``axes_dims_rope`` and
    ``rope_theta`` where recorded, else the diffusers config's (``axes_dims_rope``, the family's
    theta key), else the family record's defaults; the record's table size. A setting that
    cannot be used is refused with the fix (re-export)."""
    cfg = getattr(config, "diffusers_config", None)
    cfg = cfg if isinstance(cfg, Mapping) else {}
    axes = getattr(config, "axes_dims_rope", None) or cfg.get("axes_dims_rope") or record.axes
    theta = getattr(config, "rope_theta", None)
    if theta is None:
        theta = record.rope_theta(cfg)
    key = getattr(record, "max_positions_key", None)
    max_positions = record.max_positions
    if key and isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
        max_positions = int(cfg[key])  # the model's own table size (e.g. rope_max_seq_len)
    extra = {"max_positions": max_positions, "scale_rope": getattr(record, "scale_rope", True),
             "precision": getattr(record, "rope_precision", "float32")}
    # a family whose frequencies follow its own rule names a function of its record module
    # (record.rope_rule, no torch) that gives the Setting's other fields from the model's config
    if getattr(record, "rope_rule", None):
        import importlib

        module = importlib.import_module(f"qkrope.families.{record.package}")
        extra.update(getattr(module, record.rope_rule)(cfg))
    try:
        return checked_setting(record.scheme, axes, theta, rotated=record.rotated, **extra)
    except InputError as exc:
        raise InputError(f"{source} records no usable RoPE setting ({exc}). Fix: re-export the "
                         f"model with `qkrope export`") from None


def record_of(config: Any, source: str = "the sidecar"):
    """The family record a model's sidecar config names (none: the registry's default, what
    sidecars written before families were recorded hold)."""
    from qkrope import families

    return families.by_name(getattr(config, "family", None), source=source)


# --------------------------------------------------------------------------------------------
# Building caches (one path for every scheme)
# --------------------------------------------------------------------------------------------

def _complex_to_cache(freqs: torch.Tensor) -> torch.Tensor:
    return torch.cat([freqs.real, freqs.imag], dim=-1).float().contiguous()



def _position_array(value: object, name: str):
    """A request's position tensor as numpy, as diffusers reads it (``ids.float()``; bfloat16
    has no numpy dtype). A stride-0 batch (an ``expand``) is one item: only that item is
    converted, so a view of a few bytes that claims millions of items copies nothing."""
    if not isinstance(value, torch.Tensor):
        if value is None or isinstance(value, (str, bytes)):
            raise InputError(f"{name} must be [tokens, axes] position ids (a tensor or array); "
                             f"got {value!r}")
        return value
    if value.device.type == "meta" or value.layout != torch.strided:
        raise InputError(f"{name} must be a dense tensor with values; got {_describe(value)}")
    t = value.detach()
    if t.dim() == 3 and t.shape[0] > 1 and t.stride(0) == 0:
        t = t[:1]
    if t.is_complex() or t.dtype == torch.bool:
        return t.cpu().numpy()
    if t.dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16,
                   torch.int8, torch.uint8, torch.float16):
        return t.cpu().numpy()  # a view: check_ids converts item 0 only, after the bounds
    return t.float().cpu().numpy()


def checked_positions(scheme, request: Mapping, setting: Setting):
    """The scheme's checked request (its positions), every size bounded before anything is
    converted or built; the scheme's refusals as one-line InputErrors."""
    request = dict(request)
    try:
        if hasattr(scheme, "bound"):
            scheme.bound(request, setting, MAX_CACHE_BYTES)
        for name in scheme.POSITION_FIELDS:
            if name in request:
                request[name] = _position_array(request[name], name)
        return scheme.positions(request, setting, MAX_CACHE_BYTES)
    except schemes.BadRequest as exc:
        raise InputError(str(exc)) from None


def build_rope_caches(scheme_name: str, request: Mapping, setting: Setting, *,
                      device: torch.device | str | None = None) -> RopeCaches:
    """The caches of ``request`` (the fields scheme ``scheme_name`` takes: ``img_shapes`` /
    ``txt_seq_len``, or ``txt_ids`` / ``img_ids``) for ``setting`` (:func:`checked_setting`,
    :func:`model_setting`), on ``device``: checked, bounded by :data:`MAX_CACHE_BYTES` before
    anything is allocated, memoised (:data:`MEMO_BYTES` in all; treat them as read-only).
    A position past the scheme's tables is a :class:`RopeCacheOverflowError`."""
    try:
        scheme = schemes.scheme(scheme_name)
    except schemes.BadRequest as exc:
        raise InputError(str(exc)) from None
    pos = checked_positions(scheme, request, setting)
    return _build_cached(scheme, pos, setting, checked_device(device))


#: What the memoised caches may hold in all, in bytes (per process, every device and scheme
#: together): a 1024x1024 image with 512 text tokens is 2.3 MiB, so about 27 such entries; the
#: least recently used go first, and a pair larger than the whole bound is returned without
#: being kept. (A pipeline passes the same sizes or ids at every step: one entry per image.)
MEMO_BYTES = 64 * 2**20


class _ByteBoundedMemo:
    """An LRU memo of :class:`RopeCaches` bounded by the bytes of the tensors it keeps (an
    entry count would let 64 large pairs pin gigabytes), keyed by the scheme's key of the
    positions, the setting and the device."""

    def __init__(self, build, limit: int):
        self._build, self.limit = build, limit
        self._entries: "collections.OrderedDict[tuple, RopeCaches]" = collections.OrderedDict()
        self.nbytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size(caches: RopeCaches) -> int:
        return sum(t.numel() * t.element_size() for t in caches)

    def __call__(self, scheme, pos, setting: Setting, device: torch.device) -> RopeCaches:
        key = (scheme.key(pos), setting, str(device))
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit
        caches = self._build(scheme, pos, setting, device)
        size = self._size(caches)
        with self._lock:
            if size <= self.limit and key not in self._entries:
                self._entries[key] = caches
                self.nbytes += size
                while self.nbytes > self.limit:
                    _, old = self._entries.popitem(last=False)
                    self.nbytes -= self._size(old)
        return caches

    def __len__(self) -> int:
        return len(self._entries)

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


def _build_uncached(scheme, pos, setting: Setting, device: torch.device) -> RopeCaches:
    # The arithmetic lives in the scheme modules, numpy only, so that the Triton rope model
    # computes the same bits without torch.
    try:
        img, txt = scheme.build(pos, setting)
    except schemes.PositionOverflow as exc:
        raise RopeCacheOverflowError(str(exc), required=exc.required,
                                     available=exc.available) from None
    return RopeCaches(torch.from_numpy(img).to(device), torch.from_numpy(txt).to(device))


_build_cached = _ByteBoundedMemo(_build_uncached, MEMO_BYTES)


def checked_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` that tensors can be put on (None: the CPU), else an
    InputError naming it: a name torch does not know (``"gpu"``), or a device this process
    does not have (``"cuda"`` without CUDA, ``"cuda:7"`` on a machine with one GPU)."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, bool) or not isinstance(device, (str, torch.device, int)):
        raise InputError(f"device must be a torch.device or its name ('cpu', 'cuda', 'cuda:1'); "
                         f"got {device!r} ({type(device).__name__})")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InputError(f"device {device!r} is not a device torch knows ({_first_line(exc)}). "
                         f"Fix: pass 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "meta":
        return dev
    try:
        torch.empty(0, device=dev)  # the device exists in this process: nothing is allocated
    except Exception as exc:  # noqa: BLE001 - AssertionError (no CUDA build), RuntimeError, ...
        raise InputError(f"device {str(dev)!r} is not available in this process "
                         f"({_first_line(exc)}). Fix: pass a device it has, e.g. 'cpu'"
                         + (f" or 'cuda:0'..'cuda:{torch.cuda.device_count() - 1}'"
                            if dev.type == "cuda" and torch.cuda.device_count() else "")) from None
    return dev


def _first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= 120 else text[:117] + "..."



# --------------------------------------------------------------------------------------------
# Describing what arrived (for error messages)
# --------------------------------------------------------------------------------------------

def _describe(obj: object) -> str:
    if obj is None:
        return "None"
    if isinstance(obj, torch.Tensor):
        kind = "complex " if obj.is_complex() else ""
        return f"a {kind}tensor {tuple(obj.shape)} {obj.dtype} on {obj.device}"
    if isinstance(obj, (tuple, list)):
        kind = type(obj).__name__
        n = len(obj)
        if all(isinstance(t, torch.Tensor) for t in obj):
            shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in obj)
            text = f"a {kind} of {n} tensors"
            if n == 4:
                text += ", which looks like a (cos, sin) pair per stream"
            elif n == 2 and all(t.is_complex() for t in obj):
                text += ", which looks like diffusers' complex (img, txt) RoPE output"
            return f"{text} [{shapes}]"
        if n == 2 and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in obj):
            return f"a {kind} of 2 pairs, which looks like ((img_cos, img_sin), (txt_cos, txt_sin))"
        return f"a {kind} of {n} items ({', '.join(type(x).__name__ for x in obj)})"
    return f"a {type(obj).__name__}"


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------

def _is_real_2d(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_complex()


# How far a genuine cache can be from cos^2 + sin^2 == 1. Rounding cos and sin to bfloat16 (unit
# roundoff u = 2^-8, the coarsest dtype a cache may have passed through) moves each square by at
# most (2u + u^2) of itself, so the sum by at most 2u + u^2; fp32 cos/sin add a few fp32 ulps
# (< 1e-6). One bound for every storage dtype: a float32 tensor may hold a bf16 cache's values
# (the `.float()` of one), and fp16 holds bf16's values exactly.
_U_BF16 = 2.0 ** -8
CACHE_IDENTITY_TOL = 2 * _U_BF16 + _U_BF16 ** 2 + 1e-6
# Every row of a RoPE angle table is far from the identity: it holds low-frequency columns whose
# angles are near 0 (a^2 + b^2 near 0, off by ~1) and high-frequency ones whose angles are large
# (off by far more). A row in which every pair has a^2 + b^2 within 1/2 of 1 is no angle table.
_ANGLE_ROW_DISTANCE = 0.5
# Columns of a half-width (cos, sin) table belong to different frequencies: some row differs by
# far more than this between neighbouring (or half-apart) columns unless every angle is ~0.
_NEAR_DUPLICATE = 1e-3


def _identity_distance(t: torch.Tensor) -> torch.Tensor:
    """|t[:, j]^2 + t[:, j + h]^2 - 1| for every row and pair j < h (float64, on t's device)."""
    h = t.shape[1] // 2
    t64 = t.double()
    return (t64[:, :h] ** 2 + t64[:, h:2 * h] ** 2 - 1.0).abs()


def _classify_table(t: torch.Tensor, stream: str) -> str:
    """'cache' or 'angles' for one real 2-D table; anything else is an error saying what the
    table looks like (docs/spec.md section 5: the converter never guesses)."""
    what = f"the {stream} table {tuple(t.shape)} {t.dtype}"
    if t.device.type == "meta" or t.layout != torch.strided:
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: cannot read the values of {what} on "
            f"{t.device} ({t.layout}); pass a dense tensor with values (e.g. .to_dense()).")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise RopeCacheError(f"image_rotary_emb must be cos_sin_cache tensors: {what} is empty, so "
                             f"its format cannot be told. {_CONVERT_HINT}")
    if not bool(torch.isfinite(t).all()):
        raise RopeCacheError(f"image_rotary_emb must be cos_sin_cache tensors: {what} has NaN or "
                             f"inf values. {_CONVERT_HINT}")
    low_precision = t.dtype not in (torch.float32, torch.float64)
    if t.shape[1] % 2 == 0:
        d = _identity_distance(t)
        if float(d.max()) <= CACHE_IDENTITY_TOL:
            return "cache"
        inter = (t.double()[:, 0::2] ** 2 + t.double()[:, 1::2] ** 2 - 1.0).abs()
        if float(inter.max()) <= CACHE_IDENTITY_TOL:
            raise RopeCacheError(
                f"image_rotary_emb must be cos_sin_cache tensors: {what} holds (cos, sin) pairs "
                f"interleaved column by column (cos_j, sin_j, ...); a cos_sin_cache has all cos "
                f"first, then all sin. Fix: torch.cat([t[:, 0::2], t[:, 1::2]], dim=-1).float().")
        rows_far = bool((d.amax(dim=1) > _ANGLE_ROW_DISTANCE).all())
        near = f"max |cos^2 + sin^2 - 1| = {float(d.max()):.3g}"
    else:
        rows_far, near = True, "an odd width"
    if rows_far and not low_precision:
        return "angles"
    if rows_far:
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: {what} looks like an angle table "
            f"stored in {t.dtype}, which cannot hold RoPE angles (positions x frequencies lose "
            f"their fractional part). Fix: compute the angles, or the caches, in float32.")
    raise RopeCacheError(
        f"image_rotary_emb must be cos_sin_cache tensors: {what} is neither a cos/sin cache "
        f"({near}, more than the {CACHE_IDENTITY_TOL:.2g} rounding to bfloat16 can cause) nor an "
        f"angle table (some rows are close to cos^2 + sin^2 == 1). It may be a damaged or "
        f"differently laid out cache. Fix: build the caches with "
        f"qkrope.runtime.caches_for(model_path, ...) or pass the angles.")


def _check_cos_sin(cos: torch.Tensor, sin: torch.Tensor, stream: str) -> None:
    """(cos, sin) tables must hold cos and sin of the same angles: cos^2 + sin^2 == 1."""
    if cos.device.type == "meta" or cos.layout != torch.strided or sin.layout != torch.strided:
        raise RopeCacheError(f"image_rotary_emb must be cos_sin_cache tensors: cannot read the "
                             f"{stream} (cos, sin) values ({cos.device}, {cos.layout}); pass "
                             f"dense tensors with values.")
    if cos.numel() == 0:
        return
    err = float((cos.double() ** 2 + sin.double() ** 2 - 1.0).abs().max())
    if not err <= CACHE_IDENTITY_TOL:
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: the {stream} (cos, sin) pair is not "
            f"cos and sin of the same angles (max |cos^2 + sin^2 - 1| = {err:.3g}, more than the "
            f"{CACHE_IDENTITY_TOL:.2g} rounding to bfloat16 can cause); got "
            f"{_describe((cos, sin))}. {_CONVERT_HINT}")


def _pair_to_cache(cos: torch.Tensor, sin: torch.Tensor, head_dim: int | None,
                   stream: str) -> torch.Tensor:
    if not (_is_real_2d(cos) and _is_real_2d(sin)) or cos.shape != sin.shape:
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: the {stream} (cos, sin) pair must be "
            f"two real 2-D tensors of one shape; got {_describe((cos, sin))}")
    width = cos.shape[1]
    if head_dim is not None and width > head_dim:
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: the {stream} (cos, sin) tables are "
            f"{width} wide, more than head_dim={head_dim}; got {_describe((cos, sin))}")
    _check_cos_sin(cos, sin, stream)
    even = width % 2 == 0
    h = width // 2
    interleave_dup = even and bool(torch.equal(cos[:, 0::2], cos[:, 1::2])
                                   and torch.equal(sin[:, 0::2], sin[:, 1::2]))
    half_dup = even and bool(torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:]))
    # Duplicated tables are written by repeat_interleave / cat and are exact. Tables that are
    # duplicated but for small differences are neither reading with certainty: refuse them.
    if even and not (interleave_dup or half_dup) and cos.numel():
        near = min(max(float((cos[:, 0::2] - cos[:, 1::2]).abs().max()), float((sin[:, 0::2] - sin[:, 1::2]).abs().max())),
                   max(float((cos[:, :h] - cos[:, h:]).abs().max()), float((sin[:, :h] - sin[:, h:]).abs().max())))
        if near <= _NEAR_DUPLICATE:
            raise RopeCacheError(
                f"image_rotary_emb must be cos_sin_cache tensors: the {stream} (cos, sin) tables "
                f"{tuple(cos.shape)} are duplicated column by column except for differences up to "
                f"{near:.2g}, so they are neither a clean duplicated full-width table nor a "
                f"half-width one. {_CONVERT_HINT}")
    # The values decide. Only tables whose angles are all equal (e.g. every position 0) fit both
    # patterns; then only the width can: read as half width they give a cache twice as wide,
    # which must fit in head_dim. If it fits, both readings are possible: an error, not a guess.
    if interleave_dup and half_dup:
        if head_dim is None or 2 * width <= head_dim:
            raise RopeCacheError(
                f"image_rotary_emb must be cos_sin_cache tensors: the {stream} (cos, sin) tables "
                f"{tuple(cos.shape)} hold one angle per row in every column, so they read both as "
                f"half width (a {2 * width}-wide cache) and as duplicated full width (a "
                f"{width}-wide cache)"
                + (f", and both fit head_dim={head_dim}" if head_dim is not None else
                   " (no head_dim given to decide)")
                + ". Fix: pass the cache itself, cat([cos, sin], -1) for half-width tables or "
                  "cat([cos[:, 0::2], sin[:, 0::2]], -1) for duplicated ones.")
        full = True
    else:
        full = interleave_dup or half_dup
    if not full:
        if head_dim is not None and 2 * width > head_dim:
            raise RopeCacheError(
                f"image_rotary_emb must be cos_sin_cache tensors: the {stream} (cos, sin) tables "
                f"are half width ({width} pairs), which gives a rotary_dim of {2 * width}, more "
                f"than head_dim={head_dim}; got {_describe((cos, sin))}")
        return torch.cat([cos, sin], dim=-1).float().contiguous()
    if interleave_dup:
        return torch.cat([cos[:, 0::2], sin[:, 0::2]], dim=-1).float().contiguous()
    raise RopeCacheError(
        f"the {stream} (cos, sin) tables are full width and half-duplicated (cos[:, :h] == "
        f"cos[:, h:]), i.e. NeoX pairing (j, j + h). The exported attention rotates "
        f"interleaved pairs (2j, 2j + 1), so these tables do not belong to its weights. Fix: "
        f"build the "
        f"caches with qkrope.runtime.caches_for(model_path, ...), or export with interleaved=False "
        f"if the model really is NeoX-style and pass cat([cos[:, :h], sin[:, :h]], -1).")


def _single_to_cache(t: torch.Tensor, head_dim: int | None, stream: str) -> torch.Tensor:
    if t.is_complex():
        if t.dim() != 2:
            raise RopeCacheError(f"image_rotary_emb must be cos_sin_cache tensors: the {stream} "
                                 f"complex frequencies must be [S, rotary_dim/2]; got "
                                 f"{_describe(t)}")
        if head_dim is not None and 2 * t.shape[1] > head_dim:
            raise RopeCacheError(
                f"image_rotary_emb must be cos_sin_cache tensors: the {stream} complex "
                f"frequencies {tuple(t.shape)} give a rotary_dim of {2 * t.shape[1]}, more than "
                f"head_dim={head_dim}. {_CONVERT_HINT}")
        cache = _complex_to_cache(t)
        if cache.numel() and not float(_identity_distance(cache).max()) <= CACHE_IDENTITY_TOL:
            raise RopeCacheError(
                f"image_rotary_emb must be cos_sin_cache tensors: the {stream} complex frequencies "
                f"{tuple(t.shape)} are not unit phasors (max ||f| ^ 2 - 1| = "
                f"{float(_identity_distance(cache).max()):.3g}; RoPE's are polar(1, angle)). "
                f"{_CONVERT_HINT}")
        return cache
    if t.dim() != 2:
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: the {stream} entry must be 2-D; got "
            f"{_describe(t)}. {_CONVERT_HINT}")
    # A cache holds (cos, sin) pairs: cos^2 + sin^2 == 1 in every row, within what rounding can
    # do. An angle table is far from that in every row. The width alone cannot tell them apart
    # under partial rotary; anything in between is refused.
    kind = _classify_table(t, stream)
    limit = t.shape[1] if kind == "cache" else 2 * t.shape[1]
    if head_dim is not None and limit > head_dim:
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: the {stream} "
            f"{'cache' if kind == 'cache' else 'angle table'} {tuple(t.shape)} gives a rotary_dim of "
            f"{limit}, more than head_dim={head_dim}. {_CONVERT_HINT}")
    if kind == "cache":
        return t.float().contiguous()
    angles = t.float()
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1).contiguous()


def to_cos_sin_caches(image_rotary_emb: object, *, head_dim: int | None = None) -> RopeCaches:
    """Convert any supported RoPE format (docs/spec.md section 5) to the ``(img_cache, txt_cache)`` pair.

    Accepted: diffusers' complex ``(img_freqs, txt_freqs)``; real angle tables ``[S, rd/2]``;
    per-stream ``(cos, sin)`` tables, half width or interleave-duplicated full width, nested
    ``((img_cos, img_sin), (txt_cos, txt_sin))`` or flat ``(img_cos, img_sin, txt_cos, txt_sin)``;
    an existing cache pair (returned as fp32 contiguous tensors, a copy only if needed).

    The values decide what a real table holds: a cache satisfies cos^2 + sin^2 == 1 within what
    rounding through bfloat16 can cause (``CACHE_IDENTITY_TOL``; a cache stored in bf16/fp16 is
    converted with ``.float()``), an angle table is far from it in every row, and (cos, sin) pairs
    must be cos and sin of the same angles; full-width (cos, sin) tables have duplicated columns.
    ``head_dim`` (the attention head size) breaks the one tie (tables whose angles are all
    equal) and rejects tables (caches, angles, complex frequencies) wider than the head.

    Raises RopeCacheError, saying what the tensor looks like and the fix, for anything it cannot
    classify with certainty (a damaged or interleaved cache, low-precision angles, NaN/inf, meta
    or sparse tensors), for NeoX half-duplicated tables (not Qwen-Image's pairing) and anything
    unrecognised: it never guesses.
    """
    obj = image_rotary_emb
    if isinstance(obj, RopeCaches):
        for stream, t in (("image", obj.img), ("text", obj.txt)):
            if head_dim is not None and t.shape[-1] > head_dim:
                raise RopeCacheError(
                    f"image_rotary_emb must be cos_sin_cache tensors: the {stream} cache "
                    f"{tuple(t.shape)} is wider than head_dim={head_dim}; its width is the "
                    f"rotary_dim, at most the head size. {_CONVERT_HINT}")
        return RopeCaches(obj.img.float().contiguous(), obj.txt.float().contiguous())
    if isinstance(obj, (tuple, list)):
        if len(obj) == 4 and all(isinstance(t, torch.Tensor) for t in obj):
            return RopeCaches(_pair_to_cache(obj[0], obj[1], head_dim, "image"),
                              _pair_to_cache(obj[2], obj[3], head_dim, "text"))
        if len(obj) == 2 and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in obj):
            return RopeCaches(_pair_to_cache(obj[0][0], obj[0][1], head_dim, "image"),
                              _pair_to_cache(obj[1][0], obj[1][1], head_dim, "text"))
        if len(obj) == 2 and all(isinstance(t, torch.Tensor) for t in obj):
            return RopeCaches(_single_to_cache(obj[0], head_dim, "image"),
                              _single_to_cache(obj[1], head_dim, "text"))
    raise RopeCacheError(
        f"image_rotary_emb must be cos_sin_cache tensors, or one of the formats "
        f"to_cos_sin_caches converts (a complex (img, txt) pair, angle tables, (cos, sin) pairs per "
        f"stream); got {_describe(obj)}.")


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def validate_cos_sin_caches(image_rotary_emb: object, *, head_dim: int, img_seq_len: int,
                            txt_seq_len: int, device: torch.device | str | None = None,
                            full: bool = False) -> RopeCaches:
    """Check a ``(img_cache, txt_cache)`` pair against a model's head size and token counts.

    Never copies or converts. The default check reads metadata only (no device synchronisation);
    ``full=True`` also reads the values (finite, cos^2 + sin^2 close to 1), which synchronises.

    Raises:
        RopeCacheError (a RuntimeError) whose message starts with a stable phrase, says what
        arrived and how to fix it; RopeCacheOverflowError when a cache has too few rows.
    """
    obj = image_rotary_emb
    if not (isinstance(obj, (tuple, list)) and len(obj) == 2
            and all(isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_complex()
                    for t in obj)):
        raise RopeCacheError(
            f"image_rotary_emb must be cos_sin_cache tensors: a pair (img_cache, txt_cache) of "
            f"2-D float32 [rows, rotary_dim] tensors; got {_describe(obj)}. {_CONVERT_HINT}")
    want_device = torch.device(device) if device is not None else None
    for stream, cache, seq_len in (("img", obj[0], img_seq_len), ("txt", obj[1], txt_seq_len)):
        name = f"{stream} cos_sin_cache"
        if cache.dtype != torch.float32:
            raise RopeCacheError(
                f"{name} must be float32; got {cache.dtype} {tuple(cache.shape)}. Fix: pass "
                f"cache.float() (RoPE angles lose accuracy below fp32, so caches stay fp32 even for "
                f"bf16/fp16 models).")
        rows, width = cache.shape
        if width <= 0 or width % 2 or width > head_dim:
            raise RopeCacheError(
                f"{name} width (rotary_dim) must be even and between 2 and head_dim={head_dim}; got "
                f"{width} (shape {tuple(cache.shape)}). Fix: the cache is [rows, rotary_dim] with "
                f"cos in the first half and sin in the second; convert other layouts with "
                f"qkrope.runtime.to_cos_sin_caches(..., head_dim={head_dim}).")
        if rows < seq_len:
            raise RopeCacheOverflowError(
                f"{name} has too few rows: required={seq_len}, available={rows}, "
                f"overflow={seq_len - rows} (one row per {stream} token). Fix: build the caches for "
                f"the actual shapes, e.g. qkrope.runtime.caches_for(model_path, ...).",
                required=seq_len, available=rows)
        if cache.layout != torch.strided:
            raise RopeCacheError(
                f"{name} must be a dense tensor; got a {cache.layout} tensor {tuple(cache.shape)}. "
                f"Fix: pass cache.to_dense().")
        if want_device is not None and not _same_device(cache.device, want_device):
            raise RopeCacheError(
                f"{name} is on {cache.device} but the activations are on {want_device}. Fix: "
                f"move the caches once, e.g. caches_for(..., device={str(want_device)!r}).")
        if not cache.is_contiguous():
            raise RopeCacheError(
                f"{name} must be contiguous; got strides {cache.stride()} for shape "
                f"{tuple(cache.shape)}. Fix: pass cache.contiguous().")
        if full:
            if cache.device.type == "meta":
                raise RopeCacheError(
                    f"{name} is a meta tensor (shape only, no values), so full=True cannot check its "
                    f"values. Fix: validate the real caches, or pass full=False for a metadata check.")
            if not bool(torch.isfinite(cache).all()):
                raise RopeCacheError(f"{name} has non-finite values (NaN or inf). Fix: rebuild it.")
            h = width // 2
            err = float(_identity_distance(cache).max()) if rows else 0.0
            if err > CACHE_IDENTITY_TOL:
                raise RopeCacheError(
                    f"{name} values are not (cos, sin) pairs: max |cos^2 + sin^2 - 1| = {err:.3g}. "
                    f"Fix: the cache holds cos in columns [0, {h}) and sin in [{h}, {width}); "
                    f"angles or interleaved tables must be converted with to_cos_sin_caches.")
    return RopeCaches(obj[0], obj[1])


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cuda":
        ia = a.index if a.index is not None else torch.cuda.current_device()
        ib = b.index if b.index is not None else torch.cuda.current_device()
        return ia == ib
    return True


# --------------------------------------------------------------------------------------------
# The caches of an exported model
# --------------------------------------------------------------------------------------------

_ENGINE_SUFFIXES = (".engine", ".plan", ".trt")


def _model_rope_config(path) -> tuple[Any, list, str, object]:
    """(config, [(input name, shape with axis names)], where it was read, the EngineInfo of an
    engine or None) of an ``.onnx`` or ``.engine``: the sidecar, else (an ONNX file without one)
    the ``qkrope.config`` entry that ``qkrope export`` writes into the model's
    ``metadata_props``."""
    import json
    import os
    from pathlib import Path

    from qkrope.errors import InputFileNotFoundError
    from qkrope.sidecars import EngineInfo, ModelConfig, ModelInfo, sidecar_path

    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"model_path must be the path of an .onnx or .engine file; got "
                         f"{path!r} ({type(path).__name__})")
    p = Path(path)
    if not p.is_file():
        raise InputFileNotFoundError(f"{p} does not exist. Fix: pass the .onnx file `qkrope "
                                     f"export` wrote or the .engine `qkrope build` wrote")
    suffix = p.suffix.lower()
    if suffix in _ENGINE_SUFFIXES:
        info = EngineInfo.load(p)
        # the named axes where the exporter named one, the fixed sizes (a cache's width) else
        return (info.config,
                [(t.name, [s if a is None else a for a, s in zip(t.axes, t.shape)]
                  if t.axes else t.shape) for t in info.inputs],
                info.source, info)
    if suffix != ".onnx":
        raise InputError(f"cannot tell what {p} is from its suffix {suffix!r}: pass an .onnx "
                         f"model (qkrope export) or an .engine (qkrope build)")
    if sidecar_path(p).exists():
        info = ModelInfo.load(p)
        return info.config, [(t.name, t.shape) for t in info.inputs], info.source, None
    from . import onnx_file

    model = onnx_file.read_onnx_model(p)  # a file that is no ONNX model: one line naming it
    desc = ModelInfo.from_onnx_graph(p, model=model)
    props = {m.key: m.value for m in model.metadata_props}
    text = props.get("qkrope.config")
    if text is None:
        raise InputError(
            f"{p} has no sidecar {sidecar_path(p).name} and no 'qkrope.config' metadata, so its "
            f"RoPE axes are unknown. Fix: keep the sidecar next to the model, or build the caches "
            f"with qkrope.runtime.caches.build_rope_caches(scheme, request, setting)")
    try:
        config = json.loads(text)
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise InputError(f"{p}: its 'qkrope.config' metadata is not a JSON object. Fix: "
                         f"re-export the model with `qkrope export`")
    where = f"{p} (metadata_props)"
    return (ModelConfig.from_dict(config, source=where), [(t.name, t.shape) for t in desc.inputs],
            where, None)


def _profile_holds(profile: dict, need: dict) -> bool:
    for (name, dim), value in need.items():
        levels = profile.get(name)
        if levels is None:
            continue
        if not levels["min"][dim] <= value <= levels["max"][dim]:
            return False
    return True




def caches_for(model_path, img_shapes: Sequence[Sequence[int]] | None = None,
               txt_seq_len: int | None = None, *, device: torch.device | str | None = None,
               batch: int | None = None, **positions) -> RopeCaches:
    """The RoPE caches an exported model needs for a call: the ``img_cache_rows`` /
    ``txt_cache_rows`` inputs of any ``.onnx`` (``qkrope export``) or ``.engine``
    (``qkrope build``), whatever its family.

    The request is what the model's pipeline passes its transformer, in the fields of the
    family's position scheme (:mod:`qkrope.runtime.schemes`): a "grid" model (Qwen-Image) takes
    ``caches_for(path, img_shapes, txt_seq_len)``, an "ids" model (FLUX.1 / FLUX.2)
    ``caches_for(path, txt_ids=..., img_ids=...)``. The scheme and RoPE numbers come from the
    model's sidecar (``config.family``, ``axes_dims_rope``, ``rope_theta``; absent: the family
    record's), else from the ``qkrope.config`` entry of an ONNX file's ``metadata_props``.
    Refused, before anything is built or memoised: fields the scheme does not take, malformed
    or oversized requests, a cache width that is not the model's cache input width, and for an
    engine sizes (image tokens, text tokens, and ``batch`` when given) that no optimisation
    profile holds.

    Args:
        model_path: the ``.onnx`` or ``.engine`` file.
        img_shapes: grid scheme: ``[(frames, height, width), ...]`` in latent patches
            (diffusers' per-batch form accepted).
        txt_seq_len: grid scheme: text tokens.
        positions: the other schemes' fields by name (ids scheme: ``txt_ids``, ``img_ids``,
            the ``[tokens, axes]`` position ids its pipeline passes).
        device: where the caches are put (the activations' device).
        batch: the call's batch size, checked against an engine's profiles (the caches
            themselves have no batch axis).
    """
    config, inputs, source, info = _model_rope_config(model_path)
    record = record_of(config, source)
    scheme = schemes.scheme(record.scheme)
    request = {k: v for k, v in dict(img_shapes=img_shapes, txt_seq_len=txt_seq_len,
                                      **positions).items() if v is not None}
    check_fields(scheme, request, f"{source} is a {record.short} model",
                 f"caches_for({str(model_path)!r})")
    setting = model_setting(config, record, source)
    batch = _checked_batch(batch)
    device = checked_device(device)
    pos = checked_positions(scheme, request, setting)
    img_rows, txt_rows = scheme.rows(pos)
    _check_cache_widths(source, inputs, setting.axes_dim)
    if info is not None:
        img_name, txt_name = (t.name for t in model_io.CACHE_INPUTS)
        need = {(img_name, 0): img_rows, (txt_name, 0): txt_rows}
        if batch is not None:
            need[(model_io.HIDDEN_STATES.name, 0)] = batch
        ranges = _serving_refusal(info, need)
        if ranges is not None:
            raise InputError(
                f"{model_path} cannot serve {img_rows} image tokens, {txt_rows} text tokens"
                + (f", batch {batch}" if batch is not None else "")
                + f" ({scheme.describe(pos)}): no optimisation profile holds them ({ranges}). "
                f"Fix: use sizes within a profile, or rebuild with `qkrope build --resolutions "
                f"WxH --txt-tokens MIN:MAX --batch MIN:MAX`")
    return _build_cached(scheme, pos, setting, device)


def check_fields(scheme, request: Mapping, what: str, call: str) -> None:
    """The request gives exactly the fields ``scheme`` takes: another scheme's fields (a
    pipeline of another family) and missing ones are refused in one line saying what was
    received and what this model takes."""
    wanted = tuple(scheme.FIELDS)
    others = [k for k in request if k not in wanted]
    missing = [k for k in wanted if k not in request]
    takes = ", ".join(wanted)
    if others:
        raise InputError(f"{what}: its caches come from {takes}, not {', '.join(others)} "
                         f"(the {scheme.NAME!r} position scheme). Fix: {call.rstrip(')')}, "
                         + ", ".join(f"{k}=..." for k in wanted) + ")")
    if missing:
        raise InputError(f"{call} needs {' and '.join(wanted)} for this model ({what}: the "
                         f"{scheme.NAME!r} position scheme); got no {', '.join(missing)}")


def _checked_batch(batch: object) -> int | None:
    """caches_for's ``batch``: None, or a whole number >= 1."""
    if batch is None:
        return None
    batch = _whole(batch, "batch")
    if batch < 1:
        raise InputError(f"batch must be >= 1; got {batch}")
    return batch


def _check_cache_widths(source, inputs, axes) -> None:
    """The model's cache inputs (``inputs``: (name, shape) pairs) are as wide as the RoPE axes
    its sidecar records sum to (a static width; a dynamic one is not checked)."""
    shapes = {name: list(shape) for name, shape in inputs}
    for name in (t.name for t in model_io.CACHE_INPUTS):
        shape = shapes.get(name)
        width = shape[-1] if shape else None
        if isinstance(width, int) and width >= 0 and width != sum(axes):
            raise InputError(
                f"{source}: the model's {name} is {width} wide but its axes_dims_rope {list(axes)} "
                f"sum to {sum(axes)}: the sidecar does not describe this model. Fix: re-export "
                f"the model with `qkrope export`")


def _serving_refusal(info, need: dict) -> str | None:
    """None when one of the engine's profiles holds the sizes in ``need`` ({(input, axis):
    value}), else the profiles' ranges for the message."""
    if not info.profiles or any(_profile_holds(p, need) for p in info.profiles):
        return None
    labels = list(info.profile_labels) + [""] * len(info.profiles)
    return "; ".join(
        f"profile {k}{' (' + labels[k] + ')' if labels[k] else ''}: "
        + ", ".join(f"{n} {p[n]['min'][d]}..{p[n]['max'][d]}" for (n, d) in need if n in p)
        for k, p in enumerate(info.profiles))


