"""Queries about TensorRT engine files and the GPU, shared by the engine builder, the runners and
the Triton repository (no TensorRT import at module load): whether a file is a serialised engine
at all, and the current GPU. Reading ONNX files is :mod:`qkrope.runtime.onnx_file`."""

from __future__ import annotations

import os
from pathlib import Path

from qkrope._fileio import looks_like_onnx
from qkrope.errors import QkropeError

from .onnx_file import OnnxModelError, checked_onnx_model


class NotAnEngineError(QkropeError, ValueError):
    """A file given as a TensorRT engine is not one (an ONNX model, an empty file)."""


def check_engine_file(engine: str | os.PathLike) -> None:
    """Refuse, before TensorRT is needed, what is not a serialised engine: an empty file or an
    ONNX model (by its suffix or its content; its QKNormRoPE nodes are checked against the node
    contract first, as every consumer of an ONNX file does). ``engine`` must exist."""
    engine = Path(engine)
    fix = (f"Fix: build an engine with `qkrope build {engine} -o "
           f"{engine.with_suffix('.engine').name}` and pass that")
    if engine.suffix.lower() == ".onnx" or looks_like_onnx(engine):
        try:
            checked_onnx_model(engine)
        except OnnxModelError:
            if engine.suffix.lower() != ".onnx":
                return  # a plan whose first bytes happen to look like ONNX
            raise NotAnEngineError(f"{engine} is not a TensorRT engine (an .onnx file). "
                                   f"{fix}") from None
        raise NotAnEngineError(f"{engine} is an ONNX model, not a TensorRT engine. {fix}")
    if engine.stat().st_size == 0:
        raise NotAnEngineError(f"{engine} is empty, not a TensorRT engine. Fix: rebuild it "
                               f"with `qkrope build`")


def gpu_info() -> dict | None:
    """Name and compute capability of the current CUDA device, or None without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        dev = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(dev)
        return {"name": torch.cuda.get_device_name(dev), "compute_capability": f"{major}.{minor}",
                "index": dev}
    except Exception:  # pragma: no cover - best effort metadata
        return None
