"""qkrope: ONNX/TensorRT export of diffusion transformers with fused QK-RMSNorm + RoPE.

``import qkrope`` is cheap: it needs neither diffusers, TensorRT nor CUDA. The work lives in
``qkrope.export`` (PyTorch side: reference op, attention block, ONNX export) and
``qkrope.runtime`` (host side: RoPE caches, validation, engines, runners).
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
