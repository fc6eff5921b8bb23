"""LongCat-Image (diffusers' LongCatImageTransformer2DModel, and LongCat-Image-Edit): the record. A
dual-stream transformer with FLUX.1's blocks, attention layout and position embedder (theta
10000 fixed in diffusers' code), a plain timestep embedding (no pooled text, no guidance) and
its own id layout. Facts only: its record's dual_stream gives it the shared dual-stream export,
reference and drop-in hooks (qkrope.families._dual_stream.SHARED_HOOKS); tiny.py is its own."""

from __future__ import annotations

from qkrope import contract
from qkrope.families._dual_stream import DualStream, IdsLayout, launches
from qkrope.families._record import DOUBLE_THEN_SINGLE_BLOCKS, FamilyRecord
from qkrope.model_io import (ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE,
                             TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the activations, the timestep and the two caches in place of txt_ids/img_ids.
GRAPH = ModelDecl("transformer", (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP,
                                  IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE), (SAMPLE,))

#: How it differs as a dual-stream transformer: temb = time_embed(timestep, dtype); its
#: pipelines put the text at (0, i, i), the output image at (1, 512 + row, 512 + column) (the
#: tokenizer's 512 tokens before it; the edit pipeline's reference image at first axis 2);
#: diffusers' forward takes guidance and ignores it, and so does the drop-in.
DUAL_STREAM = DualStream(
    temb="time_embed",
    ids=IdsLayout(n_axes=3, image_step=1, text_axes=(1, 2), image_first=1, image_offset=512),
    forward_args=("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids",
                  "guidance", "return_dict"),
    pipelines="LongCatImagePipeline, LongCatImageEditPipeline")

#: LongCat-Image at 1024 x 1024: 24 heads x 128 (FLUX.1's), 4096 image tokens, the pipelines'
#: 512 text tokens, a single-stream block's joined 4608; batch 1 and 2 (CFG's two calls).
LAUNCHES = launches("LongCat-Image", 24)

# torch's RMSNorm then diffusers' apply_rotary_emb in fp32: rounded twice, as FLUX.1.
LONGCAT_IMAGE = FamilyRecord(
    name="longcat-image", class_name="LongCatImageTransformer2DModel",
    label="LongCat-Image (and Edit)", short="LongCat-Image", package="longcat_image",
    scheme="ids", axes=(16, 56, 56), theta=10000, theta_key=None, max_positions=None,
    rounding=contract.ROUNDING_TWO_STEPS, graph=GRAPH,
    fp8_excluded=("x_embedder", "context_embedder", "time_embed", "norm_out", "proj_out"),
    blocks=True, block_lists=DOUBLE_THEN_SINGLE_BLOCKS, launches=LAUNCHES,
    dual_stream=DUAL_STREAM)

RECORDS = (LONGCAT_IMAGE,)
