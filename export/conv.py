"""Patch-embedding convolutions in a form every export dtype can write.

ONNX's ``Conv`` takes no bfloat16 before opset 22, and the ONNX checker refuses a graph whose
``Conv`` reads bfloat16 (seen on every video model's Conv3d patch embedding: HunyuanVideo(-1.5),
Wan; HunyuanImage-2.1's Conv2d). :func:`patch_conv` therefore writes the convolution of a bf16
export in float32: the bf16 inputs and weights are exact in float32, the products and sums are
float32 (as torch's bf16 convolution accumulates in float32 on the CPU), and one rounding to
bf16 ends it; the weights stay bf16 initializers (a ``Cast`` in the graph). Outside an export,
and for every other dtype, it is the module itself, so the eager model is unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def patch_conv(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for an ``nn.Conv2d`` / ``nn.Conv3d``, in float32 inside an ONNX export of
    bfloat16 activations (module docstring)."""
    if x.dtype != torch.bfloat16 or not torch.onnx.is_in_onnx_export():
        return conv(x)
    op = {4: F.conv2d, 5: F.conv3d}[x.dim()]
    bias = None if conv.bias is None else conv.bias.float()
    out = op(x.float(), conv.weight.float(), bias, stride=conv.stride, padding=conv.padding,
             dilation=conv.dilation, groups=conv.groups)
    return out.to(x.dtype)


__all__ = ["patch_conv"]
