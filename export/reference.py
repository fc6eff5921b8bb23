"""The maths of QKNormRoPE (docs/spec.md section 3) in plain PyTorch: the project's one Python reference.

Everything else (the torch custom op, the ONNX function body, the CUDA kernel and its CPU build)
is checked against :func:`qk_norm_rope_reference`.
"""

from __future__ import annotations

import torch

from qkrope import contract
from qkrope.contract import NodeAttributes
from qkrope.errors import InputError
from qkrope.layout import check_tensor_layout

def _norm_rope(x: torch.Tensor, weight: torch.Tensor, cache: torch.Tensor,
               attributes: NodeAttributes) -> torch.Tensor:
    eps, interleaved, rounding = attributes.eps, attributes.interleaved, attributes.rounding
    seq_len = x.shape[1]
    rotary_dim = cache.shape[1]
    half = rotary_dim // 2

    xf = x.float()
    # Same operations, in the same order, as diffusers' RMSNorm and torch's rms_norm: mean of
    # squares in fp32, rsqrt.
    if attributes.norm_scope == contract.NORM_SCOPE_ROW:
        # One RMSNorm over the token's flat [H * D] row (Wan's torch.nn.RMSNorm(heads *
        # head_dim) before the unflatten): the mean runs over the contiguous row, as torch's
        # does on [B, S, H * D]; the weight [H * D] is index h * D + d.
        inv = torch.rsqrt(xf.flatten(-2).pow(2).mean(-1, keepdim=True) + eps).unsqueeze(-1)
        weight = weight.reshape(x.shape[-2], x.shape[-1])
    else:
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    narrow = x.dtype != torch.float32
    if rounding == contract.ROUNDING_EACH_STEP and narrow:
        # diffusers' RMSNorm (Qwen-Image): normalised value rounded to the activation dtype,
        # multiplied by the weight (rounded again), then rotated in fp32. The product is taken in
        # fp32: for a weight in the activation dtype it is exact (two 8- or 11-bit significands),
        # so the rounded result is the dtype's own multiply; an fp32 weight enters at its value.
        y = ((xf * inv).to(x.dtype).float() * weight.float()).to(x.dtype).float()
    elif rounding == contract.ROUNDING_TWO_STEPS and narrow:
        # torch's RMSNorm (FLUX's norm_q/norm_k): (x * inv) * w in fp32, rounded once to the
        # activation dtype; diffusers' apply_rotary_emb then rotates that value in fp32.
        y = (xf * inv * weight.float()).to(x.dtype).float()
    else:
        y = xf * inv * weight.float()

    rows = cache[:seq_len].float()
    cos = rows[:, :half][None, :, None, :]  # [1, S, 1, half], broadcast over batch and heads
    sin = rows[:, half:rotary_dim][None, :, None, :]
    if interleaved:
        a, b = y[..., 0:rotary_dim:2], y[..., 1:rotary_dim:2]
    else:
        a, b = y[..., :half], y[..., half:rotary_dim]
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    rotated = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), -1)
    out = torch.cat((rotated, y[..., rotary_dim:]), dim=-1) if rotary_dim < x.shape[-1] else rotated
    return out.to(x.dtype)


def check_qk_norm_rope_args(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                            k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                            eps: float = contract.DEFAULT_EPS,
                            interleaved: bool = contract.DEFAULT_INTERLEAVED,
                            rounding: int = contract.DEFAULT_ROUNDING,
                            norm_scope: int = contract.DEFAULT_NORM_SCOPE) -> NodeAttributes:
    """Raise InputError naming what was received when the arguments break the op's contract (the
    value rules are qkrope.contract's: epsilon, head_dim, interleaved, rounding, norm_scope);
    the tensors are checked first, then the values, which are returned as one
    :class:`NodeAttributes`."""
    tensors = (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight),
               ("cos_sin_cache", cos_sin_cache))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor; got a {type(t).__name__}")
    for name, t in tensors[1:]:
        if t.device != q.device:
            raise InputError(f"{name} is on device {t.device} but q is on {q.device}: every "
                             f"tensor of the op must be on q's device (move it with "
                             f".to({str(q.device)!r}))")
    norm_scope = contract.check_norm_scope(norm_scope)  # the weights' shape depends on it
    check_tensor_layout(q, k, q_weight, k_weight, cos_sin_cache, norm_scope=norm_scope)
    head_dim = q.shape[-1]
    contract.check_head_dim(head_dim)
    rows, rotary_dim = cos_sin_cache.shape
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise InputError(f"cos_sin_cache width (rotary_dim) must be even and in (0, head_dim="
                         f"{head_dim}]; got {rotary_dim}")
    if rows < q.shape[1]:
        raise InputError(
            f"cos_sin_cache has {rows} rows but q/k have {q.shape[1]} tokens (required="
            f"{q.shape[1]}, available={rows}, overflow={q.shape[1] - rows}); build the cache for "
            f"the actual sequence length")
    contract.check_epsilon(eps)
    contract.check_rounding(rounding)
    return NodeAttributes(eps, interleaved, rounding, norm_scope)


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                           k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, *,
                           eps: float = contract.DEFAULT_EPS,
                           interleaved: bool = contract.DEFAULT_INTERLEAVED,
                           rounding: int = contract.DEFAULT_ROUNDING,
                           norm_scope: int = contract.DEFAULT_NORM_SCOPE,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE from a 2-D ``[rows, rotary_dim]`` fp32 cache.

    q, k: ``[B, S, H, D]``; weights ``[D]`` in q's dtype or float32; cache row ``s`` is token
    ``s`` (cos half, sin half).
    Dims at or beyond ``rotary_dim`` are normalised but not rotated. ``norm_scope`` 1
    (:data:`qkrope.contract.NORM_SCOPE_ROW`): one RMSNorm over each token's ``H * D`` values,
    weights ``[H * D]``, then the same per-head rotation. See docs/spec.md section 3.
    """
    attributes = NodeAttributes(eps, interleaved, rounding, norm_scope)
    return (_norm_rope(q, q_weight, cos_sin_cache, attributes),
            _norm_rope(k, k_weight, cos_sin_cache, attributes))
