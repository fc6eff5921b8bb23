"""Chroma's export hooks (export layer): the attention processor, the cache-input wrapper, the
sample inputs and the post-export check (no float64) that
:func:`qkrope.export.onnx_export.export_transformer` asks for (the hook protocol:
:class:`qkrope.export.onnx_export.TransformerPlan`).

diffusers' ``ChromaTransformer2DModel`` is FLUX.1's attention code (``FluxAttention`` with
``FluxAttnProcessor``, RoPE tables from ``FluxPosEmbed`` in float64) with other modulations.
Every attention gets the generic fused processor
(:class:`qkrope.export.flux_attention.FluxAttnProcessor`): two ``QKNormRoPE`` nodes per
double-stream block (image and text stream, each with its cache), one per single-stream block
(the ``[text; image]`` sequence, the joined cache).

:class:`ChromaCacheInputTransformer` replays diffusers' ``forward`` for the inference path (no
ControlNet residuals, no IP-Adapter): the graph inputs are ``hidden_states,
encoder_hidden_states, encoder_hidden_states_mask, timestep, img_cos_sin_cache,
txt_cos_sin_cache``. The text mask is joined with ones for the image tokens, as the pipelines
do, and the blocks turn it into diffusers' pairwise mask (added to the scores: a float mask).
The timestep embedding's guidance half, which diffusers builds from a Python list of the batch
size, is built from zeros of the timestep's shape (the same values, a dynamic batch).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope.errors import InputError
from qkrope.export.flux_attention import FluxAttnProcessor, check_no_double, joint_rope
from qkrope.families._record import FamilyRecord


def patch_chroma(transformer: nn.Module, *, rounding: int) -> nn.Module:
    """Give every attention of a Chroma transformer the fused processor (in place)."""
    processor = FluxAttnProcessor(rounding, masked=True)
    blocks = list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)
    if not blocks:
        raise InputError("the Chroma model has no transformer blocks")
    for block in blocks:
        block.attn.set_processor(processor)
    return transformer


def node_count(transformer: nn.Module, kept: tuple[int, int] | None = None) -> int:
    """QKNormRoPE nodes of the export: two per double-stream block, one per single-stream (of
    the ``kept`` (double, single) blocks; every block by default)."""
    double, single = kept or (len(transformer.transformer_blocks),
                              len(transformer.single_transformer_blocks))
    return 2 * double + single


def input_vec(embed: nn.Module, timestep: torch.Tensor) -> torch.Tensor:
    """``ChromaCombinedTimestepTextProjEmbeddings.forward`` (the approximator's input) with the
    guidance projection of zeros taken from the timestep's shape instead of a list of the
    batch size (a constant batch in the traced graph): Timesteps of 0 is cos 0 = 1 and
    sin 0 = 0 whatever the input's dtype, so the values are diffusers'."""
    mod_len = embed.mod_proj.shape[0]
    batch = timestep.shape[0]
    times = embed.time_proj(timestep).to(dtype=timestep.dtype)
    guidance = embed.guidance_proj(torch.zeros_like(timestep)).to(dtype=timestep.dtype)
    mod_proj = embed.mod_proj.to(dtype=times.dtype, device=times.device).repeat(batch, 1, 1)
    both = torch.cat([times, guidance], dim=1).unsqueeze(1).repeat(1, mod_len, 1)
    return torch.cat([both, mod_proj], dim=-1).to(timestep.dtype)


class ChromaCacheInputTransformer(nn.Module):
    """A Chroma transformer whose ``forward`` takes the graph inputs
    (:data:`qkrope.families.chroma.CHROMA_TRANSFORMER`, in graph order), running the first
    ``kept`` (double, single) blocks (every block by default). The modulation rows of each block
    are those of the whole model (their offsets count every block), so a prefix computes what
    the whole model's first blocks compute."""

    def __init__(self, transformer: nn.Module, *, rounding: int,
                 kept: tuple[int, int] | None = None):
        super().__init__()
        self.rounding = rounding
        patch_chroma(transformer, rounding=rounding)
        self.transformer = transformer
        self.double, self.single = kept or (len(transformer.transformer_blocks),
                                            len(transformer.single_transformer_blocks))

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
                img_cos_sin_cache, txt_cos_sin_cache):
        t = self.transformer
        s_img, s_txt = hidden_states.shape[1], encoder_hidden_states.shape[1]
        rope = joint_rope(img_cos_sin_cache, txt_cos_sin_cache, s_img, s_txt)
        # the pipelines' attention_mask: the text mask, then ones for the image tokens
        mask = torch.cat([encoder_hidden_states_mask,
                          torch.ones_like(hidden_states[:, :, 0],
                                          dtype=encoder_hidden_states_mask.dtype)], dim=1)
        hidden_states = t.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        pooled_temb = t.distilled_guidance_layer(input_vec(t.time_text_embed, timestep))
        encoder_hidden_states = t.context_embedder(encoder_hidden_states)
        n_double, n_single = len(t.transformer_blocks), len(t.single_transformer_blocks)
        img_offset = 3 * n_single
        txt_offset = img_offset + 6 * n_double
        for index, block in enumerate(t.transformer_blocks[:self.double]):
            img_mod, txt_mod = img_offset + 6 * index, txt_offset + 6 * index
            temb = torch.cat((pooled_temb[:, img_mod:img_mod + 6],
                              pooled_temb[:, txt_mod:txt_mod + 6]), dim=1)
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                temb=temb, image_rotary_emb=rope, attention_mask=mask)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for index, block in enumerate(t.single_transformer_blocks[:self.single]):
            hidden_states = block(hidden_states=hidden_states,
                                  temb=pooled_temb[:, 3 * index:3 * index + 3],
                                  image_rotary_emb=rope, attention_mask=mask)
        hidden_states = hidden_states[:, s_txt:, ...]
        hidden_states = t.norm_out(hidden_states, pooled_temb[:, -2:])
        return t.proj_out(hidden_states)


