"""The tiny random JoyImage Edit transformer and pipeline folder (tiny hook), built in code.

The transformer: 2 double-stream blocks x 2 heads x 32 (RoPE axes 8 + 12 + 12, theta 256 as
the released config's), 16 latent channels (the Wan VAE's), patch (1, 2, 2), text width 24.
The pipeline folder holds the transformer, diffusers' tiny AutoencoderKLWan and the scheduler;
JoyImageEditPipeline's Qwen3-VL text encoder, tokenizer and processor are not built here (no
tiny Qwen3-VL processor without torchvision), so the folder is saved with those three as None
and a call passes ``prompt_embeds``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import randomised
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

#: The tiny JoyImage Edit config (head 32 = rope_dim_list's sum).
JOYIMAGE_CONFIG = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=64,
                       num_attention_heads=2, text_dim=24, mlp_width_ratio=2.0, num_layers=2,
                       rope_dim_list=[8, 12, 12], rope_type="rope", theta=256)


def build_transformer(record, seed: int = 0, **overrides):
    """The tiny JoyImage Edit transformer, weights ~ N(0, 0.2^2), norm weights near 1."""
    diffusers = require("diffusers", "the tiny JoyImage Edit transformer")
    torch.manual_seed(seed)
    model = diffusers.JoyImageEditTransformer3DModel(**{**JOYIMAGE_CONFIG, **overrides})
    return randomised(model, seed, scale=0.2, vector_scale=0.05)


def vae():
    """diffusers' tiny Wan VAE (16 latent channels)."""
    diffusers = require("diffusers", "the tiny JoyImage Edit pipeline")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                      num_res_blocks=1,
                                      temperal_downsample=[False, True, True]).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny JoyImageEditPipeline folder: transformer, VAE and scheduler saved with
    ``save_pretrained``; text encoder, tokenizer and processor None (module docstring)."""
    diffusers = require("diffusers", "the tiny JoyImage Edit pipeline")
    components = dict(transformer=build_transformer(record, seed), vae=vae(),
                      scheduler=diffusers.FlowMatchEulerDiscreteScheduler())
    directory = Path(directory)
    directory.mkdir(parents=True)
    index = {"_class_name": "JoyImageEditPipeline", "_diffusers_version": diffusers.__version__,
             "text_encoder": [None, None], "tokenizer": [None, None],
             "processor": [None, None]}
    for name, component in components.items():
        component.save_pretrained(str(directory / name))
        index[name] = ["diffusers", type(component).__name__]
    (directory / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return directory
