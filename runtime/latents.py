"""What a call's activations look like, told once for every family (no family named here):
the latent layouts a transformer takes, the per-sample text lengths of a batch, and the named
axes a sample's shapes are made of.

Latent kinds (a family record's ``latent``):

- ``"packed-tokens"``: ``hidden_states`` is ``[batch, tokens, features]``; the pipeline packs
  the latent's patches itself, so a token is one patch and an image grid ``(f, h, w)`` (in
  latent patches) has ``f * h * w`` tokens;
- ``"video-5d"``: ``hidden_states`` is the latent itself, ``[batch, channels, frames, height,
  width]``, which the model patchifies with its patch size ``(pt, ph, pw)`` (diffusers' configs
  ``patch_size_t`` and ``patch_size``): ``(F / pt) * (H / ph) * (W / pw)`` tokens, each axis a
  whole number of patches.

:class:`Latent` gives the token count and the token grid of a latent shape, checks it in one
line, and makes the shape of a grid; :func:`latent_of` reads the patch size from a diffusers
config. :class:`TextLengths` carries per-sample sequences (a different text length per batch
item, padded to the longest: the mask says which tokens are real). The named axes of a 5-D
latent are :data:`GRID_AXES`; :func:`concrete_shape` resolves any input's named shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from qkrope import model_io
from qkrope.errors import InputError

PACKED_TOKENS, VIDEO_5D = "packed-tokens", "video-5d"
#: Every latent kind: (the rank of hidden_states, what its axes are).
KINDS = {PACKED_TOKENS: (3, "[batch, tokens, features]"),
         VIDEO_5D: (5, "[batch, channels, frames, height, width]")}
#: The named axes of a latent grid (latent frames / rows / columns, before patchifying).
LATENT_FRAMES, LATENT_HEIGHT, LATENT_WIDTH = (model_io.LATENT_FRAMES, model_io.LATENT_HEIGHT,
                                              model_io.LATENT_WIDTH)
GRID_AXES = (LATENT_FRAMES, LATENT_HEIGHT, LATENT_WIDTH)


@dataclass(frozen=True)
class Latent:
    """A latent layout: its ``kind`` (:data:`KINDS`) and, for a latent the model patchifies,
    the patch size ``(frames, height, width)`` of one token."""

    kind: str = PACKED_TOKENS
    patch: tuple = (1, 1, 1)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InputError(f"latent kind {self.kind!r} is not one of {sorted(KINDS)}")
        patch = tuple(self.patch)
        if len(patch) != 3 or any(isinstance(p, bool) or not isinstance(p, int) or p < 1
                                  for p in patch):
            raise InputError(f"a latent's patch size is three whole numbers >= 1 (frames, "
                             f"height, width); got {self.patch!r}")
        object.__setattr__(self, "patch", patch)

    @property
    def rank(self) -> int:
        return KINDS[self.kind][0]

    def grid(self, shape: Sequence[int], name: str = "hidden_states") -> tuple:
        """The token grid ``(f, h, w)`` of a 5-D latent of ``shape`` (one line naming what is
        wrong: the rank, an axis that is no whole number of patches); a packed latent has no
        grid of its own (None)."""
        shape = tuple(int(d) for d in shape)
        rank, layout = KINDS[self.kind]
        if len(shape) != rank:
            raise InputError(f"{name} must be {layout} ({self.kind} latent); got shape "
                             f"{list(shape)}")
        if self.kind == PACKED_TOKENS:
            return None
        axes = shape[2:]
        bad = [(n, a, p) for n, a, p in zip(("frames", "height", "width"), axes, self.patch)
               if a < 1 or a % p]
        if bad:
            n, a, p = bad[0]
            raise InputError(f"{name} {list(shape)}: its {n} axis ({a}) is not a whole number "
                             f"of the model's {p}-wide patches. Fix: give the latent a {n} that "
                             f"is a multiple of {p}")
        return tuple(a // p for a, p in zip(axes, self.patch))

    def tokens(self, shape: Sequence[int], name: str = "hidden_states") -> int:
        """The image tokens of a latent of ``shape`` (checked as :meth:`grid`)."""
        grid = self.grid(shape, name)
        if grid is None:
            return int(shape[1])
        f, h, w = grid
        return f * h * w

    def shape_for(self, batch: int, features: int, grid: Sequence[int]) -> tuple:
        """The latent shape of ``batch`` items of one token grid ``(f, h, w)``: ``features`` is
        the channels of a 5-D latent, the token width of a packed one."""
        f, h, w = (int(v) for v in grid)
        if self.kind == PACKED_TOKENS:
            return (int(batch), f * h * w, int(features))
        pt, ph, pw = self.patch
        return (int(batch), int(features), f * pt, h * ph, w * pw)

    def grid_axes(self, grid: Sequence[int]) -> dict:
        """The named latent axes (:data:`GRID_AXES`) of one token grid, in latent units."""
        return {n: int(v) * p for n, v, p in zip(GRID_AXES, grid, self.patch)}


def latent_of(record: Any, diffusers_config: Mapping | None = None) -> Latent:
    """The latent layout of a family (its record's ``latent``, default packed tokens) with the
    patch size the model's diffusers config gives (``patch_size`` as an int or a
    ``(t, h, w)`` triple, ``patch_size_t``)."""
    kind = getattr(record, "latent", PACKED_TOKENS) or PACKED_TOKENS
    if kind == PACKED_TOKENS:
        return Latent(kind)
    cfg = diffusers_config or {}
    size = cfg.get("patch_size", 1)
    if isinstance(size, (list, tuple)):
        patch = tuple(int(v) for v in size)
    else:
        patch = (int(cfg.get("patch_size_t", 1) or 1), int(size), int(size))
    return Latent(kind, patch)


def grid_axes(grid: Sequence[int], latent: Latent | None = None) -> dict:
    """:meth:`Latent.grid_axes` (default: one latent unit per token)."""
    return (latent or Latent(VIDEO_5D)).grid_axes(grid)


def concrete_shape(name: str, shape: Sequence, sizes: Mapping[str, int]) -> tuple:
    """A tensor's named shape (ints and axis names) for these axis values, in one line naming
    an axis ``sizes`` does not give. Cache rows default to their stream's tokens."""
    values = dict(sizes)
    for rows, tokens in model_io.CACHE_ROWS_FOR.items():
        if rows not in values and tokens in values:
            values[rows] = values[tokens]
    out = []
    for d in shape:
        if isinstance(d, str):
            if d not in values:
                raise InputError(f"{name}: unknown axis name {d!r} (known: {sorted(values)}). "
                                 f"Fix: re-export the model with this qkrope")
            out.append(int(values[d]))
        else:
            out.append(int(d))
    return tuple(out)


