"""Tiny test builders, one per model family, keyed by the family record's name
(:func:`qkrope.families.names`): the registry the family-parametrised tests run over. A new
family gets its export, check and FP8 tests by adding its builder here (and its record in
qkrope/families/).

Sizes: FLUX.1 / FLUX.2 and HunyuanVideo-1.5 / HunyuanVideo are diffusers' own test configs
(tests/_flux_models.py, tests/_hunyuan_video_models.py); Qwen-Image is
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
import _hunyuan_video_models as hvm  # noqa: E402

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


def _hunyuan_image(seed: int):
    """diffusers' own test config of HunyuanImage-2.1 (tests/pipelines/hunyuan_image_21):
    4 heads x 8, one double- and one single-stream block, RoPE axes (4, 4), byT5 projection;
    weights redrawn at scale 0.3 (diffusers zeroes some)."""
    import torch
    from diffusers import HunyuanImageTransformer2DModel

    torch.manual_seed(seed)
    model = HunyuanImageTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=8,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1),
        guidance_embeds=False, text_embed_dim=32, text_embed_2_dim=32, rope_axes_dim=(4, 4))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


#: family name -> its tiny builder
BUILDERS: dict[str, TinyBuilder] = {
    "qwen-image": TinyBuilder("qwen-image", "qwen-image", tp.tiny_transformer,
                              int(tp.TRANSFORMER_CONFIG["num_layers"])),
    "flux1": _flux("flux1-schnell"),
    "flux2": _flux("flux2-klein"),
    **{v: TinyBuilder(v, v, (lambda seed, v=v: hvm.transformer(v, seed)),
                      int(hvm.VARIANTS[v][1]["num_layers"])) for v in hvm.VARIANTS},
    "hunyuan-image": TinyBuilder("hunyuan-image", "hunyuan-image", _hunyuan_image, 1),
}

#: pytest parameters: one per family, in registry order
PARAMS = [pytest.param(BUILDERS[name], id=name) for name in families.names() if name in BUILDERS]
