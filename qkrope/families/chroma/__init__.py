"""Chroma (diffusers' ChromaTransformer2DModel: FLUX.1's attention code, FluxAttention with
FluxAttnProcessor and FluxPosEmbed, modulated by one approximator network, with a text padding
mask): the record. Facts only; the hooks are export.py, reference.py and dropin.py beside this
file."""

from __future__ import annotations

from qkrope import contract
from qkrope.families._dual_stream import DualStream, IdsLayout, launches
from qkrope.families._record import DOUBLE_THEN_JOINED_BLOCKS, FamilyRecord
from qkrope.stages import PipelineStages, TextEncoderStage, VaeStage
from qkrope.model_io import (BATCH, ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE,
                             SAMPLE, TIMESTEP, TXT_COS_SIN_CACHE, TXT_TOKENS, ModelDecl,
                             TensorDecl)

#: Chroma's text mask as the graph takes it: the text part of the ``attention_mask`` its
#: pipelines pass, in the model's float dtype, added to the attention scores as diffusers' SDPA
#: adds a float mask (name, role and axes of model_io's ENCODER_HIDDEN_STATES_MASK; only the
#: dtype and so the meaning differ: docs/spec.md, "Chroma's attention mask").
CHROMA_TEXT_MASK = TensorDecl(
    "encoder_hidden_states_mask", "encoder_hidden_states_mask", (BATCH, TXT_TOKENS),
    "text mask, [batch, txt_tokens] in the model's float dtype: the text part of the "
    "attention_mask the Chroma pipelines pass (1 = a prompt token or its first padding token, "
    "0 = the other padding); the graph adds mask_i * mask_j to the attention scores of tokens "
    "i and j (image tokens 1), as diffusers' SDPA adds a float mask")

#: The Chroma transformer's graph: FLUX.1's inputs less pooled_projections and guidance (the
#: approximator makes the modulations from the timestep alone), the two caches in place of
#: txt_ids/img_ids, and the text mask.
CHROMA_TRANSFORMER = ModelDecl("transformer",
                               (HIDDEN_STATES, ENCODER_HIDDEN_STATES, CHROMA_TEXT_MASK, TIMESTEP,
                                IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
                               (SAMPLE,))

#: FP8's default exclusions: the image and text embedders, the approximator that turns the
#: timestep into every block's shift, scale and gate once per step (batch-many rows: FP8 would
#: save nothing and its error would reach every block, as FLUX.2's shared modulations) and the
#: output projection. time_text_embed and norm_out have no weights.
FP8_EXCLUDED = ("x_embedder", "context_embedder", "distilled_guidance_layer", "proj_out")

#: The node launches of Chroma1-HD at 1024 x 1024 (24 heads x 128, interleaved pairs at full
#: rotary width, as FLUX.1): a double-stream block's 4096 image tokens and the pipelines' 512
#: text tokens (the prompt is always padded to max_sequence_length=512, the mask drops the
#: padding in the scores, not in the launch) as two nodes, a single-stream block's joined 4608;
#: batch 1 and 2 (CFG runs its two predictions as separate calls); planned in FLUX's eager
#: order (2) and the one-rounding mode.
LAUNCHES = launches("Chroma1-HD", 24)

# FLUX.1's attention and norms (torch's RMSNorm, rotation in fp32): FLUX's eager order,
# bit-exact in bf16/fp16 (qkrope.contract.ROUNDING_TWO_STEPS). FluxPosEmbed(theta=10000) is fixed
# in diffusers' code; positions are ids (no table, no limit). --layers K keeps the first K
# blocks in execution order (double-stream, then single-stream) with the whole model's
# modulation rows (diffusers' forward finds a block's rows at offsets counted from every block:
# 3 * single + 6 * double + 6 * i); --blocks compares each block's image and text outputs, or
# the joined stream its single-stream blocks return.
#: ChromaPipeline's other stages: T5's last hidden state, called with the ids and the mask
#: (``[0]`` of the call); the 2-D AutoencoderKL.
STAGES = PipelineStages(
    pipelines=("ChromaPipeline",),
    text_encoders={"text_encoder": TextEncoderStage(reads=("last_hidden_state",))},
    vae=VaeStage("image"))
CHROMA = FamilyRecord(
    name="chroma", class_name="ChromaTransformer2DModel", label="Chroma (Chroma1-HD, Base)",
    short="Chroma", package="chroma", scheme="ids", axes=(16, 56, 56), theta=10000,
    theta_key=None, max_positions=None, rounding=contract.ROUNDING_TWO_STEPS,
    graph=CHROMA_TRANSFORMER, fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=DOUBLE_THEN_JOINED_BLOCKS, launches=LAUNCHES, stages=STAGES)

RECORDS = (CHROMA,)

#: Chroma as a dual-stream transformer (qkrope.families._dual_stream): its own blocks (the
#: approximator's modulation rows, single-stream blocks over the joined sequence: the export's
#: own wrapper), FLUX.1's ids (text at 0, a further image at first axis k), no guidance.
DUAL_STREAM = DualStream(
    temb="time_text_embed", ids=IdsLayout(n_axes=3, image_step=1), single_pair=False,
    forward_args=("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids",
                  "attention_mask", "joint_attention_kwargs", "controlnet_block_samples",
                  "controlnet_single_block_samples", "return_dict", "controlnet_blocks_repeat"),
    pipelines="ChromaPipeline, ChromaImg2ImgPipeline, ChromaInpaintPipeline")
