"""Ideogram 4 (diffusers' Ideogram4Transformer2DModel, served in Ideogram4Pipeline as both its
``transformer`` and its ``unconditional_transformer``): the record. Facts only; the hooks are
export.py, reference.py, dropin.py and tiny.py beside this file.

One packed stream per batch item, ``[left padding][text][image]``: every block runs one
self-attention over all of it, with a block-diagonal mask from ``segment_ids`` (the pipeline
gives the padding segment -1 and the text and the image segment 1, so a padding token sees only
the padding and the text and image never see it). Per head (head_dim 256), q and k are
normalised by diffusers' RMSNorm (float32, the normalised value rounded to the activation dtype,
times the weight in that dtype) and rotated over the whole head with NeoX pairing (``(j, j +
128)``: node ``interleaved=0``), cos and sin cast to the activation dtype and the rotation done
in it. The node in ``contract.ROUNDING_EACH_STEP`` reproduces the norm bit for bit and rotates
in float32 with float32 cos / sin, rounding once: in fp32 every mode is the same computation;
in bf16 / fp16 no mode is bit-exact (diffusers rounds cos, sin, both products and their sum),
and the difference is within the bound derived in docs/spec.md section 6e.

The RoPE (``Ideogram4MRoPE``): one frequency per pair, ``1 / theta^(2j/256)`` over the whole
head (j < 128, theta the config's ``rope_theta``, 5e6), each applied to one of the position
axes (t, h, w) of ``position_ids [B, L, 3]``, interleaved: axis 1 where j mod 3 = 1 and j <
3·mrope_section[1], axis 2 where j mod 3 = 2 and j < 3·mrope_section[2], axis 0 otherwise; the
angle is the float32 product, cos and sin float32. Text token i sits at (i, i, i), image patch
(y, x) at (65536, 65536 + y, 65536 + x), padding at 0. The caches are built on the host (the
drop-in): the float32 angles exactly as diffusers computes them, then the "ids" scheme over 128
one-pair axes whose "positions" are those angles (a one-pair axis has the frequency 1 exactly,
so its columns are cos and sin of the angle, computed in float64 and rounded to float32: the
correctly rounded value, within one float32 ulp of torch's float32 cos / sin; the axes in order
are the pairs in order, so the cache is the NeoX cos half then sin half).

The graph takes the two regions apart: ``hidden_states`` the image latents ``[B, image
tokens, in_channels]``, ``encoder_hidden_states`` the text region ``[B, text tokens,
llm_features_dim]`` with its int64 mask (1 = a text token, 0 = left padding), the timestep,
the text-region cache and the image cache; the graph joins ``[text; image]`` as diffusers'
packed sequence and returns the image rows. A call whose items have different position ids
(prompts of different lengths) runs once per group of equal ones (docs/spec.md section 6c).
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_ATTENTION_MASK, ENCODER_HIDDEN_STATES, HIDDEN_STATES,
                             IMG_COS_SIN_CACHE, SAMPLE, TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the image latents, the text region and its int64 mask, the timestep (float32;
#: the model embeds it in its activation dtype, as the pipeline passes it), the text-region and
#: image caches; the output is the image rows of the prediction.
IDEOGRAM4_TRANSFORMER = ModelDecl(
    "transformer", (HIDDEN_STATES, ENCODER_HIDDEN_STATES, ENCODER_ATTENTION_MASK, TIMESTEP,
                    IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE), (SAMPLE,))

#: One block list, ``layers`` (the config's ``num_layers``), each block returning the joined
#: ``[text; image]`` stream.
IDEOGRAM4_BLOCKS = (BlockList("layers", "num_layers", ("joined",)),)

#: Pairs per head of diffusers' default config (head_dim 256): the cache's "axes" are one pair
#: each (see the module docstring).
PAIRS = 128

#: The node at 2048 x 2048 (the pipeline's default: 16384 image tokens; 18 heads x 256, NeoX
#: pairing): the conditional call (2048 text-region tokens + the image) and the unconditional
#: one (the image alone); planned in the export's rounding and the one-rounding mode (the plan
#: prices NeoX pairing per token: qknorm_rope_plan.h kFastNeoxPerToken).
LAUNCHES = tuple(Launch("Ideogram 4", stream, seq, 18, head_dim=256, interleaved=False,
                        batches=(1,), roundings=(contract.ROUNDING_EACH_STEP, 0))
                 for stream, seq in (("joint 2048+16384", 2048 + 16384),
                                     ("image 16384", 16384)))

IDEOGRAM4 = FamilyRecord(
    name="ideogram4", class_name="Ideogram4Transformer2DModel", label="Ideogram 4",
    short="Ideogram 4", package="ideogram4", scheme="ids", axes=(2,) * PAIRS, theta=5_000_000,
    theta_key="rope_theta", max_positions=None, rounding=contract.ROUNDING_EACH_STEP,
    graph=IDEOGRAM4_TRANSFORMER,
    fp8_excluded=("input_proj", "llm_cond_proj", "t_embedding", "adaln_proj", "final_layer"),
    blocks=True, block_lists=IDEOGRAM4_BLOCKS, launches=LAUNCHES)

RECORDS = (IDEOGRAM4,)
