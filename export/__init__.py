"""PyTorch side: the QKNormRoPE reference and custom op, the Qwen-Image attention block, and the
ONNX export. ``import qkrope.export`` needs torch only; diffusers is imported when used."""

from qkrope import contract
from .attention import QwenImageAttention
from .ops import qk_norm_rope
from .reference import qk_norm_rope_reference

__all__ = ["contract", "QwenImageAttention", "qk_norm_rope", "qk_norm_rope_reference"]
