"""qkrope.dtypes: one table of dtype names for every layer."""

from __future__ import annotations

import pytest

from qkrope import dtypes
from qkrope.runtime import onnx_file, trt_utils as tu


def test_dtypes_module_maps_every_layer():
    import numpy as np
    import torch
    from onnx import TensorProto

    from qkrope import dtypes

    rows = [("fp32", "float32", torch.float32, TensorProto.FLOAT, "FLOAT", "TYPE_FP32"),
            ("fp16", "float16", torch.float16, TensorProto.FLOAT16, "HALF", "TYPE_FP16"),
            ("bf16", "bfloat16", torch.bfloat16, TensorProto.BFLOAT16, "BF16", "TYPE_BF16")]
    for short, name, tdt, onnx_code, trt_name, triton_name in rows:
        for spelling in (short, name, tdt, onnx_code, trt_name, f"DataType.{trt_name}",
                         triton_name, str(tdt)):
            assert dtypes.canonical(spelling) == name, spelling
        assert dtypes.NAME_BY_SHORT[short] == name and dtypes.short_name(tdt) == short
        assert dtypes.TORCH_BY_SHORT[short] is tdt and dtypes.torch_dtype(name) is tdt
        assert dtypes.onnx_code(short) == onnx_code and dtypes.triton_type(tdt) == triton_name
        assert dtypes.TRT_BY_NAME[name] == trt_name
    assert dtypes.numpy_dtype("bf16").name == "bfloat16"
    assert dtypes.numpy_dtype("fp16") == np.float16
    assert dtypes.canonical("tensor(float)") == "float32"
    assert dtypes.canonical(TensorProto.BOOL) == "bool" and dtypes.canonical("BOOL") == "bool"
    assert dtypes.canonical("half") == "float16" and dtypes.canonical("float") == "float32"
    assert dtypes.canonical("DataType.FP8") == "float8_e4m3fn"
    with pytest.raises(ValueError):
        dtypes.torch_dtype("float8_e4m3fn")
    with pytest.raises(ValueError):
        dtypes.short_name("int64")
    # the runtime modules use it (no private tables left)
    from qkrope import sidecars
    from qkrope.runtime import triton
    assert sidecars.DTYPES is dtypes.NAME_BY_SHORT
    tables = ("ONNX_DTYPES", "ONNX_DTYPE_CODES", "ORT_DTYPES", "TRT_DTYPES", "torch_dtype")
    for mod, names in ((tu, tables), (onnx_file, tables), (triton, ("_TRITON_DTYPES",))):
        for n in names:
            assert not hasattr(mod, n), f"{mod.__name__}.{n}"
