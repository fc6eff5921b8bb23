"""One table of tensor dtype names for every layer of qkrope.

The canonical spelling is numpy's name (``"float32"``, ``"float16"``, ``"bfloat16"`` (ml_dtypes'
name), ``"bool"``, ...). Everything else maps to and from it:

==========  ===========  ===============  =============  ==========  ===============
short       canonical    torch            ONNX (code)    TensorRT    Triton
==========  ===========  ===============  =============  ==========  ===============
fp32        float32      torch.float32    FLOAT (1)      FLOAT       TYPE_FP32
fp16        float16      torch.float16    FLOAT16 (10)   HALF        TYPE_FP16
bf16        bfloat16     torch.bfloat16   BFLOAT16 (16)  BF16        TYPE_BF16
==========  ===========  ===============  =============  ==========  ===============

plus the integer/bool types the models' masks and timesteps use. The short names are the
``--dtype`` values of ``qkrope export`` / ``qkrope bench``; :data:`TORCH_BY_SHORT` is the table
the exporter uses for them.
"""

from __future__ import annotations

import sys
from typing import Any

from qkrope.errors import InputError

#: ``--dtype`` short names -> canonical (numpy) names: the model precisions qkrope exports.
NAME_BY_SHORT = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
SHORT_BY_NAME = {v: k for k, v in NAME_BY_SHORT.items()}

#: the names :data:`TORCH_BY_NAME` maps (torch's attribute of the same name)
TORCH_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
               "uint8", "bool")


def __getattr__(name: str):
    """``TORCH_BY_NAME`` (canonical name -> torch dtype) and ``TORCH_BY_SHORT`` (``--dtype``
    short name -> torch dtype, the exporter's table), made on first use so that this module,
    and the sidecars and commands that read dtype names, import without torch."""
    if name == "TORCH_BY_NAME":
        import torch

        table = {n: getattr(torch, n) for n in TORCH_NAMES}
    elif name == "TORCH_BY_SHORT":
        table = {k: __getattr__("TORCH_BY_NAME")[v] for k, v in NAME_BY_SHORT.items()}
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = table
    return table

#: canonical name -> ONNX ``TensorProto`` element type
ONNX_BY_NAME = {"float32": 1, "uint8": 2, "int8": 3, "uint16": 4, "int16": 5, "int32": 6,
                "int64": 7, "bool": 9, "float16": 10, "float64": 11, "uint32": 12,
                "uint64": 13, "bfloat16": 16}
NAME_BY_ONNX = {v: k for k, v in ONNX_BY_NAME.items()}

#: ONNX Runtime type strings (``NodeArg.type``) -> canonical name
NAME_BY_ORT = {f"tensor({t})": n for t, n in (
    ("float", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
    ("double", "float64"), ("int64", "int64"), ("int32", "int32"), ("int16", "int16"),
    ("int8", "int8"), ("uint8", "uint8"), ("bool", "bool"))}

#: ``tensorrt.DataType`` member name -> canonical name (FP8/INT4/FP4 have no numpy/torch I/O)
NAME_BY_TRT = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8",
               "INT32": "int32", "INT64": "int64", "BOOL": "bool", "UINT8": "uint8",
               "FP8": "float8_e4m3fn", "INT4": "int4", "FP4": "float4_e2m1"}
TRT_BY_NAME = {v: k for k, v in NAME_BY_TRT.items()}

#: canonical name -> Triton ``DataType`` enum name
TRITON_BY_NAME = {
    "float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16",
    "float64": "TYPE_FP64", "bool": "TYPE_BOOL", "int8": "TYPE_INT8", "int16": "TYPE_INT16",
    "int32": "TYPE_INT32", "int64": "TYPE_INT64", "uint8": "TYPE_UINT8",
    "uint16": "TYPE_UINT16", "uint32": "TYPE_UINT32", "uint64": "TYPE_UINT64",
}
NAME_BY_TRITON = {v: k for k, v in TRITON_BY_NAME.items()}

