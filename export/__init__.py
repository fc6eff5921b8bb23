"""PyTorch side: the QKNormRoPE reference and custom op, the Qwen-Image attention block, and the
ONNX export.

The transformer export as a function, with the options and defaults of ``qkrope export --model
transformer`` (:mod:`qkrope.export.api`)::

    from qkrope.export import export_transformer

    result = export_transformer("Qwen-Image/transformer", "qwen.onnx", layers=2)
    result.dtype, result.dtype_reason, result.paths   # bf16, why, (qwen.onnx, ..., .json)

``import qkrope.export`` imports nothing heavy: each public name below is imported from its module
on first use (``from qkrope.export import QwenImageAttention`` imports torch), as
:mod:`qkrope.runtime` does. diffusers is imported only where a function needs it.
"""

from __future__ import annotations

from qkrope._lazy import lazy_names

from qkrope import contract

# public name -> the module that defines it
_PUBLIC = {"QwenImageAttention": "attention", "qk_norm_rope": "ops",
           "qk_norm_rope_reference": "reference", "export_transformer": "api",
           "ExportResult": "api"}

__all__ = ["contract", *_PUBLIC]


__getattr__, __dir__ = lazy_names(__name__, {n: f".{m}" for n, m in _PUBLIC.items()}, globals(),
                                  submodules=True)
