"""Kandinsky 5 (diffusers' Kandinsky5Transformer3DModel): the record. Facts only; the hooks are
export.py, reference.py, dropin.py and tiny.py beside this file.

The model takes a channels-last latent ``[batch, frames, height, width, channels]`` and
patchifies it itself; the graph takes it channels-first (the ``video-5d`` latent, a permutation
each way: the drop-in's, the wrapper's). A text transformer (encoder blocks: text self-attention
rotated over the text's 1-D positions across the whole head) runs first, then the visual blocks
(self-attention rotated over the latent's (frame, row, column) positions, then a cross-attention
of visual queries on text keys, not rotated). RoPE pairs are interleaved ``(2j, 2j + 1)``; the
frequencies are ``exp(-ln(10000) * j / (d / 2))`` (float32), the visual angles divided by the
call's ``scale_factor`` per axis (the "divided_grid" scheme). Its q/k norms are
``nn.RMSNorm(head_dim)`` with no eps on ``q.float()``: eps is float32's machine epsilon.

Rounding: q/k normalised in float32 and rounded to the model's dtype, then rotated in float32
and rounded to bfloat16 in every dtype. In bf16 that is ``contract.ROUNDING_TWO_STEPS``; in fp32
and fp16 the export adds the bf16 round trip after the node (a Cast pair): bit for bit in fp32;
in fp16, where the node has already rounded to fp16, within one bf16 step (a double rounding:
docs/spec.md section 3.5). The record's ``qk_round_dtype`` says so: the check holds an fp32 or
fp16 export to bf16's tolerance.
"""

from __future__ import annotations

from typing import Any, Mapping

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_HIDDEN_STATES, IMG_COS_SIN_CACHE, LATENT, LATENT_SAMPLE,
                             POOLED_PROJECTIONS, TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: diffusers' RoPE base and table sizes (fixed in Kandinsky5RoPE1D / Kandinsky5RoPE3D's
#: defaults, not in the config): text positions, and positions per visual axis.
THETA = 10000
TEXT_TABLE = 1024
VISUAL_TABLE = (128, 128, 128)
#: float32's machine epsilon: nn.RMSNorm(eps=None) on float32 values.
EPS = 1.1920928955078125e-07


def setting_fields(config: Mapping[str, Any]) -> dict:
    """The divided_grid Setting's table sizes (the text table as ``max_positions``, the visual
    tables as ``table_lengths``): diffusers' fixed defaults, whatever the config."""
    return dict(max_positions=TEXT_TABLE, table_lengths=VISUAL_TABLE)


#: The graph inputs in graph order: the latent (channels first), the text, the timestep, the
#: pooled CLIP embedding, the visual and text caches.
KANDINSKY5_TRANSFORMER = ModelDecl(
    "transformer", (LATENT, ENCODER_HIDDEN_STATES, TIMESTEP, POOLED_PROJECTIONS,
                    IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
    (LATENT_SAMPLE,))

#: FP8's default exclusions: the embedders (time, text, pooled text, visual) and the output
#: layer (what runs once per step or maps the latent in and out).
FP8_EXCLUDED = ("time_embeddings", "text_embeddings", "pooled_text_embeddings",
                "visual_embeddings", "out_layer")

#: The text blocks (returning the text) run before the visual blocks (returning the latent).
# the text blocks' output is read by the visual blocks' cross-attention only (the output layer
# reads the visual stream): an export of text blocks alone holds none of them
BLOCK_LISTS = (BlockList("text_transformer_blocks", "num_text_blocks", ("txt",),
                         feeds_output=False),
               BlockList("visual_transformer_blocks", "num_visual_blocks", ("img",)))

#: The node launches at Kandinsky 5.0 Video Lite's sizes (model_dim 1792 in 64-wide heads: 28
#: heads; interleaved pairs over the whole head): a 5 s video at 768x512 (121 frames -> 31
#: latent frames, 48 x 32 tokens per frame) in the visual self-attention, and 256 text tokens
#: in the text self-attention. bf16's rounding first.
LAUNCHES = (
    Launch("Kandinsky 5.0 Video Lite", "video 121x512x768", 31 * 32 * 48, 28, head_dim=64,
           batches=(1,), roundings=(contract.ROUNDING_TWO_STEPS,)),
    Launch("Kandinsky 5.0 Video Lite", "text 256", 256, 28, head_dim=64,
           roundings=(contract.ROUNDING_TWO_STEPS,)),
)

KANDINSKY5 = FamilyRecord(
    name="kandinsky5", class_name="Kandinsky5Transformer3DModel",
    label="Kandinsky 5 (T2V, I2V, T2I, I2I)", short="Kandinsky 5", package="kandinsky5",
    scheme="divided_grid", axes=(16, 24, 24), theta=THETA, theta_key=None,
    max_positions=TEXT_TABLE, rounding=contract.ROUNDING_TWO_STEPS,
    graph=KANDINSKY5_TRANSFORMER, fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=BLOCK_LISTS, blocks_key="num_visual_blocks", rotated=("img", "txt"),
    latent="video-5d",
    rope_rule="setting_fields", launches=LAUNCHES, qk_round_dtype="bf16")

RECORDS = (KANDINSKY5,)

#: The angle divisors of a check's or an export's sample (the video pipelines' 480p-range
#: factors, so the division is exercised; the image pipelines pass (1, 1, 1)).
SAMPLE_SCALE = (1.0, 2.0, 2.0)
