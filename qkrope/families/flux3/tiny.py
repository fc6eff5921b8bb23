"""The tiny random FLUX.3 transformer (tiny hook), built in code: 1 per-mode block per mode and
1 joint block, 2 heads x 16, RoPE axes (4, 4, 4, 4), 4 image / reference channels, text width
32, random weights at a non-trivial scale (norm weights near 1, norm_q / norm_k in float32 as
the class keeps them).

No tiny pipeline: FLUX.3's pipelines are modular (Flux3ModularPipeline: blocks, a guider, a
Qwen3-VL encoder with its AutoProcessor), which neither ``save_tiny_pipeline``'s
``save_pretrained`` folders nor ``qkrope generate`` (a DiffusionPipeline class from
model_index.json) load: :func:`save_pipeline` refuses in one line."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import randomised
from qkrope.errors import InputError
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

WHAT = "the tiny FLUX.3 transformer"

TRANSFORMER_CONFIG = dict(in_channels=4, cond_in_channels=4, num_layers=1, num_single_layers=1,
                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                          timestep_channels=16, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4))


def keep_in_fp32(model):
    """``model`` with its class's ``_keep_in_fp32_modules`` (norm_q, norm_k) in float32, as
    diffusers' ``from_pretrained(torch_dtype=...)`` loads it (``.to(dtype)`` casts them too)."""
    import torch

    keep = tuple(type(model)._keep_in_fp32_modules or ())
    for name, module in model.named_modules():
        if name.split(".")[-1] in keep:
            module.to(torch.float32)
    return model


def build_transformer(record, seed: int = 0, **overrides):
    """The tiny random Flux3Transformer2DModel (float32; :func:`keep_in_fp32` after a cast)."""
    diffusers = require("diffusers", WHAT)
    import torch

    torch.manual_seed(seed)
    model = diffusers.Flux3Transformer2DModel(**{**TRANSFORMER_CONFIG, **overrides})
    return randomised(model, seed).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """Refused in one line (module docstring)."""
    raise InputError("FLUX.3's pipelines are modular (Flux3ModularPipeline), which qkrope's "
                     "tiny pipelines and qkrope generate do not build or load. Fix: export a "
                     "saved Flux3Transformer2DModel folder and swap it in with "
                     "pipe.update_components(transformer=load_transformer(...))")
