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
        for spelling, source in ((short, "name"), (name, "name"), (tdt, "torch"),
                                 (onnx_code, "onnx"), (trt_name, "tensorrt"),
                                 (f"DataType.{trt_name}", "tensorrt"), (triton_name, "triton"),
                                 (str(tdt), "torch")):
            assert dtypes.canonical(spelling, source=source) == name, (spelling, source)
        for spelling in (short, name, tdt):  # a type or qkrope's own name: no source needed
            assert dtypes.canonical(spelling) == name, spelling
        assert dtypes.NAME_BY_SHORT[short] == name and dtypes.short_name(tdt) == short
        assert dtypes.TORCH_BY_SHORT[short] is tdt and dtypes.torch_dtype(name) is tdt
        assert dtypes.onnx_code(short) == onnx_code and dtypes.triton_type(tdt) == triton_name
        assert dtypes.TRT_BY_NAME[name] == trt_name
    assert dtypes.numpy_dtype("bf16").name == "bfloat16"
    assert dtypes.numpy_dtype("fp16") == np.float16
    assert dtypes.canonical("tensor(float)", source="onnxruntime") == "float32"
    assert dtypes.canonical(TensorProto.BOOL, source="onnx") == "bool"
    assert dtypes.canonical("BOOL", source="tensorrt") == "bool"
    assert dtypes.canonical("half", source="numpy") == "float16"
    assert dtypes.canonical("DataType.FP8", source="tensorrt") == "float8_e4m3fn"
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


def test_the_source_decides_what_a_spelling_means():
    """One spelling, two vocabularies: the caller's source reads it, nothing is guessed."""
    import ml_dtypes
    import numpy as np
    import onnx_ir as ir
    from onnx import TensorProto

    assert dtypes.canonical("float", source="numpy") == "float64"  # numpy's float is double
    assert dtypes.canonical("tensor(float)", source="onnxruntime") == "float32"
    assert dtypes.canonical("FLOAT", source="onnx") == "float32"
    assert dtypes.canonical("FLOAT", source="tensorrt") == "float32"
    assert dtypes.canonical("DOUBLE", source="onnx") == "float64"
    assert dtypes.canonical(ir.DataType.BFLOAT16, source="onnx") == "bfloat16"  # onnx_ir's enum
    for code in TensorProto.DataType.values():  # the ONNX names agree with onnx's own table
        name = TensorProto.DataType.Name(code)
        if name in dtypes.ONNX_CODE_BY_ONNX_NAME:
            assert dtypes.ONNX_CODE_BY_ONNX_NAME[name] == code, name
    assert dtypes.canonical("FP16", source="triton") == "float16"  # the protocol's name
    assert dtypes.canonical(np.float16) == dtypes.canonical(np.dtype("float16")) == "float16"
    assert dtypes.canonical(np.dtype(ml_dtypes.bfloat16)) == "bfloat16"
    assert dtypes.triton_type("float64") == "TYPE_FP64"
    assert dtypes.onnx_code("HALF", source="tensorrt") == 10


@pytest.mark.parametrize("value,source", [
    ("half", None), ("float", None), ("tensor(float)", "name"), ("HALF", "name"),
    ("float32", "onnxruntime"), ("FLOAT", "triton"), ("float16", "tensorrt"), (17, "onnx"),
    ("torch.complex_half", "torch"), (None, "numpy"), ("tensor(float)", "numpy"),
])
def test_a_value_outside_its_source_is_refused_naming_value_source_and_choices(value, source):
    with pytest.raises(ValueError) as info:
        dtypes.canonical(value, source=source)
    text = str(info.value)
    assert repr(value) in text and f"source={source or 'name'!r}" in text
    assert "accepted with source=" in text


def test_a_value_without_a_type_of_its_own_must_name_its_source():
    """An int is an ONNX code only when the caller says so; a TensorRT enum likewise."""
    from fake_tensorrt import DataType

    for value in (1, DataType.HALF):
        with pytest.raises(ValueError, match=r"source= \(one of name, torch, numpy"):
            dtypes.canonical(value)
    assert dtypes.canonical(DataType.HALF, source="tensorrt") == "float16"
    with pytest.raises(ValueError, match="dtype source 'ONNX' is not one of name"):
        dtypes.canonical(1, source="ONNX")
    with pytest.raises(ValueError, match="not a dtype"):
        dtypes.canonical(True, source="onnx")


@pytest.mark.parametrize("junk", [
    ("f4", -1), ("f4", 2**70), "f4,", ">>f4", "junk", {"names": ["a"], "formats": ["x"]},
    {}, [], [("a", "f4")], "V", "O", "U10", "S", "M8", object, 2**70, ">f4",
])
def test_numpy_source_junk_is_one_input_error(junk):
    """What numpy.dtype() refuses (TypeError or ValueError), and what it takes but no model
    tensor has (structured, object, string, datetime, another byte order), is qkrope's
    InputError naming the value, never numpy's exception nor a 'void'/'object' name."""
    from qkrope.errors import InputError

    with pytest.raises(InputError, match=r"source='numpy'\) is not one qkrope maps") as info:
        dtypes.canonical(junk, source="numpy")
    assert type(info.value) is InputError and "\n" not in str(info.value)
