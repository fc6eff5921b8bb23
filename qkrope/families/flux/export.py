"""FLUX.1's and FLUX.2's export hooks (export layer): the attention processors, the cache-input
wrappers, the sample inputs and the post-export check (no float64) that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`). They make a diffusers FLUX.1
(``FluxTransformer2DModel``) or FLUX.2 (``Flux2Transformer2DModel``) transformer exportable with
the fused QK-RMSNorm + RoPE node and the RoPE caches as inputs.

diffusers computes FLUX's RoPE tables inside the model from ``txt_ids``/``img_ids`` in float64
(``FluxPosEmbed``/``Flux2PosEmbed``), which the stock ONNX export keeps as DOUBLE ops. Here the
tables come in as the two ``[rows, rotary_dim]`` fp32 caches (built outside the graph from the
ids) and every attention's per-head RMSNorm + RoPE is one ``qkrope::QKNormRoPE`` node:

- double-stream blocks: two nodes, the image stream (``norm_q``/``norm_k``, the image cache) and
  the text stream (``norm_added_q``/``norm_added_k``, the text cache);
- single-stream blocks: one node over the ``[text; image]`` sequence with the joined cache, made
  in the graph from the two cache inputs (each sliced to its stream's token count, then Concat).

:class:`FluxCacheInputTransformer` replays diffusers' ``forward`` for the standard inference
path (no ControlNet residuals, no IP-Adapter, no FLUX.2 KV cache). diffusers'
``FluxAttnProcessor`` and ``Flux2AttnProcessor`` are replaced by the generic
:class:`qkrope.export.flux_attention.FluxAttnProcessor` (shared with every model built on
``FluxAttention``), ``Flux2ParallelSelfAttnProcessor`` by the one here; they do what diffusers'
do with the fused op in place of ``norm_q``/``norm_k`` + ``apply_rotary_emb``.
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope.errors import InputError
from qkrope.export.flux_attention import (FluxAttnProcessor, FusedNormRoPE, JointRope,
                                          check_no_double as _check_no_double, joint_rope, sdpa)
from qkrope.families._record import FamilyRecord

from . import FLUX1, FLUX2


#: What the blocks pass on as ``image_rotary_emb`` (the shared FluxAttention code's name).
FluxRope = JointRope


def sample_ids(family: FamilyRecord, img_shapes, txt_len: int):
    """Position ids as the FLUX pipelines make them, for the traced sample, as torch tensors
    (:func:`qkrope.families.flux.dropin.flux_sample_ids`: the one home of that layout)."""
    from qkrope.families.flux.dropin import flux_sample_ids

    txt, img = flux_sample_ids(family.name, img_shapes, txt_len)
    return torch.from_numpy(txt), torch.from_numpy(img)


class Flux2ParallelSelfAttnProcessor:
    """Replaces FLUX.2's ``Flux2ParallelSelfAttnProcessor`` (single-stream blocks: QKV and the
    MLP input in one projection, attention and MLP outputs through one projection)."""

    def __init__(self, rounding: int):
        self.fused = FusedNormRoPE(rounding)

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise InputError("the FLUX export takes no attention_mask")
        if not isinstance(image_rotary_emb, FluxRope):
            raise InputError("the patched FLUX.2 attention needs image_rotary_emb=FluxRope(...)")
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = projected.split([3 * attn.inner_dim, projected.shape[-1] - 3 * attn.inner_dim],
                                   dim=-1)
        q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb.joint)
        out = sdpa(q, k, v, attn.head_dim)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def patch_flux(transformer: nn.Module, family: FamilyRecord, *,
               rounding: int) -> nn.Module:
    """Give every attention of a FLUX transformer its fused processor (in place)."""
    double = FluxAttnProcessor(rounding)
    single = Flux2ParallelSelfAttnProcessor(rounding)
    count = 0
    for block in list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks):
        attn = block.attn
        attn.set_processor(single if hasattr(attn, "to_qkv_mlp_proj") else double)
        count += 1
    if count == 0:
        raise InputError(f"the {family.label} model has no transformer blocks")
    return transformer


def flux_node_count(transformer: nn.Module, layers: int | None = None) -> int:
    """QKNormRoPE nodes of the export: two per double-stream block, one per single-stream
    (of the first ``layers`` blocks in execution order: :func:`kept_blocks`)."""
    double, single = kept_blocks(transformer, layers)
    return 2 * double + single


def kept_blocks(transformer: nn.Module, layers: int | None = None) -> tuple[int, int]:
    """(double-stream, single-stream) blocks of the first ``layers`` blocks in execution order
    (the double-stream ones first; all by default)."""
    double, single = len(transformer.transformer_blocks), len(transformer.single_transformer_blocks)
    if layers is None:
        return double, single
    if not 1 <= layers <= double + single:
        raise InputError(f"--layers must be between 1 and {double + single} (the model's "
                         f"num_layers + num_single_layers); got {layers}")
    return FLUX1.kept_blocks(transformer.config, layers)  # (the two records' lists agree)


class FluxCacheInputTransformer(nn.Module):
    """A FLUX.1/FLUX.2 transformer whose forward takes the graph inputs
    (:data:`qkrope.families.flux.FLUX1_TRANSFORMER` / ``FLUX2_TRANSFORMER``): :meth:`run` with the
    RoPE caches in place of the ids. :func:`cache_input_flux` gives the subclass whose
    ``forward`` has exactly the graph's inputs (``guidance`` only where the model has it)."""

    def __init__(self, transformer: nn.Module, family: FamilyRecord, *,
                 rounding: int | None = None, layers: int | None = None):
        super().__init__()
        self.family = family
        self.double, self.single = kept_blocks(transformer, layers)
        self.rounding = family.rounding if rounding is None else rounding
        patch_flux(transformer, family, rounding=self.rounding)
        self.transformer = transformer

    def run(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
            txt_cos_sin_cache, pooled_projections=None, guidance=None):
        t = self.transformer
        s_img, s_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        rope = joint_rope(img_cos_sin_cache, txt_cos_sin_cache, s_img, s_txt)
        hidden_states = t.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        encoder_hidden_states = t.context_embedder(encoder_hidden_states)
        if self.family is FLUX1:
            temb = (t.time_text_embed(timestep, pooled_projections) if guidance is None
                    else t.time_text_embed(timestep, guidance, pooled_projections))
            for block in t.transformer_blocks[:self.double]:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                    temb=temb, image_rotary_emb=rope)
            for block in t.single_transformer_blocks[:self.single]:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                    temb=temb, image_rotary_emb=rope)
        else:
            temb = t.time_guidance_embed(timestep, guidance)
            mod_img = t.double_stream_modulation_img(temb)
            mod_txt = t.double_stream_modulation_txt(temb)
            mod_single = t.single_stream_modulation(temb)
            for block in t.transformer_blocks[:self.double]:
                encoder_hidden_states, hidden_states = block(
                    hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                    temb_mod_img=mod_img, temb_mod_txt=mod_txt, image_rotary_emb=rope)
            hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
            for block in t.single_transformer_blocks[:self.single]:
                hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=None,
                                      temb_mod=mod_single, image_rotary_emb=rope)
            hidden_states = hidden_states[:, s_txt:]
        return t.proj_out(t.norm_out(hidden_states, temb))


