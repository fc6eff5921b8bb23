"""Tiny random FLUX.1 / FLUX.2 transformers, VAEs and their exports for the FLUX tests (built in
code, nothing downloaded). The sizes are diffusers' own test configs (tests/models/transformers/
test_models_transformer_flux.py, test_models_transformer_flux2.py: 2 heads x 16, text width 32,
RoPE axes (4, 4, 8) / (4, 4, 4, 4)); FLUX.1 dev has 2 double + 2 single blocks (6 nodes), the
others 1 + 1. Each variant is exported once per test session (:func:`exported`)."""

from __future__ import annotations

from pathlib import Path

import torch

import diffusers

from qkrope import families
from qkrope.families._record import FamilyRecord

_FLUX1 = dict(patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
_FLUX2 = dict(patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=32, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4])
#: The bound the FLUX drop-in's per-call error is held to, relative to max|output| (the
#: pipeline tests' latent bound starts from it): at least twice the stock export's own error,
#: which test_flux_export.py's test_ort_at_untraced_shapes measures and asserts to be below it
#: (on the 2-core EPYC: 6.8e-5 of max|output| for FLUX.1, 1.4e-4 for FLUX.2, ours within 1e-6
#: of the stock's), rounded up to 5e-4.
#: The FLUX.1 and FLUX.2 records (the registry's).
FLUX1, FLUX2 = families.by_name("flux1"), families.by_name("flux2")
FLUX_TRANSFORMER_PARITY = 5e-4

#: variant -> (family, diffusers class, config)
VARIANTS = {
    "flux1-dev": (FLUX1, diffusers.FluxTransformer2DModel,
                  dict(_FLUX1, num_layers=2, num_single_layers=2, guidance_embeds=True)),
    "flux1-schnell": (FLUX1, diffusers.FluxTransformer2DModel,
                      dict(_FLUX1, num_layers=1, num_single_layers=1, guidance_embeds=False)),
    "flux2-dev": (FLUX2, diffusers.Flux2Transformer2DModel,
                  dict(_FLUX2, num_layers=1, num_single_layers=1, guidance_embeds=True)),
    "flux2-klein": (FLUX2, diffusers.Flux2Transformer2DModel,
                    dict(_FLUX2, num_layers=1, num_single_layers=1, guidance_embeds=False)),
}


def transformer(variant: str, seed: int = 0):
    """Random weights of a non-trivial scale (diffusers' init zeroes the modulations and the
    output projection), RMSNorm weights near 1 but not all 1."""
    _, cls, config = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    model = cls(**config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05)
                    + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
    return model.eval()


_SAVED: dict[tuple[str, str], Path] = {}


def saved(variant: str, root: Path) -> Path:
    """The variant's folder (save_pretrained), once per session."""
    key = (variant, str(root))
    if key not in _SAVED:
        folder = root / f"{variant}-diffusers"
        transformer(variant).save_pretrained(str(folder))
        _SAVED[key] = folder
    return _SAVED[key]


_EXPORTED: dict[tuple[str, str], Path] = {}


def exported(variant: str, root: Path) -> Path:
    """``qkrope export --model transformer --diffusers <variant folder>``, once per session."""
    from qkrope.cli import main

    key = (variant, str(root))
    if key not in _EXPORTED:
        out = root / f"{variant}.onnx"
        assert main(["export", "--model", "transformer", "--diffusers",
                     str(saved(variant, root)), "--out", str(out)]) == 0
        _EXPORTED[key] = out
    return _EXPORTED[key]


def vae(family: FamilyRecord):
    """diffusers' pipeline-test VAE sizes: one level (vae_scale_factor 1), 1 latent channel,
    so that 2x2 packing gives the transformer's 4 input channels."""
    torch.manual_seed(0)  # diffusers initialises from the global generator
    common = dict(block_out_channels=(4,), layers_per_block=1, latent_channels=1,
                  norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False)
    if family is FLUX1:
        return diffusers.AutoencoderKL(sample_size=32, in_channels=3, out_channels=3,
                                       shift_factor=0.0609, scaling_factor=1.5035,
                                       **common).eval()
    return diffusers.AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",),
                                        up_block_types=("UpDecoderBlock2D",), **common).eval()


def ids(family: FamilyRecord, img_shapes, txt_len: int):
    """Position ids as the FLUX pipelines make them (the exporter's sample ids)."""
    from qkrope.families.flux.export import sample_ids

    return sample_ids(family, img_shapes, txt_len)