# --------------------------------------------------------------------------------------------
# The hooks export_transformer calls
# --------------------------------------------------------------------------------------------

def check_config(directory: str, model_class, dtype: torch.dtype, *, memory: bool = True):
    """Chroma's config is left to diffusers' own checks (the RoPE axes: :func:`prepare`)."""
    return None


def post_export(model) -> None:
    """No float64 in the traced graph (diffusers builds Chroma's RoPE in float64)."""
    check_no_double(model, "the Chroma graph")


def sample_mask(batch: int, txt_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The traced text mask: ones, the last quarter of the second item's tokens 0 (as
    :func:`qkrope.runtime.inputs.make_inputs` makes it), in the model's dtype."""
    mask = torch.ones(batch, txt_len)
    if batch > 1:
        mask[1, txt_len - max(1, txt_len // 4):] = 0
    return mask.to(dtype)


def prepare(record: FamilyRecord, transformer: nn.Module, *, sample, dtype: torch.dtype,
            layers: int | None, rounding: int):
    """The export of ``transformer`` (a placeholder skeleton) with its first ``layers`` blocks
    in execution order (double-stream, then single-stream; every block by default). The sidecar
    records the RoPE axes (the config's axes_dims_rope, which
    must fill the head: FluxPosEmbed rotates the whole head) and theta (10000, fixed in
    diffusers' code; read from the built model)."""
    from qkrope.export.onnx_export import TransformerPlan
    from qkrope.families.chroma.dropin import caches_from_ids, sample_ids

    cfg = dict(transformer.config)
    head_dim = int(cfg["attention_head_dim"])
    axes = tuple(int(v) for v in cfg["axes_dims_rope"])
    theta = float(transformer.pos_embed.theta)
    theta = int(theta) if theta.is_integer() else theta
    if sum(axes) != head_dim:
        raise InputError(f"axes_dims_rope {list(axes)} sums to {sum(axes)}, not "
                         f"attention_head_dim={head_dim}: Chroma rotates the whole head. Fix: "
                         f"correct the model's config.json")
    double, single = kept = record.kept_blocks(cfg, layers)
    wrapper = ChromaCacheInputTransformer(transformer, rounding=rounding, kept=kept).eval()
    txt_ids, img_ids = sample_ids(sample.img_shapes, sample.txt_len)
    caches = caches_from_ids(txt_ids, img_ids, axes_dims=axes, theta=theta, head_dim=head_dim)
    g = torch.Generator().manual_seed(1)
    b = sample.batch
    args = (torch.randn(b, sample.img_tokens, int(cfg["in_channels"]), generator=g).to(dtype),
            torch.randn(b, sample.txt_len, int(cfg["joint_attention_dim"]),
                        generator=g).to(dtype),
            sample_mask(b, sample.txt_len, dtype),
            torch.full((b,), 0.5, dtype=dtype), caches.img.clone(), caches.txt.clone())
    return TransformerPlan(
        wrapper=wrapper, args=args, decl=record.graph, axes=axes, theta=theta,
        rounding=wrapper.rounding, nodes=node_count(transformer, kept),
        num_layers_exported=double + single,
        blocks=f"{record.label}: {double} of {len(transformer.transformer_blocks)} double + "
               f"{single} of {len(transformer.single_transformer_blocks)} single blocks")
