"""Ranks, shapes and dtypes of the QKNormRoPE tensors (docs/spec.md sections 2 and 4): the one
check shared by the PyTorch op (qkrope.export) and the kernel bindings (qkrope.runtime)."""

from __future__ import annotations

import torch

from qkrope import contract
from qkrope.errors import InputError

ACTIVATION_TORCH_DTYPES = tuple(getattr(torch, name) for name in contract.ACTIVATION_DTYPES)


def check_tensor_layout(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                        norm_scope: int = 0) -> None:
    """Ranks, shapes and dtypes of the op's tensors (ValueError naming what was received); the
    weights are [head_dim] with ``norm_scope`` 0 and [heads * head_dim] with 1, both in q's dtype
    or both float32 (FLUX.3 keeps its norm weights in fp32 under bf16 activations).
    The values that the kernel itself must refuse (cache rows, rotary_dim, eps, rounding) are
    checked by :func:`qkrope.export.reference.check_qk_norm_rope_args`."""
    if q.dim() != 4 or q.shape != k.shape:
        raise InputError(
            f"q and k must both be [batch, seq, heads, head_dim] with the same shape; got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}")
    if q.dtype not in ACTIVATION_TORCH_DTYPES or k.dtype != q.dtype:
        raise InputError(f"q and k must share one dtype among float32/float16/bfloat16; got "
                         f"{q.dtype} and {k.dtype}")
    head_dim = q.shape[-1]
    width, what = ((q.shape[-2] * head_dim, "heads * head_dim, norm_scope 1") if norm_scope == 1
                   else (head_dim, "head_dim"))
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if tuple(w.shape) != (width,) or w.dtype not in (q.dtype, torch.float32):
            raise InputError(f"{name} must be [{width}] in q's dtype ({q.dtype}) or float32 "
                             f"({what}); got {tuple(w.shape)} {w.dtype}")
    if q_weight.dtype != k_weight.dtype:
        raise InputError(f"q_weight and k_weight must share one dtype (q's or float32); got "
                         f"{q_weight.dtype} and {k_weight.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.dtype != torch.float32:
        raise InputError(
            f"cos_sin_cache must be a 2-D float32 [rows, rotary_dim] tensor; got "
            f"{tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}. Convert other RoPE formats with "
            f"qkrope.runtime.to_cos_sin_caches")
