"""The tiny random MiniMax-H3 transformer (tiny hook), built in code: 2 blocks and 1 token
refiner block, 2 heads x 32 (width 48: heads x head_dim exceeds the width, as the real model's
56 x 128 over 5376 does), RoPE of ``rope_freq_dim`` 4 (24 of the 32 channels rotated, the rest
passed through), 4 video latent channels in (1, 2, 2) patches, 8 audio channels, text width 16;
random weights at a non-trivial scale (norm weights near 1).

No tiny pipeline: diffusers 0.42.1 has no MiniMax-H3 pipeline, so :func:`save_pipeline`
refuses in one line."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import randomised
from qkrope.errors import InputError
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

WHAT = "the tiny MiniMax-H3 transformer"

TRANSFORMER_CONFIG = dict(num_attention_heads=2, attention_head_dim=32, hidden_size=48,
                          num_layers=2, num_refiner_layers=1, ffn_dim=64, in_channels=4,
                          audio_in_channels=8, patch_size=(1, 2, 2), text_dim=16, freq_dim=32,
                          time_embed_hidden_dim=32, time_embed_dim=24, rope_freq_dim=4)


def build_transformer(record, seed: int = 0, **overrides):
    """The tiny random MiniMaxH3Transformer3DModel (float32)."""
    diffusers = require("diffusers", WHAT)
    import torch

    torch.manual_seed(seed)
    model = diffusers.MiniMaxH3Transformer3DModel(**{**TRANSFORMER_CONFIG, **overrides})
    return randomised(model, seed).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """Refused in one line (module docstring)."""
    raise InputError("diffusers has no MiniMax-H3 pipeline, so qkrope has no tiny one to save "
                     "or generate with. Fix: export a saved MiniMaxH3Transformer3DModel folder "
                     "and call load_transformer(...) as the transformer itself is called")
