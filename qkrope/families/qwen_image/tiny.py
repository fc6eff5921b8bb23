"""The tiny random Qwen-Image pipeline (tiny hook: :func:`save_pipeline`), built in code: a
QwenImageTransformer2DModel of 2 blocks x 2 heads x 32, an AutoencoderKLQwenImage with 4 latent
channels, a flow-matching Euler scheduler, a random 1-layer Qwen2 text encoder whose width is the
transformer's text width (the pipeline reads its last hidden state; diffusers declares
Qwen2.5-VL, whose text stack this is) and the byte-level tokenizer. Its builders
(``tiny_transformer``, ``tiny_vae``, ``pipeline``, ``prompt_embeds``) are the pipeline tests'
and the main job's (also read as ``qkrope.apps.tiny_pipeline.<name>``)."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_parts import saved
from qkrope.apps.tiny_pipeline import byte_tokenizer, randomised

TRANSFORMER_CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                          attention_head_dim=32, num_attention_heads=2, joint_attention_dim=24,
                          axes_dims_rope=(8, 12, 12))
VAE_CONFIG = dict(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                  temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
#: the tiny text encoder: a 1-layer Qwen2 whose width is the tiny transformer's text width
TEXT_ENCODER_CONFIG = dict(hidden_size=TRANSFORMER_CONFIG["joint_attention_dim"],
                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, max_position_embeddings=4096)


def tiny_transformer(seed: int = 0, **config):
    """Random weights of a non-trivial scale (diffusers' init zeroes some layers);
    ``config``: fields that replace TRANSFORMER_CONFIG's (a test's ``num_layers=3``)."""
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    return randomised(diffusers.QwenImageTransformer2DModel(**{**TRANSFORMER_CONFIG, **config}),
                      seed)


def tiny_vae(seed: int = 0):
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    torch.manual_seed(seed)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKLQwenImage(**VAE_CONFIG).eval()


def pipeline(transformer, vae, *, edit: bool = False):
    """A QwenImagePipeline (or QwenImageEditPipeline) around ``transformer`` without a text
    encoder: call it with prompt_embeds / prompt_embeds_mask."""
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    require("transformers", "diffusers' Qwen-Image pipelines")
    cls = diffusers.QwenImageEditPipeline if edit else diffusers.QwenImagePipeline
    extra = {"processor": None} if edit else {}
    return cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
               tokenizer=None, transformer=transformer, **extra)


def prompt_embeds(batch: int, tokens: int, seed: int, *, pad: int = 0):
    """Random prompt embeddings and their 1/0 mask; the last prompt is ``pad`` tokens shorter."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, tokens, TRANSFORMER_CONFIG["joint_attention_dim"], generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if pad:
        mask[-1, tokens - pad:] = 0
    return embeds, mask


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """A whole tiny QwenImagePipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    require("transformers", "the tiny Qwen-Image pipeline's text encoder")
    from transformers import Qwen2Config, Qwen2Model

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    encoder = Qwen2Model(Qwen2Config(vocab_size=len(tokenizer), **TEXT_ENCODER_CONFIG)).eval()
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny_vae(seed),
        text_encoder=encoder, tokenizer=tokenizer, transformer=tiny_transformer(seed))
    return saved(pipe, directory)
