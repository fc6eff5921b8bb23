"""The export's argument checks, before anything is traced: ``--dtype``, ``--opset`` (and the
lowest one an attention form or FP8 needs, :func:`default_opset`), ``--out`` (a writable
folder, outputs that are none of the inputs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from qkrope import contract, dtypes
from qkrope._fileio import (EXTERNAL_DATA, MODEL_SIDECAR, ONNX_MODEL, check_output_folder,
                            check_outputs)
from qkrope.errors import InputError
from qkrope.sidecars import sidecar_path

from .attention import DEFAULT_ATTENTION_FORM, check_attention_form
from .onnx_function import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET

TORCH_DTYPES = dtypes.TORCH_BY_SHORT  # "fp32" | "fp16" | "bf16" -> torch dtype

def default_opset(attention: str = DEFAULT_ATTENTION_FORM, quant: str | None = None) -> int:
    """DEFAULT_OPSET, or the lowest opset that has the attention form (23 for ``onnx23``) and
    the quantisation (19 for FP8 Q/DQ)."""
    return max(DEFAULT_OPSET,
               contract.ATTENTION_MIN_OPSET.get(check_attention_form(attention), DEFAULT_OPSET),
               FP8_MIN_OPSET if quant else DEFAULT_OPSET)


FP8_MIN_OPSET = 19  # QuantizeLinear/DequantizeLinear take float8 types from opset 19


def _check_quant_opset(quant: str | None, opset: int) -> None:
    if quant is not None and opset < FP8_MIN_OPSET:
        raise InputError(f"--quant {quant} needs --opset {FP8_MIN_OPSET} or later (float8 "
                         f"QuantizeLinear/DequantizeLinear); got {opset}")


def _check_opset(opset: int) -> int:
    if not MIN_OPSET <= int(opset) <= MAX_OPSET:
        raise InputError(f"--opset must be between {MIN_OPSET} and {MAX_OPSET} (the dynamo exporter "
                         f"targets opset 18+; the default {DEFAULT_OPSET} has the widest TensorRT/"
                         f"ONNX Runtime support); got {opset}")
    return int(opset)


def _check_dtype(dtype: str) -> torch.dtype:
    if dtype not in TORCH_DTYPES:
        raise InputError(f"--dtype must be one of {sorted(TORCH_DTYPES)}; got {dtype!r}")
    return TORCH_DTYPES[dtype]


def _check_out(out: str | os.PathLike, inputs: Sequence[str | os.PathLike | None] = ()) -> Path:
    """``--out`` before the trace: a .onnx path in a writable folder whose three outputs are
    none of the ``inputs`` (the weights, the diffusers folder's files) and replace no file of
    another kind (:func:`qkrope._fileio.check_outputs`)."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise InputError(f"--out must end in .onnx; got {str(out)!r}")
    if out.is_dir():
        raise InputError(f"--out {str(out)!r} is a directory")
    check_output_folder(out.parent)  # before the trace: a file in the path, a read-only folder
    check_outputs([(out, ONNX_MODEL),
                   (out.parent / (out.name + ".data"), EXTERNAL_DATA),
                   (sidecar_path(out), MODEL_SIDECAR)],
                  list(inputs))
    return out
