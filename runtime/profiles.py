"""TensorRT optimisation profiles for qkrope models, as plain data (no TensorRT needed).

A profile maps every network input to three shapes ``{"min": (...), "opt": (...), "max": (...)}``.
:func:`derive_profile` builds it from the model's description
(:class:`qkrope.sidecars.ModelInfo`: the exporter's sidecar ``<model>.onnx.json``, or the ONNX
graph's own inputs) plus the ``qkrope build`` flags;
:func:`validate_profile` checks it before anything is handed to TensorRT.

Derivation rules (named axes of the sidecar):

=================  ====  ==========================  ===========================================
axis               min   opt                         max
=================  ====  ==========================  ===========================================
batch              1     the export sample's batch   ``--max-batch`` or max(opt, 2) (CFG pairs)
img_tokens         1     export value                ``--max-img-tokens`` or max(opt, 4096)
                                                     (4096 = a 1024x1024 image)
txt_tokens         1     export value                ``--max-txt-tokens`` or max(opt, 512)
img_cache_rows     = img_tokens' min/opt/max (at least; a cache has >= 1 row per token)
txt_cache_rows     = txt_tokens' min/opt/max (at least)
any other axis     export value for all three (fixed); override with --min/--opt/--max
=================  ====  ==========================  ===========================================

Explicit ``--min/--opt/--max NAME:DxDxD`` (trtexec's syntax) or ``NAME:[D,D,D]`` (polygraphy's)
shapes replace the derived ones for that input, and
the named axes they fix apply to the other inputs at that level (``--max
encoder_hidden_states:2x40x3072`` also makes the mask's max text length 40). After
overrides, every cache-rows dimension is raised to at least the token dimension of its stream at
the same level (min, opt, max), so an engine always accepts one cache row per token.

Resolution presets (``qkrope build --resolutions 512x512,1024x1024,1328x1328``,
:func:`derive_preset_profiles`) make one profile per preset, smallest first: image tokens
(the family record's ``pixels_per_token`` per token side, 16 for every family so far: 8x VAE,
2x2 patches; 1024x1024 -> 4096; a third number ``WxHxF`` is a video preset's token frames) min 1,
opt = max = the preset; text tokens ``--txt-tokens MIN:MAX`` (default 1..512) and batch
``--batch MIN:MAX`` (default 1..2, a CFG pair) min = the range's min, opt = max = its max; a 5-D
latent's grid axes (``latent_frames`` / ``latent_height`` / ``latent_width``) min one patch,
opt = max = the preset's. :func:`select_profile` is the runner's choice: the first profile whose
[min, max] holds a call's shapes. The family's position scheme says what presets and text range
its positions can reach (:func:`check_rope_positions`: a scheme with position tables, "grid",
bounds them; "ids" has no such limit).
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from qkrope import model_io
from qkrope.errors import QkropeError
from qkrope.model_io import (BATCH, CACHE_ROWS_FOR, IMG_TOKENS, TXT_CACHE_ROWS,  # noqa: F401
                             TXT_TOKENS)
from qkrope.sidecars import LEVELS, ModelInfo, TensorInfo


DEFAULT_MAX_BATCH = 2
DEFAULT_MAX_IMG_TOKENS = 4096   # 1024x1024 image: 64 x 64 latent patches
DEFAULT_MAX_TXT_TOKENS = 512

Shape = tuple[int, ...]
Profile = dict[str, dict[str, Shape]]


class ProfileError(QkropeError, ValueError):
    """An optimisation profile (derived or given by flags) is malformed or inconsistent."""


# --------------------------------------------------------------------------------------------
# Command-line shapes
# --------------------------------------------------------------------------------------------

# trtexec's NAME:DxDxD (also NAME:D,D,D) or polygraphy's NAME:[D,D,D]; NAME: / NAME:[] = scalar.
_SHAPE_RE = re.compile(r"^(?P<name>[^:\[\]]+):(?:\[(?P<list>\d+(?:,\d+)*)?\]|"
                       r"(?P<dims>\d+(?:[x,]\d+)*))?$")
SHAPE_SYNTAX = ("NAME:DIMxDIMx... (trtexec's --minShapes syntax, e.g. hidden_states:1x4096x3072) "
                "or NAME:[DIM,DIM,...] (polygraphy's --trt-min-shapes syntax, e.g. "
                "hidden_states:[1,4096,3072])")


def parse_shape_spec(text: str) -> tuple[str, Shape]:
    """``"hidden_states:1x4096x3072"`` or ``"hidden_states:[1,4096,3072]"`` ->
    ``("hidden_states", (1, 4096, 3072))``.

    ``NAME:`` or ``NAME:[]`` (no dims) is a scalar. trtexec's form separates dimensions with
    ``x`` (or ``,``); polygraphy's puts them in brackets separated by ``,`` (spaces allowed).
    """
    m = _SHAPE_RE.match(re.sub(r"\s+", "", text))
    if not m:
        raise ProfileError(f"cannot read the shape {text!r}: expected {SHAPE_SYNTAX}")
    dims = m.group("list") or m.group("dims")
    shape = tuple(int(d) for d in re.split(r"[x,]", dims)) if dims else ()
    return m.group("name"), shape


def parse_shape_specs(items: Iterable[str] | None) -> dict[str, Shape]:
    """Several ``NAME:DIMS`` items (one flag may hold many, separated by spaces) ->
    ``{name: shape}``."""
    out: dict[str, Shape] = {}
    for item in items or ():
        # spaces inside polygraphy's brackets do not separate items
        item = re.sub(r"\[[^\]]*\]", lambda m: re.sub(r"\s+", "", m.group(0)), str(item))
        for part in item.split():
            name, shape = parse_shape_spec(part)
            if name in out and out[name] != shape:
                raise ProfileError(f"input {name!r} is given twice with different shapes: "
                                   f"{_fmt(out[name])} and {_fmt(shape)}")
            out[name] = shape
    return out


def _fmt(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else "(scalar)"


def format_profile(profile: Mapping[str, Mapping[str, Sequence[int]]]) -> str:
    """Human-readable table, one line per input."""
    lines = []
    width = max((len(n) for n in profile), default=0)
    for name, levels in profile.items():
        lines.append(f"  {name:<{width}}  min {_fmt(levels['min'])}  opt {_fmt(levels['opt'])}  "
                     f"max {_fmt(levels['max'])}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Derivation
# --------------------------------------------------------------------------------------------

def axis_ranges(inputs: Sequence[TensorInfo], export: Mapping[str, int], *,
                max_batch: int | None = None, max_img_tokens: int | None = None,
                max_txt_tokens: int | None = None) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) per named axis of ``inputs``, by the rules above; ``export`` holds the
    axes' export values (:meth:`qkrope.sidecars.ModelInfo.export_values`)."""
    axes = {a for spec in inputs for a in spec.shape if isinstance(a, str)}
    ranges: dict[str, tuple[int, int, int]] = {}
    flags = {BATCH: (max_batch, DEFAULT_MAX_BATCH, "--max-batch"),
             IMG_TOKENS: (max_img_tokens, DEFAULT_MAX_IMG_TOKENS, "--max-img-tokens"),
             TXT_TOKENS: (max_txt_tokens, DEFAULT_MAX_TXT_TOKENS, "--max-txt-tokens")}
    for axis, (given, default, flag) in flags.items():
        if given is not None and int(given) < 1:
            raise ProfileError(f"{flag} must be >= 1; got {given}")
    for axis in sorted(axes):
        if axis in flags:
            given, default, flag = flags[axis]
            opt = export.get(axis, 1)
            hi = int(given) if given is not None else max(opt, default)
            opt = min(opt, hi)  # a smaller explicit max pulls opt down with it
            ranges[axis] = (1, opt, hi)
        elif axis not in CACHE_ROWS_FOR:
            if axis not in export:
                raise ProfileError(
                    f"the model's axis {axis!r} has no export value in the sidecar, so its "
                    f"profile range is unknown. Fix: give the shapes of the inputs that use it "
                    f"with --min/--opt/--max NAME:DIMxDIM...")
            v = export[axis]
            ranges[axis] = (v, v, v)
    for rows_axis, token_axis in CACHE_ROWS_FOR.items():
        if rows_axis in axes:
            tok = ranges.get(token_axis)
            exp = export.get(rows_axis)
            if tok is None:
                v = exp if exp is not None else 1
                ranges[rows_axis] = (1, v, max(v, DEFAULT_MAX_TXT_TOKENS
                                               if rows_axis == TXT_CACHE_ROWS
                                               else DEFAULT_MAX_IMG_TOKENS))
            else:
                ranges[rows_axis] = tok
    # the text cache covers the conditions a model joins to its text (their rows after it)
    joined = [ranges[a] for a in model_io.JOINED_TEXT_AXES if a in ranges]
    if TXT_CACHE_ROWS in ranges and joined:
        ranges[TXT_CACHE_ROWS] = tuple(ranges[TXT_CACHE_ROWS][i] + sum(r[i] for r in joined)
                                       for i in range(3))
    # a packed sequence's rows are its streams' rows, each once (model_io.PACKED_FROM)
    if model_io.PACKED_ROWS in axes:
        parts = [ranges.get(a) or (export[a],) * 3 for a in model_io.PACKED_FROM
                 if a in ranges or a in export]
        ranges[model_io.PACKED_ROWS] = tuple(sum(p[i] for p in parts) for i in range(3))
    return ranges


