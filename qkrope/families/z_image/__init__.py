"""Z-Image (diffusers' ZImageTransformer2DModel: Z-Image, Z-Image-Turbo): the record.
Facts only; the hooks are export.py, reference.py and dropin.py beside this file.

The graph takes what one call of equal-positioned samples needs (docs/spec.md section 6c): the
patchified latent tokens, the caption features padded to the batch's caption length (a
multiple of 32) with a mask of the real ones, the timestep and the two 2-D caches. Samples
whose padded captions differ in length (CFG's negative prompt) have different positions; the
drop-in runs them as separate calls, one per caption length.
"""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import BlockList, FamilyRecord, Launch
from qkrope.stages import PipelineStages, TextEncoderStage, VaeStage
from qkrope.model_io import (BATCH, ENCODER_HIDDEN_STATES, HIDDEN_STATES, IMG_COS_SIN_CACHE,
                             SAMPLE, TIMESTEP, TXT_COS_SIN_CACHE, TXT_TOKENS, ModelDecl,
                             TensorDecl)

#: Z-Image's caption mask: not an attention mask. False marks a caption pad token, which the
#: model replaces with its learned cap_pad_token and still attends to (diffusers pads each
#: caption to a multiple of 32 that way).
CAPTION_MASK = TensorDecl(
    "encoder_hidden_states_mask", "encoder_hidden_states_mask", (BATCH, TXT_TOKENS),
    "caption mask, bool [batch, txt_tokens]: True = a real caption token, False = a pad token "
    "(replaced by the model's cap_pad_token and attended, as diffusers pads captions to a "
    "multiple of 32)")

#: The graph: Qwen-Image's inputs in the same order, with the caption mask's meaning above.
Z_IMAGE_TRANSFORMER = ModelDecl(
    "transformer",
    (HIDDEN_STATES, ENCODER_HIDDEN_STATES, CAPTION_MASK, TIMESTEP, IMG_COS_SIN_CACHE,
     TXT_COS_SIN_CACHE),
    (SAMPLE,))

#: FP8's default exclusions: the latent-patch and caption embedders, the timestep embedder and
#: the final layer (AdaLN + output projection), as for the other families.
FP8_EXCLUDED = ("all_x_embedder", "cap_embedder", "t_embedder", "all_final_layer")

#: The caption and image token counts diffusers pads each sample to a multiple of.
SEQ_MULTIPLE = 32

#: The node launches at 1024x1024 (4096 image tokens), 30 heads x 128, interleaved pairs at
#: full rotary width: the noise refiner's image sequence, the context refiner's caption (the
#: pipelines' max_sequence_length, 512) and a main block's [image; caption]; batch 1 and 2
#: (CFG's two samples are one call when their captions pad alike, else two); planned in the
#: export's rounding (1, diffusers' order) and the one-rounding mode.
LAUNCHES = tuple(Launch("Z-Image", stream, seq, 30, roundings=(contract.ROUNDING_EACH_STEP, 0))
                 for stream, seq in (("image 4096", 4096), ("caption 512", 512),
                                     ("joint 4096+512", 4096 + 512)))

# diffusers' RMSNorm (the attentions' norm_q / norm_k: the normalised value rounded, then
# multiplied by the weight in the activation dtype) and a complex64 rotation in fp32: the order
# of Qwen-Image's, so rounding 1 is bit-exact with the stock model in bf16/fp16. The RoPE
# tables (RopeEmbedder) are looked up by integer position ids: the "table" scheme. Every
# attention (noise refiner, context refiner, main layers) rotates. Its block lists in execution
# order: the noise refiner (image tokens, padded to a multiple of 32), the context refiner
# (caption tokens) and the main layers over one [image; caption] stream ("joined": the image
# first here, the order diffusers' _build_unified_sequence concatenates in); each block returns
# that one tensor. --layers K keeps the first K of them in that order (K <= 2 * n_refiner_layers
# runs no main layer: the final layer then reads the refined image tokens, as diffusers'
# forward does with the later blocks passing their stream through); --blocks compares each
# block's output.
#: ZImagePipeline's other stages: the Qwen3 text encoder's second-to-last hidden state (the
#: pipeline's chat template and mask stay in its Python); the 2-D AutoencoderKL, its encoder
#: for image to image.
STAGES = PipelineStages(
    pipelines=("ZImagePipeline",),
    text_encoders={"text_encoder": TextEncoderStage(reads=("hidden_states[-2]",))},
    vae=VaeStage("image", encode=("ZImageImg2ImgPipeline",)))
Z_IMAGE = FamilyRecord(
    name="z-image", class_name="ZImageTransformer2DModel", label="Z-Image (and Z-Image-Turbo)",
    short="Z-Image", package="z_image", scheme="table", axes=(32, 48, 48), theta=256,
    theta_key="rope_theta", max_positions=None, rounding=contract.ROUNDING_EACH_STEP,
    graph=Z_IMAGE_TRANSFORMER, fp8_excluded=FP8_EXCLUDED, blocks=True, blocks_key="n_layers",
    block_lists=(BlockList("noise_refiner", "n_refiner_layers", ("img",)),
                 BlockList("context_refiner", "n_refiner_layers", ("txt",)),
                 BlockList("layers", "n_layers", ("joined",))),
    launches=LAUNCHES, rope_rule="setting_fields", stages=STAGES)

#: diffusers' default ``axes_lens``: the rows of each axis' RoPE table.
AXES_LENS = (1024, 512, 512)


def setting_fields(config) -> dict:
    """The Setting fields of a model with this diffusers ``config``: its tables' lengths
    (``axes_lens``), which bound every position on the local path and in the Triton rope model
    (:func:`qkrope.runtime.schemes.table.check_lengths`)."""
    return {"table_lengths": tuple(int(v) for v in config.get("axes_lens") or AXES_LENS)}


RECORDS = (Z_IMAGE,)
