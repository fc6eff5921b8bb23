"""Bria 3.2 (diffusers' BriaTransformer2DModel): the record. A dual-stream transformer with
FLUX.1's blocks, attention layout and id-based position embedder (its base the config's
rope_theta), a timestep embedding of the scheduler's timestep itself (not t / 1000 times 1000)
and no pooled text. Facts only: its record's dual_stream gives it the shared dual-stream export,
reference and drop-in hooks (qkrope.families._dual_stream.SHARED_HOOKS); tiny.py is its own."""

from __future__ import annotations

from qkrope import contract
from qkrope.families._dual_stream import DualStream, IdsLayout, launches
from qkrope.families._record import DOUBLE_THEN_SINGLE_BLOCKS, FamilyRecord
from qkrope.model_io import (ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE,
                             TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the activations, the timestep and the two caches in place of txt_ids/img_ids
#: (Bria 3.2 embeds no guidance; its forward's pooled_projections is unused).
GRAPH = ModelDecl("transformer", (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP,
                                  IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE), (SAMPLE,))

#: How it differs as a dual-stream transformer: temb = time_embed(timestep, dtype) of the
#: timestep as the pipeline passes it (timestep_scale 1); FLUX.1's id layout (text at 0, the
#: image at (0, row, column)); a guidance value is refused (diffusers' model would add a
#: guidance embedding it does not have).
DUAL_STREAM = DualStream(
    temb="time_embed", timestep_scale=1, ids=IdsLayout(n_axes=3, image_step=1),
    forward_args=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                  "img_ids", "txt_ids", "guidance", "attention_kwargs", "return_dict",
                  "controlnet_block_samples", "controlnet_single_block_samples"),
    pipelines="BriaPipeline", unguided_guidance="refuse")

#: Bria 3.2 at 1024 x 1024: 24 heads x 128, 4096 image tokens, the pipeline's 128 text tokens
#: (max_sequence_length), a single-stream block's joined 4224; batch 2 (CFG batched) and 1.
LAUNCHES = launches("Bria 3.2", 24, text=128)

# torch's RMSNorm then diffusers' apply_rotary_emb in fp32: rounded twice, as FLUX.1.
BRIA = FamilyRecord(
    name="bria", class_name="BriaTransformer2DModel", label="Bria 3.2", short="Bria",
    package="bria", scheme="ids", axes=(16, 56, 56), theta=10000, theta_key="rope_theta",
    max_positions=None, rounding=contract.ROUNDING_TWO_STEPS, graph=GRAPH,
    fp8_excluded=("x_embedder", "context_embedder", "time_embed", "norm_out", "proj_out"),
    blocks=True, block_lists=DOUBLE_THEN_SINGLE_BLOCKS, launches=LAUNCHES,
    dual_stream=DUAL_STREAM)

RECORDS = (BRIA,)

#: Bria's other transformers, refused by class (the registry's one line).
REFUSED = {
    "BriaFiboTransformer2DModel":
        "its double-stream attentions (torch.nn.RMSNorm) and single-stream attentions "
        "(diffusers' RMSNorm) round differently in bf16 / fp16 (twice, and after each step), "
        "which one export's rounding attribute cannot both match, and before every block it "
        "joins a projected text-encoder layer of its own (text_encoder_layers) to half the "
        "text stream, an input the dual-stream graph does not have",
    "BriaFibo2Transformer2DModel":
        "it is a single stream whose gist-token count (its sequence length) is computed on the "
        "host from each prompt's text length, its gist tokens come from a Perceiver resampler "
        "over the text, and its injection blocks add cross-attention to per-block text "
        "bundles and per-token (noisy / clean) modulation, none of which the dual-stream or "
        "Z-Image exports have",
}
