"""The tiny random Bria 3.2 pipeline (tiny hook: :func:`save_pipeline`), built in code: FLUX.1's
diffusers test sizes for the transformer (1 + 1 blocks, 2 heads x 16, RoPE axes (4, 4, 8),
text width 32; the tests' tiny Bria, read from here by tests/_families.py), a one-level VAE
with 1 latent channel (2x2 packing gives the transformer's 4 input channels), and
BriaPipeline's T5 encoder as a random 1-layer T5EncoderModel of width 32 with a byte-level
tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import byte_tokenizer, randomised, t5_encoder

CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
              axes_dims_rope=[4, 4, 8])


def bria_transformer(seed: int = 0, **overrides):
    """A tiny random BriaTransformer2DModel."""
    diffusers = require("diffusers", "the tiny Bria pipeline")
    return randomised(diffusers.BriaTransformer2DModel(**{**CONFIG, **overrides}), seed)


def vae():
    """A one-level AutoencoderKL with 1 latent channel."""
    diffusers = require("diffusers", "the tiny Bria pipeline")
    torch.manual_seed(0)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
        layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0, scaling_factor=1.5035).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny BriaPipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny Bria pipeline")
    require("transformers", "the tiny Bria pipeline's text encoder")
    tok = byte_tokenizer(model_max_length=512, append_eos=True)
    pipe = diffusers.BriaPipeline(
        transformer=bria_transformer(seed), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae(), text_encoder=t5_encoder(tok, CONFIG["joint_attention_dim"], seed),
        tokenizer=tok)
    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    return directory
