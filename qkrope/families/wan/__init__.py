"""Wan 2.1 / 2.2 (diffusers' WanTransformer3DModel, with its WanRotaryPosEmbed): the record.
Facts only; the hooks are export.py, reference.py and dropin.py beside this file.

Wan normalises q and k with one ``torch.nn.RMSNorm(heads * head_dim)`` over the token's flat
row before the head split: the node's ``norm_scope`` 1 (qkrope.contract.NORM_SCOPE_ROW,
docs/spec.md section 3.2), with FLUX's rounding order (torch's RMSNorm rounds once, the fp32
rotation again): bit-exact with the stock attention in bf16/fp16. Its RoPE is a (frame, row,
column) grid from 0, not centred, computed in float64 (``get_1d_rotary_pos_embed(...,
freqs_dtype=float64)``) over tables of ``rope_max_seq_len`` positions: the "grid" scheme with
``scale_rope=False`` and float64 tables. The text is not rotated (cross-attention ``attn2`` has
no RoPE): the graph has no text cache input.

Derivatives: the folder runs Wan 2.1 T2V (1.3B, 14B), Wan 2.2 T2V-A14B and I2V-A14B (both
experts) and TI2V-5B text-to-video. Refused in one line: VACE (WanVACETransformer3DModel),
Animate (WanAnimateTransformer3DModel) and SkyReels-V2 (SkyReelsV2Transformer3DModel) by their
class (the registry's list), Wan 2.1 I2V / FLF2V's CLIP image branch (image_dim) by the config
check, TI2V-5B's image-to-video (per-token timesteps) by the drop-in.
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE,
                             TIMESTEP, ModelDecl)

#: Wan's graph: the latent's patches packed as tokens (hidden_states [batch, img_tokens,
#: in_channels * pt * ph * pw], each patch in (channel, t, h, w) order, the Conv3d weight's),
#: the text embeddings, the timestep (float32, as the pipelines pass it) and the image cache;
#: the output is the packed prediction [batch, img_tokens, pt * ph * pw * out_channels] (each
#: patch in (t, h, w, channel) order: diffusers' unpatchify). The drop-in packs and unpacks.
WAN_TRANSFORMER = ModelDecl("transformer",
                            (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP, IMG_COS_SIN_CACHE),
                            (SAMPLE,))

#: FP8's default exclusions: the patch embedding, the timestep/text(/image) embedder, the final
#: AdaLN's projection (TensorRT's Wan demo keeps the embedders and the head in high precision).
FP8_EXCLUDED = ("patch_embedding", "condition_embedder", "proj_out")

# The kernel launches of Wan's fused node (issue 33 item 2): one row-scope node per block, q
# and k of [batch, tokens, heads, 128], rounding 2, norm_scope 1. Wan's pipelines run the
# conditional and unconditional predictions as two calls of batch 1. Tokens per launch: 720p
# (1280 x 720) at 81 frames is 21 latent frames x 45 x 80 patches = 75,600; 480p (832 x 480)
# at 81 frames 21 x 30 x 52 = 32,760; TI2V-5B's 704 x 1280 at 121 frames (16x VAE) 31 x 22 x
# 40 = 27,280.
WAN_LAUNCHES = (
    Launch("Wan 2.1/2.2 14B 720p 81f", "video 75600", 75600, 40, batches=(1,), roundings=(2,),
           norm_scope=1),
    Launch("Wan 2.1/2.2 14B 480p 81f", "video 32760", 32760, 40, batches=(1,), roundings=(2,),
           norm_scope=1),
    Launch("Wan 2.1 1.3B 480p 81f", "video 32760", 32760, 12, batches=(1,), roundings=(2,),
           norm_scope=1),
    Launch("Wan 2.2 TI2V-5B 720p 121f", "video 27280", 27280, 24, batches=(1,),
           roundings=(2,), norm_scope=1),
)

#: diffusers' WanRotaryPosEmbed: theta fixed at 10000, tables of rope_max_seq_len positions
#: (1024 in every released config); axes for head_dim 128: frames 44, rows 42, columns 42
#: (h = w = 2 * (head_dim // 6), t the rest: :func:`wan_axes`). One block list, ``blocks`` (its
#: length the config's num_layers), each ``WanTransformerBlock`` returning the video tokens
#: alone (hidden_states; the text is read by the cross-attention, never changed): --layers
#: keeps the first blocks, --blocks compares each one's output, the check's reference streams
#: one block at a time. Wan 2.2's second expert is its own folder and export.
WAN = FamilyRecord(
    name="wan", class_name="WanTransformer3DModel",
    label="Wan 2.1 / 2.2 (T2V 1.3B / 14B, T2V-A14B, I2V-A14B, TI2V-5B)", short="Wan",
    package="wan", scheme="grid", axes=(44, 42, 42), theta=10000, theta_key=None,
    max_positions=1024, rounding=contract.ROUNDING_FLUX, graph=WAN_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=(BlockList("blocks", "num_layers", ("img",)),), rotated=("img",),
    scale_rope=False, launches=WAN_LAUNCHES,
    rope_precision="float64", max_positions_key="rope_max_seq_len")


def wan_axes(head_dim: int) -> tuple:
    """The (frames, rows, columns) RoPE widths of a head_dim, as WanRotaryPosEmbed splits it."""
    h = w = 2 * (int(head_dim) // 6)
    return (int(head_dim) - h - w, h, w)


RECORDS = (WAN,)
