"""JoyImage Edit (diffusers' JoyImageEditTransformer3DModel): the record. Facts only; the hooks
are export.py, reference.py, dropin.py and tiny.py beside this file.

The model takes the 5-D latent ``[batch, channels, frames, height, width]`` (the edit
pipeline's 6-D ``[batch, items, channels, frames, height, width]`` is the same latent with its
items laid along the frames, the target first: the drop-in does that reshape) and patchifies it
with a Conv3d. Its blocks are double-stream: each stream has its own fused QKV projection and
per-head ``torch.nn.RMSNorm`` q/k norms, the joint sequence is ``[latent; text]``. RoPE: the
latent's own token grid (frame, row, column from 0: the "grid" scheme uncentred) over
``rope_dim_list`` (16, 56, 56) with ``theta`` 256, float32 frequencies as HunyuanVideo's, pairs
``(2j, 2j+1)``; the text is normalised but not rotated (``rope_type`` "rope"; "mrope", which
rotates the text after the grid, is refused by the export).

Rounding: ``torch.nn.RMSNorm`` normalises and scales in fp32 and rounds once, the rotation runs
in fp32 and rounds once: contract.ROUNDING_TWO_STEPS, bit-exact in bf16, fp16 and fp32
(tests/test_family_joyimage.py).
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.model_io import (ENCODER_HIDDEN_STATES, IMG_COS_SIN_CACHE, LATENT, LATENT_SAMPLE,
                             TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the 5-D latent, the timestep, the text, the image cache and the text cache
#: (identity rows: the text is not rotated).
JOYIMAGE_TRANSFORMER = ModelDecl(
    "transformer", (LATENT, TIMESTEP, ENCODER_HIDDEN_STATES, IMG_COS_SIN_CACHE,
                    TXT_COS_SIN_CACHE),
    (LATENT_SAMPLE,))

#: FP8's default exclusions: the patch embedder, the condition embedder (timestep and text
#: projection), the final norm and the output projection.
FP8_EXCLUDED = ("img_in", "condition_embedder", "norm_out", "proj_out")

#: The node launches of one block at the edit pipeline's usual size (24 heads x 128; a 1024 x
#: 1024 edit: the 8x VAE and 2x2 patches give 64 x 64 tokens per item, two items: the target and
#: its reference image), the latent stream (rounding 2, the export's, first).
LAUNCHES = (
    Launch("JoyImage Edit", "latent 2 x 1024x1024", 2 * 64 * 64, 24,
           roundings=(contract.ROUNDING_TWO_STEPS, contract.ROUNDING_ONE)),
)

# Two nodes per block (the latent with the image cache, the text with identity rows); one block
# list, double_blocks (num_layers), each returning (latent, text).
JOYIMAGE_EDIT = FamilyRecord(
    name="joyimage-edit", class_name="JoyImageEditTransformer3DModel",
    label="JoyImage Edit (image editing)", short="JoyImage Edit", package="joyimage",
    scheme="grid", axes=(16, 56, 56), theta=256, theta_key="theta", max_positions=1024,
    rounding=contract.ROUNDING_TWO_STEPS, graph=JOYIMAGE_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=(BlockList("double_blocks", "num_layers", ("img", "txt")),),
    rotated=("img",), latent="video-5d", scale_rope=False, launches=LAUNCHES)

RECORDS = (JOYIMAGE_EDIT,)

#: Classes of this lineage refused, with the reason (the registry's REFUSED).
REFUSED = {
    "JoyImageEditPlusTransformer3DModel": (
        "JoyImage Edit-Plus rotates each batch item with its own positions (shape_list: every "
        "sample's target and reference grids, padded to the longest) and masks the padding, "
        "while the node takes one cache per call for the whole batch; serving it needs a drop-in "
        "that splits the batch per shape list and a graph with the text and patch masks"),
}
