"""Wan's export hooks (export layer): the config check, the attention processor, the
cache-input wrapper, the sample inputs and the post-export check (no float64) that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers computes Wan's RoPE tables in float64 (``WanRotaryPosEmbed``) and patchifies the 5-D
latent with a Conv3d. Here:

- :class:`WanAttnProcessor` replaces diffusers' ``WanAttnProcessor`` on every attention. The
  self-attention (``attn1``, the only one with RoPE) runs the cross-head RMSNorm + RoPE of q and
  k as one ``qkrope.export.qk_norm_rope`` call with ``norm_scope`` 1 (one ``QKNormRoPE`` node
  per block). The cross-attention (``attn2``: q from the video, k/v from the text, RMSNorm and
  no RoPE) is left as diffusers computes it (``norm_q`` / ``norm_k`` as torch.nn.RMSNorm): its q
  and k have different token counts, so one node (q and k of one shape) cannot take them, and
  a node per tensor with identity cache rows would read a cache for nothing.
- :class:`WanCacheInputTransformer` replays ``WanTransformer3DModel.forward`` with the graph
  inputs (:data:`qkrope.families.wan.WAN_TRANSFORMER`): the patches packed as tokens (the
  Conv3d run on each patch: the same products as on the volume), the image cache in place of
  the RoPE module, the packed prediction out (the drop-in unpatchifies). ``--layers K`` runs
  the first K blocks and then the model's own head (final norm and projection).

diffusers is imported lazily (it is optional).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import contract
from qkrope.errors import InputError
from qkrope.export.attention import _attention
from qkrope.export.ops import qk_norm_rope

from . import WAN, wan_axes


def _sdpa(q, k, v, head_dim: int) -> torch.Tensor:
    """softmax attention over [B, S, H, D] inputs; returns [B, S, H * D] in q's dtype."""
    out = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, head_dim)
    return out.transpose(1, 2).flatten(2, 3).type_as(q)


class WanAttnProcessor:
    """Replaces diffusers' ``WanAttnProcessor``: ``rotary_emb`` is the image cache
    ``[rows, head_dim]`` (self-attention, fused) or None (cross-attention, as diffusers)."""

    def __init__(self, rounding: int):
        self.rounding = contract.check_rounding(rounding)
        self._attributes: dict[float, contract.NodeAttributes] = {}

    def attributes(self, eps: float) -> contract.NodeAttributes:
        if eps not in self._attributes:
            self._attributes[eps] = contract.NodeAttributes(eps, True, self.rounding,
                                                            contract.NORM_SCOPE_ROW)
        return self._attributes[eps]

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if attention_mask is not None:
            raise InputError("the Wan export takes no attention_mask (Wan attends to every "
                             "token)")
        if getattr(attn, "fused_projections", False):
            raise InputError("the Wan attention has fused QKV projections (fuse_qkv_"
                             "projections()); export the model before fusing them")
        if attn.add_k_proj is not None:
            raise InputError("the Wan attention has the I2V image branch (added_kv_proj_dim), "
                             "which this export does not carry")
        heads = attn.heads
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q, k, v = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        head_dim = q.shape[-1] // heads
        if rotary_emb is not None:  # attn1: cross-head RMSNorm + RoPE, one node
            q, k = (t.unflatten(2, (heads, -1)) for t in (q, k))
            q, k = qk_norm_rope(q, k, attn.norm_q.weight, attn.norm_k.weight, rotary_emb,
                                **self.attributes(float(attn.norm_q.eps)).as_kwargs())
        else:  # attn2: diffusers' RMSNorm, no RoPE (module docstring)
            q, k = (t.unflatten(2, (heads, -1)) for t in (attn.norm_q(q), attn.norm_k(k)))
        v = v.unflatten(2, (heads, -1))
        out = _sdpa(q, k, v, head_dim)
        return attn.to_out[1](attn.to_out[0](out))


def patch_wan(transformer: nn.Module, *, rounding: int) -> nn.Module:
    """Give every attention of a Wan transformer the processor above (in place)."""
    processor = WanAttnProcessor(rounding)
    for block in transformer.blocks:
        block.attn1.set_processor(processor)
        block.attn2.set_processor(processor)
    if not len(transformer.blocks):
        raise InputError("the Wan model has no transformer blocks")
    return transformer


