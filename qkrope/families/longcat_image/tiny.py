"""The tiny random LongCat-Image pipeline (tiny hook: :func:`save_pipeline`), built in code:
FLUX.1's diffusers test sizes for the transformer (1 + 1 blocks, 2 heads x 16, RoPE axes
(4, 4, 8), text width 32) with 64 input channels (LongCatImagePipeline packs 16 latent
channels in 2x2, fixed in its code; the tests' tiny LongCat-Image, read from here by
tests/_families.py), a one-level VAE with 16 latent channels, and the pipeline's Qwen2.5-VL
text encoder as a random 1-layer Qwen2 decoder of width 32 (it encodes and, for the prompt
rewrite, generates) with a byte-level chat tokenizer, which also stands in for the processor
(the rewrite uses only its text side)."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_parts import one_level_vae, saved, tiny_model
from qkrope.apps.tiny_pipeline import CHATML_TEMPLATE, byte_tokenizer, decoder_encoder

WHAT = "the tiny LongCat-Image pipeline"

CONFIG = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
              pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def longcat_transformer(seed: int = 0, **overrides):
    """A tiny random LongCatImageTransformer2DModel."""
    return tiny_model("LongCatImageTransformer2DModel", CONFIG, seed, what=WHAT, **overrides)


def vae():
    """A one-level AutoencoderKL with the pipeline's 16 latent channels."""
    return one_level_vae(WHAT, latent_channels=16, width=16)


def text_encoder(seed: int = 0):
    """(tokenizer, text encoder): a byte-level chat tokenizer and a random 1-layer Qwen2
    decoder as wide as the transformer's text input."""
    require("transformers", WHAT)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = byte_tokenizer(chat_template=CHATML_TEMPLATE)
    encoder = decoder_encoder(Qwen2Config, Qwen2ForCausalLM, tok, CONFIG["joint_attention_dim"],
                              seed=seed)
    # the prompt rewrite generates up to 512 tokens; a random model would run them all, so its
    # generation suppresses every token but the end (the rewritten prompt is then empty)
    encoder.generation_config.suppress_tokens = [i for i in range(len(tok))
                                                 if i != tok.eos_token_id]
    return tok, encoder


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny LongCatImagePipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", WHAT)
    tok, encoder = text_encoder(seed)
    # the prompt rewrite uses the processor's text side only (chat template, encode, decode):
    # the tokenizer serves (Qwen2VLProcessor needs torchvision's video processor to build)
    processor = tok
    pipe = diffusers.LongCatImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(), text_encoder=encoder,
        tokenizer=tok, text_processor=processor, transformer=longcat_transformer(seed))
    return saved(pipe, directory)
