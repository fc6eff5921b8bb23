"""Tiny test builders, one per model family, keyed by the family record's name
(:func:`qkrope.families.names`): the registry the family-parametrised tests run over. A new
family gets its export, check and FP8 tests by adding its builder here (and its record in
qkrope/families/).

Sizes: FLUX.1 / FLUX.2 are diffusers' own test configs (tests/_flux_models.py); Qwen-Image is
the project's tiny pipeline transformer (qkrope.apps.tiny_pipeline: 2 blocks x 2 heads x 32,
RoPE axes (8, 12, 12), the sizes its export and pipeline tests were tuned on). Each builder's
model is random with weights of a non-trivial scale (diffusers' init zeroes some layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import _flux_models as fm  # noqa: E402

from qkrope import families  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402


@dataclass(frozen=True)
class TinyBuilder:
    """One family's tiny transformer: ``build(seed)`` makes it; ``blocks`` its number of
    ``transformer_blocks``."""

    family: str  # the record's name
    variant: str  # what it is, in test ids
    build: Callable[[int], object]
    blocks: int

    @property
    def record(self):
        return families.by_name(self.family)

    def saved(self, root: Path) -> Path:
        """The model's folder (save_pretrained), once per session and root."""
        key = (self.variant, str(root))
        if key not in _SAVED:
            folder = root / f"{self.variant}-diffusers"
            self.build(0).save_pretrained(str(folder))
            _SAVED[key] = folder
        return _SAVED[key]


_SAVED: dict[tuple[str, str], Path] = {}


def _flux(variant: str) -> TinyBuilder:
    family, _, config = fm.VARIANTS[variant]
    return TinyBuilder(family.name, variant, lambda seed: fm.transformer(variant, seed),
                       int(config["num_layers"]))


#: diffusers' Cosmos-Predict2 Video2World test config (tests/pipelines/cosmos/
#: test_cosmos2_video2world.py: 2 blocks x 2 heads x 16, a condition-mask channel)
COSMOS_CONFIG = dict(in_channels=16 + 1, out_channels=16, num_attention_heads=2,
                     attention_head_dim=16, num_layers=2, mlp_ratio=2, text_embed_dim=32,
                     adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
                     rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=True,
                     extra_pos_embed_type="learnable")


def cosmos_torchvision_standin() -> None:
    """diffusers' Cosmos forward resizes the padding mask with torchvision, which the test
    environment may lack: its tensor path (``F.interpolate(mode="nearest")``) stands in for
    it then (what the drop-in does too)."""
    import types

    import diffusers.models.transformers.transformer_cosmos as tc
    import torch.nn.functional as nnf

    if not hasattr(tc, "transforms"):
        tc.transforms = types.SimpleNamespace(
            functional=types.SimpleNamespace(
                resize=lambda t, size, interpolation=None: nnf.interpolate(t, size=size,
                                                                           mode="nearest")),
            InterpolationMode=types.SimpleNamespace(NEAREST="nearest"))


def cosmos_transformer(seed: int = 0, **overrides):
    """The tiny Cosmos-Predict2 transformer, weights ~ N(0, 0.2^2) (diffusers zeroes the
    learnable positional embedding)."""
    import torch
    from diffusers import CosmosTransformer3DModel

    cosmos_torchvision_standin()
    torch.manual_seed(seed)
    model = CosmosTransformer3DModel(**{**COSMOS_CONFIG, **overrides})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


#: family name -> its tiny builder
BUILDERS: dict[str, TinyBuilder] = {
    "qwen-image": TinyBuilder("qwen-image", "qwen-image", tp.tiny_transformer,
                              int(tp.TRANSFORMER_CONFIG["num_layers"])),
    "flux1": _flux("flux1-schnell"),
    "flux2": _flux("flux2-klein"),
    "cosmos-predict2": TinyBuilder("cosmos-predict2", "cosmos-predict2", cosmos_transformer,
                                   int(COSMOS_CONFIG["num_layers"])),
}

#: pytest parameters: one per family, in registry order
PARAMS = [pytest.param(BUILDERS[name], id=name) for name in families.names() if name in BUILDERS]