# One subclass per graph signature: torch.export names the graph inputs after forward's
# parameters, and the FLUX graphs differ by pooled_projections (FLUX.1) and guidance.
class _Flux1Guided(FluxCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
                guidance, img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                        txt_cos_sin_cache, pooled_projections, guidance)


class _Flux1(FluxCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                        txt_cos_sin_cache, pooled_projections)


class _Flux2Guided(FluxCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, timestep, guidance,
                img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                        txt_cos_sin_cache, guidance=guidance)


class _Flux2(FluxCacheInputTransformer):
    def forward(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                        txt_cos_sin_cache)


_WRAPPERS = {(FLUX1.name, True): _Flux1Guided, (FLUX1.name, False): _Flux1,
             (FLUX2.name, True): _Flux2Guided, (FLUX2.name, False): _Flux2}


def has_guidance(transformer: nn.Module) -> bool:
    """Whether the model embeds a guidance value (the config's guidance_embeds)."""
    return bool(transformer.config.get("guidance_embeds", False))


def cache_input_flux(transformer: nn.Module, family: FamilyRecord, *,
                     rounding: int | None = None,
                     layers: int | None = None) -> FluxCacheInputTransformer:
    """The wrapper whose ``forward`` arguments are the family's graph inputs, in graph order
    (``layers``: the first ``layers`` blocks in execution order only)."""
    cls = _WRAPPERS[(family.name, has_guidance(transformer))]
    return cls(transformer, family, rounding=rounding, layers=layers).eval()


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """FLUX's config is left to diffusers' own checks."""
    return None


