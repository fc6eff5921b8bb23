"""The tiny random Bria 3.2 pipeline (tiny hook: :func:`save_pipeline`), built in code: FLUX.1's
diffusers test sizes for the transformer (1 + 1 blocks, 2 heads x 16, RoPE axes (4, 4, 8),
text width 32; the tests' tiny Bria, read from here by tests/_families.py), a one-level VAE
with 1 latent channel (2x2 packing gives the transformer's 4 input channels), and
BriaPipeline's T5 encoder as a random 1-layer T5EncoderModel of width 32 with a byte-level
tokenizer."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_parts import one_level_vae, saved, tiny_model
from qkrope.apps.tiny_pipeline import byte_tokenizer, t5_encoder
from qkrope.families._dual_stream import TINY_CONFIG

WHAT = "the tiny Bria pipeline"

CONFIG = dict(TINY_CONFIG)


def bria_transformer(seed: int = 0, **overrides):
    """A tiny random BriaTransformer2DModel."""
    return tiny_model("BriaTransformer2DModel", CONFIG, seed, what=WHAT, **overrides)


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny BriaPipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", WHAT)
    require("transformers", WHAT)
    tok = byte_tokenizer(model_max_length=512, append_eos=True)
    pipe = diffusers.BriaPipeline(
        transformer=bria_transformer(seed), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=one_level_vae(WHAT, shift_factor=0.0), tokenizer=tok,
        text_encoder=t5_encoder(tok, CONFIG["joint_attention_dim"], seed))
    return saved(pipe, directory)
