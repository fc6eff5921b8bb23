"""``qk_norm_rope`` as a torch custom op (``torch.ops.qkrope.qk_norm_rope``).

Registering the op with a fake implementation lets ``torch.export`` trace through it as one node,
which the ONNX exporter then translates to one ``qkrope::QKNormRoPE`` node.
"""

from __future__ import annotations

import torch

from qkrope import contract
from .reference import check_qk_norm_rope_args, qk_norm_rope_reference


@torch.library.custom_op(contract.TORCH_OP, mutates_args=())
def _qk_norm_rope_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, eps: float,
                     interleaved: bool, rounding: int,
                     norm_scope: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return qk_norm_rope_reference(q, k, q_weight, k_weight, cos_sin_cache, eps=eps,
                                  interleaved=interleaved, rounding=rounding,
                                  norm_scope=norm_scope)


@_qk_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, cos_sin_cache, eps, interleaved, rounding, norm_scope=0):
    return torch.empty_like(q), torch.empty_like(k)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos_sin_cache: torch.Tensor, *, eps: float = contract.DEFAULT_EPS,
                 interleaved: bool = contract.DEFAULT_INTERLEAVED,
                 rounding: int = contract.DEFAULT_ROUNDING,
                 norm_scope: int = contract.DEFAULT_NORM_SCOPE,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused QK-RMSNorm + RoPE (docs/spec.md section 3) as one op.

    Args:
        q, k: ``[B, S, H, D]``, one dtype among float32/float16/bfloat16.
        q_weight, k_weight: RMSNorm weights ``[D]`` (``[H * D]`` with ``norm_scope`` 1), both
            in q's dtype or both float32 (the value enters the fp32 arithmetic as it is).
        cos_sin_cache: ``[R, rotary_dim]`` float32, ``R >= S``; cos half then sin half, row s for
            token s. ``rotary_dim`` is even and ``<= D``.
        eps: RMSNorm epsilon (inside the square root).
        interleaved: True pairs ``(2j, 2j+1)`` (GPT-J, Qwen-Image); False pairs ``(j, j+half)``.
        rounding: 0 rounds once at the end; 1 reproduces diffusers' eager order for Qwen-Image
            (RMSNorm rounds ``x*inv``, then ``*w``); 2 FLUX's (torch's RMSNorm rounds ``x*inv*w``
            once, the fp32 rotation rounds again). ``qkrope.contract.ROUNDING_*`` name them.
        norm_scope: 0 normalises each head's D values; 1 each token's whole ``H * D`` row
            (Wan's cross-head RMSNorm), then rotates per head as 0 does
            (``qkrope.contract.NORM_SCOPE_*``).

    Returns: ``(q_out, k_out)``, same shapes and dtype as q and k.
    """
    if not torch.compiler.is_compiling():
        a = check_qk_norm_rope_args(q, k, q_weight, k_weight, cos_sin_cache, eps=eps,
                                    interleaved=interleaved, rounding=rounding,
                                    norm_scope=norm_scope)
        eps, interleaved, rounding, norm_scope = a.eps, a.interleaved, a.rounding, a.norm_scope
    # the op's schema takes the values as scalars (torch.library has no record type);
    # norm_scope only when set, so a head-scope call traces as before
    extra = (int(norm_scope),) if int(norm_scope) != contract.DEFAULT_NORM_SCOPE else ()
    return torch.ops.qkrope.qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, float(eps),
                                         bool(interleaved), int(rounding), *extra)