def check_no_double(model) -> None:
    """No float64 anywhere in the FLUX graph (:func:`qkrope.export.flux_attention.check_no_double`)."""
    _check_no_double(model, "the FLUX graph")


post_export = check_no_double


def sample_args(family: FamilyRecord, transformer: nn.Module, sample, dtype: torch.dtype,
                theta, axes, head_dim: int, guided: bool) -> tuple:
    """The traced sample: random activations (and pooled projections for FLUX.1), timestep,
    guidance where the graph has it, and the caches of the pipelines' position ids."""
    from qkrope.families.flux.dropin import caches_from_ids

    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    txt_ids, img_ids = sample_ids(family, sample.img_shapes, sample.txt_len)
    caches = caches_from_ids(family.name, txt_ids, img_ids, axes_dims=axes, theta=theta,
                             head_dim=head_dim)
    b = sample.batch
    args = [torch.randn(b, sample.img_tokens, int(cfg["in_channels"]), generator=g).to(dtype),
            torch.randn(b, sample.txt_len, int(cfg["joint_attention_dim"]),
                        generator=g).to(dtype)]
    if family is FLUX1:
        args.append(torch.randn(b, int(cfg["pooled_projection_dim"]), generator=g).to(dtype))
    args.append(torch.full((b,), 0.5, dtype=dtype))
    if guided:
        args.append(torch.full((b,), 3.5, dtype=dtype))
    return tuple(args) + (caches.img.clone(), caches.txt.clone())


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` (a placeholder skeleton) with its first ``layers`` blocks
    in execution order (double-stream first, then single-stream; all by default; the sidecar's
    num_layers_exported). The sidecar records
    the RoPE axes (3 for FLUX.1, 4 for FLUX.2) and theta (FLUX.1's 10000 is fixed in diffusers'
    code, FLUX.2's is the config's rope_theta, 2000 by default), as read from the loaded model."""
    from qkrope.export.onnx_export import TransformerPlan

    cfg = dict(transformer.config)
    head_dim = int(cfg["attention_head_dim"])
    axes = tuple(int(v) for v in cfg["axes_dims_rope"])
    theta = float(transformer.pos_embed.theta)  # the value diffusers built the model with
    theta = int(theta) if theta.is_integer() else theta
    if sum(axes) != head_dim:
        raise InputError(f"axes_dims_rope {list(axes)} sums to {sum(axes)}, not "
                         f"attention_head_dim={head_dim}: FLUX rotates the whole head")
    guided = has_guidance(transformer)
    wrapper = cache_input_flux(transformer, record, rounding=rounding, layers=layers)
    args = sample_args(record, transformer, sample, dtype, theta, axes, head_dim, guided)
    double, single = wrapper.double, wrapper.single
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.decl(guided), axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=flux_node_count(transformer, layers),
        num_layers_exported=double + single,
        blocks=f"{record.label}: {double} of {len(transformer.transformer_blocks)} double + "
               f"{single} of {len(transformer.single_transformer_blocks)} single blocks")
