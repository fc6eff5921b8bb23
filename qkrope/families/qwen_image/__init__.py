"""Qwen-Image (diffusers' QwenImageTransformer2DModel, with its QwenEmbedRope): the record.
Facts only; the hooks are export.py, reference.py and dropin.py beside this file."""

from __future__ import annotations

from qkrope.families._record import FamilyRecord, Launch
from qkrope.model_io import ATTENTION_BLOCK, TRANSFORMER
from qkrope.stages import PipelineStages, TextEncoderStage, VaeStage

#: Top-level modules TensorRT's diffusion demo leaves in high precision: the default of
#: `qkrope quantize --exclude` for a Qwen-Image transformer.
FP8_EXCLUDED = ("img_in", "txt_in", "time_text_embed", "norm_out", "proj_out")

#: The node launches of one block: one per stream, 24 heads x 128, interleaved at full rotary
#: width; image tokens (resolution / 16)^2 at 512, 1024 and 1328 pixels, text 512 tokens; batch 1
#: and 2; planned in the export's default rounding (0) and diffusers' order (1).
LAUNCHES = tuple(
    Launch("Qwen-Image", f"image {res}x{res}", (res // 16) ** 2, ATTENTION_BLOCK.heads,
           ATTENTION_BLOCK.head_dim, roundings=(0, 1)) for res in (512, 1024, 1328)
) + (Launch("Qwen-Image", "text 512", 512, ATTENTION_BLOCK.heads, ATTENTION_BLOCK.head_dim,
            roundings=(0, 1)),)

#: QwenImagePipeline's other stages: the Qwen2.5-VL text encoder's last hidden state (the
#: pipeline's template and its dropped 34-token prefix stay in the pipeline's Python), and the
#: causal video VAE (one latent frame per image), its encoder for image to image.
STAGES = PipelineStages(
    pipelines=("QwenImagePipeline",),
    # max_sequence_length 512 plus the 34-token template prefix the pipeline drops after the call
    text_encoders={"text_encoder": TextEncoderStage(reads=("hidden_states[-1]",),
                                                    tokens=512 + 34)},
    vae=VaeStage("causal-video", encode=("QwenImageImg2ImgPipeline",)))

QWEN_IMAGE_RECORD = FamilyRecord(
    name="qwen-image", class_name="QwenImageTransformer2DModel",
    label="Qwen-Image (and Qwen-Image-Edit)", short="Qwen-Image", package="qwen_image",
    scheme="grid", axes=ATTENTION_BLOCK.axes_dims_rope, theta=ATTENTION_BLOCK.theta, theta_key=None,
    max_positions=ATTENTION_BLOCK.max_positions, rounding=0, graph=TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True, launches=LAUNCHES, stages=STAGES)

RECORDS = (QWEN_IMAGE_RECORD,)
