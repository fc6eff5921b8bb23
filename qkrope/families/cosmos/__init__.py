"""Cosmos-Predict2 (diffusers' CosmosTransformer3DModel): the record. Facts only; the hooks are
export.py, reference.py and dropin.py beside this file, the RoPE rule below (pure Python: the facts the "scaled_grid" scheme is handed through its
Setting, found by the record's ``rope_rule``).

The model takes the 5-D latent ``[batch, channels, frames, height, width]`` and patchifies it
itself; its self-attention normalises q and k per head and rotates them by split halves
(``interleaved=False``) over 3-D positions (frames, height, width) from 0, with a base per axis
(NTK-style factors from the config's ``rope_scale``) and video frame positions scaled to 24 fps
(the "scaled_grid" scheme). Its cross-attention normalises q (video) and k (text) without RoPE
and stays unfused (the node takes one q/k pair of one sequence with one cache).
"""

from __future__ import annotations

from typing import Any, Mapping

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_HIDDEN_STATES, FRAME_TIMESTEP, IMG_COS_SIN_CACHE, LATENT,
                             LATENT_SAMPLE, PADDING_MASK, ModelDecl)

# --------------------------------------------------------------------------------------------
# The RoPE rule (diffusers' CosmosRotaryPosEmbed): from a model's config (attention_head_dim,
# rope_scale, max_size, patch_size):
# - the axes: height and width head_dim // 6 * 2 each, frames the rest (128 -> 44, 42, 42);
# - one base per axis, NTK-style: 10000.0 * rope_scale[i] ** (d_i / (d_i - 2)), computed as
#   diffusers computes it (Python floats), then used by torch as a float32 scalar;
# - positions per axis: max(max_size[i] // patch_size[i]) (diffusers' seq table; a longer axis
#   makes its forward fail, so the scheme refuses it);
# - frame positions of a video call scaled by BASE_FPS / fps (diffusers' base_fps=24).
# --------------------------------------------------------------------------------------------

#: diffusers' CosmosRotaryPosEmbed base and frame rate (fixed in its code).
THETA = 10000.0
BASE_FPS = 24


def rope_axes(head_dim: int) -> tuple:
    """(frames, height, width) RoPE widths of a head ``head_dim`` wide."""
    h = int(head_dim) // 6 * 2
    return (int(head_dim) - 2 * h, h, h)


def axis_thetas(head_dim: int, rope_scale) -> tuple:
    """The base of each axis (frames, height, width) as Python floats, in diffusers' order of
    operations: ``factor = scale ** (d / (d - 2))``, ``theta = 10000.0 * factor``."""
    out = []
    for d, scale in zip(rope_axes(head_dim), rope_scale):
        factor = float(scale) ** (d / (d - 2))
        out.append(THETA * factor)
    return tuple(out)


def max_positions(max_size, patch_size) -> int:
    """Positions diffusers' table holds on every axis: ``max(max_size // patch_size)``."""
    return max(int(s) // int(p) for s, p in zip(max_size, patch_size))


def setting_fields(config: Mapping[str, Any]) -> dict:
    """The Setting fields of a model with this diffusers ``config`` (defaults: diffusers')."""
    head_dim = int(config.get("attention_head_dim", 128))
    rope_scale = tuple(config.get("rope_scale") or (2.0, 1.0, 1.0))
    max_size = tuple(config.get("max_size") or (128, 240, 240))
    patch = tuple(config.get("patch_size") or (1, 2, 2))
    return dict(axis_thetas=axis_thetas(head_dim, rope_scale),
                max_positions=max_positions(max_size, patch), base_fps=float(BASE_FPS))


#: The transformer graph: the latent (a condition-mask channel included where the model takes
#: one), the text, per-frame timesteps, the padding mask at the latent's size and the image
#: cache (no text cache: the text is never rotated).
COSMOS_TRANSFORMER = ModelDecl(
    "transformer", (LATENT, ENCODER_HIDDEN_STATES, FRAME_TIMESTEP, PADDING_MASK,
                    IMG_COS_SIN_CACHE),
    (LATENT_SAMPLE,))

#: FP8's default exclusions: the patch embedder, the timestep embedder, the final AdaLN and
#: the output projection (as for the other families: what runs once per step, or maps the
#: latent in and out).
FP8_EXCLUDED = ("patch_embed", "time_embed", "norm_out", "proj_out")

#: The node launches of one self-attention at the pipelines' default sizes (128-wide heads,
#: split halves over the whole head; Text2Image 768x1360 -> 48 x 85 tokens; Video2World 93
#: frames -> 24 latent frames, 704x1280 -> 44 x 80 and 480x832 -> 30 x 52 tokens per frame):
#: 2B has 16 heads, 14B 40. Rounding 1 (the export's) first; the CFG branches are separate calls.
#: The plan prices NeoX pairing per token (qknorm_rope_plan.h kFastNeoxPerToken).
LAUNCHES = (
    Launch("Cosmos-Predict2 2B", "image 768x1360", 48 * 85, 16, interleaved=False,
           roundings=(1, 0)),
    Launch("Cosmos-Predict2 2B", "video 93x704x1280", 24 * 44 * 80, 16, interleaved=False,
           roundings=(1, 0)),
    Launch("Cosmos-Predict2 14B", "video 93x480x832", 24 * 30 * 52, 40, interleaved=False,
           roundings=(1, 0)),
    Launch("Cosmos-Predict2 14B", "video 93x704x1280", 24 * 44 * 80, 40, interleaved=False,
           roundings=(1, 0)),
)

# diffusers' RMSNorm (Qwen-Image's: x * inv rounded, times the weight rounded) and the fp32
# split-halves rotation rounded once: contract.ROUNDING_EACH_STEP. One block list,
# transformer_blocks (num_layers); each CosmosTransformerBlock returns the video tokens alone
# (hidden_states: the pair with after_proj's projection is a ControlNet block's, never the
# export's), so --blocks compares one "img" output per block and --layers K keeps the first K
# blocks with the whole model's embedders, norm_out and proj_out.
COSMOS_PREDICT2 = FamilyRecord(
    name="cosmos-predict2", class_name="CosmosTransformer3DModel",
    label="Cosmos-Predict2 (2B, 14B: Text2Image, Video2World)", short="Cosmos-Predict2",
    package="cosmos", scheme="scaled_grid", axes=rope_axes(128), theta=int(THETA),
    theta_key=None, max_positions=max_positions((128, 240, 240), (1, 2, 2)),
    rounding=contract.ROUNDING_EACH_STEP, graph=COSMOS_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=(BlockList("transformer_blocks", "num_layers", ("img",)),), rotated=("img",),
    latent="video-5d", rope_rule="setting_fields", launches=LAUNCHES)

RECORDS = (COSMOS_PREDICT2,)