@dataclass(frozen=True)
class TextLengths:
    """Per-sample sequences: the real text length of each batch item (the text tensor is padded
    to the longest; the caches hold one row per padded token and the mask says which are real).
    """

    lengths: tuple

    @classmethod
    def checked(cls, lengths: Any, batch: int, txt_tokens: int,
                name: str = "txt_lens") -> "TextLengths":
        """``lengths`` (one whole number per batch item, each 1..``txt_tokens``) or one line
        saying what was received and what is expected."""
        expected = (f"{name} must be {batch} whole numbers (one text length per batch item), "
                    f"each between 1 and the {txt_tokens} text tokens")
        if isinstance(lengths, np.ndarray):
            lengths = lengths.tolist()
        if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
            raise InputError(f"{expected}; got {type(lengths).__name__} {lengths!r:.60}")
        out = []
        for n in lengths:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
                raise InputError(f"{expected}; got the entry {n!r} in {list(lengths)!r:.80}")
            out.append(int(n))
        if len(out) != batch or any(not 1 <= n <= txt_tokens for n in out):
            raise InputError(f"{expected}; got {out if len(out) <= 8 else out[:8] + ['...']}")
        return cls(tuple(out))

    @property
    def padded(self) -> int:
        """The text tokens of the padded batch: the longest sample's."""
        return max(self.lengths)

    def mask(self, txt_tokens: int | None = None) -> np.ndarray:
        """The bool ``[batch, txt_tokens]`` mask: True for each item's real tokens."""
        width = self.padded if txt_tokens is None else int(txt_tokens)
        return np.arange(width)[None, :] < np.asarray(self.lengths)[:, None]


def pack_patches(latent, patch: Sequence[int]):
    """A latent ``[batch, channels, *axes]`` (2 or 3 axes) that a model patchifies itself, as
    the tokens its patch embedding sees: ``[batch, tokens, channels x prod(patch)]``, tokens in
    row-major order of the patch grid, each token's features in (channel, *patch) order (the
    flattening of a convolution whose kernel and stride are the patch). A reshape and a
    permutation: exact. Returns ``(tokens, grid)``; one line naming what does not divide."""
    patch = tuple(int(p) for p in patch)
    shape = tuple(int(d) for d in latent.shape)
    if len(shape) != 2 + len(patch):
        axes = ", ".join(("frames", "height", "width")[-len(patch):])
        raise InputError(f"hidden_states must be [batch, channels, {axes}] (the model's patch "
                         f"is {list(patch)}); got shape {list(shape)}")
    bad = [(a, p) for a, p in zip(shape[2:], patch) if a < 1 or a % p]
    if bad:
        a, p = bad[0]
        raise InputError(f"hidden_states {list(shape)}: an axis of {a} is not a whole number of "
                         f"the model's {p}-wide patches. Fix: give the latent axes that are "
                         f"multiples of the patch size {list(patch)}")
    b, c = shape[:2]
    grid = tuple(a // p for a, p in zip(shape[2:], patch))
    split = [b, c]
    for g, p in zip(grid, patch):
        split += [g, p]
    n = len(patch)
    order = [0] + [2 + 2 * i for i in range(n)] + [1] + [3 + 2 * i for i in range(n)]
    tokens = latent.reshape(split).permute(order).reshape(b, math.prod(grid), -1)
    return tokens, grid


def unpack_patches(tokens, grid: Sequence[int], patch: Sequence[int]):
    """The inverse of :func:`pack_patches` for a model's output tokens ``[batch, tokens,
    channels x prod(patch)]`` (features in (channel, *patch) order, diffusers' unpatchify):
    ``[batch, channels, *(grid x patch)]``."""
    grid, patch = tuple(int(g) for g in grid), tuple(int(p) for p in patch)
    b, n = int(tokens.shape[0]), len(patch)
    x = tokens.reshape([b, *grid, -1, *patch])
    order = [0, n + 1]
    for i in range(n):
        order += [1 + i, n + 2 + i]
    return x.permute(order).reshape([b, -1, *(g * p for g, p in zip(grid, patch))])
