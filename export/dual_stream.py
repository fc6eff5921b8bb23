"""The fused replacement of diffusers' ``FluxAttnProcessor`` (export layer), for every
transformer built from diffusers' ``FluxAttention`` with that processor: its double-stream
attentions (the image stream and the added text stream, ``norm_q``/``norm_k`` and
``norm_added_q``/``norm_added_k``) and its single-stream ones (one ``[text; image]`` sequence).

diffusers' processor normalises each stream per head (``torch.nn.RMSNorm``), joins the streams
as ``[text; image]`` and rotates the joined sequence with float64-built tables. Here each norm
+ RoPE is one ``qkrope::QKNormRoPE`` call (:func:`qkrope.export.ops.qk_norm_rope`): two per
double-stream attention (the image cache, the text cache), one per single-stream attention (the
joined cache). What a block passes as ``image_rotary_emb`` is a :class:`JointRope`, made once
per forward by the family's cache-input wrapper (:func:`joint_rope`).

``attention_mask`` is passed to softmax attention as diffusers passes it to SDPA: a bool mask
keeps (True) or drops keys, a float mask is added to the scores
(:func:`qkrope.export.attention._attention` exports both).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from qkrope import contract
from qkrope.errors import InputError

from .attention import _attention
from .ops import qk_norm_rope


class JointRope(NamedTuple):
    """What the blocks pass on as ``image_rotary_emb``: the two caches and their join."""

    img: torch.Tensor
    txt: torch.Tensor
    joint: torch.Tensor  # [txt rows (text tokens); img rows (image tokens)]


def joint_rope(img_cache: torch.Tensor, txt_cache: torch.Tensor, s_img, s_txt) -> JointRope:
    """The caches of a ``[text; image]`` model: each stream's, and their join, sliced to the
    streams' token counts (a cache may have more rows than tokens)."""
    return JointRope(img_cache, txt_cache, torch.cat([txt_cache[:s_txt], img_cache[:s_img]],
                                                     dim=0))


def norm_eps(norm: nn.Module, where: str) -> float:
    """The epsilon of a per-head RMSNorm the node replaces (it must have a weight)."""
    eps = getattr(norm, "eps", None)
    if eps is None or getattr(norm, "weight", None) is None:
        raise InputError(f"{where}: the RMSNorm has no epsilon or no weight (elementwise_affine="
                         f"False), which the QKNormRoPE node needs; not a standard "
                         f"FluxAttention")
    return float(eps)


class FusedNormRoPE:
    """One ``qk_norm_rope`` call per stream, the node attributes per module epsilon."""

    def __init__(self, rounding: int):
        self.rounding = contract.check_rounding(rounding)
        self._attributes: dict[float, contract.NodeAttributes] = {}

    def __call__(self, q, k, norm_q, norm_k, cache):
        eps = norm_eps(norm_q, "norm_q")
        if eps not in self._attributes:
            self._attributes[eps] = contract.NodeAttributes(eps, True, self.rounding)
        return qk_norm_rope(q, k, norm_q.weight, norm_k.weight, cache,
                            **self._attributes[eps].as_kwargs())


def sdpa(q, k, v, head_dim: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax attention over [B, S, H, D] inputs; returns [B, S, H * D] in q's dtype."""
    out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, head_dim)
    return out.transpose(1, 2).flatten(2, 3).to(q.dtype)


class FluxAttnProcessor:
    """Replaces diffusers' ``FluxAttnProcessor`` on a ``FluxAttention`` (double-stream with
    ``encoder_hidden_states``, single-stream without); ``image_rotary_emb`` is a
    :class:`JointRope`. ``masked``: whether the model passes an ``attention_mask`` (refused
    otherwise, so that a mask never goes unnoticed)."""

    def __init__(self, rounding: int, *, masked: bool = False):
        self.fused = FusedNormRoPE(rounding)
        self.masked = masked

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        if attention_mask is not None and not self.masked:
            raise InputError("this export of FluxAttention takes no attention_mask (the model "
                             "attends to every token)")
        if not isinstance(image_rotary_emb, JointRope):
            raise InputError("the patched FluxAttention needs image_rotary_emb=JointRope(img, "
                             "txt, joint); run it through the family's cache-input wrapper")
        if getattr(attn, "fused_projections", False):
            raise InputError("the FluxAttention has fused QKV projections (fuse_qkv_"
                             "projections()); export the model before fusing them")
        head_dim = attn.head_dim
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        if encoder_hidden_states is None:  # single-stream: the [text; image] sequence
            q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.joint)
            return sdpa(q, k, v, head_dim, attention_mask)
        tq, tk, tv = (proj(encoder_hidden_states).unflatten(-1, (-1, head_dim))
                      for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.img)
        tq, tk = self.fused(tq, tk, attn.norm_added_q, attn.norm_added_k, image_rotary_emb.txt)
        out = sdpa(torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1),
                   head_dim, attention_mask)
        s_txt = encoder_hidden_states.shape[1]
        txt_out = attn.to_add_out(out[:, :s_txt].contiguous())
        img_out = attn.to_out[1](attn.to_out[0](out[:, s_txt:].contiguous()))
        return img_out, txt_out


def check_no_double(model, what: str = "the graph") -> None:
    """No float64 anywhere in the traced graph: no DOUBLE input, output, initializer, value or
    Cast (TensorRT's parser demotes DOUBLE to FLOAT, so ONNX Runtime and TensorRT would
    disagree). diffusers builds these models' RoPE in float64; the export takes the caches."""
    import onnx_ir as ir

    from .onnx_export import ExportError

    double = ir.DataType.DOUBLE
    values = list(model.graph.inputs) + list(model.graph.outputs) + list(
        model.graph.initializers.values())
    for node in model.graph.all_nodes():
        values += list(node.outputs)
        if node.op_type == "Cast" and "to" in node.attributes and \
                int(node.attributes["to"].value) == int(double):
            raise ExportError(f"node {node.name} casts to DOUBLE: {what} must have no float64")
    for value in values:
        if value is not None and value.dtype == double:
            raise ExportError(f"graph value {value.name} is DOUBLE: {what} must have no "
                              f"float64")


__all__ = ["JointRope", "joint_rope", "norm_eps", "FusedNormRoPE", "sdpa", "FluxAttnProcessor",
           "check_no_double"]
