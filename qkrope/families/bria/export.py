"""Bria's export hooks: the shared dual-stream export with its DUAL_STREAM."""

from __future__ import annotations

from qkrope.export import dual_stream
from qkrope.export.dual_stream import check_config, post_export  # noqa: F401
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401

from . import DUAL_STREAM


def prepare(record, transformer, *, sample, dtype, layers, rounding):
    return dual_stream.prepare(record, DUAL_STREAM, transformer, sample=sample, dtype=dtype,
                               layers=layers, rounding=rounding)
