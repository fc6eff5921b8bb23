"""The tiny random HunyuanImage-2.1 pipeline (tiny hook: :func:`save_pipeline`), built in code:
diffusers' own test transformer (tests/pipelines/hunyuan_image_21: 4 heads x 8, one double- and
one single-stream block, RoPE axes (4, 4), byT5 projection; the tests' tiny HunyuanImage, read
from here by tests/_families.py), diffusers' pipeline-test AutoencoderKLHunyuanImage (4 latent
channels, 8x), and HunyuanImagePipeline's encoders: a random Qwen2_5_VLForConditionalGeneration
(3 text layers of width 32, the pipeline reads the hidden state 2 layers from the top; a 1-block
vision tower it does not use) with a byte-level tokenizer, and a 1-layer T5EncoderModel of width
32 for the glyph text with transformers' ByT5Tokenizer (it needs no vocabulary file)."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_parts import saved
from qkrope.apps.tiny_pipeline import byte_tokenizer, randomised, t5_encoder

#: diffusers' own test config of HunyuanImage-2.1 (tests/pipelines/hunyuan_image_21)
TRANSFORMER_CONFIG = dict(in_channels=4, out_channels=4, num_attention_heads=4,
                          attention_head_dim=8, num_layers=1, num_single_layers=1,
                          num_refiner_layers=1, patch_size=(1, 1), guidance_embeds=False,
                          text_embed_dim=32, text_embed_2_dim=32, rope_axes_dim=(4, 4))


def hunyuan_image_transformer(seed: int = 0):
    """The tiny transformer, weights redrawn ~ N(0, 0.3^2) (diffusers zeroes some)."""
    diffusers = require("diffusers", "the tiny HunyuanImage-2.1 pipeline")
    torch.manual_seed(seed)
    model = diffusers.HunyuanImageTransformer2DModel(**TRANSFORMER_CONFIG)
    return randomised(model, seed, scale=0.3, vector_scale=None, norms_near_one=False)


def vae():
    diffusers = require("diffusers", "the tiny HunyuanImage-2.1 pipeline")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=TRANSFORMER_CONFIG["in_channels"],
        block_out_channels=(32, 64, 64, 64), layers_per_block=1, scaling_factor=0.476986,
        spatial_compression_ratio=8, sample_size=128).eval()


def text_encoder(tokenizer, seed: int = 0):
    """A random Qwen2_5_VLForConditionalGeneration of the transformer's text width."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    width = TRANSFORMER_CONFIG["text_embed_dim"]
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    text = dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": [4, 2, 2]}, **ids)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                  out_hidden_size=width, fullatt_block_indexes=[0])
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny HunyuanImagePipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny HunyuanImage-2.1 pipeline")
    require("transformers", "the tiny HunyuanImage-2.1 pipeline's text encoders")
    from transformers import ByT5Tokenizer

    tok = byte_tokenizer()
    byt5 = ByT5Tokenizer()
    pipe = diffusers.HunyuanImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(),
        text_encoder=text_encoder(tok, seed), tokenizer=tok,
        text_encoder_2=t5_encoder(byt5, TRANSFORMER_CONFIG["text_embed_2_dim"], seed),
        tokenizer_2=byt5, transformer=hunyuan_image_transformer(seed))
    return saved(pipe, directory)
