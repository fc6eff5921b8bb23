"""The tiny random Z-Image pipeline (tiny hook: :func:`save_pipeline`), built in code: diffusers'
own test transformer (tests/pipelines/z_image: 2 + 1 + 1 blocks x 2 heads x 16, RoPE axes
(8, 4, 4), tables (256, 32, 32); the tests' tiny Z-Image, read from here by tests/_families.py),
a two-level AutoencoderKL of 16 latent channels, and ZImagePipeline's Qwen3 encoder as a random
2-layer Qwen3Model of width 16 (the pipeline reads its second-to-last hidden state) with a
byte-level tokenizer and a ChatML chat template."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_parts import saved
from qkrope.apps.tiny_pipeline import (CHATML_TEMPLATE, byte_tokenizer, decoder_encoder,
                                       randomised)

#: diffusers' Z-Image test config (tests/pipelines/z_image/test_z_image.py)
Z_IMAGE_CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                      n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5,
                      qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
                      axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])


def z_image_transformer(seed: int = 0):
    """The tiny Z-Image transformer (the pad tokens random too)."""
    diffusers = require("diffusers", "the tiny Z-Image pipeline")
    return randomised(diffusers.ZImageTransformer2DModel(**Z_IMAGE_CONFIG), seed)


def vae():
    """diffusers' Z-Image pipeline-test VAE: two levels (vae_scale_factor 2), 16 channels."""
    diffusers = require("diffusers", "the tiny Z-Image pipeline")
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[32, 64],
        layers_per_block=1, latent_channels=16, norm_num_groups=32, sample_size=32,
        scaling_factor=0.3611, shift_factor=0.1159).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny ZImagePipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny Z-Image pipeline")
    require("transformers", "the tiny Z-Image pipeline's text encoder")
    from transformers import Qwen3Config, Qwen3Model

    tok = byte_tokenizer(chat_template=CHATML_TEMPLATE)
    encoder = decoder_encoder(Qwen3Config, Qwen3Model, tok, Z_IMAGE_CONFIG["cap_feat_dim"],
                              layers=2, seed=seed, head_dim=8)
    pipe = diffusers.ZImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(), text_encoder=encoder,
        tokenizer=tok, transformer=z_image_transformer(seed))
    return saved(pipe, directory)
