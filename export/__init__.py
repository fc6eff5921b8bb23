"""PyTorch side: the QKNormRoPE reference and custom op, the Qwen-Image attention block, and the
ONNX export.

``import qkrope.export`` imports nothing heavy: each public name below is imported from its module
on first use (``from qkrope.export import QwenImageAttention`` imports torch), as
:mod:`qkrope.runtime` does. diffusers is imported only where a function needs it.
"""

from __future__ import annotations

import importlib

from qkrope import contract

# public name -> the module that defines it
_PUBLIC = {"QwenImageAttention": "attention", "qk_norm_rope": "ops",
           "qk_norm_rope_reference": "reference"}

__all__ = ["contract", *_PUBLIC]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        try:  # a submodule accessed as an attribute (qkrope.export.onnx_export)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists; something it imports does not
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
