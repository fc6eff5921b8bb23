"""The export hooks of a dual-stream clone (a record with ``dual_stream``, no export.py of its
own: qkrope.families._dual_stream.SHARED_HOOKS): :mod:`qkrope.export.dual_stream`'s export with
the record's :class:`~qkrope.families._dual_stream.DualStream`."""

from __future__ import annotations

from qkrope.export import dual_stream
from qkrope.export.dual_stream import check_config, post_export  # noqa: F401 (the hooks)
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401


def prepare(record, transformer, *, sample, dtype, layers, rounding):
    """The dual-stream export plan with the record's own differences."""
    return dual_stream.prepare(record, record.dual_stream, transformer, sample=sample,
                               dtype=dtype, layers=layers, rounding=rounding)


__all__ = ["check_config", "prepare", "post_export"]