def derive_profile(model: ModelInfo, *, min_shapes: Mapping[str, Shape] | None = None,
                   opt_shapes: Mapping[str, Shape] | None = None,
                   max_shapes: Mapping[str, Shape] | None = None,
                   max_batch: int | None = None, max_img_tokens: int | None = None,
                   max_txt_tokens: int | None = None,
                   axis_levels: Mapping[str, tuple[int, int, int]] | None = None) -> Profile:
    """The profile for every input of ``model`` (its ``inputs``' shapes of ints and axis names,
    the axes' export values), explicit shapes taking precedence.

    Raises ProfileError with the input, the level and the fix when something does not fit.
    """
    inputs = list(model.inputs)
    if not inputs:
        raise ProfileError("the model description lists no inputs")
    names = [spec.name for spec in inputs]
    overrides = {"min": dict(min_shapes or {}), "opt": dict(opt_shapes or {}),
                 "max": dict(max_shapes or {})}
    for level, shapes in overrides.items():
        unknown = sorted(set(shapes) - set(names))
        if unknown:
            raise ProfileError(f"--{level} names {', '.join(map(repr, unknown))}, which the model "
                               f"does not have; its inputs are: {', '.join(names)}")

    # Axes only need a derived range for the inputs that are not fully given by flags.
    needs_axes = [spec for spec in inputs
                  if not all(spec.name in overrides[lvl] for lvl in LEVELS)]
    ranges = axis_ranges(needs_axes, model.export_values(), max_batch=max_batch,
                         max_img_tokens=max_img_tokens, max_txt_tokens=max_txt_tokens)
    for axis, levels in (axis_levels or {}).items():  # a preset's (min, opt, max) per axis
        levels = tuple(int(v) for v in levels)
        if axis in ranges:
            ranges[axis] = levels
        # a cache's rows follow its stream's tokens, also where no input has a token axis
        # (a 5-D latent: its tokens are the grid's)
        for rows_axis, token_axis in CACHE_ROWS_FOR.items():
            if token_axis == axis and rows_axis in ranges:
                ranges[rows_axis] = levels

    # An explicit shape also sets its named axes for the other inputs at that level
    # (--max encoder_hidden_states:2x40x3072 makes the mask's and the text cache's max 40 too).
    given_axes: dict[str, dict[str, int]] = {level: {} for level in LEVELS}
    by_name = {spec.name: list(spec.shape) for spec in inputs}
    for level in LEVELS:
        for name, given in overrides[level].items():
            shape = by_name[name]
            given = tuple(int(d) for d in given)
            if len(given) != len(shape):
                raise ProfileError(
                    f"--{level} {name}:{_fmt(given)} has {len(given)} dimensions but {name} "
                    f"has {len(shape)} ({_describe_shape(shape)})")
            overrides[level][name] = given
            for d, v in zip(shape, given):
                if isinstance(d, str):
                    given_axes[level].setdefault(d, v)

    profile: Profile = {}
    for spec in inputs:
        name, shape = spec.name, list(spec.shape)
        entry: dict[str, Shape] = {}
        for i, level in enumerate(LEVELS):
            if name in overrides[level]:
                entry[level] = overrides[level][name]
            else:
                entry[level] = tuple(
                    d if isinstance(d, int) else _axis_value(d, given_axes[level], ranges, i)
                    for d in shape)
        profile[name] = entry
    return reconcile_cache_rows(profile, inputs)


