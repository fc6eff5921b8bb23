"""Parts the families' tiny pipelines (their ``tiny.py`` hooks) share: a diffusers model built
from a config with random weights of a non-trivial scale, and the one-level VAE of diffusers'
pipeline tests (vae_scale_factor 1 where the pipeline reads it from the levels), and the
saving of a built pipeline."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import randomised


def tiny_model(class_name: str, config: dict, seed: int = 0, *, what: str, **overrides):
    """diffusers' ``class_name`` built from ``config`` (``overrides`` on top), randomised
    (:func:`qkrope.apps.tiny_pipeline.randomised`); ``what`` names the caller in the message of
    a missing diffusers."""
    diffusers = require("diffusers", what)
    return randomised(getattr(diffusers, class_name)(**{**config, **overrides}), seed)


def one_level_vae(what: str, *, latent_channels: int = 1, width: int = 4,
                  shift_factor: float = 0.0609, scaling_factor: float = 1.5035):
    """An AutoencoderKL with one level ``width`` wide and ``latent_channels`` latent channels,
    3-channel images, no quant convolutions (diffusers' FLUX pipeline-test VAE at the
    defaults), in eval mode."""
    import torch

    diffusers = require("diffusers", what)
    torch.manual_seed(0)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(width,),
        layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=shift_factor, scaling_factor=scaling_factor).eval()


def saved(pipe, directory) -> Path:
    """``pipe`` saved with ``save_pretrained`` in ``directory``: that folder, as a Path (what a
    tiny hook's ``save_pipeline`` returns)."""
    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    return directory
