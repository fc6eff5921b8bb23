"""Host side at inference: RoPE caches (build, convert, validate), engines and runners.

``import qkrope.runtime`` needs torch only; TensorRT and ONNX Runtime are imported when used.
"""

from .caches import (
    RopeCacheError,
    RopeCacheOverflowError,
    RopeCaches,
    build_qwen_rope_caches,
    to_cos_sin_caches,
    validate_cos_sin_caches,
)

__all__ = [
    "RopeCacheError",
    "RopeCacheOverflowError",
    "RopeCaches",
    "build_qwen_rope_caches",
    "to_cos_sin_caches",
    "validate_cos_sin_caches",
]
