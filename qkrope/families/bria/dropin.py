"""Bria's drop-in: the shared dual-stream one with its DUAL_STREAM."""

from __future__ import annotations

from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime.dual_stream import DualStreamTransformer, dropin_hooks

from . import DUAL_STREAM


class BriaTransformer(DualStreamTransformer):
    """What BriaPipeline calls on ``pipe.transformer``."""

    SPEC = DUAL_STREAM


dropin_class, sample_request = dropin_hooks(BriaTransformer)
