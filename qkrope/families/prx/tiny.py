"""The tiny random PRX pipeline (tiny hook: :func:`save_pipeline`), built in code: the
transformer (1 block, 2 heads x 16, RoPE axes (8, 8), 2 x 2 patches of 4 latent channels, text
width 16; the tests' tiny PRX), a one-level AutoencoderKL of 4 latent channels (scale factor
1), and PRXPipeline's T5Gemma encoder as a random 1-layer one of width 16 over a byte-level
tokenizer (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_parts import one_level_vae
from qkrope.apps.tiny_pipeline import byte_tokenizer, randomised
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

WHAT = "the tiny PRX pipeline"

CONFIG = dict(in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0,
              num_heads=2, depth=1, axes_dim=[8, 8])


def build_transformer(record, seed: int = 0, **overrides):
    """The tiny random PRXTransformer2DModel (random weights at a non-trivial scale: diffusers'
    init zeroes the modulations and the final layer; norm weights near 1)."""
    diffusers = require("diffusers", WHAT)
    return randomised(diffusers.PRXTransformer2DModel(**{**CONFIG, **overrides}), seed).eval()


def text_encoder(tokenizer, seed: int = 0):
    """A random 1-layer T5GemmaEncoder of width 16 over ``tokenizer``'s vocabulary."""
    import torch
    from transformers import T5GemmaModuleConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    torch.manual_seed(seed)
    cfg = T5GemmaModuleConfig(hidden_size=CONFIG["context_in_dim"], intermediate_size=32,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                              head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=64,
                              pad_token_id=tokenizer.pad_token_id)
    cfg.dropout_rate = 0.0  # read by the encoder, not set by the config class
    return T5GemmaEncoder(cfg).eval()


def build_pipeline(record, seed: int = 0):
    """The tiny PRXPipeline (in memory)."""
    diffusers = require("diffusers", WHAT)
    require("transformers", WHAT)
    tok = byte_tokenizer(model_max_length=16, append_eos=True)
    return diffusers.PRXPipeline(
        transformer=build_transformer(record, seed),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder(tok, seed), tokenizer=tok,
        vae=one_level_vae(WHAT, latent_channels=CONFIG["in_channels"], shift_factor=0.0))


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny PRXPipeline saved with ``save_pretrained``."""
    directory = Path(directory)
    build_pipeline(record, seed).save_pretrained(str(directory))
    return directory
