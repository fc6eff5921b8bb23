"""The reference hook of a dual-stream clone (a record with ``dual_stream``, no reference.py of
its own: qkrope.families._dual_stream.SHARED_HOOKS): diffusers' forward arguments with the ids
its pipelines lay out (:func:`qkrope.runtime.dual_stream.forward_kwargs`)."""

from __future__ import annotations

from qkrope import families
from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401
from qkrope.runtime import dual_stream


def forward_kwargs(info, by_role, img_shapes) -> dict:
    """The stock forward's arguments for the export ``info`` describes (its record: the
    sidecar's family)."""
    record = families.by_name(info.config.family)
    return dual_stream.forward_kwargs(record.dual_stream.ids, info, by_role, img_shapes)


__all__ = ["forward_kwargs"]
