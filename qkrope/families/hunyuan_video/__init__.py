"""HunyuanVideo-1.5 (diffusers' HunyuanVideo15Transformer3DModel, 8.3 B) and HunyuanVideo
(HunyuanVideoTransformer3DModel, 13 B) and HunyuanVideo FramePack
(HunyuanVideoFramepackTransformer3DModel, on HunyuanVideo's code): the records. Facts only; the hooks are export.py,
reference.py and dropin.py beside this file.

Both take the 5-D latent ``[batch, channels, frames, height, width]`` and patchify it themselves
(record ``latent="video-5d"``); their RoPE is the latent's own token grid (frame, row, column,
each counted from 0: the "grid" scheme uncentred, ``scale_rope=False``) over the config's
``rope_axes_dim`` with ``rope_theta``. The text tokens are normalised (``norm_added_q/k`` in the
double-stream blocks, ``norm_q/k`` over the joint sequence in HunyuanVideo's single-stream
blocks) but not rotated (``rotated=("img",)``: identity text rows). The joint sequence is
``[latent; text]``.
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_ATTENTION_MASK, ENCODER_ATTENTION_MASK_2,
                             ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_2, GUIDANCE,
                             IMAGE_EMBEDS, IMG_COS_SIN_CACHE, LATENT, LATENT_SAMPLE,
                             LATENTS_CLEAN, LATENTS_HISTORY_2X, LATENTS_HISTORY_4X,
                             POOLED_PROJECTIONS, TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph inputs, in graph order (the caches in place of diffusers' RoPE module): the 5-D
#: latent the model patchifies, in and out (qkrope.model_io.LATENT / LATENT_SAMPLE). The text
#: cache's rows are the joined text stream's (HunyuanVideo-1.5: MLLM + ByT5 + image tokens).
HUNYUAN_VIDEO15_TRANSFORMER = ModelDecl(
    "transformer",
    (LATENT, TIMESTEP, ENCODER_HIDDEN_STATES, ENCODER_ATTENTION_MASK,
     ENCODER_HIDDEN_STATES_2, ENCODER_ATTENTION_MASK_2, IMAGE_EMBEDS, IMG_COS_SIN_CACHE,
     TXT_COS_SIN_CACHE),
    (LATENT_SAMPLE,))
HUNYUAN_VIDEO_TRANSFORMER = ModelDecl(
    "transformer",
    (LATENT, TIMESTEP, ENCODER_HIDDEN_STATES, ENCODER_ATTENTION_MASK, POOLED_PROJECTIONS,
     GUIDANCE, IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
    (LATENT_SAMPLE,))

#: FP8 default exclusions: the patch and condition embedders (latent, text refiner, ByT5,
#: image, timestep, condition type), the final AdaLN and the output projection.
HUNYUAN_VIDEO15_EXCLUDED = ("x_embedder", "image_embedder", "context_embedder",
                            "context_embedder_2", "time_embed", "cond_type_embed", "norm_out",
                            "proj_out")
HUNYUAN_VIDEO_EXCLUDED = ("x_embedder", "context_embedder", "time_text_embed", "norm_out",
                          "proj_out")

def _launches(model: str, heads: int, videos, text: int, single: bool) -> tuple[Launch, ...]:
    """A model's node launches at its pipelines' usual sizes (x 128, interleaved pairs at full
    rotary width; ``videos``: (name, latent tokens) of one video): the latent and the text
    stream of a double-stream block, and (HunyuanVideo) the joint [latent; text] launch of a
    single-stream block, which is the longest: tens of thousands of tokens per launch."""
    roundings = (contract.ROUNDING_EACH_STEP, contract.ROUNDING_ONE)
    out = [Launch(model, f"latent {name}", tokens, heads, roundings=roundings)
           for name, tokens in videos]
    out.append(Launch(model, f"text {text}", text, heads, roundings=roundings))
    if single:
        out += [Launch(model, f"joint {name} + text {text}", tokens + text, heads,
                       roundings=roundings) for name, tokens in videos]
    return tuple(out)


#: HunyuanVideo-1.5 (16 heads): 121 frames (31 latent frames) at 480p (30 x 53 latent, 16x
#: VAE, patch 1) and 720p (45 x 80); the text stream joins 1000 MLLM, 256 ByT5 and 729 image
#: tokens. HunyuanVideo (24 heads): 129 frames (33 latent frames) at 544p (34 x 60 tokens: 8x
#: VAE, patch 2) and 720p (45 x 80), 256 text tokens.
HUNYUAN_VIDEO15_LAUNCHES = _launches("HunyuanVideo-1.5", 16, (("480p 121f", 31 * 30 * 53),
                                                              ("720p 121f", 31 * 45 * 80)),
                                     1000 + 256 + 729, single=False)
HUNYUAN_VIDEO_LAUNCHES = _launches("HunyuanVideo", 24, (("544p 129f", 33 * 34 * 60),
                                                        ("720p 129f", 33 * 45 * 80)),
                                   256, single=True)

#: The block lists, in execution order: (hidden_states, encoder_hidden_states) from each.
HUNYUAN_VIDEO15_BLOCKS = (BlockList("transformer_blocks", "num_layers", ("img", "txt")),)
HUNYUAN_VIDEO_BLOCKS = (BlockList("transformer_blocks", "num_layers", ("img", "txt")),
                        BlockList("single_transformer_blocks", "num_single_layers",
                                  ("img", "txt")))

# The node rounding: diffusers' RMSNorm (the normalised value rounded, times the weight rounded)
# then apply_rotary_emb in fp32 and rounded: contract.ROUNDING_EACH_STEP's order (tests/
# test_family_hunyuan_video.py: bit-exact in bf16 and fp16). The position tables hold 1024
# positions per axis (a 16384-pixel-wide latent at the 16x VAE of 1.5). --layers K keeps the
# first K blocks in execution order (HunyuanVideo: double-stream, then single-stream); --blocks
# compares each block's latent and text outputs: every block of both models, the single-stream
# ones included, returns the pair (hidden_states, encoder_hidden_states) (HunyuanVideo's
# single-stream block splits its joint [latent; text] sequence back before returning).
HUNYUAN_VIDEO15 = FamilyRecord(
    name="hunyuan-video-1.5", class_name="HunyuanVideo15Transformer3DModel",
    label="HunyuanVideo-1.5 (480p/720p, text- and image-to-video)", short="HunyuanVideo-1.5",
    package="hunyuan_video", scheme="grid", axes=(16, 56, 56), theta=256,
    theta_key="rope_theta", max_positions=1024, rounding=contract.ROUNDING_EACH_STEP,
    graph=HUNYUAN_VIDEO15_TRANSFORMER, fp8_excluded=HUNYUAN_VIDEO15_EXCLUDED, blocks=True,
    block_lists=HUNYUAN_VIDEO15_BLOCKS, rotated=("img",), latent="video-5d", scale_rope=False,
    launches=HUNYUAN_VIDEO15_LAUNCHES)
HUNYUAN_VIDEO = FamilyRecord(
    name="hunyuan-video", class_name="HunyuanVideoTransformer3DModel",
    label="HunyuanVideo (text- and image-to-video)", short="HunyuanVideo",
    package="hunyuan_video", scheme="grid", axes=(16, 56, 56), theta=256,
    theta_key="rope_theta", max_positions=1024, rounding=contract.ROUNDING_EACH_STEP,
    graph=HUNYUAN_VIDEO_TRANSFORMER, fp8_excluded=HUNYUAN_VIDEO_EXCLUDED, blocks=True,
    block_lists=HUNYUAN_VIDEO_BLOCKS, rotated=("img",), latent="video-5d", scale_rope=False,
    launches=HUNYUAN_VIDEO_LAUNCHES)

# HunyuanVideo FramePack: HunyuanVideo's blocks, text refiner and condition embedding, plus
# three history latents (clean at patch (1, 2, 2), 2x at (2, 4, 4), 4x at (4, 8, 8), each with
# its own patch convolution) joined before the latent's tokens as [4x; 2x; clean; latent], and
# SigLIP image embeddings projected and joined before the text ([image; text]). Its RoPE is per
# token: (frame index, row, column) with the frames taken from the call's index tensors (not
# contiguous: the clean latents are the first frame and the newest history frame), so the
# image cache is the "ids" scheme's over the full-resolution grid of every part, one row per
# position: [4x history frames; 2x history frames; clean frames; latent frames] x rows x
# columns. The 2x and 4x parts' rows are pooled in the graph as diffusers pools them (the
# cos and sin tables padded by repetition and averaged over each history patch: an average of
# rotations, no rotation by one position), so the node takes every row as the cache holds it.
# The history latents are model_io's LATENTS_CLEAN / LATENTS_HISTORY_2X / LATENTS_HISTORY_4X
# (conditioning roles the runner passes).
HUNYUAN_VIDEO_FRAMEPACK_TRANSFORMER = ModelDecl(
    "transformer",
    (LATENT, TIMESTEP, ENCODER_HIDDEN_STATES, ENCODER_ATTENTION_MASK, POOLED_PROJECTIONS,
     IMAGE_EMBEDS, GUIDANCE, LATENTS_CLEAN, LATENTS_HISTORY_2X, LATENTS_HISTORY_4X,
     IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
    (LATENT_SAMPLE,))
#: FP8 default exclusions: HunyuanVideo's, the history patch embedder and the image projection.
HUNYUAN_VIDEO_FRAMEPACK_EXCLUDED = HUNYUAN_VIDEO_EXCLUDED + ("clean_x_embedder",
                                                             "image_projection")
#: FramePack (24 heads) at its pipeline's usual 640 x 640 window: 9 latent frames of 80 x 80
#: (8x VAE; patch 2: 40 x 40 tokens) behind its history (2 clean frames at patch 2, 2 frames at
#: 2x, 16 at 4x: 2 x 1600 + 1 x 400 + 4 x 100 tokens), 256 text + 729 image tokens.
FRAMEPACK_TOKENS = 9 * 1600 + 2 * 1600 + 400 + 4 * 100
HUNYUAN_VIDEO_FRAMEPACK_LAUNCHES = _launches(
    "HunyuanVideo FramePack", 24, (("640x640 9f + history", FRAMEPACK_TOKENS),), 256 + 729,
    single=True)
HUNYUAN_VIDEO_FRAMEPACK = FamilyRecord(
    name="hunyuan-video-framepack", class_name="HunyuanVideoFramepackTransformer3DModel",
    label="HunyuanVideo FramePack (image-to-video with frame history)",
    short="HunyuanVideo FramePack", package="hunyuan_video", scheme="ids", axes=(16, 56, 56),
    theta=256, theta_key="rope_theta", max_positions=None,
    rounding=contract.ROUNDING_EACH_STEP, graph=HUNYUAN_VIDEO_FRAMEPACK_TRANSFORMER,
    fp8_excluded=HUNYUAN_VIDEO_FRAMEPACK_EXCLUDED, blocks=True,
    block_lists=HUNYUAN_VIDEO_BLOCKS, rotated=("img",), latent="video-5d", scale_rope=False,
    launches=HUNYUAN_VIDEO_FRAMEPACK_LAUNCHES)

RECORDS = (HUNYUAN_VIDEO15, HUNYUAN_VIDEO, HUNYUAN_VIDEO_FRAMEPACK)
