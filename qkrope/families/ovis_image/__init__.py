"""Ovis-Image (diffusers' OvisImageTransformer2DModel): the record. A dual-stream transformer with
FLUX.1's block layout, attention layout and position embedder (theta 10000 fixed in diffusers'
code), SwiGLU feed-forwards, a plain timestep embedding and an RMSNorm on the text before its
embedder. Facts only: its record's dual_stream gives it the shared dual-stream export, reference
and drop-in hooks (qkrope.families._dual_stream.SHARED_HOOKS); tiny.py is its own."""

from __future__ import annotations

from qkrope import contract
from qkrope.families._dual_stream import DualStream, IdsLayout, launches
from qkrope.families._record import DOUBLE_THEN_SINGLE_BLOCKS, FamilyRecord
from qkrope.stages import PipelineStages, TextEncoderStage, VaeStage
from qkrope.model_io import (ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE,
                             TIMESTEP, TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the activations, the timestep and the two caches in place of txt_ids/img_ids.
GRAPH = ModelDecl("transformer", (HIDDEN_STATES, ENCODER_HIDDEN_STATES, TIMESTEP,
                                  IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE), (SAMPLE,))

#: How it differs as a dual-stream transformer: temb = timestep_embedder(time_proj(timestep)),
#: context_embedder_norm before the text embedder; its pipeline puts the text at (0, i, i) and
#: the image at (0, row, column).
DUAL_STREAM = DualStream(
    temb="time_proj", context_norm="context_embedder_norm",
    ids=IdsLayout(n_axes=3, image_step=1, text_axes=(1, 2)),
    forward_args=("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids",
                  "joint_attention_kwargs", "return_dict"),
    pipelines="OvisImagePipeline")

#: Ovis-Image 7B at 1024 x 1024: 24 heads x 128, 4096 image tokens, the pipeline's 256 text
#: tokens (max_sequence_length), a single-stream block's joined 4352; batch 1 and 2.
LAUNCHES = launches("Ovis-Image", 24, text=256)

# torch's RMSNorm then diffusers' apply_rotary_emb in fp32: rounded twice, as FLUX.1.
#: OvisImagePipeline's other stages: its text encoder's last hidden state over
#: max_sequence_length 256 plus the 28 template tokens the pipeline drops after the call; the
#: 2-D AutoencoderKL.
STAGES = PipelineStages(
    pipelines=("OvisImagePipeline",),
    text_encoders={"text_encoder": TextEncoderStage(reads=("last_hidden_state",), tokens=256 + 28)},
    vae=VaeStage("image"))

OVIS_IMAGE = FamilyRecord(
    name="ovis-image", class_name="OvisImageTransformer2DModel", label="Ovis-Image",
    short="Ovis-Image", package="ovis_image", scheme="ids", axes=(16, 56, 56), theta=10000,
    theta_key=None, max_positions=None, rounding=contract.ROUNDING_TWO_STEPS, graph=GRAPH,
    fp8_excluded=("x_embedder", "context_embedder", "timestep_embedder", "norm_out",
                  "proj_out"),
    blocks=True, block_lists=DOUBLE_THEN_SINGLE_BLOCKS, launches=LAUNCHES,
    dual_stream=DUAL_STREAM, stages=STAGES)

RECORDS = (OVIS_IMAGE,)
