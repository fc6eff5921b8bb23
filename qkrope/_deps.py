"""Lazy imports of optional dependencies with one clear message when one is missing."""

from __future__ import annotations

import importlib
from types import ModuleType

from qkrope.errors import QkropeError

# module name -> what to install
_HINTS = {
    "diffusers": "pip install 'qkrope[diffusers]'  (or: pip install diffusers safetensors)",
    "safetensors": "pip install safetensors",
    "tensorrt": (
        "install TensorRT's Python bindings (pip install tensorrt from NVIDIA's index, a TensorRT "
        "tarball's python/ wheel) or run inside an NGC TensorRT container (nvcr.io/nvidia/tensorrt)"
    ),
    "tritonclient": "pip install 'qkrope[triton]'  (or: pip install 'tritonclient[grpc]')",
    "matplotlib": "pip install matplotlib",
    "modelopt": ("pip install 'qkrope[fp8]'  (or: pip install nvidia-modelopt==0.47.0, without "
                 "its [onnx]/[hf] extras, which pin onnx, onnxruntime-gpu and transformers)"),
}


class MissingDependencyError(QkropeError, ImportError):
    """An optional dependency needed for this feature is not installed."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise MissingDependencyError naming ``feature`` and the install step."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - exercised through the callers' tests
        hint = _HINTS.get(module.split(".")[0], f"pip install {module.split('.')[0]}")
        raise MissingDependencyError(
            f"{feature} needs the Python package '{module}', which could not be imported ({exc}). "
            f"Fix: {hint}."
        ) from exc
