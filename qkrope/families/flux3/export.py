"""FLUX.3's export hooks (export layer): the attention processor, the cache-input wrapper, the
sample and the checks :func:`qkrope.export.onnx_export.export_transformer` asks for.

Every attention (``Flux3AttnProcessor``: per-mode and joint blocks alike) becomes one
``qkrope::QKNormRoPE`` node: a text per-mode block's over the text cache, an image per-mode
block's over the image cache, a joint block's over the ``[text; image]`` cache the graph joins
from the two cache inputs (:func:`qkrope.export.dual_stream.joint_rope`). The node normalises
``q.float()`` with the norm weights as they are (float32: the class keeps ``norm_q`` / ``norm_k``
in float32, and so does the streamed export's skeleton, from ``_keep_in_fp32_modules``), rotates
in float32 and rounds once to q's dtype: diffusers' order, ``contract.ROUNDING_ONE``.

The wrapper replays ``Flux3Transformer2DModel.forward`` for text-to-image (no reference image:
refused in one line by the drop-in); a flow-map model's takes ``target_timestep`` too
(:class:`Flux3FlowMapCacheInputTransformer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qkrope.errors import InputError
from qkrope.export.dual_stream import joint_rope, sdpa
from qkrope.export.fused_qk import FusedNormRoPE, check_cache, norm_eps
from qkrope.export.finalize import check_no_double
from qkrope.families._contract import ExportHooks as CONTRACT  # noqa: F401
from qkrope.families._record import FamilyRecord

from . import FLUX3_FLOW_MAP, IMAGE_ROPE_SCALE



class Flux3Processor:
    """Replaces ``Flux3AttnProcessor``: q, k, v per head; q/k norm + RoPE as one node over the
    cache it is given (``image_rotary_emb``: the stream's ``[rows, head_dim]`` cache); softmax
    attention; ``to_out``."""

    def __init__(self, rounding: int):
        self.fused = FusedNormRoPE(rounding)
        self.rounding = self.fused.rounding

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise InputError("the FLUX.3 export takes no attention_mask (every token attends "
                             "to its stream)")
        check_cache(image_rotary_emb, "FLUX.3")
        if getattr(attn, "fused_projections", False):
            raise InputError("the FLUX.3 attention has fused QKV projections (fuse_qkv_"
                             "projections()); export the model before fusing them")
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.heads, -1))
                   for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = self.fused(q, k, attn.norm_q, attn.norm_k, image_rotary_emb)
        out = sdpa(q, k, v, attn.head_dim)
        return attn.to_out[1](attn.to_out[0](out))


def check_supported(transformer: nn.Module) -> None:
    """One line for a configuration the graph does not carry: RoPE axes that do not fill the
    head."""
    cfg = transformer.config
    axes = tuple(int(v) for v in cfg["axes_dims_rope"])
    if sum(axes) != int(cfg["attention_head_dim"]) or any(d % 2 for d in axes):
        raise InputError(f"axes_dims_rope {list(axes)} must be even widths summing to "
                         f"attention_head_dim={cfg['attention_head_dim']}: FLUX.3 rotates the "
                         f"whole head. Fix: correct the model's config.json")


def attentions(transformer: nn.Module) -> list:
    """Every attention the text-to-image forward runs (text and image per-mode blocks, joint
    blocks; the reference image's per-mode blocks too, so none keeps diffusers' processor)."""
    blocks = (list(transformer.txt_mode_blocks) + list(transformer.mode_blocks["image"])
              + list(transformer.mode_blocks["image_cond"])
              + list(transformer.single_transformer_blocks))
    return [block.attn for block in blocks]


def block_counts(transformer: nn.Module) -> tuple[int, int, int]:
    """(text per-mode, image per-mode, joint) blocks."""
    return (len(transformer.txt_mode_blocks), len(transformer.mode_blocks["image"]),
            len(transformer.single_transformer_blocks))


class Flux3CacheInputTransformer(nn.Module):
    """``Flux3Transformer2DModel.forward`` (text-to-image) with the two caches in place of the
    ids; ``forward``'s arguments are the graph inputs in graph order: ``hidden_states [B,
    img_tokens, in_channels]``, ``encoder_hidden_states [B, txt_tokens, joint_attention_dim]``,
    ``timestep [B]`` (in [0, 1]), ``img_cos_sin_cache``, ``txt_cos_sin_cache`` -> ``sample [B,
    img_tokens, in_channels]``."""

    def __init__(self, transformer: nn.Module, *, rounding: int,
                 kept: tuple[int, int, int] | None = None):
        super().__init__()
        check_supported(transformer)
        processor = Flux3Processor(rounding)
        for attn in attentions(transformer):
            attn.set_processor(processor)
        self.transformer = transformer
        self.rounding = rounding
        # the first (text, image, joint) blocks that run (--layers): every block by default
        self.kept = tuple(kept) if kept is not None else block_counts(transformer)

    def forward(self, hidden_states, encoder_hidden_states, timestep, img_cos_sin_cache,
                txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, timestep, None, img_cos_sin_cache,
                        txt_cos_sin_cache)

    def run(self, hidden_states, encoder_hidden_states, timestep, target_timestep,
            img_cos_sin_cache, txt_cos_sin_cache):
        """The forward; ``target_timestep`` a flow-map model's (else None)."""
        t = self.transformer
        batch, s_img = hidden_states.shape[0], hidden_states.shape[1]
        s_txt = encoder_hidden_states.shape[1]
        dtype = hidden_states.dtype
        # the image tokens at the timestep, the text at 0 (diffusers' step 1)
        image_temb = t.time_proj(timestep.to(dtype) * 1000)
        image_temb = t.timestep_embedder(image_temb.to(dtype))[:, None, :]
        zero_temb = t.time_proj(torch.zeros_like(timestep, dtype=dtype))
        zero_temb = t.timestep_embedder(zero_temb.to(dtype))[:, None, :]
        if target_timestep is not None:  # a flow map: the jump's embedding added to every mode's
            target_temb = t.time_proj(target_timestep.to(dtype) * 1000)
            target_temb = t.target_timestep_embedder(target_temb.to(dtype))[:, None, :]
            image_temb = image_temb + target_temb
            zero_temb = zero_temb + target_temb
        image_temb = image_temb.expand(batch, s_img, -1)
        txt_temb_act = F.silu(zero_temb).expand(batch, s_txt, -1)
        txt_early = t.early_stream_modulations["txt"](txt_temb_act)
        txt_single = t.single_stream_modulations["txt"](txt_temb_act)
        text = t.context_embedder(encoder_hidden_states)
        image_temb_act = F.silu(image_temb)
        image_early = t.early_stream_modulations["image"](image_temb_act)
        image_single = t.single_stream_modulations["image"](image_temb_act)
        image = t.x_embedders["image"](hidden_states)
        rope = joint_rope(img_cos_sin_cache, txt_cos_sin_cache, s_img, s_txt)
        n_txt, n_img, n_joint = self.kept
        for block in t.txt_mode_blocks[:n_txt]:
            text = block(text, txt_early, rope.txt)
        for block in t.mode_blocks["image"][:n_img]:
            image = block(image, image_early, rope.img)
        for block in t.single_transformer_blocks[:n_joint]:
            text, image = block(hidden_states=image, encoder_hidden_states=text,
                                temb_mod=image_single, temb_mod_context=txt_single,
                                image_rotary_emb=rope.joint)
        return t.proj_out(t.norm_out(image, image_temb))


