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
from qkrope.families.flux import tiny as flux_tiny
from qkrope.families._record import FamilyRecord

#: The bound the FLUX drop-in's per-call error is held to, relative to max|output| (the
#: pipeline tests' latent bound starts from it): at least twice the stock export's own error,
#: which test_flux_export.py's test_ort_at_untraced_shapes measures and asserts to be below it
#: (on the 2-core EPYC: 6.8e-5 of max|output| for FLUX.1, 1.4e-4 for FLUX.2, ours within 1e-6
#: of the stock's), rounded up to 5e-4.
#: The FLUX.1 and FLUX.2 records (the registry's).
FLUX1, FLUX2 = families.by_name("flux1"), families.by_name("flux2")
FLUX_TRANSFORMER_PARITY = 5e-4

#: variant -> (family, diffusers class, config): the configs live in the family's tiny
#: pipeline recipe (qkrope.families.flux.tiny)
VARIANTS = {v: (families.by_name(name), getattr(diffusers, cls), config)
            for v, (name, cls, config) in flux_tiny.VARIANTS.items()}
#: a tiny random FLUX transformer of a variant (weights of a non-trivial scale: diffusers' init
#: zeroes the modulations and the output projection; RMSNorm weights near 1 but not all 1)
transformer = flux_tiny.transformer


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
    """diffusers' pipeline-test VAE sizes (qkrope.families.flux.tiny.vae): one level
    (vae_scale_factor 1), 1 latent channel, so that 2x2 packing gives the transformer's 4 input
    channels."""
    return flux_tiny.vae(family.name)


def ids(family: FamilyRecord, img_shapes, txt_len: int):
    """Position ids as the FLUX pipelines make them (the exporter's sample ids)."""
    from qkrope.families.flux.export import sample_ids

    return sample_ids(family, img_shapes, txt_len)