# Other spellings seen in sidecars, CLIs and libraries (lower case).
_ALIASES = {"float": "float32", "f32": "float32", "half": "float16", "f16": "float16",
            "double": "float64", "fp64": "float64", "boolean": "bool",
            **NAME_BY_SHORT}
_PREFIXES = ("torch.", "datatype.", "trt.", "tensorrt.", "np.", "numpy.")


def canonical(dtype: Any) -> str:
    """Any dtype spelling -> the canonical (numpy) name.

    Accepts a torch dtype, a numpy dtype, a ``tensorrt.DataType``, an ONNX element type code, an
    ONNX Runtime type string (``"tensor(float)"``), a Triton ``TYPE_*`` name, a ``--dtype`` short
    name or a plain name (``"half"``, ``"DataType.BF16"``, ``"torch.float16"``). Unknown
    spellings come back lower-cased and unprefixed (callers decide whether they are supported).
    """
    if isinstance(dtype, bool):
        raise TypeError(f"not a dtype: {dtype!r}")
    if isinstance(dtype, int):
        return NAME_BY_ONNX.get(dtype, str(dtype))
    torch = sys.modules.get("torch")  # a torch dtype exists only once torch is imported
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype)[len("torch."):]
    if not isinstance(dtype, str):
        name = getattr(dtype, "name", None)  # tensorrt.DataType, numpy dtype
        text = name if isinstance(name, str) else str(dtype)
    else:
        text = dtype
    text = text.strip()
    if text in NAME_BY_ORT:
        return NAME_BY_ORT[text]
    if text.upper() in NAME_BY_TRITON:
        return NAME_BY_TRITON[text.upper()]
    low = text.lower()
    for prefix in _PREFIXES:
        if low.startswith(prefix):
            low, text = low[len(prefix):], text[len(prefix):]
            break
    if text in NAME_BY_TRT:  # TensorRT member names are upper case (FLOAT, HALF, BF16, ...)
        return NAME_BY_TRT[text]
    if text.upper() in NAME_BY_TRT and low not in TORCH_NAMES and low not in _ALIASES:
        return NAME_BY_TRT[text.upper()]
    return _ALIASES.get(low, low)


def torch_dtype(dtype: Any):
    """The torch dtype for any spelling; ValueError for one torch cannot hold."""
    name = canonical(dtype)
    if name not in TORCH_NAMES:
        raise InputError(f"dtype {dtype!r} has no torch equivalent qkrope supports "
                         f"({', '.join(TORCH_NAMES)})")
    return __getattr__("TORCH_BY_NAME")[name]


def short_name(dtype: Any) -> str:
    """``fp32`` / ``fp16`` / ``bf16`` for a model precision in any spelling."""
    name = canonical(dtype)
    if name not in SHORT_BY_NAME:
        raise InputError(f"dtype {dtype!r} is not a model precision qkrope exports "
                         f"({', '.join(NAME_BY_SHORT)})")
    return SHORT_BY_NAME[name]


def onnx_code(dtype: Any) -> int:
    """The ONNX ``TensorProto`` element type for any spelling."""
    name = canonical(dtype)
    if name not in ONNX_BY_NAME:
        raise InputError(f"dtype {dtype!r} has no ONNX element type in qkrope's table")
    return ONNX_BY_NAME[name]


def triton_type(dtype: Any) -> str | None:
    """Triton's ``TYPE_*`` name for any spelling, or None when Triton has none."""
    return TRITON_BY_NAME.get(canonical(dtype))


def numpy_dtype(dtype: Any):
    """A numpy dtype for any spelling, ``bfloat16`` as ml_dtypes' type."""
    import numpy as np

    name = canonical(dtype)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


__all__ = ["NAME_BY_SHORT", "SHORT_BY_NAME", "TORCH_NAMES", "TORCH_BY_NAME", "TORCH_BY_SHORT", "ONNX_BY_NAME",
           "NAME_BY_ONNX", "NAME_BY_ORT", "NAME_BY_TRT", "TRT_BY_NAME", "TRITON_BY_NAME",
           "NAME_BY_TRITON", "canonical", "torch_dtype", "short_name", "onnx_code",
           "triton_type", "numpy_dtype"]
