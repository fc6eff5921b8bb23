"""The tiny random Ovis-Image pipeline (tiny hook: :func:`save_pipeline`), built in code:
FLUX.1's diffusers test sizes for the transformer (1 + 1 blocks, 2 heads x 16, RoPE axes
(4, 4, 8), text width 32; the tests' tiny Ovis-Image, read from here by tests/_families.py),
a one-level VAE with 1 latent channel (2x2 packing gives the transformer's 4 input channels),
and OvisImagePipeline's Qwen3 text encoder as a random 1-layer Qwen3Model of width 32 with a
byte-level chat tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import (CHATML_TEMPLATE, byte_tokenizer, decoder_encoder,
                                       randomised)

CONFIG = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1,
              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
              axes_dims_rope=[4, 4, 8])


def ovis_transformer(seed: int = 0, **overrides):
    """A tiny random OvisImageTransformer2DModel."""
    diffusers = require("diffusers", "the tiny Ovis-Image pipeline")
    return randomised(diffusers.OvisImageTransformer2DModel(**{**CONFIG, **overrides}), seed)


def vae():
    """A one-level AutoencoderKL (vae_scale_factor 1) with 1 latent channel."""
    diffusers = require("diffusers", "the tiny Ovis-Image pipeline")
    torch.manual_seed(0)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
        layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny OvisImagePipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny Ovis-Image pipeline")
    require("transformers", "the tiny Ovis-Image pipeline's text encoder")
    from transformers import Qwen3Config, Qwen3Model

    tok = byte_tokenizer(chat_template=CHATML_TEMPLATE)
    encoder = decoder_encoder(Qwen3Config, Qwen3Model, tok, CONFIG["joint_attention_dim"],
                              seed=seed, head_dim=8)
    pipe = diffusers.OvisImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(), text_encoder=encoder,
        tokenizer=tok, transformer=ovis_transformer(seed))
    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    return directory
