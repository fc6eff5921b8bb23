"""The tiny random Kandinsky 5 pipeline (tiny hook), built in code: diffusers' Kandinsky 5 test
transformer (tests/pipelines/kandinsky5/test_kandinsky5.py: 1 text and 1 visual block, model_dim
48 in 2 heads of 24, axes (8, 8, 8)) with random weights (diffusers zeroes the modulations), its
tiny AutoencoderKLHunyuanVideo, and Kandinsky5T2VPipeline's two text encoders as a random
1-layer Qwen2 of width 16 (the text stack of Qwen2.5-VL) and a 1-layer CLIP text model of width
32, both over the byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import (byte_tokenizer, clip_text_encoder, decoder_encoder,
                                       randomised)
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

#: diffusers' Kandinsky 5 pipeline test transformer config
TRANSFORMER_CONFIG = dict(in_visual_dim=4, in_text_dim=16, in_text_dim2=32, time_dim=32,
                          out_visual_dim=4, patch_size=(1, 2, 2), model_dim=48, ff_dim=128,
                          num_text_blocks=1, num_visual_blocks=1, axes_dims=(8, 8, 8),
                          visual_cond=False)


def tiny_transformer(seed: int = 0, **overrides):
    """The tiny Kandinsky5Transformer3DModel, weights ~ N(0, 0.2^2), norms near 1."""
    diffusers = require("diffusers", "the tiny Kandinsky 5 pipeline")
    import torch

    torch.manual_seed(seed)
    model = diffusers.Kandinsky5Transformer3DModel(**{**TRANSFORMER_CONFIG, **overrides})
    return randomised(model, seed)


def build_transformer(record, seed: int = 0):
    """The tests' builder (tests/_families.py)."""
    return tiny_transformer(seed)


def vae():
    """diffusers' tiny AutoencoderKLHunyuanVideo of the Kandinsky 5 pipeline tests."""
    diffusers = require("diffusers", "the tiny Kandinsky 5 pipeline")
    import torch

    torch.manual_seed(0)
    return diffusers.AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, spatial_compression_ratio=8,
        temporal_compression_ratio=4, latent_channels=4, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, norm_num_groups=4).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """A whole tiny Kandinsky5T2VPipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny Kandinsky 5 pipeline")
    require("transformers", "the tiny Kandinsky 5 pipeline's text encoders")
    from transformers import Qwen2Config, Qwen2Model

    tok = byte_tokenizer(model_max_length=4096)
    tok_2 = byte_tokenizer(model_max_length=77, append_eos=True)
    pipe = diffusers.Kandinsky5T2VPipeline(
        transformer=tiny_transformer(seed), vae=vae(),
        text_encoder=decoder_encoder(Qwen2Config, Qwen2Model, tok,
                                     TRANSFORMER_CONFIG["in_text_dim"], seed=seed),
        tokenizer=tok,
        text_encoder_2=clip_text_encoder(tok_2, TRANSFORMER_CONFIG["in_text_dim2"], seed),
        tokenizer_2=tok_2,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))
    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    return directory