def _axis_value(axis: str, given: Mapping[str, int], ranges: Mapping, i: int) -> int:
    if axis in given:
        return given[axis]
    if axis in CACHE_ROWS_FOR and CACHE_ROWS_FOR[axis] in given:
        return given[CACHE_ROWS_FOR[axis]]  # cache rows follow explicitly given token counts
    return ranges[axis][i]


def _describe_shape(shape: Sequence) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _axis_positions(inputs: Sequence[TensorInfo]) -> dict[str, list[tuple[str, int]]]:
    pos: dict[str, list[tuple[str, int]]] = {}
    for spec in inputs:
        for i, d in enumerate(spec.shape):
            if isinstance(d, str):
                pos.setdefault(d, []).append((spec.name, i))
    return pos


def reconcile_cache_rows(profile: Profile, inputs: Sequence[TensorInfo]) -> Profile:
    """Raise every cache-rows dimension to at least its stream's token count, per level."""
    pos = _axis_positions(inputs)
    out = {name: dict(levels) for name, levels in profile.items()}
    for rows_axis, token_axis in CACHE_ROWS_FOR.items():
        if rows_axis not in pos or token_axis not in pos:
            continue
        for level in LEVELS:
            tokens = max(out[n][level][i] for n, i in pos[token_axis])
            for n, i in pos[rows_axis]:
                shape = list(out[n][level])
                if shape[i] < tokens:
                    shape[i] = tokens
                    out[n][level] = tuple(shape)
    return out


