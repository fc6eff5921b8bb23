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
the exporter uses for them. A value is read in the vocabulary its caller names
(``canonical(value, source="onnxruntime")``, as polygraphy's ``DataType.from_dtype``), never
guessed from its spelling.
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

#: ONNX ``TensorProto.DataType`` member names -> element type (the codes above, by onnx's name)
ONNX_CODE_BY_ONNX_NAME = {"FLOAT": 1, "UINT8": 2, "INT8": 3, "UINT16": 4, "INT16": 5, "INT32": 6,
                          "INT64": 7, "BOOL": 9, "FLOAT16": 10, "DOUBLE": 11, "UINT32": 12,
                          "UINT64": 13, "BFLOAT16": 16}

#: where a dtype value comes from: the ``source`` of :func:`canonical`
SOURCES = ("name", "torch", "numpy", "onnx", "onnxruntime", "tensorrt", "triton")

#: qkrope's own spellings (``source="name"``): the canonical names and the --dtype short names
NAMES = tuple(dict.fromkeys((*TORCH_NAMES, *ONNX_BY_NAME, *NAME_BY_TRT.values(), *NAME_BY_SHORT)))


def _refuse(dtype: Any, source: str | None, accepted) -> InputError:
    return InputError(f"dtype {dtype!r} (source={source!r}) is not one qkrope maps; accepted "
                      f"with source={source!r}: {', '.join(str(a) for a in accepted)}")


def _source_of(dtype: Any) -> str:
    """The source a value names by its type alone (no spelling is read): a torch dtype, a numpy
    dtype or scalar type, or a string (qkrope's own names). Anything else must be named."""
    torch = sys.modules.get("torch")  # a torch dtype exists only once torch is imported
    if torch is not None and isinstance(dtype, torch.dtype):
        return "torch"
    np = sys.modules.get("numpy")
    if np is not None and (isinstance(dtype, np.dtype)
                           or (isinstance(dtype, type) and issubclass(dtype, np.generic))):
        return "numpy"
    if isinstance(dtype, str):
        return "name"
    raise InputError(f"dtype {dtype!r} ({type(dtype).__name__}): say where it comes from with "
                     f"source= (one of {', '.join(SOURCES)}), e.g. canonical(value, "
                     f"source=\"onnx\") for an ONNX element type code")


def canonical(dtype: Any, source: str | None = None) -> str:
    """A dtype from ``source`` -> the canonical (numpy) name, as polygraphy's
    ``DataType.from_dtype(dtype, source_module)``: the caller says which vocabulary the value is
    in, so no spelling is guessed (``"float"`` is float32 to ONNX Runtime's ``tensor(float)`` but
    float64 to numpy).

    ``source``:

    - ``"name"``: qkrope's own names (:data:`NAMES`: ``"float32"``, ``"bfloat16"``,
      ``"float8_e4m3fn"``, ..., and the --dtype short names ``"fp32"``, ``"fp16"``, ``"bf16"``);
    - ``"torch"``: a ``torch.dtype`` (any: its name) or its text ``"torch.float16"``;
    - ``"numpy"``: what ``numpy.dtype()`` takes (``np.float16``, ``"half"``, ``"<f4"``,
      ml_dtypes' bfloat16);
    - ``"onnx"``: a ``TensorProto`` element type, as its code (``1``) or name (``"FLOAT"``);
    - ``"onnxruntime"``: a ``NodeArg.type`` string (``"tensor(float)"``);
    - ``"tensorrt"``: a ``tensorrt.DataType`` or its member name (``"HALF"``, ``"DataType.HALF"``);
    - ``"triton"``: a Triton ``TYPE_*`` name (``"TYPE_FP16"``) or its protocol name (``"FP16"``);
    - ``None`` (the default): by the value's type only: a torch dtype, a numpy dtype or scalar
      type, or a string in qkrope's own names; any other value must name its source.

    A value outside its source's table raises :class:`~qkrope.errors.InputError` naming the
    value, the source and the accepted values.
    """
    if isinstance(dtype, bool):
        raise InputError(f"not a dtype: {dtype!r}")
    if source is None:
        source = _source_of(dtype)
    if source == "name":
        if isinstance(dtype, str) and dtype in NAMES:
            return NAME_BY_SHORT.get(dtype, dtype)
        raise _refuse(dtype, source, NAMES)
    if source == "torch":
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(dtype, torch.dtype):
            return str(dtype)[len("torch."):]
        if isinstance(dtype, str) and dtype.startswith("torch.") and \
                dtype[len("torch."):] in TORCH_NAMES:
            return dtype[len("torch."):]
        raise _refuse(dtype, source, [f"torch.{n}" for n in TORCH_NAMES])
    if source == "numpy":
        import numpy as np

        accepted = ["what numpy.dtype() takes for one of qkrope's dtypes (np.float16, 'half', "
                    "'<f4', ml_dtypes.bfloat16, ...), in native byte order"]
        try:
            if dtype is None:  # numpy reads None as float64
                raise TypeError
            parsed = np.dtype(dtype)
        except Exception:  # noqa: BLE001 - TypeError, ValueError, ...: numpy takes no such dtype
            raise _refuse(dtype, source, accepted) from None
        # a structured, object, string or datetime dtype, or another byte order, is no dtype a
        # model tensor has: refused, as every other source's values outside qkrope's table
        if parsed.name not in NAMES or not parsed.isnative:
            raise _refuse(dtype, source, accepted)
        return parsed.name
    if source == "onnx":
        code = ONNX_CODE_BY_ONNX_NAME.get(dtype) if isinstance(dtype, str) else dtype
        if isinstance(code, int) and not isinstance(code, bool) and int(code) in NAME_BY_ONNX:
            return NAME_BY_ONNX[int(code)]
        raise _refuse(dtype, source, [f"{n} ({c})" for n, c in ONNX_CODE_BY_ONNX_NAME.items()])
    if source == "onnxruntime":
        if isinstance(dtype, str) and dtype in NAME_BY_ORT:
            return NAME_BY_ORT[dtype]
        raise _refuse(dtype, source, NAME_BY_ORT)
    if source == "tensorrt":
        name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
        if isinstance(name, str) and name.startswith("DataType."):
            name = name[len("DataType."):]
        if name in NAME_BY_TRT:
            return NAME_BY_TRT[name]
        raise _refuse(dtype, source, NAME_BY_TRT)
    if source == "triton":
        if isinstance(dtype, str):
            key = dtype if dtype.startswith("TYPE_") else f"TYPE_{dtype}"
            if key in NAME_BY_TRITON:
                return NAME_BY_TRITON[key]
        raise _refuse(dtype, source, NAME_BY_TRITON)
    raise InputError(f"dtype source {source!r} is not one of {', '.join(SOURCES)}")


def torch_dtype(dtype: Any, source: str | None = None):
    """The torch dtype of a dtype from ``source`` (see :func:`canonical`); ValueError for one
    torch cannot hold."""
    name = canonical(dtype, source)
    if name not in TORCH_NAMES:
        raise InputError(f"dtype {dtype!r} has no torch equivalent qkrope supports "
                         f"({', '.join(TORCH_NAMES)})")
    return __getattr__("TORCH_BY_NAME")[name]


def short_name(dtype: Any, source: str | None = None) -> str:
    """``fp32`` / ``fp16`` / ``bf16`` for a model precision from ``source``."""
    name = canonical(dtype, source)
    if name not in SHORT_BY_NAME:
        raise InputError(f"dtype {dtype!r} is not a model precision qkrope exports "
                         f"({', '.join(NAME_BY_SHORT)})")
    return SHORT_BY_NAME[name]


def onnx_code(dtype: Any, source: str | None = None) -> int:
    """The ONNX ``TensorProto`` element type of a dtype from ``source``."""
    name = canonical(dtype, source)
    if name not in ONNX_BY_NAME:
        raise InputError(f"dtype {dtype!r} has no ONNX element type in qkrope's table")
    return ONNX_BY_NAME[name]


def triton_type(dtype: Any, source: str | None = None) -> str | None:
    """Triton's ``TYPE_*`` name of a dtype from ``source``, or None when Triton has none."""
    return TRITON_BY_NAME.get(canonical(dtype, source))


def numpy_dtype(dtype: Any, source: str | None = None):
    """The numpy dtype of a dtype from ``source``, ``bfloat16`` as ml_dtypes' type."""
    import numpy as np

    name = canonical(dtype, source)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


__all__ = ["NAME_BY_SHORT", "SHORT_BY_NAME", "TORCH_NAMES", "TORCH_BY_NAME", "TORCH_BY_SHORT",
           "ONNX_BY_NAME", "NAME_BY_ONNX", "ONNX_CODE_BY_ONNX_NAME", "NAME_BY_ORT", "NAME_BY_TRT",
           "TRT_BY_NAME", "TRITON_BY_NAME", "NAME_BY_TRITON", "SOURCES", "NAMES", "canonical",
           "torch_dtype", "short_name", "onnx_code", "triton_type", "numpy_dtype"]