class Flux3FlowMapCacheInputTransformer(Flux3CacheInputTransformer):
    """A flow-map model's wrapper (``flow_map=True``): ``target_timestep [B]`` after the
    timestep (the record's FLUX3_FLOW_MAP)."""

    def forward(self, hidden_states, encoder_hidden_states, timestep, target_timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        return self.run(hidden_states, encoder_hidden_states, timestep, target_timestep,
                        img_cos_sin_cache, txt_cos_sin_cache)


def flow_map(transformer: nn.Module) -> bool:
    """Whether ``transformer`` is a flow-map model (its config's flow_map)."""
    return bool(transformer.config.get("flow_map", False))


def sample_ids(img_shape, txt_len: int, scale: float = IMAGE_ROPE_SCALE):
    """(txt_ids, img_ids) float32 numpy ``[tokens, 4]`` as the FLUX.3 pipelines lay them out
    for an image of ``img_shape`` ``(frames, h, w)`` tokens (the frames must be 1) and
    ``txt_len`` text tokens: the image at (0, row * scale, column * scale, 0), the text at (0,
    0, 0, index) (Flux3PrepareLatentsStep, Flux3TextRoPEInputsStep)."""
    from qkrope.families.flux3.dropin import pipeline_ids

    return pipeline_ids(img_shape, txt_len, scale)


def sample_args(transformer: nn.Module, sample, dtype: torch.dtype) -> tuple:
    """The traced sample in graph order: random image tokens and text, timestep 0.5, the caches
    of the pipelines' ids for the sample's one image."""
    from qkrope.runtime.dual_stream import caches_from_ids

    if len(sample.img_shapes) != 1 or int(sample.img_shapes[0][0]) != 1:
        raise InputError(f"a FLUX.3 sample is one image (1, height, width in tokens); got "
                         f"{sample.img_shapes}. Fix: pass one --img-shape 1 H W")
    cfg = transformer.config
    g = torch.Generator().manual_seed(1)
    b = sample.batch
    hidden = torch.randn(b, sample.img_tokens, int(cfg["in_channels"]), generator=g).to(dtype)
    text = torch.randn(b, sample.txt_len, int(cfg["joint_attention_dim"]),
                       generator=g).to(dtype)
    txt_ids, img_ids = sample_ids(sample.img_shapes[0], sample.txt_len)
    caches = caches_from_ids("FLUX.3", txt_ids, img_ids,
                             axes_dims=tuple(int(v) for v in cfg["axes_dims_rope"]),
                             theta=float(transformer.pos_embed.theta),
                             head_dim=int(cfg["attention_head_dim"]))
    # a flow map jumps from the timestep (0.5) to a later one (0.25)
    target = (torch.full((b,), 0.25, dtype=dtype),) if flow_map(transformer) else ()
    return (hidden, text, torch.full((b,), 0.5, dtype=dtype), *target, caches.img.clone(),
            caches.txt.clone())


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """The config is left to diffusers' own checks and :func:`check_supported`."""
    return None


def post_export(model) -> None:
    """No float64 in the graph (diffusers builds FLUX.3's RoPE in float64)."""
    check_no_double(model, "the FLUX.3 graph")


def node_count(kept: tuple[int, int, int]) -> int:
    """QKNormRoPE nodes of the kept (text, image, joint) blocks, one per block; the text blocks'
    only where a joint block is kept (the output layer reads the image stream: without a joint
    block the text blocks' values reach no output and the graph drops them)."""
    n_txt, n_img, n_joint = kept
    return n_img + (n_txt + n_joint if n_joint else 0)


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` with its first ``layers`` blocks in execution order (text
    per-mode, image per-mode, joint: the record's block lists; every block by default)."""
    from qkrope.export.onnx_export import TransformerPlan

    cfg = dict(transformer.config)
    counts = block_counts(transformer)
    if layers is not None and not 1 <= layers <= sum(counts):
        raise InputError(f"--layers must be between 1 and {sum(counts)} (FLUX.3's "
                         f"{' + '.join(str(c) for c in counts)} text, image and joint blocks); "
                         f"got {layers}. Fix: pass --layers 1 to {sum(counts)}")
    kept = record.kept_blocks(cfg, layers)
    wrapper = (Flux3FlowMapCacheInputTransformer if flow_map(transformer) else
               Flux3CacheInputTransformer)(transformer, rounding=rounding, kept=kept).eval()
    args = sample_args(transformer, sample, dtype)
    theta = float(transformer.pos_embed.theta)
    txt, img, joint = kept
    attn = transformer.single_transformer_blocks[0].attn if counts[2] else \
        transformer.mode_blocks["image"][0].attn
    return TransformerPlan(
        wrapper=wrapper, args=args,
        decl=FLUX3_FLOW_MAP if flow_map(transformer) else record.graph,
        axes=tuple(int(v) for v in cfg["axes_dims_rope"]),
        theta=int(theta) if theta.is_integer() else theta, rounding=rounding,
        nodes=node_count(kept), num_layers_exported=sum(kept),
        blocks=f"{record.label}: {txt} of {counts[0]} text + {img} of {counts[1]} image "
               f"per-mode blocks + {joint} of {counts[2]} joint blocks",
        heads=int(attn.heads), head_dim=int(attn.head_dim),
        eps=norm_eps(attn.norm_q, "norm_q"), interleaved=True)


__all__ = ["Flux3Processor", "Flux3CacheInputTransformer", "check_supported", "attentions",
           "block_counts", "node_count", "sample_ids", "sample_args", "prepare", "check_config",
           "post_export", "Flux3FlowMapCacheInputTransformer", "flow_map"]
