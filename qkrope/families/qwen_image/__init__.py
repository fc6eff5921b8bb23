"""Qwen-Image (diffusers' QwenImageTransformer2DModel, with its QwenEmbedRope): the record.
Facts only; the hooks are export.py, reference.py and dropin.py beside this file."""

from __future__ import annotations

from qkrope.families._record import FamilyRecord
from qkrope.model_io import QWEN_IMAGE, TRANSFORMER

#: Top-level modules TensorRT's diffusion demo leaves in high precision: the default of
#: `qkrope quantize --exclude` for a Qwen-Image transformer.
FP8_EXCLUDED = ("img_in", "txt_in", "time_text_embed", "norm_out", "proj_out")

QWEN_IMAGE_RECORD = FamilyRecord(
    name="qwen-image", class_name="QwenImageTransformer2DModel",
    label="Qwen-Image (and Qwen-Image-Edit)", short="Qwen-Image", package="qwen_image",
    scheme="grid", axes=QWEN_IMAGE.axes_dims_rope, theta=QWEN_IMAGE.theta, theta_key=None,
    max_positions=QWEN_IMAGE.max_positions, rounding=0, graph=TRANSFORMER,
    fp8_excluded=FP8_EXCLUDED, blocks=True)

RECORDS = (QWEN_IMAGE_RECORD,)
