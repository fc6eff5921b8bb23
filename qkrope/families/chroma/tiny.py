"""The tiny random Chroma pipeline (tiny hook: :func:`save_pipeline`), built in code: diffusers'
pipeline-test transformer (tests/pipelines/chroma: 1 double + 1 single block, 2 heads x 16,
RoPE axes (4, 4, 8), an approximator of 1 layer x 32; the tests' tiny Chroma, read from here by
tests/_families.py), its one-level VAE (FLUX.1's, 1 latent channel), and ChromaPipeline's
T5 encoder as a random 1-layer T5EncoderModel of width 32 with a byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import byte_tokenizer, randomised, t5_encoder

#: Chroma: diffusers' pipeline-test sizes (tests/pipelines/chroma/test_pipeline_chroma.py)
CHROMA_CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                     axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32,
                     approximator_layers=1, approximator_num_channels=16)


def chroma_transformer(seed: int = 0, **overrides):
    """A tiny random ChromaTransformer2DModel."""
    diffusers = require("diffusers", "the tiny Chroma pipeline")
    return randomised(diffusers.ChromaTransformer2DModel(**{**CHROMA_CONFIG, **overrides}), seed)


def vae():
    """diffusers' Chroma pipeline-test VAE: one level (vae_scale_factor 1), 1 latent channel
    (2x2 packing gives the transformer's 4 input channels)."""
    diffusers = require("diffusers", "the tiny Chroma pipeline")
    torch.manual_seed(0)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
        layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
        use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny ChromaPipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny Chroma pipeline")
    require("transformers", "the tiny Chroma pipeline's text encoder")
    tok = byte_tokenizer(model_max_length=512, append_eos=True)
    pipe = diffusers.ChromaPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(),
        text_encoder=t5_encoder(tok, CHROMA_CONFIG["joint_attention_dim"], seed),
        tokenizer=tok, transformer=chroma_transformer(seed))
    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    return directory
