"""HunyuanImage-2.1 (diffusers' HunyuanImageTransformer2DModel, with its
HunyuanImageRotaryPosEmbed): the record. Facts only; the hooks are export.py, reference.py and
dropin.py beside this file."""

from __future__ import annotations

from qkrope import contract
from qkrope.families._record import FamilyRecord
from qkrope.model_io import (ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_MASK, GUIDANCE,
                             HIDDEN_STATES, IMG_COS_SIN_CACHE, SAMPLE, TIMESTEP,
                             TXT_COS_SIN_CACHE, ModelDecl)

#: The graph: the latent's patches as tokens (the drop-in packs the pipelines' [B, C, H, W] or
#: [B, C, F, H, W] latent, and unpacks the sample, exactly as the model's patch embedding and
#: unpatchify order them), the Qwen2.5-VL text and its mask, the timestep, the distilled
#: guidance where the config has guidance_embeds, and the two caches (the text's identity rows).
HUNYUAN_IMAGE_TRANSFORMER = ModelDecl(
    "transformer",
    (HIDDEN_STATES, ENCODER_HIDDEN_STATES, ENCODER_HIDDEN_STATES_MASK, TIMESTEP, GUIDANCE,
     IMG_COS_SIN_CACHE, TXT_COS_SIN_CACHE),
    (SAMPLE,))

#: FP8's default exclusions: the patch embedding, the text token refiner and the byT5
#: projection, the timestep/guidance embedding, the final AdaLN and the output projection.
FP8_EXCLUDED = ("x_embedder", "context_embedder", "context_embedder_2", "time_guidance_embed",
                "norm_out", "proj_out")

# diffusers' RMSNorm (norm_q/norm_k: x * inv rounded, then * w) and its real-valued
# apply_rotary_emb in fp32: the Qwen-Image order of the node (contract.ROUNDING_DIFFUSERS),
# bit-exact in bf16/fp16. The text is normalised (norm_added_q/k, and the single-stream
# blocks' norm over [image; text]) but not rotated: identity cache rows. A 32x VAE and 1x1
# patches: 32 pixels per token side. --layers/--blocks do not apply (every double- and
# single-stream block is kept).
HUNYUAN_IMAGE = FamilyRecord(
    name="hunyuan-image", class_name="HunyuanImageTransformer2DModel",
    label="HunyuanImage-2.1 (and its refiner)", short="HunyuanImage-2.1",
    package="hunyuan_image", scheme="patch-grid", axes=(64, 64),
    theta=256, theta_key="rope_theta", max_positions=None,
    rounding=contract.ROUNDING_DIFFUSERS, graph=HUNYUAN_IMAGE_TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=False, pixels_per_token=32, rotated=("img",),
    axes_key="rope_axes_dim")

RECORDS = (HUNYUAN_IMAGE,)
