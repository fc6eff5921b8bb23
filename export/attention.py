"""Qwen-Image joint ("double stream") attention with the fused QK-RMSNorm + RoPE op.

Parameter names are diffusers' (``Attention`` + ``QwenDoubleStreamAttnProcessor2_0``), so a
diffusers state dict loads as is. RoPE comes in as the 2-D cache pair, which is what makes the
block exportable to ONNX (diffusers' own RoPE is complex-valued).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from qkrope.errors import InputError
from qkrope import contract
from qkrope.model_io import ATTENTION_BLOCK
from .ops import qk_norm_rope


class RMSNormWeight(nn.Module):
    """Holds one per-head RMSNorm weight ``[head_dim]`` under diffusers' name ``<norm>.weight``.
    The normalisation itself runs inside the fused op."""

    def __init__(self, dim: int, eps: float = contract.DEFAULT_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


class QwenImageAttention(nn.Module):
    """Qwen-Image joint attention (docs/spec.md section 1).

    ``forward(hidden_states [B, S_img, C], encoder_hidden_states [B, S_txt, C],
    image_rotary_emb=(img_cache, txt_cache), encoder_hidden_states_mask=None [B, S_txt])``
    returns ``(img_out [B, S_img, C], txt_out [B, S_txt, C])``.

    Args:
        dim: model width C (Qwen-Image: 3072).
        heads, head_dim: H and D with H * D == C (Qwen-Image: 24 x 128).
        eps: RMSNorm epsilon.
        interleaved: RoPE pairing (Qwen-Image: interleaved).
        rounding: 0 one rounding at the end of the fused op; 1 diffusers' eager rounding order.
        validate: check the cache pair with validate_cos_sin_caches on every eager call
            (metadata only, no device synchronisation).
    """

    def __init__(self, dim: int = ATTENTION_BLOCK.dim, heads: int = ATTENTION_BLOCK.heads,
                 head_dim: int = ATTENTION_BLOCK.head_dim, *,
                 eps: float = contract.DEFAULT_EPS,
                 interleaved: bool = contract.DEFAULT_INTERLEAVED,
                 rounding: int = contract.DEFAULT_ROUNDING,
                 validate: bool = True):
        super().__init__()
        if heads * head_dim != dim:
            raise InputError(f"heads * head_dim must equal dim; got {heads} x {head_dim} != {dim}")
        contract.check_head_dim(head_dim)
        self.dim, self.heads, self.head_dim = dim, heads, head_dim
        #: the QKNormRoPE node's values, one record (checked here)
        self.attributes = contract.NodeAttributes(eps, interleaved, rounding)
        self.validate = validate
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.add_q_proj = nn.Linear(dim, inner)
        self.add_k_proj = nn.Linear(dim, inner)
        self.add_v_proj = nn.Linear(dim, inner)
        self.norm_q = RMSNormWeight(head_dim, eps)
        self.norm_k = RMSNormWeight(head_dim, eps)
        self.norm_added_q = RMSNormWeight(head_dim, eps)
        self.norm_added_k = RMSNormWeight(head_dim, eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(inner, dim)

    @property
    def eps(self) -> float:
        return self.attributes.eps

    @property
    def interleaved(self) -> bool:
        return self.attributes.interleaved

    @property
    def rounding(self) -> int:
        return self.attributes.rounding

    @classmethod
    def from_diffusers(cls, attn: nn.Module, **kwargs) -> "QwenImageAttention":
        """Copy a diffusers ``Attention`` that runs ``QwenDoubleStreamAttnProcessor2_0``.

        The result has the source's dtype and device. ``kwargs`` go to the constructor
        (``rounding``, ``validate``, ...).
        """
        heads = attn.heads
        head_dim = attn.inner_dim // heads
        dim = attn.to_q.in_features
        norm = getattr(attn, "norm_q", None)
        if norm is None or getattr(attn, "norm_added_q", None) is None:
            raise InputError("the diffusers Attention has no per-head QK RMSNorm (norm_q / "
                             "norm_added_q): it is not Qwen-Image's joint attention")
        kwargs.setdefault("eps", float(norm.eps))
        ref = next(attn.parameters())
        module = cls(dim, heads, head_dim, **kwargs).to(device=ref.device, dtype=ref.dtype)
        module.load_state_dict(attn.state_dict(), strict=True)
        return module

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor],
                encoder_hidden_states_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():
            check_block_inputs(hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                               dim=self.dim)
        s_img, s_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        if self.validate and not torch.compiler.is_compiling():
            from qkrope.runtime.caches import validate_cos_sin_caches

            validate_cos_sin_caches(image_rotary_emb, head_dim=self.head_dim, img_seq_len=s_img,
                                    txt_seq_len=s_txt, device=hidden_states.device)
        img_cache, txt_cache = image_rotary_emb

        return joint_attention(self, hidden_states, encoder_hidden_states, img_cache, txt_cache,
                               encoder_hidden_states_mask, head_dim=self.head_dim,
                               attributes=self.attributes)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(int(d)) for d in t.shape) + "]"


def check_block_inputs(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                       encoder_hidden_states_mask: torch.Tensor | None, *, dim: int) -> None:
    """The attention block's activations: ``[B, S_img, dim]``, ``[B, S_txt, dim]`` and an
    optional ``[B, S_txt]`` mask; an InputError naming the shapes otherwise (metadata only)."""
    for name, t, axis in (("hidden_states", hidden_states, "img_tokens"),
                          ("encoder_hidden_states", encoder_hidden_states, "txt_tokens")):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor [batch, {axis}, dim={dim}]; got a "
                             f"{type(t).__name__}")
        if t.dim() != 3 or t.shape[-1] != dim:
            raise InputError(f"{name} must be [batch, {axis}, dim={dim}]; got {_shape(t)}")
    if hidden_states.shape[0] != encoder_hidden_states.shape[0]:
        raise InputError(f"hidden_states has batch {hidden_states.shape[0]} but "
                         f"encoder_hidden_states has batch {encoder_hidden_states.shape[0]} "
                         f"(hidden_states {_shape(hidden_states)}, encoder_hidden_states "
                         f"{_shape(encoder_hidden_states)}): one batch for both streams")
    mask = encoder_hidden_states_mask
    if mask is not None:
        want = [int(encoder_hidden_states.shape[0]), int(encoder_hidden_states.shape[1])]
        if not isinstance(mask, torch.Tensor) or list(mask.shape) != want:
            got = _shape(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise InputError(f"encoder_hidden_states_mask must be [batch, txt_tokens] = {want} "
                             f"(encoder_hidden_states {_shape(encoder_hidden_states)}); got {got}")


#: How the exported graph spells softmax(q k^T / sqrt(D) + mask) v: :data:`contract.ATTENTION_FORMS`
#: (``qkrope export --attention``), see :func:`_attention`.
ATTENTION_FORMS = contract.ATTENTION_FORMS
DEFAULT_ATTENTION_FORM = contract.DEFAULT_ATTENTION_FORM
_EXPORT_FORM: contextvars.ContextVar[str] = contextvars.ContextVar(
    "qkrope_attention_form", default=DEFAULT_ATTENTION_FORM)


def check_attention_form(form: str, opset: int | None = None) -> str:
    if form not in ATTENTION_FORMS:
        raise InputError(f"--attention must be one of {', '.join(ATTENTION_FORMS)}; got {form!r}")
    need = contract.ATTENTION_MIN_OPSET.get(form)
    if opset is not None and need is not None and int(opset) < need:
        raise InputError(f"--attention {form} needs --opset {need} or newer (the "
                         f"ONNX Attention operator was added in opset 23); got --opset {opset}")
    return form


@contextlib.contextmanager
def attention_form(form: str) -> Iterator[None]:
    """The form :func:`_attention` exports while the block runs under ``torch.onnx.export``."""
    token = _EXPORT_FORM.set(check_attention_form(form))
    try:
        yield
    finally:
        _EXPORT_FORM.reset(token)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               head_dim: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v over [B, H, S, D].

    Eager: PyTorch's SDPA (what diffusers calls, so parity stays exact). Exported, by
    :func:`attention_form`: ``onnx23`` keeps SDPA, which torch.onnx translates at opset 23 into
    one ``Attention`` node (4-D inputs, the default scale 1/sqrt(D), the bool mask as its
    ``attn_mask``, expanded to [B, 1, S_q, S_kv]: ONNX Runtime 1.31's CPU kernel refuses a mask
    whose query axis is broadcast); ``primitive`` writes the pattern TensorRT's attention fusion matches from
    primitive layers — BMM1 with Q and K pre-scaled, the mask as one additive bias, Softmax,
    BMM2 — and nothing between Softmax and BMM2. SDPA's primitive export puts an IsNaN/Where
    guard there for rows whose keys are all masked, which cannot occur in this model (image keys
    are never masked); without it the values are the same.
    """
    if not torch.onnx.is_in_onnx_export():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    if _EXPORT_FORM.get() == "onnx23":
        if mask is not None:  # ONNX Runtime's Attention kernel wants the mask's query axis full
            mask = mask.expand(-1, -1, q.shape[2], -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    scale = head_dim ** -0.25  # on Q and on K: 1/sqrt(D) together, as SDPA's math backend scales
    scores = torch.matmul(q * scale, (k * scale).transpose(-2, -1))
    if mask is not None:
        # the bias in the scores' dtype (a Where, no Cast between it and the Add)
        keep = torch.tensor(0.0, dtype=scores.dtype, device=scores.device)
        drop = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
        scores = scores + torch.where(mask, keep, drop)
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def joint_attention(attn: nn.Module, hidden_states: torch.Tensor,
                    encoder_hidden_states: torch.Tensor, img_cache: torch.Tensor,
                    txt_cache: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None, *,
                    head_dim: int, attributes: contract.NodeAttributes
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-Image joint attention on any module with diffusers' attribute names (``to_q`` ...
    ``to_add_out``, ``norm_q.weight`` ...): QwenImageAttention and diffusers' own ``Attention``
    (through :class:`qkrope.families.qwen_image.export.QKNormRoPEAttnProcessor`) share it."""
    batch, s_img, _ = hidden_states.shape
    s_txt = encoder_hidden_states.shape[1]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (-1, head_dim))

    img_q, img_k, img_v = (heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)),
                           heads(attn.to_v(hidden_states)))
    txt_q, txt_k, txt_v = (heads(attn.add_q_proj(encoder_hidden_states)),
                           heads(attn.add_k_proj(encoder_hidden_states)),
                           heads(attn.add_v_proj(encoder_hidden_states)))

    opts = attributes.as_kwargs()
    img_q, img_k = qk_norm_rope(img_q, img_k, attn.norm_q.weight, attn.norm_k.weight, img_cache,
                                **opts)
    txt_q, txt_k = qk_norm_rope(txt_q, txt_k, attn.norm_added_q.weight,
                                attn.norm_added_k.weight, txt_cache, **opts)

    # joint sequence [text, image]; SDPA wants [B, H, S, D]
    q = torch.cat([txt_q, img_q], dim=1).transpose(1, 2)
    k = torch.cat([txt_k, img_k], dim=1).transpose(1, 2)
    v = torch.cat([txt_v, img_v], dim=1).transpose(1, 2)
    mask = None
    if encoder_hidden_states_mask is not None:
        img_mask = torch.ones(batch, s_img, dtype=torch.bool, device=hidden_states.device)
        mask = torch.cat([encoder_hidden_states_mask.to(torch.bool), img_mask], dim=1)
        mask = mask[:, None, None, :]  # image keys are never masked
    out = _attention(q, k, v, mask, head_dim)
    out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)

    txt_out = attn.to_add_out(out[:, :s_txt].contiguous())
    img_out = attn.to_out[0](out[:, s_txt:].contiguous())
    if len(attn.to_out) > 1:
        img_out = attn.to_out[1](img_out)  # dropout (identity at inference)
    return img_out, txt_out