class WanCacheInputTransformer(nn.Module):
    """``WanTransformer3DModel`` with the graph's inputs and output (module docstring):
    ``forward(hidden_states [B, N, C * pt * ph * pw], encoder_hidden_states [B, T, text_dim],
    timestep [B] float32, img_cos_sin_cache [R, head_dim] fp32) -> [B, N, pt * ph * pw *
    out_channels]``, running the first ``kept`` blocks (every block by default)."""

    def __init__(self, transformer: nn.Module, *, rounding: int = WAN.rounding,
                 kept: int | None = None):
        super().__init__()
        self.rounding = rounding
        patch_wan(transformer, rounding=rounding)
        self.transformer = transformer
        self.kept = len(transformer.blocks) if kept is None else int(kept)

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache):
        t = self.transformer
        cfg = t.config
        batch, tokens = hidden_states.shape[0], hidden_states.shape[1]
        patch = tuple(int(p) for p in cfg.patch_size)
        x = hidden_states.reshape(batch * tokens, int(cfg.in_channels), *patch)
        x = t.patch_embedding(x).reshape(batch, tokens, -1)  # [B*N, inner, 1, 1, 1]
        temb, timestep_proj, context, _ = t.condition_embedder(timestep, encoder_hidden_states,
                                                               None)
        timestep_proj = timestep_proj.unflatten(1, (6, -1))
        for block in t.blocks[:self.kept]:
            x = block(x, context, timestep_proj, img_cos_sin_cache)
        shift, scale = (t.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (t.norm_out(x.float()) * (1 + scale) + shift).type_as(x)
        return t.proj_out(x)


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

#: WanTransformer3DModel's config fields this export reads sizes from: positive ints
_POSITIVE_INT_FIELDS = ("attention_head_dim", "in_channels", "num_attention_heads",
                        "num_layers", "text_dim", "freq_dim", "ffn_dim", "rope_max_seq_len")


def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The folder's config.json as WanTransformer3DModel takes it, refused in one line where the
    export cannot reproduce it: the I2V / FLF2V CLIP image branch (``image_dim`` /
    ``added_kv_proj_dim``), a q/k norm other than the cross-head RMSNorm, a patch size that is
    not three positive ints, a head too narrow for the three RoPE axes, sizes that are not
    positive ints."""
    import inspect
    import json
    import os

    from qkrope.export.patch_diffusers import check_fits_in_memory, itemsize

    path = os.path.join(directory, "config.json")
    fix = f"Fix: save the model again with save_pretrained, or correct {path}"
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"{path} is not readable JSON ({type(exc).__name__}). {fix}") from None
    if not isinstance(raw, dict):
        raise InputError(f"{path} holds a JSON {type(raw).__name__}, not a model config. {fix}")
    defaults = {name: p.default for name, p in
                inspect.signature(model_class.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    cfg = {**defaults, **raw}
    for key in _POSITIVE_INT_FIELDS:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{path}: {key!r} must be a positive int, got {json.dumps(v)[:60]}"
                             f". {fix}")
    if cfg.get("image_dim") is not None or cfg.get("added_kv_proj_dim") is not None:
        raise InputError(f"{path}: a Wan 2.1 I2V / FLF2V model (image_dim "
                         f"{cfg.get('image_dim')}, the CLIP image branch), which the Wan export "
                         f"does not carry yet. Fix: export a T2V, Wan 2.2 I2V-A14B or TI2V-5B "
                         f"model, or run this one in PyTorch")
    if cfg.get("qk_norm") != "rms_norm_across_heads":
        raise InputError(f"{path}: qk_norm {cfg.get('qk_norm')!r}; the Wan export fuses the "
                         f"cross-head RMSNorm ('rms_norm_across_heads'), what every released Wan "
                         f"model uses. {fix}")
    patch = cfg.get("patch_size")
    if not (isinstance(patch, (list, tuple)) and len(patch) == 3 and all(
            isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in patch)):
        raise InputError(f"{path}: patch_size must be three positive ints (t, h, w), got "
                         f"{json.dumps(patch)[:60]}. {fix}")
    head_dim = cfg["attention_head_dim"]
    if head_dim % 2 or min(wan_axes(head_dim)) < 2 or head_dim > contract.MAX_HEAD_DIM:
        raise InputError(f"{path}: attention_head_dim {head_dim} cannot be split into Wan's "
                         f"three even RoPE axes (frames, rows, columns: {wan_axes(head_dim)}) "
                         f"within the kernel's {contract.MAX_HEAD_DIM}. {fix}")
    if memory:
        dim = cfg["num_attention_heads"] * head_dim
        # each block: self- and cross-attention (8 dim^2) and the FFN (2 dim ffn_dim)
        params = cfg["num_layers"] * (8 * dim * dim + 2 * dim * cfg["ffn_dim"])
        check_fits_in_memory(f"{path} ({cfg['num_layers']} blocks of width {dim})",
                             params * itemsize(dtype), "check its sizes")
    return cfg


def check_no_double(model) -> None:
    """No float64 anywhere in the graph (diffusers' RoPE is float64; the caches replace it)."""
    import onnx_ir as ir

    from qkrope.export.onnx_export import ExportError

    double = ir.DataType.DOUBLE
    values = list(model.graph.inputs) + list(model.graph.outputs) + list(
        model.graph.initializers.values())
    for node in model.graph.all_nodes():
        values += list(node.outputs)
        if node.op_type == "Cast" and "to" in node.attributes and \
                int(node.attributes["to"].value) == int(double):
            raise ExportError(f"node {node.name} casts to DOUBLE: the Wan graph must have no "
                              f"float64")
    for value in values:
        if value is not None and value.dtype == double:
            raise ExportError(f"graph value {value.name} is DOUBLE: the Wan graph must have no "
                              f"float64")


post_export = check_no_double


def sample_args(transformer: nn.Module, sample, dtype: torch.dtype) -> tuple:
    """The traced sample: random packed patches and text, a float32 timestep, the image cache
    of the sample's grid (the grid scheme's float64 tables)."""
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    (f, h, w), = sample.img_shapes[:1]
    patch = tuple(int(p) for p in cfg.patch_size)
    width = int(cfg.in_channels) * patch[0] * patch[1] * patch[2]
    setting = checked_setting(WAN.scheme, wan_axes(int(cfg.attention_head_dim)), WAN.theta,
                              max_positions=int(cfg.rope_max_seq_len), scale_rope=False,
                              rotated=WAN.rotated, precision=WAN.rope_precision)
    caches = build_rope_caches(WAN.scheme, {"img_shapes": [(f, h, w)],
                                            "txt_seq_len": sample.txt_len}, setting)
    b = sample.batch
    return (torch.randn(b, f * h * w, width, generator=g).to(dtype),
            torch.randn(b, sample.txt_len, int(cfg.text_dim), generator=g).to(dtype),
            torch.full((b,), 500.0, dtype=torch.float32),
            caches.img.clone())


def prepare(record, transformer: nn.Module, *, sample, dtype: torch.dtype, layers: int | None,
            rounding: int):
    """The export of ``transformer`` (a placeholder skeleton) with its first ``layers`` blocks
    (every block by default): one fused node per kept block (attn1), the sidecar's axes from
    the head width."""
    from qkrope.export.onnx_export import TransformerPlan

    if len(sample.img_shapes) != 1:
        raise InputError(f"a Wan sample is one video grid (frames, height, width in patches); "
                         f"got {sample.img_shapes}")
    cfg = dict(transformer.config)
    axes = wan_axes(int(cfg["attention_head_dim"]))
    kept, = record.kept_blocks(cfg, layers)
    wrapper = WanCacheInputTransformer(transformer, rounding=rounding, kept=kept).eval()
    n = len(transformer.blocks)
    eps = float(transformer.blocks[0].attn1.norm_q.eps)
    return TransformerPlan(
        wrapper=wrapper, args=sample_args(transformer, sample, dtype), decl=record.graph,
        axes=axes, theta=record.theta, rounding=rounding, nodes=kept, num_layers_exported=kept,
        blocks=f"{record.label}: {kept} of {n} blocks",
        attributes=wrapper.transformer.blocks[0].attn1.processor.attributes(eps))
