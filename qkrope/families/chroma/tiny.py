"""The tiny random Chroma pipeline (tiny hook: :func:`save_pipeline`), built in code: diffusers'
pipeline-test transformer (tests/pipelines/chroma: 1 double + 1 single block, 2 heads x 16,
RoPE axes (4, 4, 8), an approximator of 1 layer x 32; the tests' tiny Chroma, read from here by
tests/_families.py), its one-level VAE (FLUX.1's, 1 latent channel), and ChromaPipeline's
T5 encoder as a random 1-layer T5EncoderModel of width 32 with a byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_parts import one_level_vae, saved, tiny_model
from qkrope.apps.tiny_pipeline import byte_tokenizer, t5_encoder
from qkrope.families._dual_stream import TINY_CONFIG

WHAT = "the tiny Chroma pipeline"

#: Chroma: diffusers' pipeline-test sizes (tests/pipelines/chroma/test_pipeline_chroma.py)
CHROMA_CONFIG = dict(TINY_CONFIG, approximator_hidden_dim=32, approximator_layers=1,
                     approximator_num_channels=16)


def chroma_transformer(seed: int = 0, **overrides):
    """A tiny random ChromaTransformer2DModel."""
    return tiny_model("ChromaTransformer2DModel", CHROMA_CONFIG, seed, what=WHAT, **overrides)


def vae():
    """diffusers' Chroma pipeline-test VAE: one level (vae_scale_factor 1), 1 latent channel
    (2x2 packing gives the transformer's 4 input channels)."""
    return one_level_vae(WHAT)


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny ChromaPipeline saved with ``save_pretrained``."""
    diffusers = require("diffusers", WHAT)
    require("transformers", WHAT)
    tok = byte_tokenizer(model_max_length=512, append_eos=True)
    pipe = diffusers.ChromaPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(),
        text_encoder=t5_encoder(tok, CHROMA_CONFIG["joint_attention_dim"], seed),
        tokenizer=tok, transformer=chroma_transformer(seed))
    return saved(pipe, directory)
