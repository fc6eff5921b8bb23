"""HunyuanImage-2.1 (diffusers' HunyuanImageTransformer2DModel, with its
HunyuanImageRotaryPosEmbed): the record. Facts only; the hooks are export.py, reference.py and
dropin.py beside this file."""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.stages import PipelineStages, TextEncoderStage, VaeStage
from qkrope.model_io import (ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_MASK, GUIDANCE,
                             HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE, TIMESTEP,
                             TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the latent's patches as tokens (the drop-in packs the pipelines' [B, C, H, W] or
#: [B, C, F, H, W] latent, and unpacks the sample, exactly as the model's patch embedding and
#: unpatchify order them), the Qwen2.5-VL text and its mask, the timestep, the distilled
#: guidance where the config has guidance_embeds, and the two caches (the text's identity rows);
#: a model with the byT5 branch also takes the glyph tokens and their mask after the text mask
#: (export.graph_decl).
HUNYUAN_IMAGE_TRANSFORMER = ModelDecl(
    "transformer",
    (HIDDEN_STATES, ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_MASK, TIMESTEP, GUIDANCE,
     IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
    (SAMPLE,))

#: FP8's default exclusions: the patch embedding, the text token refiner and the byT5
#: projection, the timestep/guidance embedding, the final AdaLN and the output projection.
FP8_EXCLUDED = ("x_embedder", "context_embedder", "context_embedder_2", "time_guidance_embed",
                "norm_out", "proj_out")

#: The node launches of HunyuanImage-2.1 (28 heads x 128, interleaved pairs at full rotary
#: width) at its native 2048x2048 (a 32x VAE, 1x1 patches: 64 x 64 = 4096 image tokens) and at
#: 1024x1024 (1024), with the pipeline's 1000 Qwen2.5-VL text tokens (padded to max_length):
#: a double-stream block's image and text nodes, a single-stream block's joined node; batch 1
#: and 2; planned in diffusers' order (1) and the one-rounding mode.
LAUNCHES = tuple(
    Launch("HunyuanImage-2.1", stream, seq, 28, roundings=(contract.ROUNDING_EACH_STEP, 0))
    for stream, seq in (("image 2048x2048", 4096), ("image 1024x1024", 1024), ("text 1000", 1000),
                        ("single 4096+1000", 4096 + 1000)))

# diffusers' RMSNorm (norm_q/norm_k: x * inv rounded, then * w) and its real-valued
# apply_rotary_emb in fp32: the Qwen-Image order of the node (contract.ROUNDING_EACH_STEP),
# bit-exact in bf16/fp16. The text is normalised (norm_added_q/k, and the single-stream
# blocks' norm over [image; text]) but not rotated: identity cache rows. A 32x VAE and 1x1
# patches: 32 pixels per token side. --layers K keeps the first K blocks in execution order
# (double-stream transformer_blocks, then single-stream single_transformer_blocks; the token
# refiner, the embeddings, norm_out and proj_out are outside the block lists and always kept);
# --blocks compares each block's image and text outputs: both kinds of block return
# (hidden_states, encoder_hidden_states), the single-stream ones splitting their
# [image; text] sequence back into the two streams.
#: HunyuanImagePipeline's other stages: the Qwen2.5-VL encoder's third-to-last hidden state
#: (hidden_state_skip_layer 2), called with the ids and mask at 1000 tokens plus the 34 of the
#: template prefix the pipeline drops; ByT5 (a T5 encoder) for the quoted glyph text, its last
#: hidden state at 128 tokens; the 2-D AutoencoderKLHunyuanImage's decoder (32x, 2048 x 2048 by
#: default). The refiner's pipeline encodes the image and reads its encoder otherwise: not
#: declared.
STAGES = PipelineStages(
    pipelines=("HunyuanImagePipeline",),
    text_encoders={"text_encoder": TextEncoderStage(reads=("hidden_states[-3]",), tokens=1034),
                   "text_encoder_2": TextEncoderStage(reads=("last_hidden_state",),
                                                      tokens=128)},
    vae=VaeStage("image"), size=(2048, 2048))
HUNYUAN_IMAGE = FamilyRecord(
    name="hunyuan-image", class_name="HunyuanImageTransformer2DModel",
    label="HunyuanImage-2.1 (and its refiner)", short="HunyuanImage-2.1",
    package="hunyuan_image", scheme="patch-grid", axes=(64, 64),
    theta=256, theta_key="rope_theta", max_positions=None,
    rounding=contract.ROUNDING_EACH_STEP, graph=HUNYUAN_IMAGE_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True,
    block_lists=(BlockList("transformer_blocks", "num_layers", ("img", "txt")),
                 BlockList("single_transformer_blocks", "num_single_layers", ("img", "txt"))),
    pixels_per_token=32, rotated=("img",), launches=LAUNCHES, stages=STAGES)

RECORDS = (HUNYUAN_IMAGE,)
