"""Qwen-Image's export hooks (export layer): the config check, the attention processor, the
cache-input wrapper, the sample inputs and the post-export checks that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers' Qwen-Image RoPE is complex-valued (``QwenEmbedRope`` returns complex frequencies and
``apply_rotary_emb_qwen`` multiplies complex tensors), which neither torch.onnx exporter can
translate. Here:

- :class:`QKNormRoPEAttnProcessor` replaces ``QwenDoubleStreamAttnProcessor2_0`` on every joint
  attention (through diffusers' ``set_attn_processor``): it takes ``image_rotary_emb`` as the
  ``(img_cache, txt_cache)`` pair and runs per-head RMSNorm + RoPE as one
  ``qkrope.export.qk_norm_rope`` call per stream (one ``QKNormRoPE`` ONNX node per stream).
- :class:`CacheInputTransformer` wraps the model with a ``forward`` whose inputs are the graph
  inputs (``hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
  img_cos_sin_cache, txt_cos_sin_cache``); ``pos_embed`` (the complex RoPE) is never called, so it
  is not in the graph. It replicates ``QwenImageTransformer2DModel.forward`` for the standard
  Qwen-Image configuration (no ``zero_cond_t``, no additional t-cond, no layer-3D RoPE, no
  controlnet residuals).

diffusers is imported lazily (it is optional).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import contract
from qkrope._deps import require
from qkrope.errors import InputError
from qkrope.export.attention import joint_attention
from qkrope.export.patch_diffusers import check_fits_in_memory, itemsize
from qkrope.export.sample import check_layers


class QKNormRoPEAttnProcessor:
    """Drop-in for diffusers' ``QwenDoubleStreamAttnProcessor2_0`` taking 2-D RoPE caches."""

    def __init__(self, *, interleaved: bool = contract.DEFAULT_INTERLEAVED,
                 rounding: int = contract.DEFAULT_ROUNDING):
        self.interleaved = contract.check_interleaved(interleaved)
        self.rounding = contract.check_rounding(rounding)
        self._attributes: dict[float, contract.NodeAttributes] = {}  # per module eps

    def attributes(self, eps: float) -> contract.NodeAttributes:
        """The node values for an attention module whose RMSNorm epsilon is ``eps``."""
        if eps not in self._attributes:
            self._attributes[eps] = contract.NodeAttributes(eps, self.interleaved, self.rounding)
        return self._attributes[eps]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None,
                 encoder_hidden_states_mask=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None:
            raise InputError("QKNormRoPEAttnProcessor requires encoder_hidden_states (text stream)")
        if attention_mask is not None:
            raise InputError("QKNormRoPEAttnProcessor takes encoder_hidden_states_mask, not an "
                             "external attention_mask")
        if image_rotary_emb is None:
            raise InputError("QKNormRoPEAttnProcessor needs image_rotary_emb=(img_cache, "
                             "txt_cache); build them with qkrope.runtime.build_qwen_rope_caches")
        img_cache, txt_cache = image_rotary_emb
        return joint_attention(attn, hidden_states, encoder_hidden_states, img_cache, txt_cache,
                               encoder_hidden_states_mask, head_dim=attn.inner_dim // attn.heads,
                               attributes=self.attributes(float(attn.norm_q.eps)))


def check_supported(transformer: nn.Module) -> None:
    """Raise ValueError for configurations CacheInputTransformer does not reproduce."""
    cfg = transformer.config
    for key in ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope"):
        if cfg.get(key, False):
            raise InputError(f"the diffusers config sets {key}=True, which qkrope's transformer "
                             f"export does not support yet (standard Qwen-Image only)")
    head_dim = cfg["attention_head_dim"]
    if sum(cfg["axes_dims_rope"]) > head_dim:
        raise InputError(f"axes_dims_rope {tuple(cfg['axes_dims_rope'])} sums to more than "
                         f"attention_head_dim={head_dim}")


def patch_transformer(transformer: nn.Module, *,
                      interleaved: bool = contract.DEFAULT_INTERLEAVED,
                      rounding: int = contract.DEFAULT_ROUNDING) -> nn.Module:
    """Swap every joint attention processor for :class:`QKNormRoPEAttnProcessor` (in place)."""
    require("diffusers", "exporting a diffusers transformer")
    check_supported(transformer)
    transformer.set_attn_processor(QKNormRoPEAttnProcessor(interleaved=interleaved,
                                                           rounding=rounding))
    return transformer


