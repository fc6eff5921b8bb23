"""Motif-Video (diffusers' MotifVideoTransformer3DModel): the record. Facts only; the hooks are
export.py, reference.py, dropin.py and tiny.py beside this file.

The model takes the 5-D latent ``[batch, channels, frames, height, width]`` (the pipelines join
the noisy latent, the first-frame condition and its mask on the channels) and patchifies it
itself (record ``latent="video-5d"``). Its RoPE is the latent's own token grid (frame, row,
column, each counted from 0: the "grid" scheme uncentred, ``scale_rope=False``) over the
config's ``rope_axes_dim`` with ``rope_theta``, the frequencies and their cos / sin computed in
float64 (``get_1d_rotary_pos_embed(..., freqs_dtype=float64)``) and rotated as interleaved
pairs. The text tokens are normalised (``norm_added_q/k`` in the double-stream blocks,
``norm_q/k`` over the joint ``[latent; text]`` sequence in the single-stream blocks) but not
rotated (``rotated=("img",)``: identity text rows).

Its q/k norms are ``torch.nn.RMSNorm`` per head (eps 1e-6, a weight), the normalised value
times the weight rounded once, then diffusers' ``apply_rotary_emb`` in float32 rounded again:
``contract.ROUNDING_TWO_STEPS`` (tests/test_family_motif_video.py: bit-exact in bf16 and fp16).
The configs the node does not fit are refused by config in one line (export.check_supported):
``qk_norm`` other than ``"rms_norm"`` (a LayerNorm or none), the text cross-attention blocks
(``enable_text_cross_attention_*``: q rotated over the latent, k over the text, not rotated),
decoder layers (``num_decoder_layers``).
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_ATTENTION_MASK, ENCODER_HIDDEN_STATES, IMG_COS_SIN_CACHE,
                             LATENT, LATENT_SAMPLE, TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph inputs, in graph order (the caches in place of diffusers' RoPE module): the 5-D
#: latent the model patchifies, in and out.
MOTIF_VIDEO_TRANSFORMER = ModelDecl(
    "transformer",
    (LATENT, TIMESTEP, ENCODER_HIDDEN_STATES, ENCODER_ATTENTION_MASK, IMG_COS_SIN_CACHE,
     TXT_COS_SIN_CACHE),
    (LATENT_SAMPLE,))

#: FP8 default exclusions: the patch, text and timestep embedders, the final AdaLN and the
#: output projection (the image embedder is not in the graph: image_embeds are refused).
MOTIF_VIDEO_EXCLUDED = ("x_embedder", "context_embedder", "time_text_embed", "norm_out",
                        "proj_out")

#: The block lists, in execution order: (hidden_states, encoder_hidden_states) from each (the
#: single-stream block splits its joint sequence back before returning).
MOTIF_VIDEO_BLOCKS = (BlockList("transformer_blocks", "num_layers", ("img", "txt")),
                      BlockList("single_transformer_blocks", "num_single_layers",
                                ("img", "txt")))

#: The launches at the pipeline's default size (24 heads x 128): 121 frames (31 latent frames,
#: Wan's VAE: 4x in time, 8x in space) at 736 x 1280 (46 x 80 tokens after the 2x2 patch),
#: 512 text tokens: the latent and text nodes of a double-stream block and the joint node of a
#: single-stream block.
MOTIF_VIDEO_LAUNCHES = (
    Launch("Motif-Video", "latent 720p 121f", 31 * 46 * 80, 24,
           roundings=(contract.ROUNDING_TWO_STEPS,)),
    Launch("Motif-Video", "joint 720p 121f + text 512", 31 * 46 * 80 + 512, 24,
           roundings=(contract.ROUNDING_TWO_STEPS,)),
)

MOTIF_VIDEO = FamilyRecord(
    name="motif-video", class_name="MotifVideoTransformer3DModel",
    label="Motif-Video (text-to-video)", short="Motif-Video", package="motif_video",
    scheme="grid", axes=(16, 56, 56), theta=256, theta_key="rope_theta", max_positions=1024,
    rounding=contract.ROUNDING_TWO_STEPS, graph=MOTIF_VIDEO_TRANSFORMER,
    fp8_excluded=MOTIF_VIDEO_EXCLUDED, blocks=True, block_lists=MOTIF_VIDEO_BLOCKS,
    rotated=("img",), latent="video-5d", scale_rope=False, rope_precision="float64",
    launches=MOTIF_VIDEO_LAUNCHES)

RECORDS = (MOTIF_VIDEO,)