# --------------------------------------------------------------------------------------------
# Resolution presets: one profile per preset
# --------------------------------------------------------------------------------------------

def _default_record():
    from qkrope import families

    return families.default()


#: Pixels per image token side of the registry's default family (every family so far: 8x VAE
#: and 2x2 patches, 16); a family's own is its record's ``pixels_per_token``.
PIXELS_PER_TOKEN = _default_record().pixels_per_token


def parse_resolutions(text: str | Sequence[str] | None, *,
                      pixels_per_token: int = PIXELS_PER_TOKEN) -> list[tuple[int, ...]]:
    """``"512x512,1024x1024"`` (or a list of such items) -> ``[(512, 512), (1024, 1024)]``
    as (width, height); each side a positive multiple of ``pixels_per_token`` pixels. A third
    number is a video preset's token frames (``"832x480x21"`` -> ``(832, 480, 21)``; the
    frames after the model's temporal compression and patching)."""
    items: list[str] = []
    for part in ([text] if isinstance(text, str) else list(text or ())):
        items += [p for p in re.split(r"[,\s]+", str(part)) if p]
    out = []
    for item in items:
        m = re.fullmatch(r"(\d+)[xX*](\d+)(?:[xX*](\d+))?", item)
        if not m:
            raise ProfileError(f"cannot read the resolution {item!r}: expected WIDTHxHEIGHT in "
                               f"pixels (WIDTHxHEIGHTxFRAMES for a video model), e.g. "
                               f"--resolutions 512x512,1024x1024,1328x1328")
        w, h = int(m.group(1)), int(m.group(2))
        check_resolution(w, h, pixels_per_token, item)
        preset = (w, h) if m.group(3) is None else (w, h, int(m.group(3)))
        if len(preset) == 3 and preset[2] < 1:
            raise ProfileError(f"the resolution {item}: its frames must be >= 1")
        if preset not in out:
            out.append(preset)
    if not out:
        raise ProfileError("--resolutions lists no resolution; expected e.g. 512x512,1024x1024")
    return out


