"""Tiny test builders, one per model family, keyed by the family record's name
(:func:`qkrope.families.names`): the registry the family-parametrised tests run over. A new
family gets its record, export-option, check, input-form, drop-in component, data loader,
Triton and FP8 tests (tests/test_famil*.py, test_check_blocks_families.py, test_input_forms.py,
test_dropin_component_families.py) by adding its builder here, its input forms in
tests/_input_forms.py, and its record in qkrope/families/.

Sizes: FLUX.1 / FLUX.2 and HunyuanVideo-1.5 / HunyuanVideo are diffusers' own test configs
(tests/_flux_models.py, tests/_hunyuan_video_models.py); Z-Image is diffusers' test config;
Chroma is diffusers' pipeline-test transformer (tests/pipelines/chroma: 1 double + 1 single
block, 2 heads x 16, RoPE axes (4, 4, 8), an approximator of 1 layer x 32); Qwen-Image is
the project's tiny pipeline transformer (qkrope.apps.tiny_pipeline: 2 blocks x 2 heads x 32,
RoPE axes (8, 12, 12), the sizes its export and pipeline tests were tuned on); Z-Image is
diffusers' own test config (tests/pipelines/z_image: 2 + 1 + 1 blocks x 2 heads x 16, RoPE axes
(8, 4, 4), tables (256, 32, 32)). Each builder's model is random with weights of a non-trivial
scale (diffusers' init zeroes some layers).
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
    axes_key: str = "axes_dims_rope"  # the config key of its RoPE axes
    blocks_attr: str = "transformer_blocks"  # the model's list of (main) blocks

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


def _randomised(model, g):
    """``model`` with random weights of a non-trivial scale (diffusers' init zeroes some
    layers and leaves pad tokens uninitialised), RMSNorm weights near 1 but not all 1."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05)
                    + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
    return model.eval()


#: diffusers' Z-Image test config (tests/pipelines/z_image/test_z_image.py)
Z_IMAGE_CONFIG = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                      n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5,
                      qk_norm=True, cap_feat_dim=16, rope_theta=256.0, t_scale=1000.0,
                      axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])


def z_image_transformer(seed: int = 0):
    """The tiny Z-Image transformer (the pad tokens random too)."""
    from diffusers import ZImageTransformer2DModel
    import torch

    return _randomised(ZImageTransformer2DModel(**Z_IMAGE_CONFIG),
                       torch.Generator().manual_seed(seed))


#: Chroma: diffusers' pipeline-test sizes (tests/pipelines/chroma/test_pipeline_chroma.py)
CHROMA_CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                     attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                     axes_dims_rope=[4, 4, 8], approximator_hidden_dim=32,
                     approximator_layers=1, approximator_num_channels=16)


def chroma_transformer(seed: int = 0, **overrides):
    """A tiny random ChromaTransformer2DModel (as tests/_flux_models.transformer)."""
    import diffusers
    import torch

    return _randomised(diffusers.ChromaTransformer2DModel(**{**CHROMA_CONFIG, **overrides}),
                       torch.Generator().manual_seed(seed))


#: Wan: diffusers' own test config (tests/models/transformers/test_models_transformer_wan.py):
#: 2 blocks x 2 heads x 12, patch (1, 2, 2), 4 channels, text 16, RoPE tables of 32 positions
WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                  in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
                  num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                  rope_max_seq_len=32)


def wan_transformer(seed: int = 0, **overrides):
    """The tiny Wan transformer, its RMSNorm weights random (diffusers initialises them to 1,
    which would hide the row weight's h * D + d indexing)."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**{**WAN_CONFIG, **overrides}).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm_" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


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
    **{v: TinyBuilder(v, v, (lambda seed, v=v: hvm.transformer(v, seed)),
                      int(hvm.VARIANTS[v][1]["num_layers"])) for v in hvm.VARIANTS},
    "z-image": TinyBuilder("z-image", "z-image", z_image_transformer,
                           int(Z_IMAGE_CONFIG["n_layers"]), axes_key="axes_dims",
                           blocks_attr="layers"),
    "chroma": TinyBuilder("chroma", "chroma", chroma_transformer,
                          int(CHROMA_CONFIG["num_layers"])),
    "wan": TinyBuilder("wan", "wan", wan_transformer, WAN_CONFIG["num_layers"],
                       blocks_attr="blocks"),
    "hunyuan-image": TinyBuilder("hunyuan-image", "hunyuan-image", _hunyuan_image, 1),
    "cosmos-predict2": TinyBuilder("cosmos-predict2", "cosmos-predict2", cosmos_transformer,
                                   int(COSMOS_CONFIG["num_layers"])),
}

#: pytest parameters: one per family, in registry order
PARAMS = [pytest.param(BUILDERS[name], id=name) for name in families.names() if name in BUILDERS]
