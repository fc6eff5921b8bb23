"""The tiny random Motif-Video pipeline (tiny hook: :func:`save_pipeline`), built in code at
diffusers' own test sizes (tests/pipelines/motif_video/test_motif_video.py): the transformer
(2 heads of 12, one double- and one single-stream block, RoPE axes (4, 4, 4); 33 input channels:
the latent, its first-frame condition and mask), a tiny AutoencoderKLWan of 16 latent channels,
a random 1-layer T5Gemma2Encoder of width 32 (its vision tower 1 layer of 16) over a
byte-level tokenizer (nothing downloaded),
AdaptiveProjectedGuidance as the guider."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import byte_tokenizer, randomised
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

#: diffusers' test config of the transformer (its pipeline test's)
CONFIG = dict(in_channels=33, out_channels=16, num_attention_heads=2, attention_head_dim=12,
              num_layers=1, num_single_layers=1, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
              qk_norm="rms_norm", text_embed_dim=32, rope_axes_dim=(4, 4, 4))


def build_transformer(record, seed: int = 0, **overrides):
    """The tiny random Motif-Video transformer (random weights at a non-trivial scale: diffusers'
    init zeroes the modulations and the output projection; norm weights near 1)."""
    diffusers = require("diffusers", "the tiny Motif-Video pipeline")
    return randomised(diffusers.MotifVideoTransformer3DModel(**{**CONFIG, **overrides}), seed)


def text_encoder(tokenizer, seed: int = 0):
    """A random 1-layer T5Gemma2Encoder of width 32 over ``tokenizer``'s vocabulary."""
    from transformers import (SiglipVisionConfig, T5Gemma2Encoder, T5Gemma2EncoderConfig,
                              T5Gemma2TextConfig)

    torch.manual_seed(seed)
    text = T5Gemma2TextConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              intermediate_size=64, vocab_size=len(tokenizer),
                              max_position_embeddings=128, head_dim=16, num_key_value_heads=2,
                              pad_token_id=tokenizer.pad_token_id)
    # read by the encoder's layers but not set by the config class (diffusers' test sets them)
    text.dropout_rate, text.layer_norm_epsilon, text.dense_act_fn = 0.0, 1e-6, "gelu"
    # its vision tower (unused by the pipeline's text prompts) at a tiny size too: 2 x 2 patches
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    return T5Gemma2Encoder(T5Gemma2EncoderConfig(text_config=text, vision_config=vision,
                                                 mm_tokens_per_image=4)).eval()


def build_pipeline(record, seed: int = 0):
    """The tiny MotifVideoPipeline (in memory)."""
    diffusers = require("diffusers", "the tiny Motif-Video pipeline")
    require("transformers", "the tiny Motif-Video pipeline's text encoder")
    from diffusers.guiders import AdaptiveProjectedGuidance

    tok = byte_tokenizer(model_max_length=128, append_eos=True)
    torch.manual_seed(0)  # the VAE initialises from the global generator
    vae = diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                     num_res_blocks=1, temperal_downsample=[False, True, True])
    return diffusers.MotifVideoPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0), vae=vae.eval(),
        text_encoder=text_encoder(tok, seed), tokenizer=tok,
        transformer=build_transformer(record, seed), guider=AdaptiveProjectedGuidance())


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny MotifVideoPipeline saved with ``save_pretrained``."""
    directory = Path(directory)
    build_pipeline(record, seed).save_pretrained(str(directory))
    return directory
