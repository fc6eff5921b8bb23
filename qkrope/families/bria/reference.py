"""Bria's reference hook: the shared dual-stream forward kwargs with its id layout."""

from __future__ import annotations

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401
from qkrope.runtime import dual_stream

from . import DUAL_STREAM


def forward_kwargs(info, by_role, img_shapes) -> dict:
    return dual_stream.forward_kwargs(DUAL_STREAM.ids, info, by_role, img_shapes)
