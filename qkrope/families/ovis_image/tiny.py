"""The tiny random Ovis-Image pipeline (tiny hook: :func:`save_pipeline`), built in code:
FLUX.1's diffusers test sizes for the transformer (1 + 1 blocks, 2 heads x 16, RoPE axes
(4, 4, 8), text width 32; the tests' tiny Ovis-Image, read from here by tests/_families.py),
a one-level VAE with 1 latent channel (2x2 packing gives the transformer's 4 input channels),
and OvisImagePipeline's Qwen3 text encoder as a random 1-layer Qwen3Model of width 32 with a
byte-level chat tokenizer."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_parts import one_level_vae, saved, tiny_model
from qkrope.apps.tiny_pipeline import CHATML_TEMPLATE, byte_tokenizer, decoder_encoder
from qkrope.families._dual_stream import TINY_CONFIG

WHAT = "the tiny Ovis-Image pipeline"

CONFIG = dict(TINY_CONFIG, out_channels=4)


def ovis_transformer(seed: int = 0, **overrides):
    """A tiny random OvisImageTransformer2DModel."""
    return tiny_model("OvisImageTransformer2DModel", CONFIG, seed, what=WHAT, **overrides)


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny OvisImagePipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", WHAT)
    require("transformers", WHAT)
    from transformers import Qwen3Config, Qwen3Model

    tok = byte_tokenizer(chat_template=CHATML_TEMPLATE)
    encoder = decoder_encoder(Qwen3Config, Qwen3Model, tok, CONFIG["joint_attention_dim"],
                              seed=seed, head_dim=8)
    pipe = diffusers.OvisImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=one_level_vae(WHAT),
        text_encoder=encoder, tokenizer=tok, transformer=ovis_transformer(seed))
    return saved(pipe, directory)