def check_resolution(w: int, h: int, pixels_per_token: int, item: str | None = None) -> None:
    """Both sides positive multiples of the family's ``pixels_per_token``."""
    if w < 1 or h < 1 or w % pixels_per_token or h % pixels_per_token:
        raise ProfileError(f"the resolution {item or f'{w}x{h}'} must have both sides positive "
                           f"multiples of {pixels_per_token} pixels (one image token per "
                           f"{pixels_per_token}x{pixels_per_token} pixels: the VAE's downscale "
                           f"times the patch size)")


def image_tokens(width: int, height: int, frames: int = 1, *,
                 pixels_per_token: int = PIXELS_PER_TOKEN) -> int:
    """Image tokens of a picture (or of ``frames`` token frames of a video):
    ``frames * (h / p) * (w / p)`` with p the family's pixels per token (1024x1024 -> 4096)."""
    return int(frames) * (int(height) // pixels_per_token) * (int(width) // pixels_per_token)


def preset_grid(preset: Sequence[int], pixels_per_token: int = PIXELS_PER_TOKEN) -> tuple:
    """The token grid ``(frames, height, width)`` of a preset ``(w, h)`` or ``(w, h, frames)``."""
    w, h = int(preset[0]), int(preset[1])
    frames = int(preset[2]) if len(preset) > 2 else 1
    return (frames, h // pixels_per_token, w // pixels_per_token)


def _label(preset: Sequence[int]) -> str:
    return "x".join(str(int(v)) for v in preset)


def parse_range(text: str | None, flag: str) -> tuple[int, int] | None:
    """``"1:512"`` -> ``(1, 512)``; a single ``"N"`` is ``(N, N)``."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    if not m:
        raise ProfileError(f"{flag} expects MIN:MAX (e.g. {flag} 1:512); got {text!r}")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if not 1 <= lo <= hi:
        raise ProfileError(f"{flag} {text}: need 1 <= MIN <= MAX")
    return lo, hi


def preset_axis_levels(resolutions: Sequence[Sequence[int]], *,
                       txt_tokens: tuple[int, int] = (1, DEFAULT_MAX_TXT_TOKENS),
                       batch: tuple[int, int] = (1, DEFAULT_MAX_BATCH),
                       pixels_per_token: int = PIXELS_PER_TOKEN, latent=None
                       ) -> list[tuple[str, dict[str, tuple[int, int, int]]]]:
    """One ``(label, {axis: (min, opt, max)})`` per preset, smallest image first.

    Image tokens: min 1, opt = max = the preset's tokens; text tokens and batch: min = the
    range's min, opt = max = the range's max (CFG runs batch 2). A 5-D latent
    (:class:`qkrope.runtime.latents.Latent` ``latent``) also gets its grid axes: min one patch,
    opt = max = the preset's."""
    grids = [(preset_grid(p, pixels_per_token), p) for p in resolutions]
    grids.sort(key=lambda gp: (gp[0][0] * gp[0][1] * gp[0][2], tuple(gp[1])))
    out = []
    for grid, preset in grids:
        n = grid[0] * grid[1] * grid[2]
        levels = {IMG_TOKENS: (1, n, n),
                  TXT_TOKENS: (txt_tokens[0], txt_tokens[1], txt_tokens[1]),
                  BATCH: (batch[0], batch[1], batch[1])}
        if latent is not None and latent.rank == 5:
            for (axis, value), patch in zip(latent.grid_axes(grid).items(), latent.patch):
                levels[axis] = (patch, value, value)
        out.append((_label(preset), levels))
    return out


def check_rope_positions(resolutions: Sequence[Sequence[int]], txt_max: int, *,
                         family: str | None = None) -> None:
    """Refuse profiles no call can use: the family's position scheme says what its positions
    can reach (:func:`qkrope.runtime.schemes.grid.profile_limits`: the tables' positions per
    axis must hold each preset's image, and ``txt_max`` text tokens the positions left after
    the largest image; a scheme without tables, "ids", refuses nothing). No preset: the text
    alone against the whole table."""
    from qkrope import families

    from . import schemes
    from .caches import checked_setting

    record = families.by_name(family)
    scheme = schemes.scheme(record.scheme)
    ppt = record.pixels_per_token
    grids = [preset_grid(p, ppt) for p in resolutions]
    setting = checked_setting(record.scheme, record.axes, record.theta,
                              max_positions=record.max_positions)
    refusal = scheme.profile_limits(setting, grids, txt_max)
    if refusal is None:
        return
    kind, index, needed, available = refusal
    tables = f"{record.short}'s RoPE position tables"
    if kind == "image":
        side = 2 * available * ppt
        raise ProfileError(
            f"the resolution {_label(resolutions[index])} needs {needed} RoPE positions per axis "
            f"and direction, more than the {available} of {tables} (no call could use that "
            f"profile). Fix: give sides of at most {side} pixels")
    which = ("for the text alone" if index < 0 else
             f"after the {_label(resolutions[index])} preset's image (its text positions start "
             f"at {record.max_positions - available})")
    raise ProfileError(
        f"--txt-tokens max {needed} is more than the {available} text positions {tables} "
        f"({record.max_positions} positions) leave {which}; no call could use that profile. "
        f"Fix: --txt-tokens MIN:{available} or smaller presets")


def derive_preset_profiles(model: ModelInfo, resolutions: Sequence[tuple[int, int]], *,
                           txt_tokens: tuple[int, int] | None = None,
                           batch: tuple[int, int] | None = None,
                           min_shapes: Mapping[str, Shape] | None = None,
                           opt_shapes: Mapping[str, Shape] | None = None,
                           max_shapes: Mapping[str, Shape] | None = None
                           ) -> list[tuple[str, Profile]]:
    """One validated profile per resolution preset (``[(label, profile)]``, smallest first).

    ``txt_tokens`` defaults to 1..max(512, the export's text tokens); ``batch`` to 1..2.
    Explicit --min/--opt/--max shapes apply to every preset."""
    export = model.export_values()
    if txt_tokens is None:
        txt_tokens = (1, max(DEFAULT_MAX_TXT_TOKENS, int(export.get(TXT_TOKENS, 1))))
    if batch is None:
        batch = (1, DEFAULT_MAX_BATCH)
    from qkrope import families

    from .latents import latent_of

    record = families.by_name(model.config.family, source=model.source or "the sidecar")
    for preset in resolutions:
        check_resolution(int(preset[0]), int(preset[1]), record.pixels_per_token)
    check_rope_positions(resolutions, txt_tokens[1], family=record.name)
    latent = latent_of(record, model.config.diffusers_config)
    out = []
    for label, levels in preset_axis_levels(resolutions, txt_tokens=txt_tokens, batch=batch,
                                            pixels_per_token=record.pixels_per_token,
                                            latent=latent):
        profile = derive_profile(model, min_shapes=min_shapes, opt_shapes=opt_shapes,
                                 max_shapes=max_shapes, axis_levels=levels)
        try:
            validate_profile(profile, model.inputs)
        except ProfileError as exc:
            raise ProfileError(f"resolution preset {label}: {exc}") from None
        out.append((label, profile))
    return out


def select_profile(ranges: Sequence[Mapping[str, tuple[Sequence[int], Sequence[int]]]],
                   shapes: Mapping[str, Sequence[int]],
                   labels: Sequence[str] | None = None) -> int:
    """Index of the first profile whose [min, max] holds every input shape in ``shapes``.

    ``ranges[k][name] = (min, max)``. Raises ProfileError naming every profile otherwise."""
    for k, prof in enumerate(ranges):
        ok = True
        for name, shape in shapes.items():
            if name not in prof:
                continue
            lo, hi = prof[name]
            if len(lo) != len(shape) or not all(int(a) <= int(d) <= int(b)
                                                for a, d, b in zip(lo, shape, hi)):
                ok = False
                break
        if ok:
            return k
    got = ", ".join(f"{n} {_fmt(s)}" for n, s in shapes.items())
    lines = []
    for k, prof in enumerate(ranges):
        label = f" ({labels[k]})" if labels and k < len(labels) and labels[k] else ""
        spans = ", ".join(f"{n} {_fmt(lo)}..{_fmt(hi)}" for n, (lo, hi) in prof.items())
        lines.append(f"profile {k}{label}: {spans}")
    raise ProfileError(f"no optimisation profile of the engine covers the shapes {got}; the "
                       f"engine's profiles are:\n  " + "\n  ".join(lines) +
                       "\nFix: use shapes inside one profile, or rebuild with `qkrope build "
                       "--resolutions ...` (or --min/--max) covering them")


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------

def validate_profile(profile: Mapping[str, Mapping[str, Sequence[int]]],
                     inputs: Sequence[TensorInfo]) -> None:
    """Check ``profile`` against the model inputs (shapes of ints and axis names).

    Every input has min/opt/max of the input's rank; static dimensions equal the model's; every
    dimension >= 1 and min <= opt <= max; an axis shared by several inputs (batch, tokens) has one
    value per level; cache rows >= tokens per level.
    """
    names = [spec.name for spec in inputs]
    missing = [n for n in names if n not in profile]
    if missing:
        raise ProfileError(f"no profile shapes for input(s) {', '.join(missing)}. Fix: give them "
                           f"with --min/--opt/--max NAME:DIMxDIM... (all three levels)")
    extra = sorted(set(profile) - set(names))
    if extra:
        raise ProfileError(f"profile names {', '.join(extra)}, which the model does not have; "
                           f"its inputs are: {', '.join(names)}")
    for spec in inputs:
        name, shape = spec.name, list(spec.shape)
        levels = profile[name]
        for level in LEVELS:
            if level not in levels:
                raise ProfileError(f"input {name}: no {level} shape. Fix: pass --{level} "
                                   f"{name}:DIMxDIM...")
            dims = tuple(levels[level])
            if len(dims) != len(shape):
                raise ProfileError(f"input {name}: the {level} shape {_fmt(dims)} has {len(dims)} "
                                   f"dimensions; the model's {name} is {_describe_shape(shape)}")
            for i, (d, want) in enumerate(zip(dims, shape)):
                if isinstance(want, int) and want >= 0 and d != want:
                    raise ProfileError(
                        f"input {name}: dimension {i} is static ({want}) in the model but the "
                        f"{level} shape {_fmt(dims)} has {d}. Fix: use {want} there, or re-export "
                        f"the model with that dimension dynamic")
                if d < 1:
                    raise ProfileError(f"input {name}: the {level} shape {_fmt(dims)} has a "
                                       f"dimension < 1")
        for i in range(len(shape)):
            lo, opt, hi = (levels[lv][i] for lv in LEVELS)
            if not lo <= opt <= hi:
                raise ProfileError(
                    f"input {name}: dimension {i} must satisfy min <= opt <= max; got min {lo}, "
                    f"opt {opt}, max {hi} (min {_fmt(levels['min'])}, opt {_fmt(levels['opt'])}, "
                    f"max {_fmt(levels['max'])})")
    pos = _axis_positions(inputs)
    for axis, where in pos.items():
        for level in LEVELS:
            values = {(n, i): profile[n][level][i] for n, i in where}
            if len(set(values.values())) > 1:
                detail = ", ".join(f"{n}[{i}] = {v}" for (n, i), v in values.items())
                raise ProfileError(f"axis {axis!r} must have one {level} value across inputs; got "
                                   f"{detail}. Fix: make the --{level} shapes agree")
    for rows_axis, token_axis in CACHE_ROWS_FOR.items():
        if rows_axis in pos and token_axis in pos:
            for level in LEVELS:
                rows = min(profile[n][level][i] for n, i in pos[rows_axis])
                tokens = max(profile[n][level][i] for n, i in pos[token_axis])
                if rows < tokens:
                    raise ProfileError(
                        f"{rows_axis} ({rows}) is smaller than {token_axis} ({tokens}) in the "
                        f"{level} shapes: a RoPE cache needs one row per token. Fix: raise the "
                        f"cache input's first dimension to at least {tokens}")


def profile_to_json(profile: Mapping[str, Mapping[str, Sequence[int]]]) -> dict:
    return {name: {lv: list(levels[lv]) for lv in LEVELS} for name, levels in profile.items()}
