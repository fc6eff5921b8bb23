"""Position schemes: how a family's RoPE positions come into a request and become the cache pair
(numpy and the standard library only; ``qkrope triton-repo`` copies this package beside the
Triton rope model, which imports it by path).

Each scheme module (:mod:`.grid`, :mod:`.ids`, :mod:`.table`, :mod:`.patch_grid`,
:mod:`.scaled_grid`, :mod:`.divided_grid`, :mod:`.ids_float32`) says:

- ``FIELDS``: the request fields it takes in place of the caches (``POSITION_FIELDS``: those
  whose tensors hold position values);
- ``positions(request, setting, max_bytes)``: its checks, returning the checked request, and
  ``rows(pos)``: the cache rows it needs (image, text); ``key(pos)`` for a memo;
- ``build(pos, setting)``: the numpy pair (``check(pos, setting)``: the table limits);
- ``triton_inputs(setting)``: the rope model's inputs, ``triton_request(request, setting)``
  the arrays a client sends for them, ``triton_positions(...)`` the rope model's checks;
- ``profile_limits(setting, grids, txt_max)``: what engine profiles can use.

A family's record names its scheme; :func:`scheme` returns the module. A new scheme is a new
module here, added to :data:`SCHEMES`.
"""

from __future__ import annotations

from . import divided_grid, grid, ids, ids_float32, patch_grid, scaled_grid, table
from ._common import (BIT_EXACT, PRECISIONS, STREAMS, BadPositions, BadRequest,  # noqa: F401
                      CacheBudget, PositionOverflow, Setting, TooLarge, check_mask_dtype,
                      check_token_shapes, identity_rows)

#: Every scheme by name.
SCHEMES = {m.NAME: m for m in (grid, ids, table, patch_grid, scaled_grid,
                                    divided_grid, ids_float32)}


def scheme(name: str):
    """The scheme module called ``name``; :class:`BadRequest` listing the known ones."""
    found = SCHEMES.get(name) if isinstance(name, str) else None
    if found is None:
        raise BadRequest(f"unknown RoPE position scheme {name!r}; known: {sorted(SCHEMES)}. Fix: "
                         f"re-export the model with this qkrope, or upgrade qkrope")
    return found
