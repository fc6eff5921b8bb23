"""The drop-in hooks of a dual-stream clone (a record with ``dual_stream``, no dropin.py of its
own: qkrope.families._dual_stream.SHARED_HOOKS): a :class:`~qkrope.runtime.dual_stream.
DualStreamTransformer` subclass per record, named after it, whose ``SPEC`` is the record's
``dual_stream``."""

from __future__ import annotations

import re
from typing import Sequence

from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime.dual_stream import DualStreamTransformer, ids_request


_CLASSES: dict[str, type] = {}


def _dropin(record) -> type:
    if record.name in _CLASSES:
        return _CLASSES[record.name]
    name = "".join(w[:1].upper() + w[1:] for w in re.split(r"[^0-9A-Za-z]+", record.short) if w)
    cls = type(f"{name}Transformer", (DualStreamTransformer,), {
        "__doc__": f"What {record.dual_stream.pipelines} call on ``pipe.transformer``.",
        "__module__": __name__, "__qualname__": f"{name}Transformer",
        "SPEC": record.dual_stream})
    return _CLASSES.setdefault(record.name, cls)


def dropin_class(record) -> type:
    """The record's drop-in class (one per record, made once)."""
    return _dropin(record)


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The ids the record's pipelines pass for a sample of these sizes."""
    return ids_request(record.dual_stream.ids, img_shapes, txt_len)


__all__ = ["dropin_class", "sample_request"]