class CacheInputTransformer(nn.Module):
    """``QwenImageTransformer2DModel`` with the RoPE caches as inputs (see module docstring).

    ``forward(hidden_states [B, S_img, in_channels], encoder_hidden_states [B, S_txt,
    joint_attention_dim], encoder_hidden_states_mask [B, S_txt] bool, timestep [B],
    img_cos_sin_cache [R_img, rd] fp32, txt_cos_sin_cache [R_txt, rd] fp32) -> sample``.
    ``num_layers`` keeps the first N blocks (all by default).
    """

    def __init__(self, transformer: nn.Module, num_layers: int | None = None, *,
                 interleaved: bool = contract.DEFAULT_INTERLEAVED,
                 rounding: int = contract.DEFAULT_ROUNDING):
        super().__init__()
        patch_transformer(transformer, interleaved=interleaved, rounding=rounding)
        total = len(transformer.transformer_blocks)
        check_layers(num_layers, total, "num_layers")
        self.num_layers = total if num_layers is None else num_layers
        self.transformer = transformer

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        hidden_states = t.img_in(hidden_states)
        timestep = timestep.to(hidden_states.dtype)
        encoder_hidden_states = t.txt_in(t.txt_norm(encoder_hidden_states))
        mask = encoder_hidden_states_mask.to(torch.bool)
        temb = t.time_text_embed(timestep, hidden_states)
        rope = (img_cos_sin_cache, txt_cos_sin_cache)
        for block in t.transformer_blocks[:self.num_layers]:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                encoder_hidden_states_mask=mask, temb=temb, image_rotary_emb=rope)
        hidden_states = t.norm_out(hidden_states, temb)
        return t.proj_out(hidden_states)


#: QwenImageTransformer2DModel's config fields qkrope reads sizes from: positive ints, the
#: output channels may be null (= in_channels)
_POSITIVE_INT_FIELDS = ("attention_head_dim", "in_channels", "joint_attention_dim",
                        "num_attention_heads", "num_layers", "patch_size")
_BOOL_FIELDS = ("guidance_embeds", "use_additional_t_cond", "use_layer3d_rope", "zero_cond_t")


def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True) -> dict:
    """The folder's ``config.json`` as ``model_class`` would take it (its defaults for what it
    omits), refused in one line before diffusers builds anything when it is not a JSON object,
    a size is not a positive int, a flag not a bool, ``axes_dims_rope`` not three positive even
    ints summing to ``attention_head_dim`` (diffusers asserts it), or the weights would not fit
    in this machine's memory (``memory``; the streamed export, which never holds them, passes
    False). Qwen-Image's fields; FLUX's config is left to diffusers' own checks."""
    import json

    from qkrope.export.patch_diffusers import read_config

    path, cfg = read_config(directory, model_class)
    fix = f"Fix: save the model again with save_pretrained, or correct {path}"

    def bad(key: str, want: str):
        value = json.dumps(cfg[key]) if not isinstance(cfg[key], tuple) else str(cfg[key])
        raise InputError(f"{path}: {key!r} must be {want}, got {value[:60]}. {fix}")

    for key in _POSITIVE_INT_FIELDS:
        v = cfg.get(key)
        if key in cfg and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            bad(key, "a positive int")
    v = cfg.get("out_channels")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        bad("out_channels", "a positive int or null")
    for key in _BOOL_FIELDS:
        if key in cfg and not isinstance(cfg[key], bool):
            bad(key, "true or false")
    axes = cfg.get("axes_dims_rope")
    if "axes_dims_rope" in cfg:
        if not (isinstance(axes, (list, tuple)) and len(axes) == 3 and all(
                isinstance(a, int) and not isinstance(a, bool) and a > 0 and a % 2 == 0
                for a in axes)):
            bad("axes_dims_rope", "three positive even ints")
        head_dim = cfg.get("attention_head_dim")
        if isinstance(head_dim, int) and sum(axes) != head_dim:
            bad("axes_dims_rope", f"three widths summing to attention_head_dim {head_dim}")
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("attention_head_dim")
    layers = cfg.get("num_layers")
    sizes = [cfg.get(k) for k in ("num_attention_heads", "attention_head_dim", "num_layers",
                                  "in_channels", "joint_attention_dim", "patch_size")]
    if memory and all(isinstance(v, int) for v in sizes):
        heads, head_dim, layers, in_ch, txt_dim, patch = sizes
        dim = heads * head_dim
        out_ch = cfg.get("out_channels") or in_ch
        # each block: attention (Q, K, V, out of both streams) and two 4x MLPs: ~24 dim^2; the
        # input projections and the output projection (patch x patch x out_channels wide)
        params = layers * 24 * dim * dim + dim * (in_ch + txt_dim + patch * patch * out_ch)
        check_fits_in_memory(f"{path} ({layers} blocks of width {dim})",
                             params * itemsize(dtype), "check its sizes (num_layers, "
                             "num_attention_heads, attention_head_dim, the channels)")
    return cfg




# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def prepare(record, transformer: nn.Module, *, sample, dtype: torch.dtype, layers: int | None,
            rounding: int):
    """The export of ``transformer`` (a placeholder skeleton): its cache-input wrapper (the
    first ``layers`` blocks), sample inputs, graph, RoPE setting and node count."""
    from qkrope.export.onnx_export import TransformerPlan, _sample_args

    cfg = dict(transformer.config)
    axes = tuple(int(v) for v in cfg["axes_dims_rope"])
    wrapper = CacheInputTransformer(transformer, layers, rounding=rounding).eval()
    n_layers = wrapper.num_layers
    args = _sample_args(sample, dtype, int(cfg["in_channels"]), int(cfg["joint_attention_dim"]),
                        axes, True, 0, record=record)
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=record.theta,
        rounding=rounding, nodes=2 * n_layers, num_layers_exported=n_layers,
        blocks=f"{n_layers} of {len(transformer.transformer_blocks)} blocks")


def post_export(model) -> None:
    """Nothing beyond the generic checks (finalize_model, onnx's checker)."""
