"""Host side at inference: RoPE caches (build, convert, validate), engines and runners.

``import qkrope.runtime`` needs torch only; TensorRT and ONNX Runtime are imported when used.
"""

from .caches import (
    RopeCacheError,
    RopeCacheOverflowError,
    RopeCaches,
    build_qwen_rope_caches,
    caches_for,
    to_cos_sin_caches,
    validate_cos_sin_caches,
)

__all__ = [
    "RopeCacheError",
    "RopeCacheOverflowError",
    "RopeCaches",
    "build_qwen_rope_caches",
    "caches_for",
    "to_cos_sin_caches",
    "validate_cos_sin_caches",
]

# Runtime wrapper (TensorRT engine or ONNX model behind one interface); backends import lazily.
from .runner import Runner, RunnerError, RunnerInputError, load  # noqa: E402

__all__ += ["load", "Runner", "RunnerError", "RunnerInputError"]

# Drop-in for diffusers' QwenImageTransformer2DModel in pipelines (diffusers imported lazily).
from .transformer import QwenImageTransformer, load_transformer  # noqa: E402

__all__ += ["QwenImageTransformer", "load_transformer"]
